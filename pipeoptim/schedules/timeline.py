"""Run a schedule's per-device lists in order, as early as dependencies allow, and time every action.

This is the one execution model shared by the simulator (real costs) and the validator (unit costs, to find
deadlocks and to draw where a schedule gets stuck). Semantics, chosen to match an executor that posts
non-blocking sends (``isend``) and waits on receives before computing:

- a device runs its actions strictly in list order, one at a time;
- a compute starts when the device is free and its requirements (``dataflow.requirements``) have finished,
  plus the transfer time of its input (0 for a local hand-off, as the caller decides);
- sends never block the sender (communication overlaps computation);
- a ``Sync`` is issued when the device reaches it and completes when every member has issued it, plus the
  all-reduce time. With ``sync_blocking=False`` (default) the device goes on computing meanwhile and only a
  later ``Step`` of a covered stage waits for it; with ``True`` the device waits at the ``Sync``.

If no device can move while work remains, the result is ``complete=False`` and ``blocked`` says, per stuck
device, which action it is at and what it waits for: a deadlock under these semantics.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

from .actions import (Action, Backward, BackwardInput, BackwardWeight, Forward, Handoff, Recv, Send, Step, Sync,
                      is_compute)
from .dataflow import Transfer, input_transfer, requirements
from .schedule import Schedule

__all__ = ["Record", "Blocked", "Timeline", "run_timeline", "unit_durations"]


@dataclass(frozen=True)
class Record:
    """One action as it ran: on ``device``, ``index`` in that device's list, from ``start`` to ``end``."""
    device: int
    index: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Blocked:
    """A device that cannot move: it is at ``index`` (``action``) and waits for ``waits_for``."""
    device: int
    index: int
    action: Action
    waits_for: str


@dataclass
class Timeline:
    schedule: Schedule
    records: list[list[Record]]
    complete: bool = True
    blocked: list[Blocked] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((r.end for recs in self.records for r in recs), default=0.0)

    def end_of(self, device: int) -> float:
        return max((r.end for r in self.records[device]), default=0.0)


def unit_durations(bwd_ratio: float = 2.0) -> Callable[[int, Action], float]:
    """Forward 1, backward ``bwd_ratio`` (its ``I`` and ``W`` half each), everything else 0: the validator's and
    the grid's default clock."""
    def duration(device: int, action: Action) -> float:
        if isinstance(action, Forward):
            return 1.0
        if isinstance(action, Backward):
            return float(bwd_ratio)
        if isinstance(action, (BackwardInput, BackwardWeight)):
            return bwd_ratio / 2.0
        return 0.0
    return duration


def _zero_transfer(transfer: Transfer) -> float:
    return 0.0


def run_timeline(schedule: Schedule,
                 duration: Callable[[int, Action], float] | None = None,
                 transfer_time: Callable[[Transfer], float] = _zero_transfer,
                 sync_time: Callable[[Sync], float] = lambda sync: 0.0,
                 sync_blocking: bool = False) -> Timeline:
    """Time ``schedule`` (communication actions in it are ignored: transfers are derived from data flow)."""
    duration = duration or unit_durations()
    acts = [[a for a in row if not isinstance(a, (Send, Recv, Handoff))] for row in schedule.actions]
    D = schedule.num_devices
    pos = [0] * D
    free = [0.0] * D
    end: dict[object, float] = {}                 # completed key -> time its result is available
    waiters: dict[object, list[int]] = defaultdict(list)
    records: list[list[Record]] = [[] for _ in range(D)]
    sync_count = [defaultdict(int) for _ in range(D)]
    sync_issue: dict[tuple, dict[int, float]] = defaultdict(dict)
    sync_start: dict[tuple, float] = {}
    pending_sync: dict[int, tuple] = {}           # device -> sync key it issued but has not recorded yet
    last_sync: list[dict[int, tuple]] = [dict() for _ in range(D)]  # device -> stage -> latest sync key
    blocked: dict[int, Blocked] = {}
    work = deque(range(D))

    def complete(key, t: float) -> None:
        end[key] = t
        for w in waiters.pop(key, ()):
            work.append(w)

    def wait(d: int, key, what: str) -> None:
        waiters[key].append(d)
        blocked[d] = Blocked(d, pos[d], acts[d][pos[d]], what)

    while work:
        d = work.popleft()
        blocked.pop(d, None)
        while pos[d] < len(acts[d]):
            a = acts[d][pos[d]]
            if is_compute(a):
                ready = free[d]
                missing = None
                for req in requirements(schedule, a):
                    if req not in end:
                        missing = req
                        break
                    t = end[req]
                    tr = input_transfer(schedule, a)
                    if tr is not None and tr.op == req:
                        t += transfer_time(tr)
                    ready = max(ready, t)
                if missing is not None:
                    holder = schedule.placement.get(missing.chunk)
                    wait(d, missing, f"{schedule.format(missing)} on device {holder}")
                    break
                stop = ready + duration(d, a)
                records[d].append(Record(d, pos[d], a, ready, stop))
                free[d] = stop
                complete(a, stop)
            elif isinstance(a, Sync):
                if d not in pending_sync:
                    k = sync_count[d][a]
                    sync_count[d][a] += 1
                    key = ("sync", a, k)
                    members = set(a.devices) | {d}
                    sync_issue[key][d] = free[d]
                    pending_sync[d] = key
                    for s in a.stages:
                        last_sync[d][s] = key
                    if set(sync_issue[key]) >= members:
                        sync_start[key] = max(sync_issue[key].values())
                        complete(key, sync_start[key] + sync_time(a))
                key = pending_sync[d]
                if sync_blocking:
                    if key not in end:
                        wait(d, key, "the other members of " + schedule.format(a))
                        break
                    free[d] = max(free[d], end[key])
                del pending_sync[d]
                records[d].append(_SyncRecord(d, pos[d], a, key, sync_issue, end))
            elif isinstance(a, Step):
                ready = free[d]
                key = last_sync[d].get(a.stage)
                if key is not None:
                    if key not in end:
                        wait(d, key, "completion of " + schedule.format(key[1]))
                        break
                    ready = max(ready, end[key])
                stop = ready + duration(d, a)
                records[d].append(Record(d, pos[d], a, ready, stop))
                free[d] = stop
            else:
                raise TypeError(f"device {d} action {pos[d]} is not a schedule action: {a!r}")
            pos[d] += 1

    # Sync records were created before their completion was known: fill in the real times now.
    records = [[r.resolve() if isinstance(r, _SyncRecord) else r for r in recs] for recs in records]
    done = all(pos[d] == len(acts[d]) for d in range(D))
    stuck = [blocked[d] for d in sorted(blocked)] if not done else []
    return Timeline(schedule, records, done, stuck)


class _SyncRecord:
    """Placeholder for a Sync whose completion time is known only once all members have issued it."""

    def __init__(self, device, index, action, key, issues, end):
        self.device, self.index, self.action = device, index, action
        self._key, self._issues, self._end = key, issues, end

    def resolve(self) -> Record:
        start = self._issues[self._key][self.device]
        stop = self._end.get(self._key, float("inf"))
        return Record(self.device, self.index, self.action, start, stop)
