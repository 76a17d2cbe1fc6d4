"""`pipeoptim`: optimizer-dependent weight prediction, one prediction per forward, no stash.

The forward of a micro-batch with version difference s reads ŵ = w − s·lr·Δ; every backward op reads the
real weights current at backward time; the optimizer steps the real weights. Δ comes from `mode`:
"exact" (the optimizer's own rule), "paper" (the paper's table: SGD-momentum, Adam, AdamW) or "reference"
(the public PipeOptim code's rule, Δ and ε as it computes them: pipeoptim_kernels.rules). s comes from
`s_rule`: "schedule" (what the executor passes: the schedule's s, DESIGN.md §2), "paper" (D − k − 1 on
stage k of D, also in warm-up) or "reference" (the public code's D − k on every stage, the last included,
also in warm-up). The constant rules need the stage's place (`stage=`, `stages=`, or `place()`); mode
"reference" uses s_rule "reference" unless told otherwise, so that it reproduces the code as a whole.

One prediction buffer per flat group serves every micro-batch in flight (the saved weights of each forward
are redirected to the real buffer), so the extra memory is one copy of the working weights, plus a copy of
the last gradient for rules that read it (SGD without momentum or with Nesterov, RMSprop without momentum,
Adagrad, NAdam; SGD in mode "reference"); that copy is part of `state_dict()`, so a resumed run predicts as
the uninterrupted one.

`delta="last_update"`: Δ is the last update the optimizer applied instead of its own rule's (`last_update`: any
optimizer, torch.optim.Muon and a ChainedOptimizer included; one more copy of the weights, saved by `state_dict()`).

`step(next_s=s)` fuses the step with the next forward's prediction (one pass, sgd/adam/adamw in exact
mode); the following `forward(mb, s)` then finds ŵ ready. A changed lr or s in between just predicts again.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator

import torch
from torch import nn

from ..flat import OPAQUE_RULE, rule_for
from ..last_update import LastUpdate
from ..predictor import Predictor
from .base import WeightPolicy


S_RULES = ("schedule", "paper", "reference")
DELTAS = ("optimizer", "last_update")


class PipeOptimPolicy(WeightPolicy):
    name = "pipeoptim"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, mode: str = "exact",
                 s_rule: str | None = None, stage: int | None = None, stages: int | None = None,
                 mechanism: str | None = None, backend: str = "auto", fused: bool = True, delta: str = "optimizer",
                 **options):
        s_rule = s_rule or ("reference" if mode == "reference" else "schedule")
        if s_rule not in S_RULES:
            raise ValueError(f"s_rule must be one of {', '.join(S_RULES)}, got {s_rule!r}")
        if delta not in DELTAS:
            raise ValueError(f"delta must be one of {', '.join(DELTAS)}, got {delta!r}")
        if delta == "last_update" and mode != "exact":
            raise ValueError(f"delta='last_update' predicts from the last applied update whatever the optimizer; "
                             f"mode={mode!r} selects a rule of the optimizer's own Δ. Use one or the other")
        self.needs_optimizer_rule = delta == "optimizer"
        super().__init__(module, optimizer, **options)
        if self.needs_optimizer_rule and self.binding.rule == OPAQUE_RULE:
            rule_for(optimizer)  # raises: no rule for this optimizer, and how to add one
        self.delta = delta
        self.last_update = LastUpdate(self.binding) if delta == "last_update" else None
        self.predictor = Predictor(self.binding, self.saved, mechanism=mechanism, mode=mode, backend=backend,
                                   direction=None if self.last_update is None else self.last_update.direction)
        self.fused = fused
        self.s_rule = s_rule
        self.stage: int | None = None
        self.stages: int | None = None
        if stage is not None or stages is not None:
            self.place(stage, stages)

    def place(self, stage: int, stages: int) -> None:
        """Tell the policy it runs stage `stage` (from 0) of a pipeline of `stages` stages: the constant s
        rules ("paper", "reference") need it."""
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (stage, stages))
        if not (ok and 0 <= stage < stages):
            raise ValueError(f"place(stage, stages) needs integers 0 <= stage < stages, got stage={stage!r}, "
                             f"stages={stages!r}")
        self.stage, self.stages = stage, stages

    def version_difference(self, s_schedule: float) -> float:
        """The s this policy predicts with, given the schedule's s for the same forward."""
        if self.s_rule == "schedule":
            return s_schedule
        if self.stage is None:
            raise ValueError(f"s_rule={self.s_rule!r} predicts with a constant s per stage (paper: D - k - 1, "
                             "reference: D - k) and needs the stage's place: pass stage= and stages= to "
                             "make_policy or call policy.place(stage, stages); or use s_rule='schedule' for the "
                             "schedule's s")
        return float(self.stages - self.stage - (1 if self.s_rule == "paper" else 0))

    def _forward_s(self, s: float, lookahead: float) -> float:
        return self.version_difference(s)

    @contextmanager
    def _forward_weights(self, mb: Hashable, s: float) -> Iterator[None]:
        with self.predictor.lend(s):
            yield

    def _apply_step(self, next_s: float | None) -> None:
        if next_s is not None:
            next_s = self.version_difference(next_s)
        if self.fused and next_s and self.predictor.can_fuse():
            self.predictor.step_predict(next_s)
        else:
            self.optimizer.step()

    def memory_report(self) -> dict[str, int]:
        report = {"prediction" if self.predictor.mechanism != "inplace" else "restore": self.predictor.nbytes(),
                  "last_grad": self.binding.extra_bytes()}
        if self.last_update is not None:
            report["last_update"] = self.last_update.nbytes()
        return report

    def _state_entries(self, group: int) -> dict[str, torch.Tensor]:
        return {} if self.last_update is None else {"last_update": self.last_update.buffers[group]}

    def close(self) -> None:
        if self.last_update is not None:
            self.last_update.close()
        self.predictor.close()
