"""Making a forward read predicted weights while every backward op reads the real ones.

The paper's semantics (DESIGN.md §1): the forward of a micro-batch with version difference s reads
ŵ = w − s·lr·Δ; every backward op reads the weights that are real at backward time; the optimizer steps
the real weights. Two pieces do this:

`SavedWeights` — saved-tensor hooks for the forward. Every tensor autograd saves that aliases a bound
weight buffer (the parameter itself, `W.T`, any view) is saved as a handle (buffer, offset, size,
stride) and rebuilt at backward time as a view of the buffer that the policy names then: the real
weights for PipeOptim, a stashed version for PipeDream. This is what lets the optimizer step the real
weights in place between a forward and its backward without autograd's "modified by an inplace
operation" error, and what keeps a later prediction out of an earlier micro-batch's backward. Tensors
*computed* from ŵ in the forward (autocast's casts, `2 * W`) are activations and stay as computed.
Custom autograd Functions that stash weights on `ctx` directly (not via save_for_backward) bypass the
hooks. Inside an activation-checkpointed region the weights are saved by the recomputation instead, which reads
what the policy names for it (`WeightPolicy.recompute_context`, `pipeoptim.stages.recompute`).

`Predictor` — one prediction buffer (or one stash, in place) per flat group and a mechanism that makes
the module's parameters read ŵ during the forward:
  - "swap" (default): predict into a separate buffer, then swap the two storages' data pointers, O(1)
    for the whole group: 16 B/param for Adam, no restore. Needs torch's UntypedStorage._swap_data_ptr_,
    which torch 2.12 added.
  - "pointer" (the default on torch 2.11): predict into a separate buffer and point every parameter's
    .data at it and back; 16 B/param plus a few µs per parameter of Python.
  - "inplace": stash w, write ŵ into the weights, restore after the forward: 32 B/param with these
    kernels (28 with a fused stash), the baseline.
The benchmark (benchmarks/bench_predictor.py) compares them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

import pipeoptim_kernels as pk

from .flat import FlatBinding, FlatGroup

__all__ = ["SavedWeights", "Predictor", "MECHANISMS", "available_mechanisms", "default_mechanism", "Direction"]

MECHANISMS = ("swap", "pointer", "inplace")
SWAP_SINCE = "2.12"  # the torch release that added UntypedStorage._swap_data_ptr_


def _can_swap() -> bool:
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def available_mechanisms() -> tuple[str, ...]:
    """The mechanisms this torch can run ("swap" needs torch >= 2.12)."""
    return MECHANISMS if _can_swap() else tuple(m for m in MECHANISMS if m != "swap")


def default_mechanism() -> str:
    return "swap" if _can_swap() else "pointer"


@dataclass(frozen=True)
class _Handle:
    group: int
    offset: int
    size: torch.Size
    stride: tuple
    tag: Any
    resolve: Callable[[int, Any], torch.Tensor]


class SavedWeights:
    """saved_tensors_hooks that save aliases of bound weight storages as handles (see module docstring)."""

    def __init__(self, binding: FlatBinding):
        self.binding = binding
        self._groups: dict[int, tuple[int, torch.dtype]] = {}
        for i, g in enumerate(binding.groups):
            self.watch(g.work, i)

    def watch(self, flat: torch.Tensor, group: int) -> None:
        """Treat tensors saved from `flat`'s storage as weights of `group` (flat must start at offset 0)."""
        if flat.storage_offset() != 0:
            raise ValueError("watched weight buffers must own their storage from offset 0")
        self._groups[flat.untyped_storage()._cdata] = (group, flat.dtype)

    def hooks(self, tag: Any, resolve: Callable[[int, Any], torch.Tensor],
              activations: dict | None = None) -> torch.autograd.graph.saved_tensors_hooks:
        """Inside: saved weight aliases become handles; at backward, `resolve(group, tag)` names the flat
        buffer to read (laid out like the group's weights). `activations`, if given, receives
        {storage id: bytes} of every other saved tensor's storage (what the forward keeps for its backward)."""
        groups = self._groups

        def pack(t: torch.Tensor):
            try:
                storage = t.untyped_storage()
                key = storage._cdata
            except (RuntimeError, NotImplementedError, AttributeError):
                return t
            hit = groups.get(key)
            if hit is None or hit[1] != t.dtype:
                if activations is not None:
                    activations[key] = storage.nbytes()
                # detached: a saved output kept with its grad_fn would hold its own node (a reference cycle
                # through C++ that only a backward without retain_graph breaks; the split backward has none)
                return t.detach()
            return _Handle(hit[0], t.storage_offset(), t.size(), t.stride(), tag, resolve)

        def unpack(x):
            if isinstance(x, _Handle):
                return x.resolve(x.group, x.tag).as_strided(x.size, x.stride, x.offset)
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# A direction tells the predictor what to predict with for a group: (rule, state, group hparams, mode).
Direction = Callable[[FlatGroup], tuple[str, dict, dict, str]]


class Predictor:
    """Writes ŵ for a flat binding and lends it to the module for one forward (see module docstring).

    `direction(g)` returns the (rule, state, hyperparameters, mode) to predict group g with; the default is
    the optimizer's own rule in `mode`. Only one prediction is lent at a time: forwards on a stage do not
    overlap, and saved weights are redirected by `SavedWeights`, so one buffer serves every micro-batch.
    """

    def __init__(self, binding: FlatBinding, saved: SavedWeights, *, mechanism: str | None = None,
                 mode: str = "exact", backend: str = "auto", direction: Direction | None = None):
        mechanism = mechanism or default_mechanism()
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
        if mechanism == "swap" and not _can_swap():
            raise RuntimeError(f"mechanism 'swap' needs torch.UntypedStorage._swap_data_ptr_, which torch "
                               f"{SWAP_SINCE} added; this is torch {torch.__version__}. Use mechanism='pointer' "
                               "(the default on this torch: same results, a few µs more per parameter) or "
                               f"torch >= {SWAP_SINCE}")
        if mode not in pk.MODES:
            raise ValueError(f"mode must be one of {', '.join(pk.MODES)}, got {mode!r}")
        if mode == "paper" and direction is None and binding.rule not in pk.PAPER_RULES:
            raise ValueError(f"mode='paper' reproduces the paper's table, which covers only "
                             f"{', '.join(pk.PAPER_RULES)}; this optimizer's rule is {binding.rule!r}: use mode='exact'")
        if mode == "reference" and direction is None and binding.rule not in pk.REFERENCE_RULES:
            raise ValueError(f"mode='reference' reproduces the public PipeOptim code, which predicts only for "
                             f"{', '.join(pk.REFERENCE_RULES)}; this optimizer's rule is {binding.rule!r}: use "
                             "mode='exact'")
        self.binding, self.saved, self.mechanism = binding, saved, mechanism
        self.mode, self.backend = mode, backend
        self.direction = direction or self._own_direction
        if direction is None:
            binding.keep_last_grad(mode)
        self._buffers: list[torch.Tensor] | None = None  # allocated on first use, see `buffers`
        self._tag: tuple | None = None  # what the buffers hold: (version, s, lrs, mode) of a prediction
        self._remove = binding.on_after_step(self.invalidate)
        self.lent = False

    def _own_direction(self, g: FlatGroup) -> tuple[str, dict, dict, str]:
        return g.rule, self.binding.state_for_kernel(g), self.binding.group_hparams(g), self.mode

    def invalidate(self) -> None:
        """Forget the cached prediction (it is also forgotten after every optimizer step, and whenever the
        step, s, lr or mode it was made for no longer holds)."""
        self._tag = None

    @property
    def buffers(self) -> list[torch.Tensor]:
        """"pointer"/"swap": the prediction; "inplace": the stash of the real weights. Allocated when first
        needed, so a stage that never predicts (the last one: s is always 0) holds no extra copy."""
        if self._buffers is None:
            self._buffers = [torch.empty_like(g.work) for g in self.binding.groups]
            if self.mechanism == "pointer":
                for i, buf in enumerate(self._buffers):
                    self.saved.watch(buf, i)
        return self._buffers

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers or ())

    def active(self, s: float) -> bool:
        """Whether a prediction for s would differ from the real weights (s > 0 after the first step)."""
        return s > 0 and all(self.binding.step_count(g) > 0 for g in self.binding.groups)

    def _current_tag(self, s: float) -> tuple:
        lrs = tuple(pk.rules.scalar(self.binding.group_hparams(g)["lr"]) for g in self.binding.groups)
        return (self.binding.version, float(s), lrs, self.mode)

    def _predict_into(self, outs: Sequence[torch.Tensor], s: float) -> None:
        for g, out in zip(self.binding.groups, outs):
            rule, state, hp, mode = self.direction(g)
            pk.predict(rule, g.w, state, hp, step=self.binding.step_count(g), s=s, out=out, mode=mode,
                       backend=self.backend)

    def predict(self, s: float) -> list[torch.Tensor]:
        """Write ŵ for s into the prediction buffers (pointer/swap mechanisms); returns them.

        Reuses what is there when it already holds this prediction (same step, s, lr and mode), e.g. after
        a fused step_predict."""
        if self.mechanism == "inplace":
            raise RuntimeError("the in-place mechanism has no separate prediction buffer; use lend(s)")
        tag = self._current_tag(s)
        if tag != self._tag:
            self._predict_into(self.buffers, s)
            self._tag = tag
        return self.buffers

    @contextmanager
    def lend(self, s: float) -> Iterator[None]:
        """Inside, the module's parameters read ŵ for s; outside, the real weights. No-op when not active."""
        if not self.active(s):
            yield
            return
        if self.lent:
            raise RuntimeError("a prediction is already lent to the module: forwards on one stage must not nest")
        groups = self.binding.groups
        self.lent = True
        try:
            if self.mechanism == "inplace":
                with torch.no_grad():
                    for g, stash in zip(groups, self.buffers):
                        stash.copy_(g.work)
                    self._predict_into([g.work for g in groups], s)
                try:
                    yield
                finally:
                    with torch.no_grad():
                        for g, stash in zip(groups, self.buffers):
                            g.work.copy_(stash)
            elif self.mechanism == "swap":
                self.predict(s)
                for g, buf in zip(groups, self.buffers):
                    g.work.untyped_storage()._swap_data_ptr_(buf.untyped_storage())
                try:
                    yield
                finally:
                    for g, buf in zip(groups, self.buffers):
                        g.work.untyped_storage()._swap_data_ptr_(buf.untyped_storage())
            else:
                self.predict(s)
                for g, buf in zip(groups, self.buffers):
                    for j, p in enumerate(g.params):
                        p.data = g.view(buf, j)
                try:
                    yield
                finally:
                    for g in groups:
                        for j, p in enumerate(g.params):
                            p.data = g.view(g.work, j)
        finally:
            self.lent = False

    @contextmanager
    def target(self, s: float) -> Iterator[list[torch.Tensor]]:
        """Flat buffers holding ŵ for s while inside (for a backward that reads a prediction: SpecTrain);
        the real weights when not active."""
        groups = self.binding.groups
        if not self.active(s):
            yield [g.work for g in groups]
        elif self.mechanism == "inplace":
            with self.lend(s):
                yield [g.work for g in groups]
        else:
            yield self.predict(s)

    # ---- fused step + predict -----------------------------------------------------------------------

    def can_fuse(self) -> bool:
        """Whether step_predict can replace optimizer.step(): a separate prediction buffer, the optimizer's
        own rule (sgd, adam, adamw) in exact mode, custom-free plain groups, complete flat state."""
        b = self.binding
        if self.mechanism == "inplace" or self.mode != "exact" or self.direction != self._own_direction:
            return False
        if b.rule not in pk.STEP_PREDICT_RULES:
            return False
        for g in b.groups:
            hp = b.group_hparams(g)
            if hp.get("differentiable", False):
                return False
            if b.rule != "sgd":
                needed = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hp.get("amsgrad", False) else [])
                if any(n not in g.state for n in needed) or "step" not in g.scalars:
                    return False
        return True

    def step_predict(self, s: float) -> None:
        """One optimizer step of every group and ŵ for the next forward (s ahead) in the same pass.

        Replaces optimizer.step(): the binding runs its step bookkeeping (hooks, 'step' counters, last
        gradient, working copy); torch's own step hooks and LR-scheduler step tracking do not run."""
        if not self.can_fuse():
            raise RuntimeError("step_predict cannot replace this optimizer's step (see Predictor.can_fuse); "
                               "call optimizer.step() and predict(s)")
        b = self.binding

        def update() -> None:
            for g, out in zip(b.groups, self.buffers):
                hp = b.group_hparams(g)
                step = b.step_count(g)
                if b.rule == "sgd" and pk.rules.scalar(hp.get("momentum", 0.0)) != 0.0:
                    self._ensure_momentum(g, first=step == 0)
                state = dict(g.state)
                pk.step_predict(b.rule, g.w, g.master_grad, state, hp, step=step, s=s, out=out,
                                backend=self.backend)

        b.run_step(update)
        self._tag = self._current_tag(s)

    def _ensure_momentum(self, g: FlatGroup, first: bool) -> None:
        """SGD: give the fused step a flat momentum buffer and expose it in torch's state, as torch would."""
        if "momentum_buffer" not in g.state:
            g.state["momentum_buffer"] = torch.zeros_like(g.w)
        if first:
            opt_state = self.binding.optimizer.state
            for j, m in enumerate(g.masters):
                opt_state[m]["momentum_buffer"] = g.view(g.state["momentum_buffer"], j)

    def close(self) -> None:
        self._remove()
