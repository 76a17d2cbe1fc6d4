"""Delay-aware hyper-parameters: each stage's learning rate and momentum as functions of its delay τ.

In an asynchronous pipeline stage k's gradients reach its weights τ_k updates late (τ_k = the stage's largest
version difference, read off the schedule: `schedules.staleness.max_version_difference`; D−k−1 on async 1F1B,
D−1 everywhere on async-zb, at most 1 on 2BW). Published recipes give the stale stages a smaller learning rate
and a larger momentum. The rules, for a stage of delay τ in a pipeline of P stages whose largest delay is
τ_max, at update k (updates completed so far) with a warm-up of K updates:

    lr rules (a factor on the lr the optimizer and any LR scheduler give)
      none       1                                    (with K > 0: a linear warm-up min(1, (k+1)/K))
      pipemare   1 / max(τ, 1)^(1 − min(k/K, 1))      PipeMare (MLSys 2021): K is its own warm-up, no other ramp
      graphcore  0.25 + 0.75·r,  r = 1 − τ/τ_max      Graphcore's pipelined BERT, lr·(0.25 + 0.75·s/S), with
                                                      s/S read as r (on async 1F1B r = k/(D−1) for stage k);
                                                      with K > 0 times the linear warm-up
    momentum rules (β1 of the Adam family, `momentum` of SGD, RMSprop, Muon; m = the group's own value)
      none       m
      graphcore  1 − (1 − m)(0.1 + 0.9·r)             Graphcore: stale stages keep more momentum
      nesterov   m + τ·(0.99 − m)/P                   "Nesterov Method for Asynchronous Pipeline Parallel
                                                      Optimization" (ICML 2025)

`lr_factor` and `momentum_for` are those formulas, the only place they are written. `DelayAwareHParams` applies
them to one stage's optimizer like an LR scheduler: it wraps the user's scheduler (if any), which keeps seeing
its own learning rate; after every update the param groups hold the scheduler's lr times the factor and the
rule's momentum. The weight-prediction policies read the param group's live lr, so a prediction uses the lr the
next update will apply.

The rules act on asynchronous schedules only: on a synchronous one every delay is 0 and there is nothing to
adapt, so the Pipeline refuses the option there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the CLI reads the rule names before it loads torch
    import torch

__all__ = ["LR_RULES", "MOMENTUM_RULES", "DelayRules", "DelayAwareHParams", "lr_factor", "momentum_for",
           "stage_delays"]

LR_RULES = ("none", "pipemare", "graphcore")
MOMENTUM_RULES = ("none", "graphcore", "nesterov")


def _freshness(tau: float, tau_max: float) -> float:
    """Graphcore's s/S read through the delay: 1 for a stage with no delay, 0 for the most delayed one."""
    return 1.0 if tau_max <= 0 else 1.0 - tau / tau_max


def lr_factor(rule: str, tau: float, tau_max: float, update: int, warmup: int) -> float:
    """The factor on the learning rate of a stage with delay `tau` at update `update` (module docstring)."""
    ramp = 1.0 if warmup <= 0 else min(1.0, (update + 1) / warmup)
    if rule == "none":
        return ramp
    if rule == "pipemare":
        progress = 1.0 if warmup <= 0 else min(update / warmup, 1.0)
        return max(tau, 1.0) ** -(1.0 - progress)
    if rule == "graphcore":
        return (0.25 + 0.75 * _freshness(tau, tau_max)) * ramp
    raise ValueError(f"unknown delay lr rule {rule!r}; choose one of {', '.join(LR_RULES)}")


def momentum_for(rule: str, m: float, tau: float, tau_max: float, stages: int) -> float:
    """The momentum (β1) of a stage with delay `tau`, from the group's own momentum `m` (module docstring)."""
    if rule == "none":
        return m
    if rule == "graphcore":
        return 1.0 - (1.0 - m) * (0.1 + 0.9 * _freshness(tau, tau_max))
    if rule == "nesterov":
        return m + tau * (0.99 - m) / stages
    raise ValueError(f"unknown delay momentum rule {rule!r}; choose one of {', '.join(MOMENTUM_RULES)}")


def stage_delays(schedule) -> dict[int, int]:
    """{stage: τ}, the stage's largest version difference in updates (0 for stages that never wait)."""
    from .schedules.staleness import max_version_difference
    found = max_version_difference(schedule)
    return {stage: found.get(stage, 0) for stage in range(schedule.num_stages)}


@dataclass(frozen=True)
class DelayRules:
    """Which rules to apply: `lr` (LR_RULES), `momentum` (MOMENTUM_RULES), `warmup` (K, in updates)."""
    lr: str = "none"
    momentum: str = "none"
    warmup: int = 0

    def __post_init__(self):
        if self.lr not in LR_RULES:
            raise ValueError(f"delay lr rule must be one of {', '.join(LR_RULES)}, got {self.lr!r}")
        if self.momentum not in MOMENTUM_RULES:
            raise ValueError(f"delay momentum rule must be one of {', '.join(MOMENTUM_RULES)}, got {self.momentum!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"delay warm-up must be a whole number of updates >= 0, got {self.warmup!r}")
        if self.lr == "pipemare" and self.warmup == 0:
            raise ValueError("the pipemare lr rule lr / τ^(1 − min(k/K, 1)) needs its warm-up K > 0 updates (with "
                             "K = 0 it is the plain lr); give warmup=K (pipeoptim train --delay-warmup K)")

    @classmethod
    def of(cls, value) -> "DelayRules | None":
        """None, a DelayRules, or a dict of its fields."""
        if value is None or isinstance(value, DelayRules):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"lr", "momentum", "warmup"}
            if unknown:
                raise ValueError(f"delay_hparams has unknown keys {sorted(unknown)}; use lr, momentum, warmup")
            return cls(**value)
        raise TypeError(f"delay_hparams must be None, a DelayRules or a dict(lr=..., momentum=..., warmup=...), "
                        f"got {type(value).__name__}")

    @property
    def active(self) -> bool:
        return self.lr != "none" or self.momentum != "none" or self.warmup > 0


def _momentum_key(group: dict) -> str | None:
    if "betas" in group:
        return "betas"
    if "momentum" in group:
        return "momentum"
    return None


class DelayAwareHParams:
    """One stage's delay-aware lr and momentum, applied like an LR scheduler (module docstring).

    `step()` after every optimizer update (the Pipeline's workers call it where they step an LR scheduler); it
    steps the wrapped scheduler `inner` on the undelayed lr first. `state_dict()` / `load_state_dict()` hold the
    update count and the inner scheduler's state; loading re-applies this stage's values (a checkpoint's param
    groups come from one stage)."""

    def __init__(self, optimizer: torch.optim.Optimizer, rules: DelayRules, *, delay: float, max_delay: float,
                 stages: int, inner=None):
        self.optimizer, self.rules, self.inner = optimizer, rules, inner
        self.delay, self.max_delay, self.stages = float(delay), float(max_delay), stages
        self.updates = 0
        groups = optimizer.param_groups
        if rules.momentum != "none":
            missing = [i for i, g in enumerate(groups) if _momentum_key(g) is None]
            if missing:
                raise ValueError(f"delay momentum rule {rules.momentum!r}: param group(s) {missing} of "
                                 f"{type(optimizer).__name__} have neither 'betas' nor 'momentum'; use momentum "
                                 "rule 'none' for this optimizer")
        self._lr = [float(g["lr"]) for g in groups]
        self._momentum = [self._read_momentum(g) for g in groups]
        self._apply()

    @staticmethod
    def _read_momentum(group: dict) -> float | None:
        key = _momentum_key(group)
        if key is None:
            return None
        return float(group["betas"][0]) if key == "betas" else float(group["momentum"])

    def lr_factor(self) -> float:
        return lr_factor(self.rules.lr, self.delay, self.max_delay, self.updates, self.rules.warmup)

    def _apply(self) -> None:
        factor = self.lr_factor()
        for g, lr, m in zip(self.optimizer.param_groups, self._lr, self._momentum):
            g["lr"] = lr * factor
            if m is None or self.rules.momentum == "none":
                continue
            beta = momentum_for(self.rules.momentum, m, self.delay, self.max_delay, self.stages)
            if "betas" in g:
                g["betas"] = (beta, *tuple(g["betas"])[1:])
            else:
                g["momentum"] = beta

    def step(self) -> None:
        """One update completed: step the inner scheduler on the undelayed lr, then apply the rules."""
        for g, lr in zip(self.optimizer.param_groups, self._lr):
            g["lr"] = lr
        if self.inner is not None:
            self.inner.step()
        self._lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.updates += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The learning rates the optimizer holds now (delay factor included)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"updates": self.updates, "inner": None if self.inner is None else self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the update count and the inner scheduler; the undelayed lr is the inner scheduler's (else the
        optimizer's own), the undelayed momentum the optimizer's own, so one stage's saved state loads into every
        stage, whatever its param groups."""
        if "updates" not in state:
            raise ValueError("this LR-scheduler state was not saved with delay-aware hyper-parameters; resume "
                             "with the options the checkpoint was written with")
        if self.inner is not None and state["inner"] is not None:
            self.inner.load_state_dict(state["inner"])
            self._lr = [float(x) for x in self.inner.get_last_lr()]
        self.updates = int(state["updates"])
        self._apply()

    def __repr__(self) -> str:
        return (f"DelayAwareHParams(lr={self.rules.lr!r}, momentum={self.rules.momentum!r}, "
                f"warmup={self.rules.warmup}, delay={self.delay:g}, updates={self.updates})")
