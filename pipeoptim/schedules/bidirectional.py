"""Two-replica (bidirectional) synchronous schedules: Chimera and BitPipe.

Both keep two copies of the model, "down" (replica 0, enters on device 0) and "up" (replica 1, enters on device
D-1), and send half of each group of D micro-batches each way, so one direction's warm-up fills the other's
bubble. Device r and its mirror D-1-r hold the same stages of the two replicas and average those gradients
with a ``Sync`` before stepping. Orders come from list scheduling (``listsched.py``) at unit costs with
"backward first, deepest stage first, earliest micro-batch first", which reproduces BitPipe's published order.

Chimera: D stages per replica; down stage k on device k, up stage k on device D-1-k.

BitPipe (V-shaped, DESIGN.md section 4): 2D stages per replica, four chunks per device; with stages numbered
from 0, device r holds chunk0 = down stage r, chunk1 = up stage D-1-r, chunk2 = down stage 2D-1-r,
chunk3 = up stage D+r. A down micro-batch goes devices 0 -> D-1 (stages 0..D-1), turns on device D-1 by a
local hand-off, and comes back D-1 -> 0 (stages D..2D-1); its loss is on device 0. Up is the mirror image.
The second-half chunks (2, 3) are synchronised with the mirror during the cool-down, the first-half chunks
(0, 1) at the end.

Concatenating groups of D micro-batches (N > D), for both schedules:
- ``concat="reference"``: the published rule (planned at unit costs, forward = backward) applied to the whole
  stream in group order ("direct concatenation"). With forward = backward it meets the closed formulas,
  (D-2)/(2N+D-2) for Chimera and (D-2)/(4N+D-2) for BitPipe; with backward = 2 x forward the groups interlock
  badly and idle time grows with every group (BitPipe: bubble towards 1/7, worse than interleaved 1F1B at
  D=8, N=32).
- ``concat="paced"``: groups are paced at the rate the devices can absorb them. Each operation is planned at
  its time in the one-group schedule (timed with the real backward/forward ratio) plus one group's per-device
  work, S(F + B) for S stages per replica, per earlier group; list scheduling then lets each free device run
  the ready operation planned earliest. If that is not faster than the reference at the given ratio (one
  group: nothing to concatenate), the reference order is kept. ``bench_schedules.py`` reports both.
"""
from __future__ import annotations

from .actions import Action, Backward, Chunk, Compute, Forward, Step, Sync
from .listsched import list_schedule
from .schedule import Schedule
from .timeline import run_timeline, unit_durations

__all__ = ["chimera", "bitpipe", "bitpipe_chunks", "bidirectional_replicas", "CONCATS"]

CONCATS = ("reference", "paced")


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


def chimera(devices: int, microbatches: int, concat: str = "reference", bwd_ratio: float = 2.0) -> Schedule:
    """Chimera; groups joined directly (``reference``) or ``paced`` (module docstring). Each stage is
    synchronised with its mirror as soon as both of that stage's chunks have finished their backwards."""
    D = devices
    chunks = [[Chunk(0, d), Chunk(1, D - 1 - d)] for d in range(D)]
    shell = _shell("chimera", D, microbatches, D, chunks)
    order = _order(shell, bidirectional_replicas(D, microbatches), concat, bwd_ratio)
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
    return {"concat": concat} if concat == "reference" else {"concat": concat, "bwd_ratio": bwd_ratio}


def bitpipe_chunks(devices: int) -> list[list[Chunk]]:
    """BitPipe's V-shaped placement: per device [chunk0, chunk1, chunk2, chunk3] (stages from 0)."""
    D = devices
    return [[Chunk(0, r), Chunk(1, D - 1 - r), Chunk(0, 2 * D - 1 - r), Chunk(1, D + r)] for r in range(D)]


def _paced_order(shell: Schedule, replicas: list[int], unit_order, bwd_ratio: float):
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


def _order(shell: Schedule, replicas: list[int], concat: str, bwd_ratio: float):
    """Per-device compute order for the ``concat`` rule (module docstring)."""
    if concat not in CONCATS:
        raise ValueError(f"unknown concatenation {concat!r}; choose one of {CONCATS}")
    D, N = shell.num_devices, shell.num_microbatches
    order = list_schedule(shell, replicas, _unit(1.0))
    if concat == "paced" and N > D:
        unit = list_schedule(shell.replace(num_microbatches=D), replicas[:D], _unit(1.0))
        paced = _paced_order(shell, replicas, unit, bwd_ratio)
        clock = unit_durations(bwd_ratio)
        if run_timeline(shell.replace(actions=paced), clock).makespan < \
                run_timeline(shell.replace(actions=order), clock).makespan - 1e-9:
            order = paced
    return order


def bitpipe(devices: int, microbatches: int, concat: str = "reference", bwd_ratio: float = 2.0) -> Schedule:
    """BitPipe; ``concat`` picks how groups of D micro-batches are joined (module docstring); ``bwd_ratio`` is
    the backward/forward cost ratio the ``paced`` order is planned for (the reference order ignores it)."""
    D, N = devices, microbatches
    chunks = bitpipe_chunks(D)
    shell = _shell("bitpipe", D, N, 2 * D, chunks)
    order = _order(shell, bidirectional_replicas(D, N), concat, bwd_ratio)
    actions: list[list[Action]] = []
    for r in range(D):
        acts: list[Action] = list(order[r])
        group = tuple(sorted({r, D - 1 - r}))
        first, second = chunks[r][:2], chunks[r][2:]
        late = Sync(tuple(sorted(c.stage for c in second)), group)
        early = Sync(tuple(sorted(c.stage for c in first)), group)
        if concat == "reference":
            # As published: the second-half sync goes just before the device's final backward, where the
            # device waits for that backward's gradient anyway.
            acts.insert(len(acts) - 1, late)
        else:
            acts.insert(_last_backward_index(acts, set(second)) + 1, late)
        acts.append(early)
        acts += [Step(c.stage, c.replica) for c in chunks[r]]
        actions.append(acts)
    return Schedule("bitpipe", D, N, 2 * D, chunks, actions, True, _params(concat, bwd_ratio))
