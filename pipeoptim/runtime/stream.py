"""An asynchronous schedule as one stream across ``train_step`` calls: no fill and no drain between windows.

Why: an asynchronous 1F1B pipeline (PipeDream, PipeOptim) never flushes. Run as windows that each fill and
drain, it keeps a synchronous step's bubble ((D - 1) / (N + D - 1) of the time idle on devices that wait for
their peers), and the micro-batches next to a window's ends see fewer updates in flight than the rest. With
``Pipeline(stream=True)`` the micro-batches still in flight when a window's last forward has run stay in
flight into the next call, as in the papers' pipelines.

How (``Stream``):

- The stream is the asynchronous schedule over many windows, cut on each device after the backward (and its
  ``Step``, if one follows) that comes right after the window's last forward. One call runs one segment.
  The segments are slices of one schedule of four windows, planned once (``Plan``): its first window is the
  fill, its second and third the two steady segments, its end the drain. Every version difference s,
  look-ahead and "next forward's s" is that plan's, so K calls and a drain run exactly the actions of one
  window of K x N micro-batches, in the same order, on the same values (the tests check it bit for bit).
- Labels: the micro-batches in flight from the previous call must not share a label with this call's
  (labels key the worker's saved activations and the policy's in-flight state), so the steady segments
  alternate: A forwards labels N..2N-1, B forwards 0..N-1. A call's data is indexed by label (the
  ``Pipeline`` offsets A's micro-batches by N).
- No message crosses a call: at a cut, a device's last backward feeds the previous device's next backward,
  which runs in the next call. The sender keeps that output (its transfer is ``Carried``) and sends it first
  in the next segment (a ``CARRY`` entry at the head of its program). Point-to-point bookkeeping (receives
  posted ahead, buffers reused per iteration) stays per call, and a dropped stream leaves nothing on the wire.
- Whatever reads or replaces the weights from outside ``train_step`` (``eval_step``, ``state_dict``, ``save``,
  ``load``, ``Pipeline.drain``) first runs the drain: the backwards and steps of the micro-batches in flight.
  A checkpoint thus holds no half-finished micro-batch, and a resumed run equals one that went on after the
  same drain.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple

from ..schedules.actions import Backward, Forward, Step, Sync
from ..schedules.schedule import Schedule
from .plan import COMPUTE, STEP, ConfigError, Plan

__all__ = ["Stream", "Segment", "Carried", "CARRY", "STREAM_SCHEDULES", "check_stream"]

CARRY = "carry"  # a Plan.program entry of a segment: send the output the previous call kept for this one

STREAM_SCHEDULES = ("async-1f1b", "2bw")
_WINDOWS = 4  # fill, A, B, one more (so that B's last step knows the next forward's s); then the drain


class Carried(NamedTuple):
    """The output of ``op`` goes to ``to_op`` (labels of the next segment), which runs in the next call: the
    sender keeps it and sends it at the head of that segment."""
    op: object
    to_op: object
    src: int
    dst: int
    local = False


def check_stream(schedule: Schedule) -> None:
    """A ConfigError unless ``schedule`` can run as a stream (``Pipeline(stream=True)``)."""
    name, D, N = schedule.name, schedule.num_devices, schedule.num_microbatches
    if name not in STREAM_SCHEDULES:
        raise ConfigError(f"stream=True carries micro-batches in flight from one train_step to the next, which an "
                          f"asynchronous 1F1B order allows; schedule {name!r} is not one. Use one of "
                          f"{', '.join(STREAM_SCHEDULES)}, or leave stream off")
    if schedule.params.get("in_flight", 1) != 1:
        raise ConfigError(f"stream=True runs the schedule's own warm-up across calls; in_flight="
                          f"{schedule.params['in_flight']} (a deeper warm-up) is measured in windows only. Leave "
                          "stream off, or in_flight at 1")
    if N < D:
        raise ConfigError(f"stream=True needs at least as many micro-batches per train_step as pipeline devices "
                          f"(the window must reach the steady state); got microbatches={N} on {D} devices")


class Segment(Plan):
    """The part of the stream one call runs: a ``Plan`` whose program, channels, s values and step look-ahead
    come from the four-window plan (relabelled), with ``CARRY`` entries at the head of a device's program and
    ``Carried`` transfers for outputs the next call consumes. ``carries_in``: micro-batches are in flight when
    it starts; ``in_flight_after[d]``: the (label, chunk) keys of device d's forwards still in flight after it."""

    def __init__(self, name: str, unrolled: Plan, rows: list[list[tuple]], index_of: list[list[int]],
                 carries_in: bool, in_flight_after: list[set]):
        # no Plan.__post_init__: the four-window plan was checked; every derived fact is set here from it
        self.schedule, self.forward_only, self.name = unrolled.schedule, False, name
        self.carries_in, self.in_flight_after = carries_in, in_flight_after
        self.actions = [[entry[1] for entry in row] for row in rows]
        s_fwd, s_back, next_s, channels = {}, {}, {}, {}
        for d, row in enumerate(rows):
            for j, (kind, a, _, out_to) in enumerate(row):
                orig = index_of[d][j]
                if kind is CARRY:
                    channels.setdefault((d, out_to.dst), []).append(out_to.to_op)
                    continue
                if kind is STEP:
                    next_s[(d, j)] = unrolled.next_s(d, orig)
                    continue
                if kind is not COMPUTE:
                    continue
                src_op = unrolled.actions[d][orig]
                key = (a.mb, a.chunk)
                s_back[key] = unrolled.s_backward.get((src_op.mb, src_op.chunk), 0)
                if isinstance(a, Forward):
                    s_fwd[key] = unrolled.s_forward(src_op)
                if out_to is not None and not out_to.local and not isinstance(out_to, Carried):
                    channels.setdefault((d, out_to.dst), []).append(out_to.to_op)
        self.__dict__.update(program=rows, channels=channels, s_backward=s_back,
                             _steps=(s_fwd, next_s, unrolled._steps[2]), loss_scale=unrolled.loss_scale,
                             num_steps=sum(isinstance(a, Step) for row in self.actions for a in row),
                             sync_device_sets=[])

    def __repr__(self) -> str:
        return f"Segment({self.name!r} of {self.schedule.name!r}, {self.schedule.num_devices} devices)"


class Stream:
    """The segments of one asynchronous schedule and where the stream stands: ``next()`` is the plan of the
    next ``train_step`` with the label of its first micro-batch (0 or N), ``drain()`` the plan that finishes
    what is in flight (None when nothing is)."""

    def __init__(self, make: Callable[[int], Schedule], microbatches: int):
        N = self.microbatches = microbatches
        check_stream(make(N))  # (2bw: N is a multiple of update_every, so every call steps after the same labels)
        unrolled = make(_WINDOWS * N)
        plan = Plan(unrolled)
        cuts = [_cuts(row, N) for row in plan.actions]
        slice_of = {}  # (device, action) -> which slice of the four-window plan runs it
        for d, row in enumerate(plan.actions):
            for k in range(len(cuts[d]) - 1):
                for a in row[cuts[d][k]:cuts[d][k + 1]]:
                    slice_of[(d, a)] = k

        def shift(by: int, at_least: int = 0):
            def relabel(a):
                return replace(a, mb=a.mb - by) if a.mb >= at_least else a
            return relabel

        def same(a):
            return a

        build = lambda name, k, relabel, carries_in: _segment(  # noqa: E731
            name, plan, cuts, slice_of, k, relabel, carries_in)
        self.fill = build("fill", 0, same, False)
        self.steady = (build("A", 1, same, True), build("B", 2, shift(2 * N, 2 * N), True))
        self.drains = (build("drain after A", _WINDOWS, shift(2 * N), True),
                       build("drain after B", _WINDOWS, shift(3 * N), True))
        # whose forwards are in flight: "A", "B" (the fill's carry B's labels), or None: nothing is
        self.in_flight: str | None = None

    def next(self) -> tuple[Segment, int]:
        """The next call's segment and the label of its first micro-batch; ``advance`` once it has run."""
        if self.in_flight is None:
            return self.fill, 0
        if self.in_flight == "B":
            return self.steady[0], self.microbatches
        return self.steady[1], 0

    def advance(self, segment: Segment) -> None:
        """``segment`` has run."""
        if segment is self.steady[0]:
            self.in_flight = "A"
        elif segment is self.fill or segment is self.steady[1]:
            self.in_flight = "B"
        else:
            self.in_flight = None

    def drain(self) -> Segment | None:
        """The segment that finishes the micro-batches in flight (None: nothing is)."""
        if self.in_flight is None:
            return None
        return self.drains[0] if self.in_flight == "A" else self.drains[1]


def _cuts(row: list, N: int) -> list[int]:
    """Where a device's list of the four-window schedule is cut: after the backward (and its step, if one
    follows, with the data-parallel averages before that step) that comes right after each window's last
    forward; what follows the fourth is the drain."""
    cuts = [0]
    for k in range(1, _WINDOWS + 1):
        i = next(i for i, a in enumerate(row) if isinstance(a, Forward) and a.mb == k * N - 1) + 1
        if not isinstance(row[i], Backward):  # (check_stream: N >= D puts every window's end in the steady state)
            raise AssertionError(f"the window's last forward is followed by {row[i]}, not a backward")
        i += 1
        j = i
        while j < len(row) and isinstance(row[j], Sync):
            j += 1
        if j < len(row) and isinstance(row[j], Step):
            i = j + 1
        cuts.append(i)
    cuts.append(len(row))
    return cuts


def _segment(name, plan: Plan, cuts, slice_of, k: int, relabel, carries_in: bool) -> Segment:
    rows, index_of, in_flight = [], [], []
    for d, full in enumerate(plan.program):
        head, head_index = [], []
        for i in range(cuts[d][k - 1] if k else 0, cuts[d][k] if k else 0):
            _, a, _, out_to = full[i]
            if out_to is not None and not out_to.local and slice_of[(out_to.dst, out_to.to_op)] == k:
                head.append((CARRY, relabel(out_to.to_op), None,
                             Carried(relabel(a), relabel(out_to.to_op), d, out_to.dst)))
                head_index.append(i)
        row, index = list(head), list(head_index)
        for i in range(cuts[d][k], cuts[d][k + 1]):
            kind, a, src, out_to = full[i]
            if kind is COMPUTE:
                if out_to is not None:
                    later = slice_of[(out_to.dst, out_to.to_op)] > k
                    out_to = (Carried if later else type(out_to))(relabel(out_to.op), relabel(out_to.to_op),
                                                                  out_to.src, out_to.dst)
                a = relabel(a)
            row.append((kind, a, src, out_to))
            index.append(i)
        rows.append(row)
        index_of.append(index)
        in_flight.append({(relabel(a).mb, a.chunk) for a in plan.actions[d][cuts[d][k]:cuts[d][k + 1]]
                          if isinstance(a, Forward) and slice_of[(d, _backward_of(a))] > k})
    for d, row in enumerate(rows):  # every input a segment waits for is produced in it or carried into it
        for kind, a, src, _ in row:
            if kind is COMPUTE and src is not None and src != d:
                sent = [e for e in rows[src] if (e[0] is CARRY and e[1] == a) or
                        (e[0] is COMPUTE and e[3] is not None and e[3].to_op == a and not isinstance(e[3], Carried))]
                if len(sent) != 1:
                    raise AssertionError(f"segment {name}: {a} on device {d} has {len(sent)} producers")
    return Segment(name, plan, rows, index_of, carries_in, in_flight)


def _backward_of(a: Forward):
    return Backward(a.mb, a.stage, a.replica)
