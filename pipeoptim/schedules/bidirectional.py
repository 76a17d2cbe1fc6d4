"""Two-replica (bidirectional) synchronous schedules: Chimera and BitPipe.

Both keep two copies of the model, "down" (replica 0, enters on device 0) and "up" (replica 1, enters on device
D-1), and send half of each group of D micro-batches each way, so one direction's warm-up fills the other's
bubble. Device r and its mirror D-1-r hold the same stages of the two replicas and average those gradients
with a ``Sync`` before stepping.

Chimera: D stages per replica; down stage k on device k, up stage k on device D-1-k. Its orders come from list
scheduling (``listsched.py``) at unit costs with "backward first, deepest stage first, earliest micro-batch
first"; ``concat="paced"`` as for BitPipe below.

BitPipe (V-shaped, DESIGN.md section 4): 2D stages per replica, four chunks per device; with stages numbered
from 0, device r holds chunk0 = down stage r, chunk1 = up stage D-1-r, chunk2 = down stage 2D-1-r,
chunk3 = up stage D+r. A down micro-batch goes devices 0 -> D-1 (stages 0..D-1), turns on device D-1 by a
local hand-off, and comes back D-1 -> 0 (stages D..2D-1); its loss is on device 0. Up is the mirror image.

BitPipe's orders (``concat``, how groups of D micro-batches are joined when N > D):
- ``"reference"``: the order of BitPipe's public code, for every even D and every N that is a multiple of D
  (``_published_order``). Per device it is a fixed forward list and a fixed backward list (per group, four
  streams of D/2 chunk passes merged at fixed offsets) walked in phases: a warm-up of 3D/2 + depth forwards
  (depth = distance to the nearer end), forward/backward pairs, then between groups the backwards run on
  while the next group's warm-up starts. A group's forwards start only as the previous group's backwards
  drain, so activations never exceed one group's (3D/4 + 1/2 chunk units on the end devices, D in the
  middle), but with backward B > forward F every further group adds (D-2)(B-F) idle time per device: at
  B = 2F the bubble levels off near 1/7. The second-half chunks (2, 3) are synchronised with the mirror just before the
  device's last backward, the first-half chunks (0, 1) after it; on the two middle devices both after it.
- ``"greedy"``: list scheduling of the whole stream at unit costs (the rule Chimera uses). The reference's compute
  order for one group at D = 4; for N > D it starts the next group's forwards earlier, which every device pays with
  activations up to D units (the middle devices' peak, so the largest per-device peak is unchanged) and which
  removes part of the idle time the reference order accumulates (bubble 0.0857 against 0.0943 at D=4, N=16,
  B=2F; equal with B=F, where both meet the closed formula). Syncs: the second half's right after its last
  backward, the first half's at the end.
- ``"paced"``: groups are paced at the rate the devices can absorb them. Each operation is planned at its
  time in the one-group greedy schedule (timed with the real backward/forward ratio) plus one group's
  per-device work, S(F + B) for S stages per replica, per earlier group; list scheduling then lets each free
  device run the ready operation planned earliest. Its idle time no longer grows with N (more activation
  memory: 10.5 vs 8 units at D=8). Where it is not faster than the greedy order at the given ratio (one group:
  nothing to concatenate) the greedy order is kept. Syncs as for greedy.
``bench_schedules.py`` reports all three.
"""
from __future__ import annotations

from .actions import Action, Backward, Chunk, Compute, Forward, Step, Sync
from .errors import ScheduleConfigError
from .listsched import list_schedule
from .schedule import Schedule
from .timeline import run_timeline, unit_durations

__all__ = ["chimera", "bitpipe", "bitpipe_chunks", "bidirectional_replicas", "paced_order", "CONCATS",
           "BITPIPE_CONCATS", "CHIMERA_CONCATS"]

BITPIPE_CONCATS = ("reference", "greedy", "paced")
CHIMERA_CONCATS = ("reference", "paced")
CONCATS = BITPIPE_CONCATS           # every name some bidirectional schedule accepts


def bidirectional_replicas(devices: int, microbatches: int) -> list[int]:
    """Replica of each micro-batch: in each group of D (the last group may be shorter), the first half goes
    down (0) and the second half up (1)."""
    out = []
    for start in range(0, microbatches, devices):
        size = min(devices, microbatches - start)
        out += [0 if i < size // 2 else 1 for i in range(size)]
    return out


def _unit(bwd_ratio: float):
    return lambda op: 1.0 if isinstance(op, Forward) else float(bwd_ratio)


def _last_backward_index(acts: list[Action], chunks: set[Chunk]) -> int:
    return max(i for i, a in enumerate(acts) if isinstance(a, Backward) and a.chunk in chunks)


def _shell(name: str, devices: int, microbatches: int, stages: int, chunks) -> Schedule:
    return Schedule(name, devices, microbatches, stages, chunks, [[] for _ in chunks], True)


def _check_concat(name: str, concat: str, allowed: tuple[str, ...]) -> None:
    if concat not in allowed:
        raise ScheduleConfigError(f"{name} has no concatenation {concat!r}; choose one of {', '.join(allowed)}")


def chimera(devices: int, microbatches: int, concat: str = "reference", bwd_ratio: float = 2.0) -> Schedule:
    """Chimera; groups joined directly (``reference``: list scheduling at unit costs) or ``paced`` (module
    docstring). Each stage is synchronised with its mirror as soon as both of that stage's chunks have finished
    their backwards."""
    _check_concat("chimera", concat, CHIMERA_CONCATS)
    D = devices
    chunks = [[Chunk(0, d), Chunk(1, D - 1 - d)] for d in range(D)]
    shell = _shell("chimera", D, microbatches, D, chunks)
    order = _listed_order(shell, bidirectional_replicas(D, microbatches), concat == "paced", bwd_ratio)
    actions: list[list[Action]] = []
    for d in range(D):
        acts: list[Action] = list(order[d])
        mirror = D - 1 - d
        group = tuple(sorted({d, mirror}))
        # One sync per stage, placed after the device's last backward of that stage; the mirror holds the
        # same stage in the other replica, which by symmetry finishes at the same time, so both devices
        # issue their syncs in the same order.
        per_stage = sorted(((_last_backward_index(acts, {c}), c) for c in chunks[d]), reverse=True)
        for index, chunk in per_stage:
            acts.insert(index + 1, Sync((chunk.stage,), group))
        acts += [Step(c.stage, c.replica) for c in chunks[d]]
        actions.append(acts)
    return Schedule("chimera", D, microbatches, D, chunks, actions, True, _params(concat, bwd_ratio))


def _params(concat: str, bwd_ratio: float) -> dict:
    return {"concat": concat, "bwd_ratio": bwd_ratio} if concat == "paced" else {"concat": concat}


def bitpipe_chunks(devices: int) -> list[list[Chunk]]:
    """BitPipe's V-shaped placement: per device [chunk0, chunk1, chunk2, chunk3] (stages from 0)."""
    D = devices
    return [[Chunk(0, r), Chunk(1, D - 1 - r), Chunk(0, 2 * D - 1 - r), Chunk(1, D + r)] for r in range(D)]


def _paced_plan(shell: Schedule, replicas: list[int], unit_order, bwd_ratio: float):
    """Groups paced at the rate the devices absorb them: every operation is planned at its group's one-group
    time (at the real ratio) plus one group's per-device work, S(F + B) for S stages, per earlier group;
    list scheduling then runs, on each free device, the ready operation planned earliest."""
    D = shell.num_devices
    one_group = shell.replace(num_microbatches=D, actions=unit_order)
    planned = {r.action: r.start for recs in run_timeline(one_group, unit_durations(bwd_ratio)).records
               for r in recs}
    group_work = shell.num_stages * (1 + bwd_ratio)

    # a micro-batch is planned like the one in the same direction and position of a full group
    base_mb, seen = [], {}
    for mb, replica in enumerate(replicas):
        key = (mb // D, replica)
        base_mb.append(seen.get(key, 0) + (0 if replica == 0 else D // 2))
        seen[key] = seen.get(key, 0) + 1

    def priority(op: Compute) -> tuple:
        base = type(op)(base_mb[op.mb], op.stage, op.replica)
        return (planned[base] + (op.mb // D) * group_work, isinstance(op, Forward), -op.stage)
    return list_schedule(shell, replicas, _unit(bwd_ratio), priority)


def paced_order(shell: Schedule, bwd_ratio: float) -> list[list[Compute]]:
    """The paced compute order for ``shell``'s placement and micro-batches, as generated, without falling back
    to the greedy order where it is not faster (``concat="paced"`` does fall back; tests bound this one)."""
    D = shell.num_devices
    replicas = bidirectional_replicas(D, shell.num_microbatches)
    unit = list_schedule(shell.replace(num_microbatches=D), replicas[:D], _unit(1.0))
    return _paced_plan(shell, replicas, unit, bwd_ratio)


def _listed_order(shell: Schedule, replicas: list[int], paced: bool, bwd_ratio: float):
    """The greedy order (list scheduling at unit costs), or the paced one where that is faster at the ratio."""
    D, N = shell.num_devices, shell.num_microbatches
    order = list_schedule(shell, replicas, _unit(1.0))
    if paced and N > D:
        candidate = paced_order(shell, bwd_ratio)
        clock = unit_durations(bwd_ratio)
        if run_timeline(shell.replace(actions=candidate), clock).makespan < \
                run_timeline(shell.replace(actions=order), clock).makespan - 1e-9:
            order = candidate
    return order


def _merge_at_offsets(streams: list[tuple[float, list]]) -> list:
    """Interleave lists whose i-th items sit at ``offset + i`` (ties, if any, in stream order)."""
    placed = [(offset + i, k, item) for k, (offset, items) in enumerate(streams) for i, item in enumerate(items)]
    return [item for *_, item in sorted(placed, key=lambda p: p[:2])]


def _published_order(D: int, N: int, r: int) -> list[Action]:
    """Device r's actions in the order of BitPipe's public code (see the module docstring), syncs included.

    Per group the device runs 2D forwards and 2D backwards: a first and a second pass (chunks 0/1, 2/3) of the
    D/2 micro-batches of each direction. ``near`` is the direction that enters at the device's nearer end of
    the pipeline, ``far`` the other; ``lead`` = D/2 - depth is how many near micro-batches the device has
    forwarded before the far direction's first one reaches it. The forward list merges four streams (near
    first pass from offset 0, far first pass from lead - 1/2, far second pass from D/2, near second pass from
    D/2 + lead - 1/2); the backward list is the same with the passes swapped (second passes first).
    """
    half = D // 2
    depth = min(r, D - 1 - r)
    lead = half - depth
    near, far = (0, 1) if r < half else (1, 0)
    chunks = bitpipe_chunks(D)[r]
    first_pass = {0: chunks[0], 1: chunks[1]}
    second_pass = {0: chunks[2], 1: chunks[3]}

    def passes(kind, g: int, direction: int, chunk: Chunk) -> list[Compute]:
        return [kind(g * D + direction * half + i, chunk.stage, chunk.replica) for i in range(half)]

    def group_list(kind, g: int, early: dict, late: dict) -> list[Compute]:
        return _merge_at_offsets([(0, passes(kind, g, near, early[near])),
                                  (lead - 0.5, passes(kind, g, far, early[far])),
                                  (half, passes(kind, g, far, late[far])),
                                  (half + lead - 0.5, passes(kind, g, near, late[near]))])

    groups = N // D
    fwd = [group_list(Forward, g, first_pass, second_pass) for g in range(groups)]
    bwd = [group_list(Backward, g, second_pass, first_pass) for g in range(groups)]
    warmup = 3 * half + depth               # forwards before the first backward; warmup + lead = 2D
    acts: list[Action] = list(fwd[0][:warmup])
    for g in range(groups):
        for i in range(lead):
            acts += [fwd[g][warmup + i], bwd[g][i]]
        if g == groups - 1:
            acts += bwd[g][lead:]
            break
        acts += bwd[g][lead:warmup + 1]     # the group's backwards run on ...
        for i in range(lead - 1):           # ... while the next group's warm-up starts
            acts += [fwd[g + 1][i], bwd[g][warmup + 1 + i]]
        acts += fwd[g + 1][lead - 1:warmup]

    mirror = tuple(sorted({r, D - 1 - r}))
    late_sync = Sync(tuple(sorted(c.stage for c in chunks[2:])), mirror)
    early_sync = Sync(tuple(sorted(c.stage for c in chunks[:2])), mirror)
    if depth == half - 1:                   # the two middle devices sync both halves after the last backward
        acts += [late_sync, early_sync]
    else:
        acts[-1:-1] = [late_sync]
        acts.append(early_sync)
    return acts


def bitpipe(devices: int, microbatches: int, concat: str = "reference", bwd_ratio: float = 2.0) -> Schedule:
    """BitPipe; ``concat`` picks how groups of D micro-batches are joined (module docstring); ``bwd_ratio`` is
    the backward/forward cost ratio the ``paced`` order is planned for (the other orders ignore it)."""
    _check_concat("bitpipe", concat, BITPIPE_CONCATS)
    D, N = devices, microbatches
    if D < 2 or D % 2 or N < D or N % D:
        raise ScheduleConfigError(f"bitpipe needs an even number of devices and a multiple of it as the number "
                                  f"of micro-batches (got {D} devices, {N} micro-batches); use --devices "
                                  f"{max(2, D + D % 2)} --microbatches {max(2, D + D % 2)}")
    chunks = bitpipe_chunks(D)
    if concat == "reference":
        actions = [_published_order(D, N, r) for r in range(D)]
    else:
        shell = _shell("bitpipe", D, N, 2 * D, chunks)
        order = _listed_order(shell, bidirectional_replicas(D, N), concat == "paced", bwd_ratio)
        actions = []
        for r in range(D):
            acts: list[Action] = list(order[r])
            mirror = tuple(sorted({r, D - 1 - r}))
            second, first = chunks[r][2:], chunks[r][:2]
            acts.insert(_last_backward_index(acts, set(second)) + 1,
                        Sync(tuple(sorted(c.stage for c in second)), mirror))
            acts.append(Sync(tuple(sorted(c.stage for c in first)), mirror))
            actions.append(acts)
    for r in range(D):
        actions[r] = actions[r] + [Step(c.stage, c.replica) for c in chunks[r]]
    return Schedule("bitpipe", D, N, 2 * D, chunks, actions, True, _params(concat, bwd_ratio))
