"""What a checked ``TrainConfig`` means to the rank that runs it: its optimizer, its policy's options, the
schedule's parameters and optimizer steps per window, the delay rules, how many ranks share this machine's cores,
what it emulates. One place for each, read by the checks, every rank, the run directory and the outputs.
"""
from __future__ import annotations

import os

from .config import TrainConfig

__all__ = ["emulation_words"]


def emulation_words(cfg: TrainConfig) -> str:
    """What a run emulates (``--link``, ``--straggler``), for every output that shows its numbers; '' if nothing."""
    from ..links import parse_link, parse_straggler
    parts = []
    if cfg.link:
        parts.append(f"link {parse_link(cfg.link).describe()}")
    if cfg.straggler:
        device, factor = parse_straggler(cfg.straggler)
        parts.append(f"straggler device {device} x{factor:g}")
    return ("emulated: " + "; ".join(parts)) if parts else ""


def _schedule_params(cfg: TrainConfig) -> dict:
    """The schedule's own parameters among the flags: 2bw's ``update_every`` when given."""
    return {} if cfg.update_every is None else {"update_every": cfg.update_every}


def _updates_per_window(cfg: TrainConfig) -> int:
    """Optimizer steps stage 0 takes per window of the run ``cfg`` (what the LR scheduler counts)."""
    from ..runtime.config import make_schedule
    from ..schedules.actions import Step
    sched = make_schedule(cfg.schedule, cfg.stages, cfg.microbatches, **_schedule_params(cfg))
    return sum(1 for a in sched.actions[0] if isinstance(a, Step) and a.stage == 0 and a.replica == 0)


def _cores() -> int:
    """CPU cores this process may run on (what the ranks of a CPU run share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _ranks_here(cfg: TrainConfig) -> int:
    """The ranks that run on this machine: every stage of every replica, or under torchrun this node's processes."""
    return cfg.local_ranks if cfg.local_ranks is not None else cfg.stages * cfg.dp


def _oversubscribed(cfg: TrainConfig) -> bool:
    """More CPU ranks than cores: a rank's idle share then includes waiting for a core, not only the bubble."""
    here = _ranks_here(cfg)
    return cfg.device == "cpu" and not cfg.emulate and here > (cfg.cores or here)


def _optimizer(cfg: TrainConfig):
    import torch
    name, lr = cfg.optimizer, cfg.lr
    m = cfg.momentum
    b1 = 0.9 if m is None else m
    wd = (0.1 if name == "muon" else 0.01) if cfg.weight_decay is None else cfg.weight_decay
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, 0.999), weight_decay=wd)
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, 0.999))
    if name == "nadam":
        return lambda ps: torch.optim.NAdam(ps, lr=lr, betas=(b1, 0.999), weight_decay=wd,
                                            decoupled_weight_decay=True)
    if name == "muon":
        from ..optim import muon_and_adamw, muon_at_adamw_scale
        if _muon_scale(cfg) == "adamw":
            return muon_at_adamw_scale(lr, momentum=0.95 if m is None else m, weight_decay=wd)
        return muon_and_adamw(lr=lr, momentum=0.95 if m is None else m, adamw_betas=(0.9, 0.999),
                              adamw_weight_decay=wd)
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=b1)
    return lambda ps: torch.optim.RMSprop(ps, lr=lr)


def _predict_from(cfg: TrainConfig) -> str:
    """PipeOptim's Δ: --predict-from when given; otherwise the last applied update for Muon (it has no rule of
    its own to predict with) and the optimizer's own rule for the rest."""
    if cfg.predict_from:
        return cfg.predict_from
    return "last_update" if cfg.optimizer == "muon" and cfg.policy == "pipeoptim" else "optimizer"


def _muon_scale(cfg: TrainConfig) -> str:
    """--muon-scale when given; otherwise adamw, the scale every Muon result here was measured at."""
    return cfg.muon_scale or "adamw"


def _policy_options(cfg: TrainConfig) -> dict:
    delta, dc = _predict_from(cfg), cfg.dc
    if cfg.policy == "pipeoptim" and delta != "optimizer":
        return {"delta": delta}
    return {"dc": dc} if cfg.policy == "stash" and dc else {}


def _delay_hparams(cfg: TrainConfig) -> dict:
    return {"lr": cfg.delay_lr, "momentum": cfg.delay_momentum,
            "warmup": cfg.delay_warmup}
