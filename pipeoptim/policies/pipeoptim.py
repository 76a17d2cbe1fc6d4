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

`extrapolate=γ` (default 1) scales the prediction: ŵ = w − γ·s·lr·Δ. γ = 1 is PipeOptim's; γ > 1 aims past
the backward's weights, a Nesterov-like look-ahead that damps the oscillation a delay causes. In the one-direction
model of benchmarks/quadratic_delay_model.md, with β1 = 0.95 and one update of delay (2BW), γ = 1.5–2 raises
the largest stable lr·curvature from 4.0 (γ = 1) to 5.4 and contracts faster than γ = 1 at every lr·curvature
above ~0.1. On a GPT with Muon on 2BW (docs/studies/time-to-target.md, 6.7; 3 seeds at each best lr, which
doubled as the model predicts) γ = 2 needed the fewest updates to the target at 4 and 8 stages (84.5 and 84.4
against 86.1 and 88.4 for γ = 1) but not at 16 (88.5 against 87.0), and was noisier at every depth.

`delta="last_update"`: Δ is the last update the optimizer applied instead of its own rule's (`last_update`: any
optimizer, torch.optim.Muon and a ChainedOptimizer included; one more copy of the weights, saved by `state_dict()`).

Activation recomputation (`recompute_on`, for stages the runtime checkpoints): "backward" (default) recomputes
the forward on the real weights at backward time, the weights the backward reads and the prediction aimed at,
so the recomputed region's gradient is the gradient at the real weights; no extra memory. "forward" keeps a copy
of each in-flight forward's ŵ and recomputes on it (the forward's activations bit for bit, the backward inside
the region then reads ŵ too): one copy of the working weights per micro-batch in flight, like a stash.
benchmarks/probe_recompute_weights.py compares the two (README, "Activation recomputation").

`step(next_s=s)` fuses the step with the next forward's prediction (one pass, sgd/adam/adamw in exact
mode); the following `forward(mb, s)` then finds ŵ ready. A changed lr or s in between just predicts again.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Hashable, Iterator

import torch
from torch import nn

from ..prediction.flat import OPAQUE_RULE, rule_for
from ..prediction.last_update import LastUpdate
from ..prediction.predictor import Predictor
from .base import WeightPolicy
from .scopes import nbytes


S_RULES = ("schedule", "paper", "reference")
RECOMPUTE_ON = ("backward", "forward")
DELTAS = ("optimizer", "last_update")


class PipeOptimPolicy(WeightPolicy):
    name = "pipeoptim"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, mode: str = "exact",
                 s_rule: str | None = None, stage: int | None = None, stages: int | None = None,
                 mechanism: str | None = None, backend: str = "auto", fused: bool = True, delta: str = "optimizer",
                 recompute_on: str = "backward", extrapolate: float = 1.0, **options):
        if not (isinstance(extrapolate, (int, float)) and not isinstance(extrapolate, bool)
                and math.isfinite(extrapolate) and extrapolate > 0):
            raise ValueError(f"extrapolate is the factor γ in ŵ = w − γ·s·lr·Δ (1: PipeOptim's prediction); it must "
                             f"be a finite number > 0, got {extrapolate!r}")
        s_rule = s_rule or ("reference" if mode == "reference" else "schedule")
        if s_rule not in S_RULES:
            raise ValueError(f"s_rule must be one of {', '.join(S_RULES)}, got {s_rule!r}")
        if recompute_on not in RECOMPUTE_ON:
            raise ValueError(f"recompute_on must be one of {', '.join(RECOMPUTE_ON)} (what a recomputed forward reads: "
                             f"the real weights at backward time, or the forward's kept prediction), got "
                             f"{recompute_on!r}")
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
        self.recompute_on = recompute_on
        self._kept: dict[Hashable, list[torch.Tensor]] = {}  # recompute_on="forward": mb -> its forward's ŵ
        self._kept_pool: list[list[torch.Tensor]] = []
        self.s_rule = s_rule
        self.extrapolate = float(extrapolate)
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
        """The s this policy predicts with (times `extrapolate`), given the schedule's s for the same forward."""
        return self.extrapolate * self._steps_ahead(s_schedule)

    def _steps_ahead(self, s_schedule: float) -> float:
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
            if (self.recompute_on == "forward" and self.recompute and torch.is_grad_enabled()
                    and self.predictor.active(s)):
                self._keep(mb)
            yield

    def _keep(self, mb: Hashable) -> None:
        """Copy the ŵ lent to the module now, for mb's recomputation (recompute_on="forward")."""
        lent = self.predictor.buffers if self.predictor.mechanism == "pointer" else \
            [g.work for g in self.binding.groups]  # swap: g.work's storage holds ŵ now; inplace: ŵ written into it
        bufs = self._kept_pool.pop() if self._kept_pool else [torch.empty_like(b) for b in lent]
        with torch.no_grad():
            for buf, b in zip(bufs, lent):
                buf.copy_(b)
        self._kept[mb] = bufs

    def _recompute_buffers(self, mb: Hashable, tag) -> list[torch.Tensor]:
        kept = self._kept.get(mb)
        return kept if kept is not None else super()._recompute_buffers(mb, tag)

    def _release(self, mb: Hashable, tag) -> None:
        kept = self._kept.pop(mb, None)
        if kept is not None:
            self._kept_pool.append(kept)

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
        if self._kept or self._kept_pool:
            report["recompute_kept"] = sum(nbytes(b) for b in list(self._kept.values()) + self._kept_pool)
        return report

    def _state_entries(self, group: int) -> dict[str, torch.Tensor]:
        return {} if self.last_update is None else {"last_update": self.last_update.buffers[group]}

    def close(self) -> None:
        if self.last_update is not None:
            self.last_update.close()
        self.predictor.close()
