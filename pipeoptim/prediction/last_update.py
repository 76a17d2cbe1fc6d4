"""The optimizer-agnostic prediction direction: the last update the optimizer applied.

PipeOptim predicts ŵ = w − s·lr·Δ, where −lr·Δ is the update the optimizer's next step would apply. For any
optimizer, the update it applied last is a direction that needs no knowledge of its rule:

    step t applied   u_t = w_t − w_{t−1}          (everything in it: momentum, preconditioning, Muon's
                                                   orthogonalisation, weight decay, the lr of step t)
    predicted        ŵ = w_t + s·(lr_now / lr_t)·u_t

i.e. Δ = −u_t / lr_t: the next update is taken to be the last one, rescaled to the lr the next step will use
(an LR scheduler or the delay-aware lr may change it between steps). The buffer holds Δ = (w_{t−1} − w_t)/lr_t:
before each step it copies w, after the step it subtracts the new w and divides by the step's lr.

When it is exact: SGD with momentum (no dampening, Nesterov or weight decay) applies u_t = −lr·buf_t and would
apply −lr·buf_t again without a new gradient, which is its own Δ; Adam without weight decay likewise
(u_t = −lr·m̂_t/(√v̂_t + ε), the exact rule's Δ after t steps). Elsewhere it lags the optimizer's own Δ by one
gradient: for NAdam the fresh-gradient term, for AdamW the decay λ·w_{t−1} instead of λ·w_t, for Muon the
orthogonalised Nesterov momentum of the last step instead of the one a further Newton–Schulz would give from the
current momentum (its own step computes exactly the applied update; predicting the next one would need a second
Newton–Schulz per step on the matrices). Cost: one flat copy of the weights (fp32 masters in mixed precision)
kept across steps, one copy before and one subtract-and-scale after every step; no second Newton–Schulz. The
buffer is part of the policy's `state_dict()`, so a resumed run predicts as the uninterrupted one.
"""
from __future__ import annotations

import torch

import pipeoptim_kernels as pk

from .flat import FlatBinding, FlatGroup

__all__ = ["LastUpdate"]


class LastUpdate:
    """Keeps Δ = (w_{t−1} − w_t)/lr_t per flat group of `binding` and gives it to a Predictor as its direction."""

    def __init__(self, binding: FlatBinding):
        self.binding = binding
        self.buffers = [torch.zeros_like(g.w) for g in binding.groups]
        self._lrs: list[float] = []
        self._remove = [binding.on_before_step(self._before_step), binding.on_after_step(self._after_step)]

    def _before_step(self) -> None:
        b = self.binding
        self._lrs = [pk.rules.scalar(b.group_hparams(g)["lr"]) for g in b.groups]
        with torch.no_grad():
            for buf, g in zip(self.buffers, b.groups):
                buf.copy_(g.w)

    def _after_step(self) -> None:
        with torch.no_grad():
            for buf, g, lr in zip(self.buffers, self.binding.groups, self._lrs):
                if lr == 0.0:
                    buf.zero_()      # no step size: nothing to extrapolate from
                else:
                    buf.sub_(g.w).div_(lr)

    def direction(self, g: FlatGroup) -> tuple[str, dict, dict, str]:
        """(rule, state, hyper-parameters, mode) for the kernels: ŵ = w − s·lr_now·Δ, SGD's 'paper' form."""
        i = self.binding.groups.index(g)
        hp = {"lr": self.binding.group_hparams(g)["lr"], "momentum": 1.0}
        return "sgd", {"momentum_buffer": self.buffers[i]}, hp, "paper"

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def close(self) -> None:
        for remove in self._remove:
            remove()
