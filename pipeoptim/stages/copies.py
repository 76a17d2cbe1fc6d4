"""Parameters of one stage that start as a copy of another stage's parameter.

Tied embeddings are the usual case: the input embedding (first stage) and the output projection (last stage)
are one weight in a single-process model, but two copies in a pipeline. Under a synchronous schedule they stay
one weight (``tied=``: ``runtime.tied`` sums their gradients); under an asynchronous one the stages step at
different times, so the copies are trained as separate weights that merely start equal (``copies=``).

Either way the copy must start from the source's value, and with a meta-built model only the rank holding
the source stage has it: that rank sends it (point to point) to every rank holding a copy, once, while the
pipeline is built. In one process (emulated, or both stages on one device) it is a local copy.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import ConfigError
from ..schedules.actions import Chunk

__all__ = ["check_copies", "copy_starts"]


def check_copies(copies, params: Mapping[str, tuple[int, torch.Tensor]]) -> list[tuple[str, str]]:
    """Validate ``copies=[(source, copy), ...]`` (global parameter names) against the model."""
    out = []
    for pair in copies or ():
        if isinstance(pair, str) or len(tuple(pair)) != 2:
            raise ConfigError(f"each entry of copies= is a pair (source, copy) of global parameter names, got {pair!r}")
        src, dst = tuple(pair)
        for name in (src, dst):
            if name not in params:
                close = [n for n in params if n.split(".")[-1] == name.split(".")[-1]][:6]
                raise ConfigError(f"copies=: parameter {name!r} is not in the model; names are "
                                  f"'<layer index>.<param>' (e.g. {', '.join(close or list(params)[:6])})")
        if tuple(params[src][1].shape) != tuple(params[dst][1].shape):
            raise ConfigError(f"copies=: {src} has shape {tuple(params[src][1].shape)} but {dst} has "
                              f"{tuple(params[dst][1].shape)}; a copy must have its source's shape")
        out.append((src, dst))
    return out


def _param(module, name: str) -> torch.Tensor:
    for local, p in module.named_parameters():
        if module.global_name(local) == name:
            return p
    raise KeyError(name)


def copy_starts(starts: Sequence[tuple[str, str]], stage_of: Mapping[str, int], modules: Mapping[Chunk, object],
                schedule, local_devices, ctx, devices: int) -> None:
    """Give every copy its source's value, in every model replica (``modules``: this process's chunks)."""
    if not starts:
        return
    ops, local_copies = [], []
    me = None if ctx is None else ctx.rank % devices
    base = 0 if ctx is None else (ctx.rank // devices) * devices  # this data-parallel copy's first rank
    for k, (src, dst) in enumerate(starts):
        for r in range(schedule.num_replicas):
            a, b = Chunk(r, stage_of[src]), Chunk(r, stage_of[dst])
            da, db = schedule.device_of(a.stage, r), schedule.device_of(b.stage, r)
            if ctx is None or da == db:
                if da in local_devices and db in local_devices:
                    local_copies.append((_param(modules[a], src), _param(modules[b], dst)))
                continue
            import torch.distributed as dist
            tag = k * schedule.num_replicas + r
            if me == da:
                ops.append(dist.P2POp(dist.isend, _param(modules[a], src).detach(), base + db, tag=tag))
            elif me == db:
                ops.append(dist.P2POp(dist.irecv, _param(modules[b], dst).detach(), base + da, tag=tag))
    with torch.no_grad():
        for source, target in local_copies:
            target.copy_(source)
    if ctx is not None:
        import torch.distributed as dist
        dist.barrier()  # every rank reaches here; NCCL wants its first collective before the first p2p batch
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
