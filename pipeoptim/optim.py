"""Several optimizers as one: what a stage needs when its parameters are stepped by different rules.

Muon orthogonalises the update of 2-D weight matrices and is run beside AdamW for everything else (embeddings,
norms, biases); a pipeline stage, its flat binding, its weight policy, LR scheduler and checkpoint all expect one
`torch.optim.Optimizer`. `ChainedOptimizer(muon, adamw)` is that one optimizer: its `param_groups` are the
children's own group dicts (so an LR scheduler, the delay-aware hyper-parameters or a prediction that changes or
reads a group's lr reaches the child that steps it), its `state` is a live view of the children's states, and
`step()` steps each child in turn. `state_dict()` is torch's format over all groups in order; `load_state_dict`
hands every group and every parameter's state back to the child that owns it.

`Pipeline(optimizer=...)` accepts a factory that returns a list of optimizers and chains them; `muon_and_adamw`
is such a factory. Weight prediction for a chained optimizer uses the optimizer-agnostic last applied update
(`PipeOptimPolicy(delta="last_update")`): the kernels' per-optimizer rules cover one optimizer's state.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Iterable, Iterator, Sequence

import torch

__all__ = ["ChainedOptimizer", "muon_and_adamw", "muon_at_adamw_scale", "as_optimizer"]


class _ChainedState(MutableMapping):
    """optimizer.state of a ChainedOptimizer: each parameter's entry lives in the state of the child that owns it."""

    def __init__(self, owner: "ChainedOptimizer"):
        self._owner = owner

    def _child(self, p) -> torch.optim.Optimizer:
        for child in self._owner.children:
            if p in child.state:
                return child
        for child in self._owner.children:
            if any(q is p for g in child.param_groups for q in g["params"]):
                return child
        raise KeyError("this tensor is not a parameter of any chained optimizer")

    def __getitem__(self, p):
        return self._child(p).state[p]   # the child's defaultdict creates an empty entry, as torch's does

    def __setitem__(self, p, value) -> None:
        self._child(p).state[p] = value

    def __delitem__(self, p) -> None:
        del self._child(p).state[p]

    def __contains__(self, p) -> bool:
        return any(p in child.state for child in self._owner.children)

    def __iter__(self) -> Iterator:
        for child in self._owner.children:
            yield from child.state

    def __len__(self) -> int:
        return sum(len(child.state) for child in self._owner.children)


class ChainedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, seen as one (module docstring)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        optimizers = list(optimizers)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"ChainedOptimizer needs one or more torch.optim.Optimizer objects, got "
                            f"{[type(o).__name__ for o in optimizers]}")
        if any(isinstance(o, ChainedOptimizer) for o in optimizers):
            raise TypeError("ChainedOptimizer: chain the inner optimizers themselves, not a ChainedOptimizer")
        seen: set[int] = set()
        for o in optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) in seen:
                        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two of the chained optimizers; "
                                         "give each parameter to one optimizer only")
                    seen.add(id(p))
        self.children = optimizers
        super().__init__([g for o in optimizers for g in o.param_groups], {})
        self.param_groups = [g for o in optimizers for g in o.param_groups]  # the children's own dicts
        self.state = _ChainedState(self)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        if closure is not None:
            raise ValueError("ChainedOptimizer.step takes no closure (each child would re-evaluate the loss)")
        for child in self.children:
            child.step()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "children") and hasattr(self, "state") and isinstance(self.state, _ChainedState):
            raise RuntimeError("add the group to one of the chained optimizers (ChainedOptimizer.children[i])")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        if "children" in state:                   # unpickling / deepcopy
            super().__setstate__(state)
            return
        # torch's load_state_dict: new group dicts and a new state, to be handed back to the children
        for group, new in zip(self.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in new.items() if k != "params"})
        for p, entry in state["state"].items():
            self.state[p] = entry

    def __repr__(self) -> str:
        return "ChainedOptimizer(" + ", ".join(type(c).__name__ for c in self.children) + ")"


def as_optimizer(made) -> torch.optim.Optimizer:
    """What an optimizer factory returned, as one optimizer: itself, or a ChainedOptimizer over a list of them."""
    if isinstance(made, torch.optim.Optimizer):
        return made
    if isinstance(made, (list, tuple)):
        return made[0] if len(made) == 1 else ChainedOptimizer(made)
    raise TypeError(f"the optimizer factory must return a torch.optim.Optimizer or a list of them, got "
                    f"{type(made).__name__}")


def muon_and_adamw(lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0, *, adamw_lr: float = 1e-3,
                   adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_weight_decay: float = 0.0,
                   is_matrix: Callable[[torch.Tensor], bool] | None = None, **muon_options
                   ) -> Callable[[Iterable[torch.Tensor]], list[torch.optim.Optimizer]]:
    """A factory for Pipeline(optimizer=...): torch.optim.Muon for the stage's 2-D weights (`is_matrix`, default
    p.ndim == 2: embeddings included, as the factory sees no names), AdamW for the rest. Needs torch >= 2.9."""
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch.optim.Muon needs torch >= 2.9; this is torch {torch.__version__}")
    matrix = is_matrix or (lambda p: p.ndim == 2)

    def make(params: Iterable[torch.Tensor]) -> list[torch.optim.Optimizer]:
        params = list(params)
        mats = [p for p in params if matrix(p)]
        rest = [p for p in params if not matrix(p)]
        out = []
        if mats:
            out.append(torch.optim.Muon(mats, lr=lr, momentum=momentum, weight_decay=weight_decay, **muon_options))
        if rest:
            out.append(torch.optim.AdamW(rest, lr=adamw_lr, betas=adamw_betas, weight_decay=adamw_weight_decay))
        return out

    return make


def muon_at_adamw_scale(lr: float, momentum: float = 0.95, weight_decay: float = 0.1
                        ) -> Callable[[Iterable[torch.Tensor]], list[torch.optim.Optimizer]]:
    """Muon + AdamW with one lr and weight decay for both: Muon's update scaled to AdamW's RMS (torch's
    ``adjust_lr_fn="match_rms_adamw"``), AdamW β (0.9, 0.999). The setting issue 20's study measured
    (benchmarks/RESULTS.md §6.6), so one lr sweep serves both optimizers."""
    return muon_and_adamw(lr=lr, momentum=momentum, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw",
                          adamw_lr=lr, adamw_betas=(0.9, 0.999), adamw_weight_decay=weight_decay)
