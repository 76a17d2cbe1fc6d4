"""`spectrain`: SpecTrain's prediction with the smoothed gradient, whatever the optimizer.

ŵ = w − s·lr·v, v the smoothed gradient: SGD-momentum's momentum_buffer, the Adam family's exp_avg
(an exponential average of gradients), or else an average the policy keeps itself,
v ← γ·v + (1−γ)·g after every step (extra memory, reported; saved by `state_dict()` so a resumed run
predicts as the uninterrupted one). Unlike PipeOptim it ignores how the optimizer
turns v into an update (Adam's normalisation, decoupled decay).

The paper version predicts twice per micro-batch: the forward on stage k reads ŵ for
s = ⌊k/2⌋ + D−k−1 and the backward reads ŵ for s = ⌊k/2⌋, predicted at backward time. Both s are inputs
that the schedule computes: `forward(mb, s=D−k−1, lookahead=⌊k/2⌋)` (the forward predicts s + lookahead)
and `backward(mb, s=⌊k/2⌋)`. The backward's prediction is written
into the same buffer as the forward's (they never overlap in time).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Hashable, Iterator

import torch
from torch import nn

import pipeoptim_kernels as pk

from ..prediction.flat import FlatGroup
from ..prediction.predictor import Predictor
from .base import WeightPolicy
from .scopes import nbytes

# The optimizer state that already is a smoothed gradient, by rule.
_SMOOTHED = {"adam": "exp_avg", "adamw": "exp_avg", "adamax": "exp_avg", "nadam": "exp_avg", "radam": "exp_avg"}


class SpecTrainPolicy(WeightPolicy):
    name = "spectrain"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, smoothing: float = 0.9,
                 mechanism: str | None = None, backend: str = "auto", **options):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing (γ of v ← γ·v + (1−γ)·g) must be in [0, 1), got {smoothing!r}")
        super().__init__(module, optimizer, **options)
        self.smoothing = smoothing
        self._own: dict[int, torch.Tensor] = {}
        for i, g in enumerate(self.binding.groups):
            if self._source(g) is None:
                self._own[i] = torch.zeros_like(g.w)
        self._remove = self.binding.on_after_step(self._update_average) if self._own else (lambda: None)
        self.predictor = Predictor(self.binding, self.saved, mechanism=mechanism, backend=backend,
                                   direction=self._direction)
        self._backward_target: list[torch.Tensor] | None = None

    def _source(self, g: FlatGroup) -> str | None:
        if g.rule == "sgd" and pk.rules.scalar(self.binding.group_hparams(g).get("momentum", 0.0)) != 0.0:
            return "momentum_buffer"
        return _SMOOTHED.get(g.rule)

    def _update_average(self) -> None:
        with torch.no_grad():
            for i, v in self._own.items():
                v.lerp_(self.binding.groups[i].master_grad, 1.0 - self.smoothing)

    def _direction(self, g: FlatGroup) -> tuple[str, dict, dict, str]:
        i = self.binding.groups.index(g)
        v = self._own[i] if i in self._own else g.state[self._source(g)]
        hp = {"lr": self.binding.group_hparams(g)["lr"], "momentum": 1.0}
        return "sgd", {"momentum_buffer": v}, hp, "paper"

    def _forward_s(self, s: float, lookahead: float) -> float:
        # The paper's forward predicts the version the backward will predict: ⌊k/2⌋ + D−k−1.
        return s + lookahead

    @contextmanager
    def _forward_weights(self, mb: Hashable, s: float) -> Iterator[None]:
        with self.predictor.lend(s):
            yield

    @contextmanager
    def _backward_weights(self, mb: Hashable, s: float) -> Iterator[None]:
        with self.predictor.target(s) as buffers:
            self._backward_target = buffers
            try:
                yield
            finally:
                self._backward_target = None

    def _resolve(self, group: int, tag: Any) -> torch.Tensor:
        if self._backward_target is not None:
            return self._backward_target[group]
        return self.binding.groups[group].work

    def _state_entries(self, group: int) -> dict[str, torch.Tensor]:
        own = self._own.get(group)
        return {} if own is None else {"smoothed_grad": own}

    def memory_report(self) -> dict[str, int]:
        return {"prediction" if self.predictor.mechanism != "inplace" else "restore": self.predictor.nbytes(),
                "smoothed_grad": nbytes(self._own.values())}

    def close(self) -> None:
        self._remove()
        self.predictor.close()
