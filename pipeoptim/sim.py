"""Simulate a schedule with per-operation costs: per-device timeline, makespan, bubble ratio, memory, traffic.

Schedules are data; this module puts times on them so that schedules can be compared before any GPU runs, and
so that measured per-stage times (``profile_stages``) predict a real run. The execution model is the one in
``schedules.timeline``: devices run their lists in order, sends do not block, a ``Sync`` overlaps computation
until a ``Step`` needs it.

Units. Time is whatever unit the costs are in. A scalar cost refers to one D-th of the model (one stage of a
D-stage pipeline) and is scaled by D / num_stages for schedules that cut the model finer (interleaved with v
chunks: 1/v; BitPipe's 2D stages: 1/2), so makespans of different schedules compare directly. A sequence gives
the cost of each stage of the schedule as is (profiled numbers). The same holds for activation memory and
parameter bytes; ``activation_bytes`` (what crosses a stage boundary) does not shrink with finer stages.

Bubble ratio = idle device-time / (devices x makespan), where a device is busy while it computes (forwards,
backwards, steps, predictions). With equal forward/backward costs and free communication every device is busy
for the same time, so this equals each device's idle / total, the quantity the closed formulas give:
(D-1)/(N+D-1) for GPipe and 1F1B, (D-1)/(vN+D-1) interleaved, (D-2)/(2N+D-2) Chimera, (D-2)/(4N+D-2) BitPipe.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from .schedules.actions import (Action, Backward, BackwardInput, BackwardWeight, Forward, Step, Sync,
                                weight_grad_action)
from .schedules.dataflow import Transfer, output_transfer
from .schedules.errors import ScheduleConfigError, ScheduleError
from .schedules.grid import format_grid
from .schedules.schedule import Schedule
from .schedules.staleness import version_difference
from .schedules.timeline import Timeline, run_timeline

__all__ = ["Costs", "SimResult", "simulate", "profile_stages", "compare", "with_ratio"]

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Per-operation costs (module docstring for units and scaling).

    forward, backward:     compute time of one micro-batch.
    backward_input, backward_weight:  the two halves of a split backward (``I``, ``W``); None: half of
                           ``backward`` each (the zero-bubble paper's usual assumption I = W). A full ``B``
                           always costs ``backward``.
    step:                  optimizer step of one chunk.
    predict:               weight prediction before a forward whose version difference s > 0 (only when
                           ``simulate(..., prediction=True)``).
    p2p_latency, p2p_bandwidth:   per hop: time = latency + bytes / bandwidth (bandwidth in bytes per time unit).
    activation_bytes:      bytes of a stage's output (and of the gradient sent back over the same boundary).
    handoff:               time of a local hand-off between two chunks on one device.
    allreduce_latency, allreduce_bandwidth: a ring all-reduce of b bytes among n takes
                           latency + 2(n-1)/n * b / bandwidth.
    param_bytes:           gradient bytes of one D-th of the model (scaled like compute).
    activation_memory:     memory a micro-batch's forward keeps until its backward, per D-th of the model.
    dp_size:               data-parallel copies a ``Sync(dp=True)`` also spans.
    jitter, jitter_seed:   uneven devices: each forward, backward, I and W takes its cost times a factor drawn
                           uniformly from [1 - jitter, 1 + jitter] (mean 1), the same for the same seed, device
                           and operation whatever the order of simulation; 0: none.
    """
    forward: PerStage = 1.0
    backward: PerStage = 2.0
    backward_input: PerStage | None = None
    backward_weight: PerStage | None = None
    step: PerStage = 0.0
    predict: PerStage = 0.0
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    activation_bytes: PerStage = 1.0
    handoff: float = 0.0
    allreduce_latency: float = 0.0
    allreduce_bandwidth: float = math.inf
    param_bytes: PerStage = 1.0
    activation_memory: PerStage = 1.0
    dp_size: int = 1
    jitter: float = 0.0
    jitter_seed: int = 0

    @classmethod
    def from_measurements(cls, forward: Sequence[float], backward: Sequence[float], **others) -> "Costs":
        """Costs from measured per-stage times (e.g. ``profile_stages``); other fields as keywords."""
        if len(forward) != len(backward):
            raise ValueError(f"got {len(forward)} forward times but {len(backward)} backward times; give one "
                             "of each per stage")
        return cls(forward=tuple(forward), backward=tuple(backward), **others)

    def per_stage(self, name: str, schedule: Schedule, scaled: bool = True) -> list[float]:
        value = getattr(self, name)
        if value is None and name in ("backward_input", "backward_weight"):
            return [b / 2.0 for b in self.per_stage("backward", schedule, scaled)]
        S = schedule.num_stages
        if isinstance(value, (int, float)):
            scale = schedule.num_devices / S if scaled else 1.0
            return [float(value) * scale] * S
        values = [float(v) for v in value]
        if len(values) != S:
            raise ValueError(f"Costs.{name} gives {len(values)} values but schedule {schedule.name!r} has {S} "
                             f"stages; give one value per stage, or a scalar for one D-th of the model")
        return values


@dataclass
class SimResult:
    """What ``simulate`` measured. Lists are per device."""
    schedule: Schedule
    costs: Costs
    timeline: Timeline
    makespan: float
    busy: list[float]
    peak_activations: list[float]     # activation memory held at once, from F until B or W (activation_memory units)
    weight_copies: list[float]        # weights held, in D-ths of the model (2 for Chimera and BitPipe)
    peak_weight_versions: list[float]  # weight versions weight stashing would keep, in D-ths of the model
    p2p_bytes: list[float]
    p2p_messages: list[int]
    allreduce_bytes: list[float]
    extra: dict = field(default_factory=dict)

    @property
    def bubble_ratio(self) -> float:
        D = self.schedule.num_devices
        return 1.0 - sum(self.busy) / (D * self.makespan) if self.makespan > 0 else 0.0

    def device_bubble(self, device: int) -> float:
        return 1.0 - self.busy[device] / self.makespan if self.makespan > 0 else 0.0

    def summary(self) -> dict:
        """One flat row: the numbers ``compare-schedules`` and the benchmark tabulate."""
        s = self.schedule
        return {
            "schedule": s.name + (f"[{s.params['concat']}]" if "concat" in s.params else ""),
            "devices": s.num_devices, "microbatches": s.num_microbatches,
            "makespan": self.makespan, "bubble_ratio": self.bubble_ratio,
            "peak_activations": max(self.peak_activations), "weight_copies": max(self.weight_copies),
            "weight_versions": max(self.peak_weight_versions),
            "p2p_bytes_per_device": max(self.p2p_bytes), "p2p_bytes_total": sum(self.p2p_bytes),
            "allreduce_bytes_total": sum(self.allreduce_bytes),
        }


def _ring(n: int) -> float:
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def simulate(schedule: Schedule, costs: Costs | None = None, prediction: bool = False,
             sync_blocking: bool = False) -> SimResult:
    """Time ``schedule`` under ``costs``; raises ``ScheduleError`` (with the grid) if it cannot complete."""
    costs = costs or Costs()
    s = schedule.compute_only()
    D = s.num_devices
    fwd, bwd = costs.per_stage("forward", s), costs.per_stage("backward", s)
    bwd_in, bwd_w = costs.per_stage("backward_input", s), costs.per_stage("backward_weight", s)
    step, pred = costs.per_stage("step", s), costs.per_stage("predict", s)
    act_bytes = costs.per_stage("activation_bytes", s, scaled=False)
    params = costs.per_stage("param_bytes", s)
    act_mem = costs.per_stage("activation_memory", s)
    for name, values in (("forward", fwd), ("backward", bwd), ("backward_input", bwd_in),
                         ("backward_weight", bwd_w)):
        if any(v <= 0 for v in values):
            raise ValueError(f"Costs.{name} must be positive on every stage, got {values}")
    stale = version_difference(s) if prediction else {}
    if not 0.0 <= costs.jitter < 1.0:
        raise ValueError(f"Costs.jitter must be in [0, 1) (a factor in [1 - jitter, 1 + jitter]), got {costs.jitter}")

    def duration(device: int, a: Action) -> float:
        base = _duration(device, a)
        if costs.jitter and isinstance(a, (Forward, Backward, BackwardInput, BackwardWeight)):
            draw = random.Random(f"{costs.jitter_seed}/{device}/{type(a).__name__}/{a.stage}/{a.mb}").random()
            return base * (1.0 + costs.jitter * (2.0 * draw - 1.0))
        return base

    def _duration(device: int, a: Action) -> float:
        if isinstance(a, Forward):
            return fwd[a.stage] + (pred[a.stage] if stale.get((a.stage, a.mb), 0) > 0 else 0.0)
        if isinstance(a, Backward):
            return bwd[a.stage]
        if isinstance(a, BackwardInput):
            return bwd_in[a.stage]
        if isinstance(a, BackwardWeight):
            return bwd_w[a.stage]
        if isinstance(a, Step):
            return step[a.stage]
        return 0.0

    def boundary_bytes(tr: Transfer) -> float:
        # F of stage k sends its output (boundary k); B of stage k sends the gradient of boundary k-1.
        k = tr.op.stage if isinstance(tr.op, Forward) else tr.op.stage - 1
        return act_bytes[k]

    def transfer_time(tr: Transfer) -> float:
        if tr.local:
            return costs.handoff
        return costs.p2p_latency + boundary_bytes(tr) / costs.p2p_bandwidth

    def sync_bytes(sync: Sync) -> float:
        # every member holds each synced stage once (mirror syncs pair different replicas' copies)
        return sum(params[st] for st in sync.stages)

    def members(sync: Sync) -> int:
        return max(len(sync.devices), 1) * (costs.dp_size if sync.dp else 1)

    def sync_time(sync: Sync) -> float:
        return costs.allreduce_latency + _ring(members(sync)) * sync_bytes(sync) / costs.allreduce_bandwidth

    timeline = run_timeline(s, duration, transfer_time, sync_time, sync_blocking)
    if not timeline.complete:
        raise ScheduleError("deadlock", "the schedule cannot complete", timeline.blocked[0].device,
                            timeline.blocked[0].index, format_grid(timeline))

    busy = [sum(r.end - r.start for r in recs if not isinstance(r.action, Sync)) for recs in timeline.records]
    unit = D / s.num_stages                    # one chunk, in D-ths of the model
    peak_act, versions, copies = [], [], []
    p2p_bytes, p2p_msgs, ar_bytes = [0.0] * D, [0] * D, [0.0] * D
    for d, acts in enumerate(s.actions):
        level = peak = 0.0
        current = {c: 0 for c in s.chunks[d]}  # steps applied so far, per chunk
        used: dict = {}                        # (chunk, mb) -> version its forward used
        peak_versions = 0.0
        for a in acts:
            if isinstance(a, Forward):
                level += act_mem[a.stage]
                peak = max(peak, level)
                used[(a.chunk, a.mb)] = current[a.chunk]
            elif weight_grad_action(a):        # the runtime keeps a split backward's graph until its W
                level -= act_mem[a.stage]
                used.pop((a.chunk, a.mb))
            elif isinstance(a, Step):
                current[a.chunk] += 1
            elif isinstance(a, Sync):
                ar_bytes[d] += _ring(members(a)) * sync_bytes(a)
            alive = {(c, v) for (c, _), v in used.items()} | {(c, v) for c, v in current.items()}
            peak_versions = max(peak_versions, len(alive) * unit)
            if isinstance(a, (Forward, Backward, BackwardInput)):
                tr = output_transfer(s, a)
                if tr is not None and not tr.local:
                    p2p_bytes[d] += boundary_bytes(tr)
                    p2p_msgs[d] += 1
        peak_act.append(peak)
        versions.append(peak_versions)
        copies.append(len(s.chunks[d]) * unit)
    return SimResult(s, costs, timeline, timeline.makespan, busy, peak_act, copies, versions, p2p_bytes,
                     p2p_msgs, ar_bytes)


def profile_stages(stages: Sequence, example_input, loss_fn: Callable | None = None, repeats: int = 5,
                   warmup: int = 2, split: bool = False, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Measure each stage module's forward and backward time (seconds) on this machine, one micro-batch.

    ``stages`` are torch modules applied in sequence to ``example_input`` (a tensor, or a tuple of tensors: a
    stage returning a tuple feeds the next one's arguments, as in a pipeline cut of a Hugging Face model);
    ``loss_fn(output)`` turns the last output into a scalar (default: the sum of its floating-point parts).
    ``clock``: wall time by default; ``time.thread_time`` measures the CPU time of this thread instead, which
    other processes on a shared machine do not inflate (with one torch thread every op runs on the calling
    thread). Returns ``forward``, ``backward`` (per-stage medians), ``activation_bytes`` (the size of each
    stage's outputs) and ``param_bytes`` (per stage), ready for ``Costs.from_measurements(r["forward"],
    r["backward"], activation_bytes=r["activation_bytes"], param_bytes=r["param_bytes"])``. ``split=True``
    also times the runtime's split backward, the input pass and the weight pass (``backward_input``,
    ``backward_weight``), in every repeat after the full backward.
    """
    import torch  # imported here so that schedule tooling never needs torch

    def as_tuple(v) -> tuple:
        return tuple(v) if isinstance(v, (tuple, list)) else (v,)

    def sum_of_floats(out):
        return sum(t.float().sum() for t in as_tuple(out) if t.is_floating_point())

    loss_fn = loss_fn or sum_of_floats
    n = len(stages)
    times = {k: [[] for _ in stages] for k in ("forward", "backward", "backward_input", "backward_weight")}
    out_bytes = [0.0] * n

    def forward(record: bool):
        xs = as_tuple(example_input)
        inputs, outputs = [], []
        for k, stage in enumerate(stages):
            xs = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in xs)
            t0 = clock()
            y = stage(*xs)
            t1 = clock()
            inputs.append(xs)
            outputs.append(y)
            out_bytes[k] = float(sum(t.numel() * t.element_size() for t in as_tuple(y)))
            if record:
                times["forward"][k].append(t1 - t0)
            xs = as_tuple(y)
        return inputs, outputs

    def carrying(k: int, grads) -> tuple[list, list | None]:
        """Stage k's outputs that carry a gradient and those gradients (the last stage: its loss, gradient 1)."""
        if grads is None:
            return [loss_fn(outputs[k])], None
        pairs = [(y, g) for y, g in zip(as_tuple(outputs[k]), grads) if g is not None and y.requires_grad]
        return [y for y, _ in pairs], [g for _, g in pairs]

    for rep in range(warmup + repeats):
        record = rep >= warmup
        inputs, outputs = forward(record)
        grads = None
        for k in reversed(range(n)):
            t0 = clock()
            outs, gouts = carrying(k, grads)
            if outs:
                torch.autograd.backward(outs, gouts)
            t1 = clock()
            grads = [x.grad for x in inputs[k]]
            if record:
                times["backward"][k].append(t1 - t0)
        if split:
            from .runtime.split_backward import input_pass, weight_pass
            inputs, outputs = forward(False)
            grads = None
            for k in reversed(range(n)):
                outs, gouts = carrying(k, grads)
                t0 = clock()
                grads, work = input_pass(outs, gouts, inputs[k], list(stages[k].parameters()))
                t1 = clock()
                weight_pass(work)
                t2 = clock()
                if record:
                    times["backward_input"][k].append(t1 - t0)
                    times["backward_weight"][k].append(t2 - t1)
        for stage in stages:
            stage.zero_grad(set_to_none=True)

    def median(v: list[float]) -> float:
        v = sorted(v)
        return v[len(v) // 2]
    out = {k: [median(v) for v in times[k]] for k in (("forward", "backward", "backward_input", "backward_weight")
                                                       if split else ("forward", "backward"))}
    out["activation_bytes"] = out_bytes
    out["param_bytes"] = [float(sum(p.numel() * p.element_size() for p in st.parameters())) for st in stages]
    return out


def with_ratio(costs: Costs, bwd_ratio: float) -> Costs:
    """``costs`` with backward = bwd_ratio x forward (scalar costs only)."""
    if not isinstance(costs.forward, (int, float)):
        raise ValueError("with_ratio needs a scalar forward cost")
    return replace(costs, backward=float(costs.forward) * bwd_ratio)


def _ratio(costs: Costs) -> float:
    """Overall backward/forward cost ratio (what the paced concatenation is planned for)."""
    def total(v: PerStage) -> float:
        return float(v) if isinstance(v, (int, float)) else sum(v) / len(v)
    return total(costs.backward) / total(costs.forward)


def compare(devices: int, microbatches: int, costs: Costs | None = None, names: Sequence[str] | None = None,
            chunks: int = 2) -> list[dict]:
    """One ``SimResult.summary()`` row per schedule (chimera and bitpipe: both concatenations), plus
    ``steady_bubble``.

    ``bubble_ratio`` covers one window of N micro-batches, fill and drain included. ``steady_bubble`` is the
    bubble per N micro-batches of a long run: the same for flushing schedules, which pay fill and drain every
    iteration, but for asynchronous ones (no flush) it is measured as the extra time of a 2N window over an N
    window, i.e. what each further N micro-batches cost. Schedules whose rules exclude (D, N) get a row with
    ``error`` set and no numbers.
    """
    from .schedules.registry import INFO, SCHEDULES, get_schedule

    costs = costs or Costs()
    ratio = _ratio(costs)
    rows = []
    for name in names or SCHEDULES:
        bidirectional = name in ("chimera", "bitpipe")
        variants = [{"concat": c} for c in ("reference", "paced")] if bidirectional else [{}]
        for kw in variants:
            if bidirectional:
                kw["bwd_ratio"] = ratio
            if name == "interleaved":
                kw["chunks"] = chunks
            label = name + (f"[{kw['concat']}]" if "concat" in kw else "")
            try:
                schedule = get_schedule(name, devices, microbatches, **kw)
            except ScheduleConfigError as e:
                rows.append({"schedule": label, "devices": devices, "microbatches": microbatches, "error": str(e)})
                continue
            result = simulate(schedule, costs)
            row = result.summary()
            row["schedule"] = label
            row["steady_bubble"] = row["bubble_ratio"]
            if not INFO[name].synchronous:
                longer = simulate(get_schedule(name, devices, 2 * microbatches, **kw), costs)
                extra = longer.makespan - result.makespan
                work = (sum(longer.busy) - sum(result.busy)) / devices
                row["steady_bubble"] = 1.0 - work / extra if extra > 0 else 0.0
            rows.append(row)
    return rows
