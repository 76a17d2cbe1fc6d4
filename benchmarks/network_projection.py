"""Time per update and peak activation memory of a schedule on gpt16 under a link and uneven devices (issue 43).

Why this module exists: the time-to-target study (``bench_time_to_target.py``) prices communication as free
between identical devices, exactly where a pipeline flush costs nothing. Here the same simulator, fed with the
same per-layer and per-stage costs measured in that study, also prices

- each point-to-point hop as latency + bytes / bandwidth of a named link (``pipeoptim.links.PROFILES``), the bytes
  being gpt16's real boundary: micro-batch x sequence (32) x d_model (64) x 4 bytes (fp32 hidden states, the
  activation forward and its gradient backward);
- BitPipe's mirror all-reduces as a ring of two: 2 x latency + bytes / bandwidth, the bytes being the stage's
  parameters (measured from the model);
- uneven devices: one device (D // 2, inside the pipeline) 1.5x slower on every op, and a random per-operation
  jitter (``sim.Costs.jitter``, seeded);

and it reports the peak activation memory of every schedule: the most bytes any device holds at once, from a
forward until its backward, per the schedule's order (``sim.SimResult.peak_activations``), with each layer's
bytes per sample measured as the tensors autograd saves for its backward (parameters excluded). So GPipe hiding
latency behind many micro-batches is seen with the memory it pays for it.

An asynchronous schedule can keep more micro-batches in flight than its own warm-up (``in_flight`` > 1: device d
warms up with in_flight x (D - d - 1) forwards instead of D - d - 1). That hides latency but adds staleness;
the convergence runs measured updates to the target only at in_flight = 1, so ``bench_regime_map.py`` projects
the time per update of deeper variants and marks their time to target "not measured".
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from pipeoptim.links import Link  # noqa: E402

SEQ_LEN, D_MODEL, FLOAT_BYTES = 32, 64, 4      # gpt16 (bench_time_to_target.GPT16), trained in fp32
SLOW_FACTOR = 1.5
JITTER = 0.2                                    # each op's cost times a factor uniform in [0.8, 1.2]


def boundary_bytes(samples: int) -> int:
    """Bytes of one micro-batch's hidden states crossing a gpt16 stage boundary (and of their gradient)."""
    return samples * SEQ_LEN * D_MODEL * FLOAT_BYTES


@dataclass(frozen=True)
class Setting:
    """Where the pipeline runs: a link (None: communication free, the study's model) and uneven devices."""
    profile: str
    link: Link | None
    uneven: bool = False
    slow_factor: float = SLOW_FACTOR
    jitter: float = JITTER
    seed: int = 0

    def slow_device(self, devices: int) -> int:
        return devices // 2


@dataclass(frozen=True)
class LayerMemory:
    """Per layer of gpt16 (embedding, 16 blocks, head): bytes autograd saves per sample, and parameter bytes."""
    saved_per_sample: tuple[float, ...]
    param_bytes: tuple[float, ...]


def measure_layer_memory(gpt_cfg: dict, samples: int = 4) -> LayerMemory:
    """Each layer's saved-for-backward bytes (unique storages, parameters excluded) on a micro-batch of
    ``samples``, per sample, and its parameter bytes. Deterministic: shapes only, no timing."""
    import torch

    from pipeoptim.models import GPTConfig, gpt_layers

    layers = gpt_layers(GPTConfig(**gpt_cfg), seed=0)
    x = torch.randint(0, 256, (samples, gpt_cfg["seq_len"]))
    saved, params = [], []
    for layer in layers:
        own = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        storages: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in own:
                storages[st.data_ptr()] = st.nbytes()
            return t

        x = x.detach().requires_grad_(x.is_floating_point())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        saved.append(sum(storages.values()) / samples)
        params.append(float(sum(p.numel() * p.element_size() for p in layer.parameters())))
        x = y
    return LayerMemory(tuple(saved), tuple(params))


def deeper_async(name: str, devices: int, microbatches: int, in_flight: int):
    """``async-1f1b`` or ``2bw`` whose device d warms up with in_flight x (D - d - 1) forwards (module docstring;
    the schedules' own ``in_flight`` option); in_flight = 1 is the registry's schedule."""
    from pipeoptim.schedules import get_schedule
    return get_schedule(name, devices, microbatches, in_flight=in_flight)


def _per_layer_stage(values, balance: list[int]) -> list[float]:
    out, at = [], 0
    for n in balance:
        out.append(float(sum(values[at:at + n])))
        at += n
    return out


def project(costs, schedule: str, devices: int, policy: str, setting: Setting, memory: LayerMemory,
            in_flight: int = 1) -> dict:
    """Seconds per optimizer update of ``schedule`` (the study's rules: async in windows of ``wl.window``
    micro-batches, a synchronous schedule at its fastest N and concatenation) and its peak activation bytes
    under ``setting``. ``costs``: ``bench_time_to_target.MeasuredCosts`` of the workload."""
    from pipeoptim.schedules import get_schedule
    from pipeoptim.schedules.errors import ScheduleConfigError
    from pipeoptim.sim import Costs, simulate

    import bench_time_to_target as btt

    D, wl = devices, costs.wl
    balance = wl.stage_balance(D)
    over = [costs.stage[(D, k, policy)] for k in range(D)]
    saved_stage = _per_layer_stage(memory.saved_per_sample, balance)
    params_stage = _per_layer_stage(memory.param_bytes, balance)
    link = setting.link

    def simulate_with(sched, fwd, bwd, step, size, split: bool):
        mem, par = saved_stage, params_stage
        if split:   # 2D stages: half a D-stage each
            mem, par = ([v / 2 for v in xs for _ in (0, 1)] for xs in (mem, par))
        fwd, bwd, step = list(fwd), list(bwd), list(step)
        if setting.uneven:
            slow = {c.stage for c in sched.chunks[setting.slow_device(D)]}
            for k in slow:
                fwd[k], bwd[k], step[k] = (v * setting.slow_factor for v in (fwd[k], bwd[k], step[k]))
        net = {} if link is None else dict(
            p2p_latency=link.latency_s, p2p_bandwidth=link.bandwidth_Bps,
            allreduce_latency=2 * link.latency_s, allreduce_bandwidth=link.bandwidth_Bps)
        c = Costs(forward=tuple(fwd), backward=tuple(bwd), step=tuple(step),
                  activation_bytes=tuple([float(boundary_bytes(size))] * sched.num_stages),
                  activation_memory=tuple(m * size for m in mem), param_bytes=tuple(par),
                  jitter=setting.jitter if setting.uneven else 0.0, jitter_seed=setting.seed, **net)
        return simulate(sched, c)

    if schedule in ("async-1f1b", "2bw"):
        size = wl.batch // D if schedule == "2bw" else wl.batch
        fwd, bwd = costs.compute(D, size, False)
        sched = deeper_async(schedule, D, wl.window, in_flight)
        sim = simulate_with(sched, [f + o[0] for f, o in zip(fwd, over)], [b + o[1] for b, o in zip(bwd, over)],
                            [o[2] for o in over], size, False)
        updates = wl.window // D if schedule == "2bw" else wl.window
        return {"time_s": sim.makespan / updates, "microbatches": wl.window, "microbatch_size": size, "variant": "",
                "peak_activation_bytes": max(sim.peak_activations), "bubble": sim.bubble_ratio}
    if in_flight != 1:
        raise ValueError(f"in_flight applies to async-1f1b and 2bw, not {schedule}")
    best = None
    for N in btt.microbatch_sizes(wl):
        size = wl.batch // N
        fwd, bwd = costs.compute(D, size, False)
        step = [o[2] for o in over]
        around_f, around_b = [o[0] for o in over], [o[1] for o in over]
        split = schedule in ("interleaved", "bitpipe", "zbv")
        if split:
            fwd, bwd, step = ([v / 2 for v in xs for _ in (0, 1)] for xs in (fwd, bwd, step))
            around_f, around_b = ([v for v in xs for _ in (0, 1)] for xs in (around_f, around_b))
        fwd = [f + o for f, o in zip(fwd, around_f)]
        bwd = [b + o for b, o in zip(bwd, around_b)]
        variants = [{"concat": c, "bwd_ratio": sum(bwd) / sum(fwd)} for c in ("reference", "paced")] \
            if schedule == "bitpipe" else [{}]
        for kw in variants:
            try:
                sched = get_schedule(schedule, D, N, **kw)
            except ScheduleConfigError:
                continue
            sim = simulate_with(sched, fwd, bwd, step, size, split)
            row = {"time_s": sim.makespan, "microbatches": N, "microbatch_size": size,
                   "variant": kw.get("concat", ""), "peak_activation_bytes": max(sim.peak_activations),
                   "bubble": sim.bubble_ratio}
            if best is None or row["time_s"] < best["time_s"]:
                best = row
    if best is None:
        raise ValueError(f"{schedule} has no valid number of micro-batches for batch {wl.batch} on {D} devices")
    return best


def free(setting: Setting) -> Setting:
    """The same devices with communication free (the study's model)."""
    return dataclasses.replace(setting, profile="free", link=None)
