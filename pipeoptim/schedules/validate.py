"""Check a schedule against the rules of the format, and say which rule broke where, with the grid marked.

Rules, in the order they are checked:
1. placement: every action runs on the device that holds its chunk; a ``Sync`` lists its own device and
   covers stages the device holds; device numbers exist.
2. completeness: each micro-batch 0..N-1 flows through one replica, with exactly one ``Forward`` of every
   stage of that replica and either one ``Backward`` or one split pair ``I`` + ``W``, the ``W`` after its
   ``I`` on the same device; nothing else.
3. weights: synchronous schedules step every chunk exactly once, after all its backwards and weight
   gradients (``W``) and after any ``Sync`` that covers it, and sync after the backwards and ``W`` a ``Sync``
   covers; asynchronous schedules step only with new gradient since the last step (a ``Backward`` or ``W``;
   an ``I`` computes none) and leave no gradient unapplied.
4. collectives: every member of a ``Sync`` lists it equally often.
5. order: the lists can run with non-blocking sends and blocking syncs (``timeline.run_timeline``): every
   action's inputs are produced earlier, nothing waits in a cycle.
6. communication: with explicit ``Send``/``Recv``/``Handoff`` (given, or derived by ``lower``), every input is
   received or handed off before use, every send has its receive, and the lists complete when sends and
   receives block until their partner arrives (rendezvous) and syncs block until all members arrive.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from .actions import (Backward, BackwardInput, BackwardWeight, Forward, Handoff, Recv, Send, Step, Sync, is_compute,
                      weight_grad_action)
from .dataflow import consumer, input_transfer, output_transfer
from .errors import ScheduleError
from .grid import format_grid, format_order_grid
from .lower import lower
from .schedule import Schedule
from .timeline import run_timeline, unit_durations

__all__ = ["validate", "check_rendezvous"]


def _fail(schedule: Schedule, rule: str, detail: str, device: int, index: int) -> ScheduleError:
    grid = format_order_grid(schedule, marks=[(device, index)],
                             notes=[f"! device {device}, action {index}: {detail}"])
    return ScheduleError(rule, detail, device, index, grid)


def _check_placement(s: Schedule) -> None:
    for d, acts in enumerate(s.actions):
        held = set(s.chunks[d])
        held_stages = {c.stage for c in held}
        for i, a in enumerate(acts):
            if isinstance(a, (Forward, Backward, BackwardInput, BackwardWeight, Step)):
                if a.chunk not in held:
                    owner = s.placement.get(a.chunk)
                    where = "no device" if owner is None else f"device {owner}"
                    raise _fail(s, "placement", f"{s.format(a)} runs on device {d}, but its chunk is held by "
                                f"{where}", d, i)
            elif isinstance(a, Sync):
                if any(m >= s.num_devices for m in a.devices):
                    raise _fail(s, "placement", f"{s.format(a)} names a device beyond the {s.num_devices} "
                                "of the schedule", d, i)
                if a.devices and d not in a.devices:
                    raise _fail(s, "placement", f"{s.format(a)} is listed on device {d}, which is not one of "
                                "its members", d, i)
                foreign = [st for st in a.stages if st not in held_stages]
                if foreign:
                    raise _fail(s, "placement", f"{s.format(a)} syncs stages {foreign} that device {d} does "
                                "not hold", d, i)
            elif isinstance(a, (Send, Recv)):
                if a.peer >= s.num_devices or a.peer == d:
                    raise _fail(s, "placement", f"{s.format(a)} has an invalid peer", d, i)
                if s.placement.get(a.op.chunk) is None:
                    raise _fail(s, "placement", f"{s.format(a)} refers to a chunk no device holds", d, i)


def _check_completeness(s: Schedule) -> None:
    seen: dict[tuple, tuple[int, int]] = {}
    replica_of: dict[int, int] = {}
    for d, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if not is_compute(a):
                continue
            if a.mb >= s.num_microbatches:
                raise _fail(s, "completeness", f"{s.format(a)} names micro-batch {a.mb}, but the schedule has "
                            f"{s.num_microbatches} (0..{s.num_microbatches - 1})", d, i)
            if replica_of.setdefault(a.mb, a.replica) != a.replica:
                raise _fail(s, "completeness", f"micro-batch {a.mb} runs on both replicas; each micro-batch "
                            "flows through one replica", d, i)
            key = (type(a).__name__, a.mb, a.stage)
            if key in seen:
                pd, pi = seen[key]
                raise _fail(s, "completeness", f"{s.format(a)} appears twice (first at device {pd}, action "
                            f"{pi}); every forward and backward runs exactly once", d, i)
            seen[key] = (d, i)
    for mb in range(s.num_microbatches):
        if mb not in replica_of:
            raise ScheduleError("completeness", f"micro-batch {mb} never runs", grid=format_order_grid(s))
        r = replica_of[mb]
        for st in range(s.num_stages):
            full, i, w = (seen.get((k.__name__, mb, st)) for k in (Backward, BackwardInput, BackwardWeight))
            if full is not None and (i or w) is not None:
                d, at = i or w
                raise _fail(s, "completeness", f"micro-batch {mb} on stage {st} has a full backward (device "
                            f"{full[0]}, action {full[1]}) and a split one; run either B or I and W", d, at)
            if i is not None and w is not None and i[0] == w[0] and w[1] < i[1]:
                raise _fail(s, "completeness", f"{s.format(BackwardWeight(mb, st, r))} comes before its "
                            f"{s.format(BackwardInput(mb, st, r))} (action {i[1]}); the weight gradient needs "
                            "the graph that the input-gradient pass walks first", w[0], w[1])
            needed = [Forward] + ([BackwardInput, BackwardWeight] if (i or w) is not None else [Backward])
            for kind in needed:
                if (kind.__name__, mb, st) not in seen:
                    _missing(s, kind(mb, st, r))


def _missing(s: Schedule, op) -> None:
    d = s.placement[op.chunk]
    # draw the missing action, marked, after the device's last one
    shown = s.replace(actions=[list(a) + ([op] if k == d else []) for k, a in enumerate(s.actions)])
    detail = f"{s.format(op)} is missing from device {d}"
    if isinstance(op, (BackwardInput, BackwardWeight)):
        detail += " (a split backward needs both its I and its W)"
    raise ScheduleError("completeness", detail, d, grid=format_order_grid(
        shown, marks=[(d, len(s.actions[d]))], notes=[f"! device {d}: {detail}"]))


def _check_weights(s: Schedule) -> None:
    for d, acts in enumerate(s.actions):
        last_b: dict = {}
        pending: Counter = Counter()       # chunk -> backwards since its last step
        steps: dict = defaultdict(list)
        sync_at: dict[int, int] = {}       # stage -> index of the latest Sync covering it
        for i, a in enumerate(acts):
            if weight_grad_action(a):      # a Backward or a W: the micro-batch's weight gradient is complete
                last_b[a.chunk] = i
                pending[a.chunk] += 1
            elif isinstance(a, Sync):
                for st in a.stages:
                    sync_at[st] = i
            elif isinstance(a, Step):
                steps[a.chunk].append(i)
                if not s.synchronous and pending[a.chunk] == 0:
                    raise _fail(s, "weights", f"{s.format(a)} has no new gradient: no backward of its chunk "
                                "since its previous step", d, i)
                pending[a.chunk] = 0
        for chunk in s.chunks[d]:
            name = s.format(Step(chunk.stage, chunk.replica))
            if s.synchronous:
                if len(steps[chunk]) != 1:
                    idx = steps[chunk][1] if steps[chunk] else len(acts) - 1
                    raise _fail(s, "weights", f"synchronous schedules step each chunk exactly once per "
                                f"iteration; {name} appears {len(steps[chunk])} times", d, idx)
                i = steps[chunk][0]
                if chunk in last_b and i < last_b[chunk]:
                    last = s.format(acts[last_b[chunk]])
                    raise _fail(s, "weights", f"{name} comes before the last backward of its chunk, {last} "
                                f"(action {last_b[chunk]}); the flush steps after every Backward and W", d, i)
                if chunk.stage in sync_at and i < sync_at[chunk.stage]:
                    raise _fail(s, "weights", f"{name} comes before the Sync of its stage (action "
                                f"{sync_at[chunk.stage]}); it must use the synchronised gradient", d, i)
            elif pending[chunk]:
                raise _fail(s, "weights", f"{pending[chunk]} gradient(s) (Backward or W) of chunk {name[5:]} are "
                            "never applied by a later step", d, len(acts) - 1)
        if s.synchronous:
            for i, a in enumerate(acts):
                if isinstance(a, Sync):
                    late = [last_b[c] for c in s.chunks[d] if c.stage in a.stages and last_b.get(c, -1) > i]
                    if late:
                        raise _fail(s, "weights", f"{s.format(a)} comes before {s.format(acts[max(late)])} "
                                    f"(action {max(late)}) whose gradient it must include", d, i)


def _check_collectives(s: Schedule) -> None:
    counts = [Counter(a for a in acts if isinstance(a, Sync)) for acts in s.actions]
    for d, c in enumerate(counts):
        for sync, n in c.items():
            for m in sync.devices:
                if counts[m][sync] != n:
                    i = max(i for i, a in enumerate(s.actions[d]) if a == sync)
                    raise _fail(s, "collectives", f"{s.format(sync)} appears {n} times on device {d} but "
                                f"{counts[m][sync]} times on member device {m}; a collective needs every member",
                                d, i)


def _check_order(s: Schedule) -> None:
    timeline = run_timeline(s, unit_durations(2.0), sync_blocking=True)
    if not timeline.complete:
        first = timeline.blocked[0]
        detail = "; ".join(f"device {b.device} waits at {s.format(b.action)} for {b.waits_for}"
                           for b in timeline.blocked)
        raise ScheduleError("deadlock" if len(timeline.blocked) > 1 else "dependency order",
                            f"no device can move: {detail}", first.device, first.index,
                            format_grid(timeline))


def check_rendezvous(s: Schedule) -> None:
    """Rule 6 on a schedule with explicit communication actions."""
    # static: every remote input is received before use, every local one handed off, sends have receives
    for d, acts in enumerate(s.actions):
        delivered = set()
        for i, a in enumerate(acts):
            if isinstance(a, Recv):
                tr = input_transfer(s, a.op)
                if tr is None or tr.local or tr.src != a.peer or tr.dst != d:
                    raise _fail(s, "communication", f"{s.format(a)} does not match the data flow (the input of "
                                f"{s.format(a.op)} comes from " + ("nowhere" if tr is None else f"device {tr.src}")
                                + ")", d, i)
                delivered.add(a.op)
            elif isinstance(a, Handoff):
                tr = output_transfer(s, a.op)
                if tr is None or not tr.local or tr.src != d:
                    raise _fail(s, "communication", f"{s.format(a)} is not a local transfer on device {d}", d, i)
                delivered.add(tr.to_op)
            elif isinstance(a, Send):
                tr = output_transfer(s, a.op)
                if tr is None or tr.local or tr.dst != a.peer or tr.src != d:
                    raise _fail(s, "communication", f"{s.format(a)} does not match the data flow", d, i)
            elif is_compute(a):
                tr = input_transfer(s, a)
                if tr is not None and a not in delivered:
                    how = "handed off" if tr.local else f"received from device {tr.src}"
                    raise _fail(s, "communication", f"the input of {s.format(a)} is used before it is {how}",
                                d, i)
    # dynamic: rendezvous sends/receives, blocking collectives
    D = s.num_devices
    pos = [0] * D
    done: set = set()
    sync_seen = [Counter() for _ in range(D)]
    progress = True
    while progress:
        progress = False
        for d in range(D):
            while pos[d] < len(s.actions[d]):
                a = s.actions[d][pos[d]]
                if isinstance(a, Send):
                    peer = a.peer
                    want = Recv(consumer(s, a.op), d)
                    if a.op not in done or pos[peer] >= len(s.actions[peer]) or s.actions[peer][pos[peer]] != want:
                        break
                    pos[peer] += 1
                elif isinstance(a, Recv):
                    peer = a.peer
                    theirs = s.actions[peer][pos[peer]] if pos[peer] < len(s.actions[peer]) else None
                    if not (isinstance(theirs, Send) and theirs.peer == d and consumer(s, theirs.op) == a.op
                            and theirs.op in done):
                        break
                    pos[peer] += 1
                elif isinstance(a, Sync):
                    k = sync_seen[d][a]
                    members = set(a.devices) | {d}
                    if not all(pos[m] < len(s.actions[m]) and s.actions[m][pos[m]] == a and sync_seen[m][a] == k
                               for m in members):
                        break
                    for m in members - {d}:
                        sync_seen[m][a] += 1
                        pos[m] += 1
                    sync_seen[d][a] += 1
                elif is_compute(a):
                    done.add(a)
                pos[d] += 1
                progress = True
    if any(pos[d] < len(s.actions[d]) for d in range(D)):
        stuck = [(d, pos[d]) for d in range(D) if pos[d] < len(s.actions[d])]
        detail = "; ".join(f"device {d} waits at {s.format(s.actions[d][i])}" for d, i in stuck)
        d0, i0 = stuck[0]
        raise ScheduleError("deadlock", f"with blocking sends/receives: {detail}", d0, i0,
                            format_order_grid(s, marks=stuck, notes=[f"! {detail}"]))


def validate(schedule: Schedule, communication: bool = True) -> Schedule:
    """Check every rule (module docstring); raise ``ScheduleError`` at the first broken one.

    Returns the schedule with explicit communication: the given one if it already has Send/Recv/Handoff,
    else ``lower(schedule)`` (checked too, unless ``communication=False``).
    """
    base = schedule.compute_only()
    _check_placement(schedule)
    _check_completeness(base)
    _check_weights(base)
    _check_collectives(base)
    _check_order(base)
    explicit = any(isinstance(a, (Send, Recv, Handoff)) for acts in schedule.actions for a in acts)
    if not communication:
        return schedule
    lowered = schedule if explicit else lower(base)
    check_rendezvous(lowered)
    return lowered
