"""Named asynchronous configurations, each the one a measured study found to train a given kind of model.

Asynchronous pipelines are judged by the loss they reach, and which combination of schedule, weight policy and
optimizer trains a Transformer is not something a user should have to rediscover: benchmarks/RESULTS.md §6.6
screened the candidates on a 16-block GPT (an lr sweep widened until each best was bracketed, a warm-up, then 3
seeds at each method's best) and this module ships the result by name, so that

    from pipeoptim import recipes
    r = recipes.get("async-transformer")
    pipe = Pipeline(layers, loss_fn=..., devices=8, microbatches=16, **r.pipeline_kwargs(lr=5e-4))

    pipeoptim train --recipe async-transformer --lr 5e-4 ...

run what was measured: the schedule and weight policy, the optimizer with its β1 and weight decay, the delay rules
(if any), and a linear lr warm-up over `warmup` updates (``pipeline_kwargs(..., lr_scheduler=False)`` leaves the lr
schedule to the caller). A recipe is a set of defaults, not a wrapper: everything it sets is an ordinary
``Pipeline`` argument or CLI flag, listed by ``describe()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Recipe", "RECIPES", "get", "names", "linear_warmup"]


def linear_warmup(updates: int) -> Callable:
    """``Pipeline(lr_scheduler=...)``: the lr times min(1, (k + 1) / updates) at update k, then the lr held."""
    import torch
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
        raise ValueError(f"a warm-up lasts a positive whole number of updates, got {updates!r}")
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / updates))


@dataclass(frozen=True)
class Recipe:
    name: str
    schedule: str
    policy: str
    optimizer: str                  # "adamw", "nadam" (decoupled weight decay) or "muon" (Muon + AdamW, below)
    beta1: float
    weight_decay: float
    warmup: int                     # updates of linear lr warm-up
    evidence: str                   # what was measured, and where
    avoid: str                      # what not to use instead, and why (measured)
    policy_options: dict = field(default_factory=dict)
    delay_hparams: dict | None = None
    measured_lr: dict = field(default_factory=dict)  # pipeline devices -> the lr its evidence was measured at

    def lr_for(self, devices: int) -> float:
        """The lr the recipe's evidence was measured at on ``devices`` pipeline devices; ValueError naming the
        depths and lrs that were measured when ``devices`` is not one of them (give an lr then)."""
        if devices in self.measured_lr:
            return self.measured_lr[devices]
        raise ValueError(f"recipe {self.name!r} was measured on {self._measured()}, not on {devices}; give a "
                         "learning rate (a sweep around those)")

    def _measured(self) -> str:
        return ", ".join(f"{d} devices at lr {lr:g}" for d, lr in sorted(self.measured_lr.items())) or "no depth"

    def optimizer_factory(self, lr: float) -> Callable:
        """``Pipeline(optimizer=...)``: the recipe's optimizer at learning rate `lr`."""
        import torch
        if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
            raise ValueError(f"recipe {self.name!r}: lr must be a positive number, got {lr!r}")
        betas = (self.beta1, 0.999)
        if self.optimizer == "muon":   # Muon on the 2-D weights at AdamW's update RMS, AdamW on the rest, one lr
            from .optim import muon_at_adamw_scale
            return muon_at_adamw_scale(lr, momentum=self.beta1, weight_decay=self.weight_decay)
        if self.optimizer == "adamw":
            return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, weight_decay=self.weight_decay)
        return lambda ps: torch.optim.NAdam(ps, lr=lr, betas=betas, weight_decay=self.weight_decay,
                                            decoupled_weight_decay=True)

    def lr_scheduler(self) -> Callable:
        """``Pipeline(lr_scheduler=...)``: a linear warm-up over `warmup` updates, then the lr held."""
        return linear_warmup(max(1, self.warmup))

    def pipeline_kwargs(self, lr: float, *, lr_scheduler: bool = True) -> dict:
        """Keyword arguments for ``Pipeline``: schedule, policy, policy_options, optimizer, delay_hparams and (with
        ``lr_scheduler=True``) the warm-up. Pass the model, loss, devices and micro-batches yourself."""
        kw = dict(schedule=self.schedule, policy=self.policy, policy_options=dict(self.policy_options),
                  optimizer=self.optimizer_factory(lr), delay_hparams=self.delay_hparams)
        if lr_scheduler:
            kw["lr_scheduler"] = self.lr_scheduler()
        return kw

    def cli_flags(self) -> dict[str, object]:
        """The ``pipeoptim train`` flags the recipe sets (argparse destinations -> values)."""
        flags = {"schedule": self.schedule, "policy": self.policy, "optimizer": self.optimizer,
                 "momentum": self.beta1, "weight_decay": self.weight_decay}
        if self.optimizer == "muon":
            flags["muon_scale"] = "adamw"
        if "delta" in self.policy_options:
            flags["predict_from"] = self.policy_options["delta"]
        if self.delay_hparams:
            flags.update({"delay_lr": self.delay_hparams.get("lr", "none"),
                          "delay_momentum": self.delay_hparams.get("momentum", "none"),
                          "delay_warmup": self.delay_hparams.get("warmup", 0)})
        return flags

    def describe(self) -> str:
        delay = "" if not self.delay_hparams else f", delay rules {self.delay_hparams}"
        options = "" if not self.policy_options else f" {self.policy_options}"
        return (f"{self.name}: schedule {self.schedule}, policy {self.policy}{options}, "
                f"{self.optimizer} β1 {self.beta1:g} weight decay {self.weight_decay:g}{delay}, linear lr warm-up "
                f"over {self.warmup} updates; measured on {self._measured()} (pipeoptim train --recipe without "
                f"--lr takes that lr for --stages, and refuses another depth). Evidence: {self.evidence} "
                f"Avoid: {self.avoid}")


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe(
        name="async-transformer",
        schedule="2bw", policy="2bw", optimizer="adamw", beta1=0.9, weight_decay=0.1, warmup=64,
        measured_lr={4: 5e-4, 8: 5e-4, 16: 5e-4},
        evidence="on gpt16 (16 blocks, 16 samples per update, 512 updates) it reached the synchronous target 2.5 in "
                 "3 of 3 seeds at D = 4, 8 and 16, at lr 5e-4, a quarter of the synchronous best (2e-3); PipeOptim's "
                 "prediction on top of it (policy 'pipeoptim') was no consistent gain (paired final loss -0.13 to "
                 "+0.11 nats/byte, 2 of 3 seeds at D = 8) - benchmarks/RESULTS.md §6.6. Synchronous ZBV and "
                 "BitPipe still reach the target sooner in projected time. On the Hugging Face GPT-2 of the same "
                 "size (640 updates) it reached 2.6 in 3 of 3 seeds at D = 4, 8 and 16 at the same lr 5e-4, where "
                 "synchronous training at 1e-3 needed less than half the updates.",
        avoid="asynchronous 1F1B with AdamW or NAdam (policies stash, pipeoptim, spectrain, the Nesterov paper's "
              "stash + NAdam recipe, DC-ASGD) on Transformers: stage k's updates are D-k-1 stale and no lr of a "
              "bracketed sweep reached "
              "the target in 512 updates at D = 4 or 16 (RESULTS.md §6.6).",
    ),
    Recipe(
        name="async-transformer-muon",
        schedule="2bw", policy="2bw", optimizer="muon", beta1=0.95, weight_decay=0.1, warmup=64,
        measured_lr={4: 3.2e-2, 8: 1.6e-2, 16: 1.6e-2},
        evidence="on gpt16 (16 blocks, 16 samples per update, 512 updates, 64 of warm-up) PipeDream-2BW with Muon on "
                 "the 2-D weights at AdamW's update RMS and AdamW on the rest reached the synchronous target 2.5 in 3 "
                 "of 3 seeds at D = 4, 8 and 16 at the synchronous lr (1.6e-2 at D = 8 and 16, 3.2e-2 at D = 4; "
                 "106, 91 and 92 updates against 77 synchronously with the same optimizer), projected 2.64 / 1.67 / "
                 "1.56 s: 1.8-3.4x sooner than async-transformer (2BW + AdamW, 4.81 / 4.19 / 5.26 s), level with or "
                 "ahead of synchronous 1F1B and BitPipe with Muon at D = 4 and 8, behind BitPipe at D = 16, and "
                 "behind synchronous ZBV with Muon at every depth (2.07 / 1.49 / 1.19 s). On the Hugging Face "
                 "GPT-2 of the same size (640 updates) it reached 2.6 in 3 of 3 seeds at D = 4, 8 and 16 (lr "
                 "3.2e-2 / 1.6e-2 / 3.2e-2, 77-88 updates against 65 synchronously), 2.9-4.1x sooner than "
                 "async-transformer there, ZBV with Muon again first - benchmarks/RESULTS.md §6.6.",
        avoid="AdamW or NAdam on an asynchronous 1F1B schedule (stage k D-k-1 updates stale: no lr of a bracketed "
              "sweep reached the target); with Muon on asynchronous 1F1B, stashing (it missed 2.5 at D = 16 in 3 of "
              "3 seeds) - PipeOptim's prediction from the last update (policy pipeoptim, "
              "policy_options delta='last_update') does reach it at every depth, as fast as this recipe at D = 4 "
              "and 1.6-2x slower at D = 8 and 16.",
    ),
]}


def names() -> list[str]:
    return sorted(RECIPES)


def get(name: str) -> Recipe:
    """The recipe called `name`; a clear error naming the known ones otherwise."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(names())} (pipeoptim.recipes)") from None
