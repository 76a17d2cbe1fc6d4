"""Derive a per-device order by list scheduling: run a clock, and whenever a device is free let it take the
ready compute with the best priority.

Bidirectional schedules (Chimera, BitPipe) are easiest to state this way: "backward before forward, deeper
stage first, earlier micro-batch first" at unit costs reproduces BitPipe's published per-device order, and an
optional admission rule (at most so many micro-batches in flight) bounds activation memory. The result is an
order only; it is re-timed later with any costs.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .actions import Backward, Compute, Forward
from .dataflow import consumer, requirements
from .schedule import Schedule

__all__ = ["list_schedule", "backward_first_deep"]


def backward_first_deep(op: Compute) -> tuple:
    """Priority: backwards before forwards, then the stage deepest in its replica, then the earliest mb."""
    return (0 if isinstance(op, Backward) else 1, -op.stage, op.mb)


def list_schedule(shell: Schedule, microbatch_replica: Sequence[int],
                  duration: Callable[[Compute], float],
                  priority: Callable[[Compute], tuple] = backward_first_deep,
                  admit: Callable[[int, Compute, float], bool] | None = None,
                  patience: float = 0.0) -> list[list[Compute]]:
    """Order every forward and backward of the micro-batches (``microbatch_replica[mb]`` = its replica).

    shell:     a schedule whose chunks give the placement (its actions are ignored).
    duration:  time of a compute at generation (costs must be positive).
    admit:     ``admit(device, forward, in_flight)`` may refuse to start a forward while the device holds
               ``in_flight`` activation units (chunk activations weighted by D / num_stages).
    patience:  a device about to start a forward waits instead for a backward of its own that becomes ready
               less than ``patience`` later (backwards carry the critical path back to the loss).
    """
    D, S = shell.num_devices, shell.num_stages
    unit = D / S
    ops: list[Compute] = []
    for mb, replica in enumerate(microbatch_replica):
        ops += [Forward(mb, s, replica) for s in range(S)] + [Backward(mb, s, replica) for s in range(S)]
    missing = {op: len(requirements(shell, op)) for op in ops}
    ready_at: dict[Compute, float] = {}
    avail: list[list[Compute]] = [[] for _ in range(D)]
    for op in ops:
        if missing[op] == 0:
            ready_at[op] = 0.0
            avail[shell.placement[op.chunk]].append(op)
    free = [0.0] * D
    in_flight = [0.0] * D
    order: list[list[Compute]] = [[] for _ in range(D)]
    end: dict[Compute, float] = {}

    def admissible(d: int, op: Compute) -> bool:
        return isinstance(op, Backward) or admit is None or admit(d, op, in_flight[d])

    for _ in range(len(ops)):
        best = None
        for d in range(D):
            cands = [op for op in avail[d] if admissible(d, op)]
            if not cands:
                continue
            t = max(free[d], min(ready_at[op] for op in cands))
            if best is None or t < best[0] - 1e-12:
                best = (t, d, cands)
        if best is None:
            raise RuntimeError("list scheduling stalled: the admission rule refuses every ready forward "
                               "while no backward can run; loosen the in-flight limit")
        t, d, cands = best
        op = min((op for op in cands if ready_at[op] <= t + 1e-12), key=priority)
        if isinstance(op, Forward) and patience > 0:
            soon = [b for b in avail[d] if isinstance(b, Backward) and ready_at[b] < t + patience - 1e-12]
            if soon:
                op = min(soon, key=lambda b: (ready_at[b], priority(b)))
                t = ready_at[op]
        avail[d].remove(op)
        order[d].append(op)
        end[op] = t + duration(op)
        free[d] = end[op]
        in_flight[d] += unit if isinstance(op, Forward) else -unit
        successors = [consumer(shell, op)]
        if isinstance(op, Forward):
            successors.append(Backward(op.mb, op.stage, op.replica))
        for nxt in successors:
            if nxt is None or nxt not in missing:
                continue
            missing[nxt] -= 1
            ready_at[nxt] = max(ready_at.get(nxt, 0.0), end[op])
            if missing[nxt] == 0:
                avail[shell.placement[nxt.chunk]].append(nxt)
    return order
