"""Tied parameters across stages: one logical weight held as copies on several stages (tied input and output
embeddings are the usual case).

A single-process model shares one Parameter; a pipeline cannot, because the stages that use it run on
different devices. So each owning stage keeps its own copy, and the runtime keeps the copies equal: they
start from the first name's value, and before the optimizer step every copy's gradient is replaced by the sum
of all copies' gradients (what the shared Parameter would have accumulated), so the identical optimizer
steps keep them identical. The global gradient norm counts the tied weight once (its first name).

A tie is planned per model replica (bidirectional schedules have two): the devices holding its members in
that replica. When they are one device (BitPipe: a replica's first and last stage share a device) the sum is
local; otherwise the owners all-reduce (``Executor``) or the emulator adds the copies in device order. Only
synchronous schedules are supported: in an asynchronous pipeline the owning stages step at different times,
so there is no moment at which all copies' gradients for one update exist.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..schedules.schedule import Schedule
from ..errors import ConfigError

__all__ = ["TieGroup", "plan_ties", "check_ties"]


@dataclass(frozen=True)
class TieGroup:
    """One tie in one replica: members as (device, stage, global name), first member first."""
    names: tuple[str, ...]
    replica: int
    members: tuple[tuple[int, int, str], ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted({d for d, _, _ in self.members}))


def check_ties(tied, schedule: Schedule, params: Mapping[str, tuple[int, torch.Tensor]]) -> list[tuple[str, ...]]:
    """Validate ``tied`` (sequences of global parameter names) against the model; returns them as tuples.

    ``params``: global name -> (stage, parameter)."""
    if not tied:
        return []
    if not schedule.synchronous:
        raise ConfigError(f"tied parameters need a synchronous schedule (gpipe, 1f1b, interleaved, chimera, "
                          f"bitpipe): under {schedule.name!r} the stages holding the copies step at different "
                          "times, so their summed gradient never exists. Use a synchronous schedule or untie them")
    out, seen = [], {}
    for tie in tied:
        if isinstance(tie, str) or len(tuple(tie)) < 2:
            raise ConfigError(f"each entry of tied= is a tuple of two or more global parameter names, got {tie!r}")
        tie = tuple(tie)
        for name in tie:
            if name not in params:
                close = [n for n in params if n.split(".")[-1] == name.split(".")[-1]][:6]
                raise ConfigError(f"tied parameter {name!r} is not in the model; names are '<layer index>.<param>' "
                                  f"(e.g. {', '.join(close or list(params)[:6])})")
            if name in seen:
                raise ConfigError(f"parameter {name!r} appears in two ties ({seen[name]} and {tie}); merge them "
                                  "into one tuple")
            seen[name] = tie
        shapes = {tuple(params[n][1].shape) for n in tie}
        if len(shapes) != 1:
            raise ConfigError(f"tied parameters {tie} have different shapes {sorted(shapes)}; tied copies must have "
                              "one shape (transpose the layer's weight if needed)")
        out.append(tie)
    return out


def plan_ties(ties: Sequence[tuple[str, ...]], schedule: Schedule, stage_of: Mapping[str, int]) -> list[TieGroup]:
    """Every tie in every replica, in a fixed order (all ranks run the same reductions in that order)."""
    groups = []
    for tie in ties:
        for r in range(schedule.num_replicas):
            members = tuple((schedule.device_of(stage_of[n], r), stage_of[n], n) for n in tie)
            groups.append(TieGroup(tie, r, members))
    return groups
