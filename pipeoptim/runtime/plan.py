"""What the executor and the emulator need to know about a schedule, derived once before anything runs.

A ``Schedule`` (``pipeoptim.schedules``) is pure data. Running it needs a few derived facts, computed here in
one place so the distributed executor and the single-process emulator cannot disagree:

- the per-device action lists with the communication actions removed: data movement is derived from data
  flow (``schedules.dataflow``): a compute's output is posted to its consumer right after the compute, and a
  compute waits for its input just before it runs. That is the timeline's own semantics ("sends never
  block"), so any schedule the timeline completes runs without deadlock;
- per channel (sender -> receiver) the order in which messages are sent, so a receiver can take messages
  first-in first-out (as NCCL requires) even when it consumes them in another order;
- the version difference s of every forward: the number of ``Step`` actions of the chunk between the
  micro-batch's forward and its backward in the device's list (DESIGN.md §2; it counts updates, so gradient
  accumulation is included; a split backward ends at its ``W``, as ``schedules.staleness`` explains), and
  SpecTrain's backward look-ahead from a unit-cost timeline;
- how many backwards each ``Step`` covers (the policy's ``update_every``) and the loss scale that makes the
  accumulated gradient a mean over the micro-batches of one update (the loss is scaled exactly once, at
  the last stage).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import ConfigError, PipelineError  # re-exported: the old import path keeps working
from ..schedules.actions import (Backward, BackwardWeight, Chunk, Forward, Handoff, Recv, Send, Step, Sync,
                                 is_compute, weight_grad_action)
from ..schedules.dataflow import Transfer, input_transfer, output_transfer
from ..schedules.schedule import Schedule
from ..schedules.timeline import run_timeline, unit_durations

__all__ = ["Plan", "ConfigError", "PipelineError", "COMPUTE", "WEIGHT", "SYNC", "STEP"]

COMPUTE, WEIGHT, SYNC, STEP = "compute", "weight", "sync", "step"  # the kinds of action in ``Plan.program``


@dataclass
class Plan:
    schedule: Schedule
    forward_only: bool = False
    actions: list[list] = field(init=False)

    def __post_init__(self):
        sched = self.schedule
        acts = [[a for a in row if not isinstance(a, (Send, Recv, Handoff))] for row in sched.actions]
        if self.forward_only:
            acts = [[a for a in row if isinstance(a, Forward)] for row in acts]
        self.actions = acts
        self._check_complete()

    # ---- structure -------------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.schedule.num_devices

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    def chunks(self, device: int) -> tuple[Chunk, ...]:
        return self.schedule.chunks[device]

    @cached_property
    def first_stage_devices(self) -> dict[int, int]:
        """replica -> device that reads the data (stage 0)."""
        return {r: self.schedule.device_of(0, r) for r in range(self.schedule.num_replicas)}

    @cached_property
    def loss_devices(self) -> dict[int, int]:
        last = self.schedule.num_stages - 1
        return {r: self.schedule.device_of(last, r) for r in range(self.schedule.num_replicas)}

    def is_last(self, chunk: Chunk) -> bool:
        return chunk.stage == self.schedule.num_stages - 1

    def _check_complete(self) -> None:
        sched = self.schedule
        replica_of = sched.microbatch_replica
        missing = []
        for mb in range(sched.num_microbatches):
            r = replica_of.get(mb)
            if r is None:
                missing.append(f"micro-batch {mb} has no forward")
                continue
            for s in range(sched.num_stages):
                d = sched.device_of(s, r)
                ops = [Forward(mb, s, r)]
                if not self.forward_only:
                    back = sched.backward_of(mb, s, r)
                    ops += [back] + ([BackwardWeight(mb, s, r)] if not isinstance(back, Backward) else [])
                for op in ops:
                    if op not in self.actions[d]:
                        missing.append(f"{sched.format(op)} is not in device {d}'s list")
        if missing:
            raise ConfigError(f"schedule {sched.name!r} cannot be executed: " + "; ".join(missing[:5]) +
                              " (every micro-batch needs a forward and a backward on every stage of its replica,"
                              " on the device holding that chunk)")
        if not self.forward_only:
            tl = run_timeline(sched.compute_only() if hasattr(sched, "compute_only") else sched)
            if not tl.complete:
                why = "; ".join(f"device {b.device} at {sched.format(b.action)} waits for {b.waits_for}"
                                for b in tl.blocked[:4])
                raise ConfigError(f"schedule {sched.name!r} deadlocks: {why}. Fix the per-device order "
                                  "(validate it with `pipeoptim schedule`)")

    # ---- communication ---------------------------------------------------------------------------------
    @cached_property
    def channels(self) -> dict[tuple[int, int], list]:
        """(src, dst) -> consumer ops of the messages src sends to dst, in src's sending order."""
        out: dict[tuple[int, int], list] = defaultdict(list)
        for d, row in enumerate(self.actions):
            for a in row:
                if is_compute(a):
                    t = output_transfer(self.schedule, a)
                    if t is not None and not t.local and (not self.forward_only or isinstance(a, Forward)):
                        out[(t.src, t.dst)].append(t.to_op)
        return dict(out)

    @cached_property
    def _transfers(self) -> tuple[dict, dict]:
        """Per compute action: where its output goes (a ``Transfer`` or None) and which device its input comes
        from (None: the data, or the loss on the last stage). Derived once: the executor asks per action."""
        outputs, sources = {}, {}
        for row in self.actions:
            for a in row:
                if not is_compute(a):
                    continue
                outputs[a] = output_transfer(self.schedule, a)
                if isinstance(a, Forward):
                    t = input_transfer(self.schedule, a)
                    sources[a] = None if t is None else t.src
                elif not isinstance(a, BackwardWeight):
                    t = output_transfer(self.schedule, Forward(a.mb, a.stage, a.replica))
                    sources[a] = None if t is None else t.dst
        return outputs, sources

    @cached_property
    def program(self) -> list[list[tuple]]:
        """Each device's actions as ``(kind, action, input source, output transfer)``, kind one of ``COMPUTE``
        (a forward, backward or ``I``: source and transfer as ``input_source`` and ``output_of`` say), ``WEIGHT``
        (a split backward's ``W``), ``SYNC``, ``STEP``: what the executor and the emulator ask of each action,
        derived once, so their loops ask the plan nothing per action."""
        rows = []
        for row in self.actions:
            out = []
            for a in row:
                if isinstance(a, BackwardWeight):
                    out.append((WEIGHT, a, None, None))
                elif is_compute(a):
                    out.append((COMPUTE, a, self.input_source(a), self.output_of(a)))
                else:
                    out.append((SYNC if isinstance(a, Sync) else STEP, a, None, None))
            rows.append(out)
        return rows

    def output_of(self, op) -> Transfer | None:
        """Where the output of compute action ``op`` goes."""
        return self._transfers[0][op]

    def input_source(self, op) -> int | None:
        """The device the input of ``op`` comes from (its own device for a hand-off); None: the data or the
        loss."""
        return self._transfers[1][op]

    # ---- weights ---------------------------------------------------------------------------------------
    @cached_property
    def _steps(self) -> tuple[dict, dict, dict]:
        """s of each forward, next forward's s after each Step (by (device, index)), backwards per step."""
        s_fwd: dict = {}
        next_s: dict = {}
        per_step: dict = {}
        for d, row in enumerate(self.actions):
            steps_so_far: dict[Chunk, int] = defaultdict(int)
            fwd_at: dict = {}
            backwards_since: dict[Chunk, int] = defaultdict(int)
            for a in row:
                if isinstance(a, Forward):
                    fwd_at[(a.mb, a.chunk)] = steps_so_far[a.chunk]
                elif weight_grad_action(a):           # the backward (or its W) completes the gradient
                    s_fwd[(a.mb, a.chunk)] = steps_so_far[a.chunk] - fwd_at[(a.mb, a.chunk)]
                    backwards_since[a.chunk] += 1
                elif isinstance(a, Step):
                    steps_so_far[a.chunk] += 1
                    per_step.setdefault(a.chunk, set()).add(backwards_since[a.chunk])
                    backwards_since[a.chunk] = 0
            for i, a in enumerate(row):
                if isinstance(a, Step):
                    nxt = next((b for b in row[i + 1:] if isinstance(b, Forward) and b.chunk == a.chunk), None)
                    next_s[(d, i)] = None if nxt is None else None  # filled below, needs s_fwd complete
                    if nxt is not None:
                        next_s[(d, i)] = (nxt.mb, nxt.chunk)
        next_s = {k: (None if v is None else s_fwd.get(v, 0)) for k, v in next_s.items()}
        return s_fwd, next_s, per_step

    def s_forward(self, op: Forward) -> int:
        return self._steps[0].get((op.mb, op.chunk), 0)

    def next_s(self, device: int, index: int) -> int | None:
        return self._steps[1].get((device, index))

    def update_every(self, chunk: Chunk) -> int:
        counts = set(self._steps[2].get(chunk, set())) - {0}  # a copy: the cached set must stay intact
        if len(counts) > 1:
            raise ConfigError(f"schedule {self.schedule.name!r} steps chunk {chunk} after varying numbers of "
                              f"backwards {sorted(counts)}; the runtime needs a fixed count per chunk")
        return counts.pop() if counts else 1

    @cached_property
    def num_steps(self) -> int:
        """Optimizer steps in one iteration of the whole pipeline (every device's ``Step`` actions)."""
        return sum(isinstance(a, Step) for row in self.actions for a in row)

    @cached_property
    def loss_scale(self) -> float:
        """Each micro-batch's loss is multiplied by this once, so an update applies the mean gradient of the
        micro-batches it covers (synchronous: all N of the iteration, summed over mirror replicas by Sync)."""
        if self.schedule.synchronous:
            return 1.0 / self.schedule.num_microbatches
        return 1.0 / self.update_every(self.schedule.chunks[0][0])

    @cached_property
    def s_backward(self) -> dict:
        """SpecTrain's backward look-ahead: steps the stage takes between the micro-batch's backward on this
        stage and its backward on stage 0 (when the update it contributes to is complete), timed at unit costs
        with forward = backward. A split backward counts from and to the ``W``, where its gradient completes."""
        tl = run_timeline(self.schedule, unit_durations(1.0))
        b_end: dict = {}
        steps: dict[tuple[int, Chunk], list[float]] = defaultdict(list)
        for d, recs in enumerate(tl.records):
            for r in recs:
                if weight_grad_action(r.action):
                    b_end[(r.action.mb, r.action.stage, r.action.replica)] = r.end
                elif isinstance(r.action, Step):
                    steps[(d, r.action.chunk)].append(r.end)
        out = {}
        for (mb, stage, replica), t0 in b_end.items():
            t1 = b_end.get((mb, 0, replica), t0)
            chunk = Chunk(replica, stage)
            d = self.schedule.device_of(stage, replica)
            out[(mb, chunk)] = sum(1 for t in steps[(d, chunk)] if t0 < t <= t1)
        return out

    # ---- collectives -----------------------------------------------------------------------------------
    @cached_property
    def sync_device_sets(self) -> list[tuple[int, ...]]:
        """Every distinct device set a Sync reduces over (all ranks create the same groups in this order)."""
        sets = set()
        for row in self.actions:
            for a in row:
                if isinstance(a, Sync):
                    sets.add(tuple(sorted(a.devices)))
        return sorted(sets)
