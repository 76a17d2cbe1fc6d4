"""Where each compute action's input comes from and where its output goes: the dependency rules in one place.

The validator, the timeline engine, ``lower.py`` and the runtime executor all ask these functions instead of
re-deriving the rules, so that "what must happen before an action" has a single definition (documented per
action in ``actions.py``).
"""
from __future__ import annotations

from typing import NamedTuple

from .actions import BackwardInput, BackwardWeight, Compute, Forward
from .schedule import Schedule

__all__ = ["producer", "consumer", "requirements", "Transfer", "output_transfer", "input_transfer"]


def producer(schedule: Schedule, op: Compute) -> Compute | None:
    """The compute whose output is ``op``'s input; None when the input is data (stage 0 forward), the loss
    (last-stage backward, which starts from its own forward's output) or nothing (a weight gradient ``W``).
    A backward's input comes from the next stage's ``Backward`` or ``I`` (``Schedule.backward_of``)."""
    last = schedule.num_stages - 1
    if isinstance(op, Forward):
        return Forward(op.mb, op.stage - 1, op.replica) if op.stage > 0 else None
    if isinstance(op, BackwardWeight):
        return None
    return schedule.backward_of(op.mb, op.stage + 1, op.replica) if op.stage < last else None


def consumer(schedule: Schedule, op: Compute) -> Compute | None:
    """The compute that reads ``op``'s output; None for the loss (last-stage forward: its own backward reads
    it locally), for stage 0's input gradient (nobody needs it) and for a ``W`` (it has no output)."""
    last = schedule.num_stages - 1
    if isinstance(op, Forward):
        return Forward(op.mb, op.stage + 1, op.replica) if op.stage < last else None
    if isinstance(op, BackwardWeight):
        return None
    return schedule.backward_of(op.mb, op.stage - 1, op.replica) if op.stage > 0 else None


def requirements(schedule: Schedule, op: Compute) -> tuple[Compute, ...]:
    """Everything that must have finished before ``op`` starts: a backward (or ``I``) also needs its own
    forward, a ``W`` its ``I``."""
    if isinstance(op, BackwardWeight):
        return (BackwardInput(op.mb, op.stage, op.replica),)
    before = producer(schedule, op)
    deps = () if before is None else (before,)
    if not isinstance(op, Forward):
        deps = deps + (Forward(op.mb, op.stage, op.replica),)
    return deps


class Transfer(NamedTuple):
    """Movement of ``op``'s output to ``to_op``: ``local`` (a Handoff) when both run on the same device."""
    op: Compute
    to_op: Compute
    src: int
    dst: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


def output_transfer(schedule: Schedule, op: Compute) -> Transfer | None:
    nxt = consumer(schedule, op)
    if nxt is None:
        return None
    return Transfer(op, nxt, schedule.device_of(op.stage, op.replica), schedule.device_of(nxt.stage, nxt.replica))


def input_transfer(schedule: Schedule, op: Compute) -> Transfer | None:
    prev = producer(schedule, op)
    if prev is None:
        return None
    return output_transfer(schedule, prev)
