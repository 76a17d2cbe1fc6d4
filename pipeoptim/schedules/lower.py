"""Derive the communication a schedule needs: a ``Send``/``Recv`` pair for every output that crosses devices and
a ``Handoff`` for every output that stays on its device (BitPipe's V-turn).

The result is safe under the strictest semantics an executor could use: blocking sends and receives that
complete only in pairs, and blocking collectives. It is built as one global sequence of events (a compute on
one device, a send/receive pair on two devices, a sync on all its members) and each device's list is its
share of that sequence, so no device can wait on one that waits on it: whatever event comes first in the
sequence and is not done yet has all its devices ready for it. The sequence follows the unit-cost timeline
(forward 1, backward 2), receives are placed as soon as their data exists (an executor posts them early).
"""
from __future__ import annotations

from .actions import Action, Compute, Handoff, Recv, Send, Step, Sync, is_compute
from .dataflow import input_transfer, output_transfer
from .errors import ScheduleError
from .grid import format_grid
from .schedule import Schedule
from .timeline import run_timeline, unit_durations

__all__ = ["lower"]


def lower(schedule: Schedule) -> Schedule:
    """``schedule`` with explicit ``Send``/``Recv``/``Handoff`` actions (existing ones are derived again)."""
    base = schedule.compute_only()
    timeline = run_timeline(base, unit_durations(2.0), sync_blocking=True)
    if not timeline.complete:
        raise ScheduleError("deadlock", "the schedule cannot run even with non-blocking sends, so no "
                            "communication order can fix it", grid=format_grid(timeline))
    start = {(r.device, r.index): r.start for recs in timeline.records for r in recs}
    acts = base.actions
    D = base.num_devices
    head = [0] * D
    out: list[list[Action]] = [[] for _ in range(D)]
    delivered: set[Compute] = set()          # consumers whose input has been received or handed off
    sync_seen = [dict() for _ in range(D)]   # device -> Sync -> occurrences emitted so far

    def emittable(d: int) -> bool:
        a = acts[d][head[d]]
        if is_compute(a):
            tr = input_transfer(base, a)
            return tr is None or a in delivered
        if isinstance(a, Sync):
            k = sync_seen[d].get(a, 0)
            for m in set(a.devices) | {d}:
                if head[m] >= len(acts[m]) or acts[m][head[m]] != a or sync_seen[m].get(a, 0) != k:
                    return False
        return True

    remaining = sum(len(a) for a in acts)
    while remaining:
        ready = [d for d in range(D) if head[d] < len(acts[d]) and emittable(d)]
        if not ready:  # cannot happen after a complete timeline; kept as a guard with a clear message
            raise ScheduleError("deadlock", "no device can emit its next action while deriving communication")
        d = min(ready, key=lambda dev: (start[(dev, head[dev])], dev))
        a = acts[d][head[d]]
        if isinstance(a, Sync):
            for m in sorted(set(a.devices) | {d}):
                out[m].append(a)
                sync_seen[m][a] = sync_seen[m].get(a, 0) + 1
                head[m] += 1
                remaining -= 1
            continue
        out[d].append(a)
        head[d] += 1
        remaining -= 1
        if is_compute(a):
            tr = output_transfer(base, a)
            if tr is not None:
                if tr.local:
                    out[d].append(Handoff(a))
                else:
                    out[d].append(Send(a, tr.dst))
                    out[tr.dst].append(Recv(tr.to_op, tr.src))
                delivered.add(tr.to_op)
        elif not isinstance(a, Step):
            raise TypeError(f"device {d} holds an action lower() does not know: {a!r}")
    return base.replace(actions=out)
