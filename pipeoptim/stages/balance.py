"""The stage boundaries a ``Pipeline`` cuts its layers at: the user's counts (checked), an even split by layer
count, or ``balance="time"``, which profiles each layer on one rank and gives every rank that rank's cut (timings
differ between processes, and every rank must cut the model alike).
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .model_cut import timing_copy
from .partition import balance_by_layers, balance_by_time, check_balance

__all__ = ["choose_balance"]


def choose_balance(layers, balance, sample, n_stages: int, device, seed: int, init_fn, ctx,
                   building: str) -> list[int]:
    """Layers per stage for ``balance`` (None, ``"time"`` or counts); ``ctx`` is the rank's distributed context
    (None when emulated), and ``building`` what its watchdog shows while this rank works on it."""
    if balance is None:
        return balance_by_layers(len(layers), n_stages)
    if isinstance(balance, str):
        if balance != "time":
            raise ConfigError(f"balance={balance!r}: give layer counts per stage, or 'time' to profile")
        if sample is None:
            raise ConfigError("balance='time' profiles the layers on sample= (the first layer's input)")
        balance_by_layers(len(layers), n_stages)  # same rule: a layer per stage at least
        result = None
        if ctx is None or ctx.rank == 0:  # one rank profiles, all use its cut (timings differ per process)
            result = balance_by_time(layers, _to(sample, device), n_stages,
                                     prepare=lambda i, layer: timing_copy(layer, str(i), device, seed, init_fn))
        if ctx is not None:
            import torch.distributed as dist
            box = [result]
            if ctx.watch is not None and ctx.rank != 0:
                ctx.watch.doing("waiting for rank 0's time-based balance (Pipeline start-up)", 0)
            dist.broadcast_object_list(box, src=0)
            if ctx.watch is not None:
                ctx.watch.working(building)
            result = box[0]
        return result
    if len(layers) < n_stages:
        balance_by_layers(len(layers), n_stages)
    return check_balance(balance, len(layers), n_stages)


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return tuple(t.to(device) for t in x)
