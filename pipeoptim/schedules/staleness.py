"""The version difference s(stage, micro-batch): how many optimizer steps a stage applies between a
micro-batch's forward and the end of its backward, read off the action lists.

Weight prediction (PipeOptim) extrapolates each forward's weights s steps ahead, so s must be exact for every
micro-batch, warm-up included, and for any schedule; deriving it from the schedule rather than from a formula
makes it so. For PipeDream's async 1F1B on D stages it comes out as min(j, D-k-1) for micro-batch j on stage k
(D-k-1 in steady state, 0 on the last stage); with 2BW it counts updates (every m micro-batches), not
micro-batches; synchronous schedules give 0 everywhere.

A split backward ends at its ``W``: the micro-batch's weight gradient exists only then, so the step that applies
it waits for the ``W``, and s counts the steps up to the ``W``, not up to the ``I``. Predicting that far makes
the gradient fresh when it is applied, which is what PipeOptim's prediction is for (with an unsplit backward the
step follows the backward, so both readings agree). In the asynchronous schedule whose ``W`` lags k micro-batches
behind its ``I`` on stage k (``async-zb``), s is D-1 on every stage in steady state: D-k-1 steps until the ``I``
plus k until the ``W``. ``input_version_difference`` gives the steps up to the ``I`` instead (the weights the
input gradient reads), for comparison.
"""
from __future__ import annotations

from .actions import Forward, Step, input_grad_action, weight_grad_action
from .schedule import Schedule

__all__ = ["version_difference", "input_version_difference", "max_version_difference"]


def _steps_until(schedule: Schedule, ends) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for acts in schedule.actions:
        steps: dict = {}                  # chunk -> steps so far
        at_forward: dict = {}             # (chunk, mb) -> steps when the forward ran
        for a in acts:
            if isinstance(a, Step):
                steps[a.chunk] = steps.get(a.chunk, 0) + 1
            elif isinstance(a, Forward):
                at_forward[(a.chunk, a.mb)] = steps.get(a.chunk, 0)
            elif ends(a):
                key = (a.chunk, a.mb)
                if key not in at_forward:
                    raise ValueError(f"{schedule.format(a)} runs before its forward on the same device; "
                                     "validate the schedule first")
                out[(a.stage, a.mb)] = steps.get(a.chunk, 0) - at_forward[key]
    return out


def version_difference(schedule: Schedule) -> dict[tuple[int, int], int]:
    """{(stage, micro-batch): steps of that stage's chunk between the micro-batch's forward and the action that
    completes its weight gradient (its ``Backward``, or the ``W`` of a split backward)}.

    A micro-batch flows through one replica, so (stage, micro-batch) names one chunk. Steps are counted on
    the device holding the chunk, in list order, which is the order the executor applies them.
    """
    return _steps_until(schedule, weight_grad_action)


def input_version_difference(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Like ``version_difference`` but up to the action that computes the input gradient (``Backward`` or
    ``I``): the steps between the weights the forward reads and those the input gradient reads."""
    return _steps_until(schedule, input_grad_action)


def max_version_difference(schedule: Schedule) -> dict[int, int]:
    """{stage: largest s over its micro-batches} (the number of weight versions stashing would keep, minus 1:
    a stash lives until the micro-batch's weight gradient is complete)."""
    out: dict[int, int] = {}
    for (stage, _), s in version_difference(schedule).items():
        out[stage] = max(out.get(stage, 0), s)
    return out
