"""How a stage's parameters fall into flat buffers: one ``FlatGroup`` per (param group, dtype, device), planned and
checked by ``plan_groups`` before ``flat.FlatBinding`` changes anything."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import pipeoptim_kernels as pk

__all__ = ["FlatGroup", "plan_groups", "keeps_state", "same_view"]


@dataclass(eq=False)
class FlatGroup:
    """The flat buffers of one (param group, dtype, device) slice of a bound optimizer.

    `w` is what the optimizer steps (the fp32 masters in mixed precision), `work` what the module's forward
    reads (`work is w` unless mixed). `grad` receives the module's gradients; `master_grad` is what the
    optimizer reads (`master_grad is grad` unless mixed). `state` holds per-element optimizer state by
    torch.optim's names, `scalars` the per-parameter scalars ('step', 'mu_product'), one element per param.
    """
    index: int
    rule: str
    names: list[str]
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    offsets: list[int]
    shapes: list[torch.Size]
    w: torch.Tensor
    work: torch.Tensor
    grad: torch.Tensor
    master_grad: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    last_grad: torch.Tensor | None = None
    steps_taken: int = 0  # completed steps observed by the binding (used where torch keeps no 'step')
    grad_views: list[torch.Tensor] = field(default_factory=list)         # params' .grad, made once
    master_grad_views: list[torch.Tensor] = field(default_factory=list)  # masters' .grad (mixed precision)

    @property
    def numel(self) -> int:
        return self.w.numel()

    def __repr__(self) -> str:
        mixed = f", working {self.work.dtype}" if self.mixed else ""
        return (f"FlatGroup(param_group={self.index}, rule={self.rule!r}, {len(self.params)} params, {self.numel} "
                f"elements, {self.w.dtype} on {self.w.device}{mixed}, state={sorted(self.state)})")

    @property
    def mixed(self) -> bool:
        return self.work is not self.w

    def view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter j's slice of a buffer laid out like this group's."""
        shape = self.shapes[j]
        return flat[self.offsets[j]:self.offsets[j] + shape.numel()].view(shape)


def keeps_state(rule: str, group: dict) -> bool:
    return not (rule == "sgd" and pk.rules.scalar(group.get("momentum", 0.0)) == 0.0)


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def plan_groups(module: nn.Module, optimizer: torch.optim.Optimizer,
                 working_dtype: torch.dtype | None) -> list[tuple[int, list[tuple[str, nn.Parameter]]]]:
    """Check everything and split each param group by (dtype, device), before anything is modified."""
    names = {id(p): n for n, p in module.named_parameters()}
    if working_dtype is not None and working_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"working_dtype must be torch.bfloat16 or torch.float16 (got {working_dtype}); "
                         "leave it None to train in the parameters' own dtype")
    plan, seen = [], set()
    for index, group in enumerate(optimizer.param_groups):
        buckets: dict[tuple, list] = {}
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not in the module (shape "
                                 f"{tuple(p.shape)}); build the stage's optimizer from module.parameters() only")
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]} appears twice in the optimizer's param groups")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"parameter {names[id(p)]} is not a dense strided tensor; flat buffers need dense "
                                 "parameters")
            if not p.is_floating_point():
                raise TypeError(f"parameter {names[id(p)]} has dtype {p.dtype}; flat buffers hold floating-point "
                                "parameters only")
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"parameter {names[id(p)]} has a sparse gradient (e.g. nn.Embedding(sparse=True));"
                                 " flat gradient buffers need dense gradients")
            if working_dtype is not None and p.dtype != torch.float32:
                raise TypeError(f"mixed precision needs float32 parameters to serve as masters, but "
                                f"{names[id(p)]} is {p.dtype}; build the model in float32 and pass "
                                f"working_dtype={working_dtype}")
            buckets.setdefault((p.dtype, p.device), []).append((names[id(p)], p))
        plan.extend((index, items) for items in buckets.values())
    if not plan:
        raise ValueError("the optimizer holds no trainable parameter of this module; nothing to bind")
    return plan
