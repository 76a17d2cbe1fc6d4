"""Is pipeoptim's runtime as fast as torch.distributed.pipelining on the same model and schedule?

Side by side in one run, per (model, schedule, N): 4 processes on gloo (one thread each); on every rank the
same stages of the same model with the same initial weights, once in a ``Pipeline(schedule=..., policy="none")``
and once in torch's ``PipelineStage`` + its schedule class followed by AdamW's step: 1F1B (``Schedule1F1B``)
and GPipe (``ScheduleGPipe``) on 4 stages, one per rank; interleaved 1F1B (``ScheduleInterleaved1F1B``) on 8
stages, rank r holding stages r and r + 4; ZBV (``ScheduleZBVZeroBubble``) on 8 stages, V-shaped, rank r
holding stages r and 7 - r (its last stage, with the loss, on rank 0). Both runtimes place the stages alike
(checked on every rank), and after the first step, taken by both from the same weights on the same batch,
each rank checks that the two runtimes' updated weights agree (an error otherwise). The two runtimes alternate
step by step (so a change in the machine's load hits both); a step's time is the slowest rank's (all ranks
barrier first); the median over the timed rounds is reported, with the ratio of the medians and the median of
the per-round ratios (each round times both runtimes back to back) with its 90 % bootstrap interval: on 4
processes sharing 2 cores a step's time varies by 2x from round to round, and the interval says which rows
differ from 1.0 beyond that noise. The 4-process rows also report the step's CPU time, every thread of every rank
summed (``cpu_s``, ``cpu_paired_ratio``): what each runtime costs the machine, which moves much less with the
scheduler than the wall time does. Asynchronous
schedules (no flush inside a step) are timed the same way, side by side with torch's fastest synchronous
schedule on that model and N (the fastest of the four rows above, run again in the same job), and compared in
samples per second: asynchronous 1F1B with policy none (an optimizer step per micro-batch and stage, the
optimizer's own) and with PipeOptim (the same steps, each forward on the weights predicted for its backward;
its fused kernel takes a stage's step and the next prediction in one pass over the flat buffers, where a
prediction is made; the last stage, which never predicts, steps the optimizer itself), and PipeDream-2BW
(policy 2bw, double-buffered weights) twice: with its default update every m = D micro-batches (the fewest
it allows, so N/D steps per window), and with m = N, one update per window of N micro-batches, the batch and
the number of steps of the synchronous rows, taken on weights one update old (the ``update_every`` column:
micro-batches per optimizer step in every row); at m = N also with PipeOptim (policy pipeoptim: each forward on
the weights predicted for its backward, at most one update ahead, instead of 2BW's stashed version). Async
1F1B with policy none runs twice: as windows (each ``train_step`` fills and drains the pipeline like a
synchronous step: the same bubble, plus the extra optimizer steps) and as a stream
(``Pipeline(stream=True)``: the micro-batches in flight carry from one ``train_step`` to the next, so a timed
step, after the untimed first that fills the pipeline, neither fills nor drains); the PipeOptim and 2BW rows
run as streams.
``--emulated`` adds the one-process rows: an emulated ``Pipeline`` against the plain unpipelined step of the
same model (forward and backward of every micro-batch, then AdamW); with ``--device cuda --emulated-only``
they run on the GPU, every stage on it (torch's runtime needs a GPU per rank, so no 4-process rows there).

Models: ``tiny`` (8 x Linear(64, 64)-Tanh, micro-batches of 1 x 64: almost all per-action overhead; 2 blocks
per stage on 4 stages, 1 on 8) and ``gpt`` (a byte-level GPT of ~25M parameters, 8 blocks of width 512,
micro-batches of 1 x 64 tokens; [embedding, 8 blocks, head] cut 3|2|2|3 on 4 stages and 2|1|1|1|1|1|1|2 on 8).
Every schedule trains the same model from the same weights; only the cut differs.

    python benchmarks/bench_runtime_peer.py [--models tiny gpt] [--rounds 15] [--optimizer adamw-fused] [--ranks 2]
        [--csv PATH]

``--ranks 2`` runs the side-by-side rows on 2 processes, the model cut in 2 stages (4 for interleaved and ZBV;
tiny: 4 blocks per stage, GPT: [embedding, 4 blocks | 4 blocks, head]): on a 2-core machine each rank then has a
core of its own, and a rank waiting in a fill or drain leaves it idle, as a GPU would; on 4 processes sharing 2
cores a waiting rank's core goes to another rank, so a flush costs nothing there.

``--optimizer adamw-fused`` makes both runtimes (and the one-process rows' plain and staged steps) step torch's
``AdamW(fused=True)`` instead of its default (on the CPU, one loop per parameter): an asynchronous schedule
steps after every micro-batch (async 1F1B) or every D (2BW's default), so what a step costs weighs on its
rows most.

Prints a table and writes a CSV (default: a fresh file under runs/bench_runtime_peer/) with the command line
and the CPU in its header comment.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

SYNC = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B",
        "zbv": "ScheduleZBVZeroBubble"}
# the asynchronous rows: (schedule, the weight policy it runs with, stream: whether the micro-batches in flight
# carry from one train_step to the next, 2BW's update_every m: None for the schedule's default D, "N" for one
# update per N micro-batches, the synchronous schedules' batch); the first row of a schedule names its default
# policy
ASYNC = (("async-1f1b", "none", False, None), ("async-1f1b", "none", True, None),
         ("async-1f1b", "pipeoptim", True, None), ("2bw", "2bw", True, None), ("2bw", "2bw", True, "N"),
         ("2bw", "pipeoptim", True, "N"))
STAGES = 4                       # processes (pipeline devices) of the side-by-side rows; --ranks 2: 2
TWO_PER_RANK = ("interleaved", "zbv")
_GPT_CUTS = {2: [0, 5, 10], 4: [0, 3, 5, 7, 10], 8: [0, 2, 3, 4, 5, 6, 7, 8, 10]}  # over [embedding, 8 blocks, head]


def num_stages(schedule: str, ranks: int = STAGES) -> int:
    return 2 * ranks if schedule in TWO_PER_RANK else ranks


def rank_stages(schedule: str, rank: int, ranks: int = STAGES) -> list[int]:
    """The stages torch's schedule class puts on ``rank``, in the order its stage list takes them."""
    if schedule == "interleaved":
        return [rank, rank + ranks]
    if schedule == "zbv":
        return [rank, 2 * ranks - 1 - rank]
    return [rank]


def _tiny_stage(i: int, stages: int = STAGES) -> nn.Module:
    """The same 8 Linear-Tanh blocks on 4 stages (2 each), 8 (1 each) or 2 (4 each): stage i of 8 is half of
    stage i // 2 of 4, stage i of 2 is stages 2i and 2i + 1 of 4."""
    if stages == 2 * STAGES:
        return _tiny_stage(i // 2)[2 * (i % 2):2 * (i % 2) + 2]
    if stages == STAGES // 2:
        return nn.Sequential(*_tiny_stage(2 * i), *_tiny_stage(2 * i + 1))
    torch.manual_seed(1000 + i)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())


def _gpt_cfg():
    from pipeoptim.models import GPTConfig
    return GPTConfig(vocab_size=256, seq_len=64, d_model=512, n_heads=8, n_layers=8)


def _gpt_stage(i: int, stages: int = STAGES) -> nn.Module:
    from pipeoptim.models import gpt_layers
    layers = gpt_layers(_gpt_cfg(), seed=0)
    cuts = _GPT_CUTS[stages]
    return nn.Sequential(*layers[cuts[i]:cuts[i + 1]])


def _batch(model: str, n: int, seed: int, rows: int = 1):
    """A batch of n micro-batches of ``rows`` rows each (the tiny model's 64 features, the GPT's 64 tokens)."""
    g = torch.Generator().manual_seed(seed)
    if model == "tiny":
        return torch.randn(n * rows, 64, generator=g), torch.randn(n * rows, 64, generator=g)
    x = torch.randint(0, 256, (n * rows, 64), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _loss(model: str):
    if model == "tiny":
        return lambda y, t: nn.functional.mse_loss(y, t)
    from pipeoptim.models.gpt import lm_loss
    return lm_loss


def _stage(model: str, i: int, stages: int = STAGES) -> nn.Module:
    return _tiny_stage(i, stages) if model == "tiny" else _gpt_stage(i, stages)


def _adamw(params, fused: bool = False):
    return torch.optim.AdamW(params, lr=1e-4, fused=fused)


# --optimizer: what both runtimes step (torch's own single-tensor AdamW on the CPU by default, or its fused one)
OPTIMIZERS = {"adamw": _adamw, "adamw-fused": lambda params: _adamw(params, fused=True)}


def _runtimes(model: str, schedule: str, n: int, optimizer=_adamw, peer: str | None = None,
              policy: str | None = None, stream: bool = False, update_every: int | str | None = None):
    """This rank's pipeoptim ``Pipeline`` (weight policy ``_policy(schedule, policy)``, ``Pipeline(stream=...)``,
    2BW's ``update_every``: ``_update_every(n, update_every)``) and torch's step of
    synchronous schedule ``peer`` (default: the same schedule; None for an asynchronous one without a peer):
    (pipeline, torch_step or None, {global parameter name: torch's tensor}). Torch's stages hold the same model
    from the same weights, cut for ``peer``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from pipeoptim.train import Pipeline

    ranks = int(os.environ["WORLD_SIZE"])  # (set by launch; the process group starts inside the Pipeline)
    total = num_stages(schedule, ranks)
    ours = Pipeline(stages=lambda i: _stage(model, i, total), loss_fn=_loss(model), optimizer=optimizer,
                    schedule=schedule, policy=_policy(schedule, policy), microbatches=n, stream=stream,
                    schedule_options=_schedule_options(n, update_every))
    peer = peer or (schedule if schedule in SYNC else None)
    if peer is None:
        return ours, None, {}
    rank = dist.get_rank()
    mine = rank_stages(peer, rank, ranks)
    if peer == schedule:
        placed = [c.stage for c in ours.schedule.chunks[rank]]
        if placed != mine:
            raise RuntimeError(f"{schedule}: pipeoptim puts stages {placed} on rank {rank}, torch's "
                               f"{SYNC[schedule]} puts {mine} there; the two runtimes would not run the same work")
    total = num_stages(peer, ranks)
    modules = [_stage(model, i, total) for i in mine]
    stages = [PipelineStage(m, i, total, torch.device("cpu"), group=dist.group.WORLD) for m, i in zip(modules, mine)]
    sched = getattr(torch_schedules, SYNC[peer])(stages if len(stages) > 1 else stages[0], n, loss_fn=_loss(model))
    opt = optimizer([p for m in modules for p in m.parameters()])
    first, last = 0 in mine, total - 1 in mine

    def torch_step(b):
        x, t = b
        sched.step(*((x,) if first else ()), target=t if last else None)
        opt.step()
        opt.zero_grad(set_to_none=False)
    params = {f"{i}.{name}": p for m, i in zip(modules, mine) for name, p in m.named_parameters()}
    return ours, torch_step, params


def weight_gap(ours, torch_params: dict, rtol: float = 1e-5, atol: float = 1e-6) -> tuple[float, str]:
    """The largest |pipeoptim - torch| over this rank's weights beyond ``atol + rtol * |torch|`` (0.0 when
    they agree), with the parameter's name; an error when the two runtimes hold different parameters."""
    mine = ours.named_parameters()
    if set(mine) != set(torch_params):
        raise RuntimeError(f"the runtimes hold different parameters: pipeoptim {sorted(mine)}, torch "
                           f"{sorted(torch_params)}")
    worst, where = 0.0, ""
    for name, theirs in torch_params.items():
        excess = float(((mine[name].detach() - theirs.detach()).abs() - atol - rtol * theirs.detach().abs()).max())
        if excess > worst:
            worst, where = excess, name
    return worst, where


def sgd_step_check(model: str, schedule: str, n: int, lr: float = 1.0) -> dict:
    """One rank: one SGD step (update = -lr x gradient, so a gradient off by any factor shows) in both runtimes
    from the same weights on the same batch; returns this rank's weight gap (``weight_gap``), the largest
    |pipeoptim - torch|, the largest update and the stages this rank holds."""
    ours, torch_step, theirs = _runtimes(model, schedule, n, lambda ps: torch.optim.SGD(ps, lr=lr))
    before = {k: v.detach().clone() for k, v in theirs.items()}
    batch = _batch(model, n, 0)
    ours.train_step(batch)
    torch_step(batch)
    gap, where = weight_gap(ours, theirs)
    mine = ours.named_parameters()
    diff = max(float((mine[k].detach() - theirs[k].detach()).abs().max()) for k in theirs)
    moved = max(float((theirs[k].detach() - before[k]).abs().max()) for k in theirs)
    return {"gap": gap, "where": where, "max_abs_diff": diff, "moved": moved,
            "stages": sorted({int(k.split(".")[0]) for k in theirs})}


def sgd_step_checks(model: str, schedules: list[str], n: int) -> list[dict]:
    """``sgd_step_check`` for several schedules in one process group (one launch)."""
    return [sgd_step_check(model, schedule, n) for schedule in schedules]


def rank_job(model: str, schedule: str, n: int, rounds: int, warmup: int, peer: str | None = None,
             optimizer: str = "adamw", policy: str | None = None, stream: bool = False, rows: int = 1,
             update_every: int | str | None = None) -> dict:
    """One rank: ``warmup`` + ``rounds`` alternating steps of both runtimes (torch's runs synchronous schedule
    ``peer``, by default ``schedule`` itself; an asynchronous schedule without ``peer`` runs alone; pipeoptim's
    runs weight policy ``_policy(schedule, policy)``, as a stream across its steps with ``stream``: after the
    first, untimed, every step is the stream's steady state), both stepping ``OPTIMIZERS[optimizer]`` on
    micro-batches of ``rows`` rows (2BW: an update every ``_update_every(n, update_every)``); returns the
    slowest rank's times per runtime (``name``) and the CPU time of every thread of every rank, summed
    (``"<name> cpu"``): on processes that share cores a step's wall time depends on the scheduler, its CPU time
    much less. When both run the same schedule, their weights must agree after the
    first round (same weights, same batch)."""
    import torch.distributed as dist

    ours, torch_step, torch_params = _runtimes(model, schedule, n, OPTIMIZERS[optimizer], peer=peer, policy=policy,
                                               stream=stream, update_every=update_every)
    runners = {"pipeoptim": lambda b: ours.train_step(b)}
    if torch_step is not None:
        runners["torch"] = torch_step
    times: dict[str, list[float]] = {k: [] for name in runners for k in (name, f"{name} cpu")}
    for r in range(warmup + rounds):
        batch = _batch(model, n, r, rows)
        for name, run in runners.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run(batch)
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
            if r >= warmup:
                times[name].append(float(took))
                times[f"{name} cpu"].append(float(cpu))
        if r == 0 and torch_step is not None and schedule in SYNC:
            gap, where = weight_gap(ours, torch_params)
            if gap > 0:
                raise RuntimeError(f"{model} {schedule} N={n}, rank {dist.get_rank()}: after one step from the same "
                                   f"weights the runtimes' weights differ (by {gap:.3g} beyond the tolerance, in "
                                   f"{where}): they do not compute the same step, so their times do not compare")
    if stream and ours.stream.in_flight is None:
        raise RuntimeError(f"{model} {schedule}: the stream held nothing in flight after its steps: they were windows")
    return times


def plain_runner(model: str, n: int, device: str = "cpu", optimizer: str = "adamw"):
    """The plain unpipelined step: every micro-batch's forward and backward through the whole model, then AdamW.
    Returns (step, module)."""
    loss_fn = _loss(model)
    plain = nn.Sequential(*[_stage(model, i) for i in range(STAGES)]).to(device)
    opt = OPTIMIZERS[optimizer](plain.parameters())

    def step(b):
        x, t = b
        for xm, tm in zip(x.chunk(n), t.chunk(n)):
            (loss_fn(plain(xm), tm) / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step, plain


def staged_runner(model: str, n: int, device: str = "cpu", optimizer: str = "adamw"):
    """The same stages run by hand, the graph cut at every boundary (4 backward calls per micro-batch instead of
    1), with no runtime: the floor of an emulated pipeline. Returns (step, list of stage modules)."""
    loss_fn = _loss(model)
    stages = [_stage(model, i).to(device) for i in range(STAGES)]
    opts = [OPTIMIZERS[optimizer](st.parameters()) for st in stages]

    def step(b):
        x, t = b
        for xm, tm in zip(x.chunk(n), t.chunk(n)):
            ins, outs = [], []
            h = xm
            for i, st in enumerate(stages):
                h = h.detach().requires_grad_(h.is_floating_point() and i > 0)
                ins.append(h)
                h = st(h)
                outs.append(h)
            (loss_fn(outs[-1], tm) / n).backward()
            for i in range(STAGES - 2, -1, -1):
                outs[i].backward(ins[i + 1].grad)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=False)
    return step, stages


def emulated_job(model: str, n: int, rounds: int, warmup: int, device: str = "cpu", optimizer: str = "adamw") -> dict:
    """One process: an emulated 1F1B Pipeline against the plain step of the same model (``plain_runner``) and
    against the same stages run by hand (``staged_runner``): plain -> staged is what cutting the graph costs,
    staged -> pipeoptim the runtime's own per-action work. On ``device`` (all stages on one GPU with 'cuda';
    each step timed from a synchronised start to a synchronised end)."""
    from pipeoptim.train import Pipeline

    ours = Pipeline(stages=lambda i: _stage(model, i).to(device), devices=STAGES, emulate=True, device=device,
                    loss_fn=_loss(model), optimizer=OPTIMIZERS[optimizer], schedule="1f1b", policy="none",
                    microbatches=n)
    runners = {"pipeoptim": lambda b: ours.train_step(b), "plain": plain_runner(model, n, device, optimizer)[0],
               "staged": staged_runner(model, n, device, optimizer)[0]}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(warmup + rounds):
        batch = tuple(t.to(device) for t in _batch(model, n, r))
        for name, run in runners.items():
            sync()
            t0 = time.perf_counter()
            run(batch)
            sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, with {_cpu()}"
    return _cpu()


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    isa = "AVX-512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else torch.backends.cpu.get_cpu_capability()
    return f"{name}, {os.cpu_count()} cores, {isa}"


def paired_ratio(ours: list[float], theirs: list[float], resamples: int = 2000, seed: int = 0) -> tuple:
    """The median over rounds of ours[r] / theirs[r] (each round times both runtimes back to back, so a change in
    the machine's load hits both) and its 90 % bootstrap interval (percentiles of the median over ``resamples``
    resamplings of the rounds, seeded): (median, low, high)."""
    ratios = torch.tensor(ours, dtype=torch.float64) / torch.tensor(theirs, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(ratios), (resamples, len(ratios)), generator=g)
    medians = ratios[picks].quantile(0.5, dim=1).sort().values
    low, high = medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]
    return float(ratios.quantile(0.5)), float(low), float(high)


def _policy(schedule: str, policy: str | None = None) -> str:
    """The weight policy a row of ``schedule`` runs: ``policy``, else the schedule's first in ``ASYNC``, else none."""
    if policy is not None:
        return policy
    return next((p for s, p, *_ in ASYNC if s == schedule), "none")


def _update_every(n: int, update_every: int | str | None) -> int | None:
    """2BW's micro-batches per update: None (the schedule's default, D), "N" (``n``: one update per window of n
    micro-batches, as a synchronous schedule takes) or a number."""
    if update_every == "N":
        return n
    if update_every is None or (isinstance(update_every, int) and not isinstance(update_every, bool)):
        return update_every
    raise ValueError(f"update_every must be None, 'N' or an int, got {update_every!r}")


def micro_batches_per_update(schedule: str, n: int, ranks: int, update_every: int | str | None = None) -> int:
    """How many micro-batches a row's optimizer step covers: N for a synchronous schedule, 1 for async 1F1B, m for
    2BW (default D = ``ranks``)."""
    if schedule == "async-1f1b":
        return 1
    if schedule == "2bw":
        return _update_every(n, update_every) or ranks
    return n


def _schedule_options(n: int, update_every: int | str | None) -> dict | None:
    m = _update_every(n, update_every)
    return None if m is None else {"update_every": m}


def _row(model, setting, schedule, n, times, peer, peer_schedule=None, optimizer: str = "adamw",
         policy: str = "none", stream: bool = False, rows: int = 1, update_every: int | None = None) -> dict:
    """One CSV row; ``update_every``: the micro-batches each optimizer step covers (``micro_batches_per_update``),
    when known."""
    ours = statistics.median(times["pipeoptim"])
    theirs = statistics.median(times[peer])
    spread = lambda ts: (min(ts), max(ts))  # noqa: E731
    paired, low, high = paired_ratio(times["pipeoptim"], times[peer])
    cpu = {"cpu_s": "", "peer_cpu_s": "", "cpu_paired_ratio": "", "cpu_paired_ratio_90ci": ""}
    if "pipeoptim cpu" in times and f"{peer} cpu" in times:  # the multi-process rows: CPU summed over the ranks
        ours_cpu, theirs_cpu = times["pipeoptim cpu"], times[f"{peer} cpu"]
        c_paired, c_low, c_high = paired_ratio(ours_cpu, theirs_cpu)
        cpu = {"cpu_s": round(statistics.median(ours_cpu), 5), "peer_cpu_s": round(statistics.median(theirs_cpu), 5),
               "cpu_paired_ratio": round(c_paired, 3), "cpu_paired_ratio_90ci": "%.3f-%.3f" % (c_low, c_high)}
    return {"model": model, "setting": setting, "schedule": schedule, "policy": policy, "stream": stream,
            "update_every": "" if update_every is None else update_every, "microbatches": n,
            "rows_per_microbatch": rows, "optimizer": optimizer,
            "pipeoptim_s": round(ours, 5), "pipeoptim_min_max": "%.5f-%.5f" % spread(times["pipeoptim"]),
            "peer": peer if peer_schedule is None else f"{peer}:{peer_schedule}",
            "peer_s": round(theirs, 5), "peer_min_max": "%.5f-%.5f" % spread(times[peer]),
            "ratio": round(ours / theirs, 3), "paired_ratio": round(paired, 3),
            "paired_ratio_90ci": "%.3f-%.3f" % (low, high), "samples_per_s": round(n * rows / ours, 2),
            "peer_samples_per_s": round(n * rows / theirs, 2), **cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--models", nargs="+", choices=["tiny", "gpt"], default=["tiny", "gpt"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[8, 32],
                    help="N for the tiny model (the GPT runs N = 8)")
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per runtime (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--no-async", action="store_true", help="skip the asynchronous rows")
    ap.add_argument("--emulated", action="store_true", help="add the one-process rows")
    ap.add_argument("--emulated-only", action="store_true",
                    help="only the one-process rows (what --device cuda runs: torch's runtime needs a GPU per rank)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the emulated rows run (cuda: every stage on the one GPU; needs --emulated-only)")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                    help="what both runtimes step: torch's AdamW (default) or AdamW(fused=True), one kernel per "
                         "step (an asynchronous schedule steps after every micro-batch or every few)")
    ap.add_argument("--ranks", type=int, choices=[2, STAGES], default=STAGES,
                    help="processes of the side-by-side rows (default 4; 2: a core per rank on a 2-core machine, "
                         "where a rank that waits leaves its core idle, as a GPU would; the model is cut in 2)")
    ap.add_argument("--rows-per-microbatch", type=int, default=1, metavar="B",
                    help="rows per micro-batch in the side-by-side rows (default 1: the tiny model's 1 x 64, the "
                         "GPT's 1 x 64 tokens); more makes each micro-batch's compute larger against an "
                         "optimizer step's, as on a GPU")
    ap.add_argument("--csv", default=None, help="output CSV (default: runs/bench_runtime_peer/<time>.csv)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.rows_per_microbatch < 1:
        ap.error("--rounds and --rows-per-microbatch must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not args.emulated_only:
        ap.error("--device cuda runs the emulated rows only: add --emulated-only (the 4-process rows need a GPU "
                 "per rank, and gloo moves CPU tensors)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    torch.set_num_threads(1)
    from pipeoptim.runtime import launch

    rows = []
    ranks, setting = args.ranks, f"{args.ranks} processes"
    for model in args.models:
        ns = args.microbatches if model == "tiny" else [8]
        for n in ([] if args.emulated_only else ns):
            best = None
            for schedule in SYNC:
                if schedule == "interleaved" and n % ranks:
                    print(f"{model} interleaved N={n}: skipped (pipeoptim's interleaved needs N a multiple of "
                          f"{ranks})", flush=True)
                    continue
                per_rank = launch(rank_job, ranks, model, schedule, n, args.rounds, args.warmup, None,
                                  args.optimizer, None, False, args.rows_per_microbatch, timeout_s=3600)
                times = per_rank[0]
                rows.append(_row(model, setting, schedule, n, times, "torch", schedule, args.optimizer,
                                 rows=args.rows_per_microbatch, update_every=n))
                torch_median = statistics.median(times["torch"])
                if best is None or torch_median < best[1]:
                    best = (schedule, torch_median)
                print(_format(rows[-1]), flush=True)
            if not args.no_async:
                for schedule, policy, stream, update_every in ASYNC:
                    per_rank = launch(rank_job, ranks, model, schedule, n, args.rounds, max(args.warmup, 1),
                                      best[0], args.optimizer, policy, stream, args.rows_per_microbatch,
                                      update_every, timeout_s=3600)
                    rows.append(_row(model, setting, schedule, n, per_rank[0], "torch", best[0],
                                     args.optimizer, policy, stream, args.rows_per_microbatch,
                                     micro_batches_per_update(schedule, n, ranks, update_every)))
                    print(_format(rows[-1]) + "  (peer: torch's fastest synchronous schedule above, run again "
                          "side by side)", flush=True)
        if args.emulated or args.emulated_only:
            times = emulated_job(model, 8, args.rounds, args.warmup, args.device, args.optimizer)
            setting = "emulated" if args.device == "cpu" else f"emulated, {args.device}"
            rows.append(_row(model, setting, "1f1b", 8, times, "plain", optimizer=args.optimizer))
            print(_format(rows[-1]), flush=True)
            rows.append(_row(model, setting, "1f1b", 8, times, "staged", optimizer=args.optimizer))
            print(_format(rows[-1]), flush=True)
    path = args.csv or os.path.join("runs", "bench_runtime_peer", time.strftime("%Y%m%d-%H%M%S") + ".csv")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write(f"# python {' '.join(sys.argv)}\n# {_machine(args.device)}; torch {torch.__version__}\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


def _format(r: dict) -> str:
    schedule = r["schedule"] + ("" if r["policy"] == _policy(r["schedule"]) else f"+{r['policy']}") + \
        (" stream" if r.get("stream") else "")
    if r["schedule"] == "2bw" and r.get("update_every"):
        schedule += f" m={r['update_every']}"
    rows = r.get("rows_per_microbatch", 1)
    microbatches = f"N={r['microbatches']}" + (f" x {rows} rows" if rows != 1 else "")
    return (f"{r['model']:5} {r['setting']:12} {schedule:26} {microbatches:5} pipeoptim "
            f"{r['pipeoptim_s'] * 1e3:8.2f} ms  {r['peer']:18} {r['peer_s'] * 1e3:8.2f} ms  "
            f"ratio {r['ratio']:.3f}  paired {r['paired_ratio']:.3f} ({r['paired_ratio_90ci']})  "
            f"samples/s {r['samples_per_s']:.1f} vs {r['peer_samples_per_s']:.1f}"
            + (f"  CPU paired {r['cpu_paired_ratio']:.3f} ({r['cpu_paired_ratio_90ci']})" if r["cpu_s"] != "" else ""))


if __name__ == "__main__":
    sys.exit(main())
