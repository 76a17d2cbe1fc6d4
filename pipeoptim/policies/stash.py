"""`stash` (PipeDream weight stashing) and `2bw` (PipeDream-2BW double buffering).

Both give every micro-batch's backward the weight version its forward used. Versions are copied lazily:
just before an optimizer step, if micro-batches forwarded at the current version are still in flight, the
working weights are copied once into a stash buffer that all of them share; the buffer returns to a pool
when the last of them has run its backward. So the memory is one copy per stale version in flight
(D−k−1 copies on stage k of a PipeDream pipeline, i.e. D−k versions with the live one) and nothing when
the schedule needs none.

2BW is the same machinery with gradient accumulation over `update_every` = m micro-batches (one update
per batch) and at most two versions alive, W(t) and W(t−1): W(t+1) = W(t) − ν·∇f(W(t−1)). A schedule
that would need a third version (m smaller than the micro-batches in flight) is refused before the step.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import nn

from .base import WeightPolicy
from .scopes import nbytes


class StashPolicy(WeightPolicy):
    """PipeDream: a weight version per in-flight micro-batch; backward uses its forward's version.

    `dc=λ > 0`: DC-ASGD's delay compensation of the stale gradient, g ← g + λ·g⊙g⊙(w_now − w_stash), a first-order
    correction of the gradient computed on the stashed weights to the weights it is applied to (g⊙g estimates the
    curvature's diagonal). Applied when the micro-batch's gradient is complete; needs one micro-batch per update
    (async-1f1b, async-zb). benchmarks/quadratic_delay_model.md argues for it: on a quadratic it raises the
    stability limit of delayed Adam-style momentum from ~1/s towards the synchronous one when the curvature
    estimate is within a factor 0.5–4 of the truth. No extra memory (the stash is there)."""

    name = "stash"
    max_versions: int | None = None  # None: as many as the schedule keeps in flight

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, dc: float = 0.0, **options):
        if isinstance(dc, bool) or not isinstance(dc, (int, float)) or not 0.0 <= dc < float("inf"):
            raise ValueError(f"dc (DC-ASGD's λ) must be a finite number >= 0, got {dc!r}")
        if dc and options.get("update_every", 1) != 1:
            raise ValueError(f"dc={dc} corrects each micro-batch's gradient to the weights it is applied to, which "
                             f"needs one micro-batch per update; update_every={options['update_every']} accumulates "
                             "several (use schedule 'async-1f1b' or 'async-zb', or dc=0)")
        super().__init__(module, optimizer, **options)
        self.dc = float(dc)
        self._stashes: dict[int, list[torch.Tensor]] = {}  # version -> one buffer per flat group
        self._pool: list[list[torch.Tensor]] = []
        self._remove = self.binding.on_before_step(self._before_step)

    def _forward_tag(self, mb: Hashable, s: float) -> int:
        return self.binding.version

    def _before_step(self) -> None:
        version = self.binding.version
        if version in self._stashes or version not in self._in_flight.values():
            return
        if self.max_versions is not None and len(self._stashes) + 2 > self.max_versions:
            stale = sorted(set(self._in_flight.values()))
            raise RuntimeError(
                f"{self.name}: this update would need a third weight version (micro-batches forwarded at versions "
                f"{stale} are still in flight); 2BW keeps two. Use update_every >= the number of micro-batches in "
                f"flight on this stage (the pipeline depth), or the 'stash' policy.")
        bufs = self._pool.pop() if self._pool else [torch.empty_like(g.work) for g in self.binding.groups]
        with torch.no_grad():
            for buf, g in zip(bufs, self.binding.groups):
                buf.copy_(g.work)
        self._stashes[version] = bufs

    def _resolve(self, group: int, version: Any) -> torch.Tensor:
        bufs = self._stashes.get(version)
        if bufs is not None:
            return bufs[group]
        if version != self.binding.version:
            raise RuntimeError(f"{self.name}: weight version {version} was not stashed (the optimizer was stepped "
                               "outside policy.step() while micro-batches were in flight?)")
        return self.binding.groups[group].work

    def _gradient_done(self, mb: Hashable, version: Any) -> None:
        bufs = self._stashes.get(version)
        if not self.dc or bufs is None:
            return  # forwarded at today's weights: nothing to correct
        with torch.no_grad():
            for g, stashed in zip(self.binding.groups, bufs):
                grad = g.grad.float() if g.grad.dtype != g.w.dtype else g.grad
                correction = grad * grad * (g.w - stashed.to(g.w.dtype)) * self.dc
                g.grad.add_(correction.to(g.grad.dtype))

    def _release(self, mb: Hashable, version: Any) -> None:
        if version in self._stashes and version not in self._in_flight.values():
            self._pool.append(self._stashes.pop(version))

    def memory_report(self) -> dict[str, int]:
        return {"stash": sum(nbytes(b) for b in self._stashes.values()) + sum(nbytes(b) for b in self._pool)}

    def trim(self) -> None:
        """Free the pooled (unused) stash buffers."""
        self._pool.clear()

    def close(self) -> None:
        self._remove()


class TwoBWPolicy(StashPolicy):
    """PipeDream-2BW: two weight versions, gradients accumulated over `update_every` = m micro-batches."""

    name = "2bw"
    max_versions = 2

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, update_every: int, **options):
        super().__init__(module, optimizer, update_every=update_every, **options)
