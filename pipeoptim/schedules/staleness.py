"""The version difference s(stage, micro-batch): how many optimizer steps a stage applies between a
micro-batch's forward and its backward, read off the action lists.

Weight prediction (PipeOptim) extrapolates each forward's weights s steps ahead, so s must be exact for every
micro-batch, warm-up included, and for any schedule; deriving it from the schedule rather than from a formula
makes it so. For PipeDream's async 1F1B on D stages it comes out as min(j, D-k-1) for micro-batch j on stage k
(D-k-1 in steady state, 0 on the last stage); with 2BW it counts updates (every m micro-batches), not
micro-batches; synchronous schedules give 0 everywhere.
"""
from __future__ import annotations

from .actions import Backward, Forward, Step
from .schedule import Schedule

__all__ = ["version_difference", "max_version_difference"]


def version_difference(schedule: Schedule) -> dict[tuple[int, int], int]:
    """{(stage, micro-batch): steps of that stage's chunk between the micro-batch's forward and backward}.

    A micro-batch flows through one replica, so (stage, micro-batch) names one chunk. Steps are counted on
    the device holding the chunk, in list order, which is the order the executor applies them.
    """
    out: dict[tuple[int, int], int] = {}
    for acts in schedule.actions:
        steps: dict = {}                  # chunk -> steps so far
        at_forward: dict = {}             # (chunk, mb) -> steps when the forward ran
        for a in acts:
            if isinstance(a, Step):
                steps[a.chunk] = steps.get(a.chunk, 0) + 1
            elif isinstance(a, Forward):
                at_forward[(a.chunk, a.mb)] = steps.get(a.chunk, 0)
            elif isinstance(a, Backward):
                key = (a.chunk, a.mb)
                if key not in at_forward:
                    raise ValueError(f"{schedule.format(a)} runs before its forward on the same device; "
                                     "validate the schedule first")
                out[(a.stage, a.mb)] = steps.get(a.chunk, 0) - at_forward.pop(key)
    return out


def max_version_difference(schedule: Schedule) -> dict[int, int]:
    """{stage: largest s over its micro-batches} (the number of weight versions stashing would keep, minus 1)."""
    out: dict[int, int] = {}
    for (stage, _), s in version_difference(schedule).items():
        out[stage] = max(out.get(stage, 0), s)
    return out
