"""`pipeoptim`: optimizer-dependent weight prediction, one prediction per forward, no stash.

The forward of a micro-batch with version difference s reads ŵ = w − s·lr·Δ, Δ the update direction of
the optimizer's own rule (mode "exact") or of the paper's table (mode "paper": SGD-momentum, Adam,
AdamW); every backward op reads the real weights current at backward time; the optimizer steps the real
weights. One prediction buffer per flat group serves every micro-batch in flight (the saved weights of
each forward are redirected to the real buffer), so the extra memory is one copy of the working weights,
plus a copy of the last gradient for rules that read it (SGD without momentum or with Nesterov, RMSprop
without momentum, Adagrad, NAdam); that copy is part of `state_dict()`, so a resumed run predicts as the
uninterrupted one.

`step(next_s=s)` fuses the step with the next forward's prediction (one pass, sgd/adam/adamw in exact
mode); the following `forward(mb, s)` then finds ŵ ready. A changed lr or s in between just predicts again.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator

import torch
from torch import nn

from ..predictor import Predictor
from .base import WeightPolicy


class PipeOptimPolicy(WeightPolicy):
    name = "pipeoptim"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, mode: str = "exact",
                 mechanism: str | None = None, backend: str = "auto", fused: bool = True, **options):
        super().__init__(module, optimizer, **options)
        self.predictor = Predictor(self.binding, self.saved, mechanism=mechanism, mode=mode, backend=backend)
        self.fused = fused

    @contextmanager
    def _forward_weights(self, mb: Hashable, s: float) -> Iterator[None]:
        with self.predictor.lend(s):
            yield

    def _apply_step(self, next_s: float | None) -> None:
        if self.fused and next_s and self.predictor.can_fuse():
            self.predictor.step_predict(next_s)
        else:
            self.optimizer.step()

    def memory_report(self) -> dict[str, int]:
        return {"prediction" if self.predictor.mechanism != "inplace" else "restore": self.predictor.nbytes(),
                "last_grad": self.binding.extra_bytes()}

    def close(self) -> None:
        self.predictor.close()
