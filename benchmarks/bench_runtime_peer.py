"""Is pipeoptim's runtime as fast as torch.distributed.pipelining on the same model and schedule?

Side by side in one run, per (model, schedule, N): 4 processes on gloo (one thread each); on every rank the
same stage of the same model with the same initial weights, once in a ``Pipeline(schedule=..., policy="none")``
and once in torch's ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe`` followed by AdamW's step. The two
runtimes alternate step by step (so a change in the machine's load hits both); a step's time is the slowest
rank's (all ranks barrier first); the median over the timed rounds is reported, with the ratio of the
medians. Asynchronous schedules (no flush) are timed the same way and compared, in samples per second, with
torch's faster synchronous schedule on that model. ``--emulated`` adds the one-process rows: an emulated
``Pipeline`` against the plain unpipelined step of the same model (forward and backward of every micro-batch,
then AdamW).

Models: ``tiny`` (8 x Linear(64, 64), micro-batches of 1 x 64: almost all per-action overhead) and ``gpt``
(a byte-level GPT of ~25M parameters, 8 blocks of width 512, micro-batches of 1 x 64 tokens).

    python benchmarks/bench_runtime_peer.py [--models tiny gpt] [--rounds 15] [--csv PATH]

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

SYNC = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
ASYNC = ["async-1f1b"]
STAGES = 4


def _tiny_stage(i: int) -> nn.Module:
    torch.manual_seed(1000 + i)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())


def _gpt_cfg():
    from pipeoptim.models import GPTConfig
    return GPTConfig(vocab_size=256, seq_len=64, d_model=512, n_heads=8, n_layers=8)


def _gpt_stage(i: int) -> nn.Module:
    from pipeoptim.models import gpt_layers
    layers = gpt_layers(_gpt_cfg(), seed=0)        # [embedding, 8 blocks, head] -> 3 | 2 | 2 | 3
    cuts = [0, 3, 5, 7, 10]
    return nn.Sequential(*layers[cuts[i]:cuts[i + 1]])


def _batch(model: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if model == "tiny":
        return torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)
    x = torch.randint(0, 256, (n, 64), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _loss(model: str):
    if model == "tiny":
        return lambda y, t: nn.functional.mse_loss(y, t)
    from pipeoptim.models.gpt import lm_loss
    return lm_loss


def _stage(model: str, i: int) -> nn.Module:
    return _tiny_stage(i) if model == "tiny" else _gpt_stage(i)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def rank_job(model: str, schedule: str, n: int, rounds: int, warmup: int) -> dict:
    """One rank: ``warmup`` + ``rounds`` alternating steps of both runtimes; returns the slowest rank's times."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from pipeoptim.train import Pipeline

    ours = Pipeline(stages=lambda i: _stage(model, i), loss_fn=_loss(model), optimizer=_adamw,
                    schedule=schedule, policy="none", microbatches=n)
    rank = dist.get_rank()
    runners = {"pipeoptim": lambda b: ours.train_step(b)}
    if schedule in SYNC:
        module = _stage(model, rank)
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"), group=dist.group.WORLD)
        sched = getattr(torch_schedules, SYNC[schedule])(stage, n, loss_fn=_loss(model))
        opt = _adamw(module.parameters())

        def torch_step(b):
            x, t = b
            sched.step(*((x,) if rank == 0 else ()), target=t if rank == STAGES - 1 else None)
            opt.step()
            opt.zero_grad(set_to_none=False)
        runners["torch"] = torch_step
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(warmup + rounds):
        batch = _batch(model, n, r)
        for name, run in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            run(batch)
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[name].append(float(took))
    return times


def emulated_job(model: str, n: int, rounds: int, warmup: int) -> dict:
    """One process: an emulated 1F1B Pipeline against the plain step of the same model."""
    from pipeoptim.train import Pipeline

    loss_fn = _loss(model)
    ours = Pipeline(stages=lambda i: _stage(model, i), devices=STAGES, emulate=True, loss_fn=loss_fn,
                    optimizer=_adamw, schedule="1f1b", policy="none", microbatches=n)
    plain = nn.Sequential(*[_stage(model, i) for i in range(STAGES)])
    opt = _adamw(plain.parameters())

    def plain_step(b):
        x, t = b
        for xm, tm in zip(x.chunk(n), t.chunk(n)):
            (loss_fn(plain(xm), tm) / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    runners = {"pipeoptim": lambda b: ours.train_step(b), "plain": plain_step}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(warmup + rounds):
        batch = _batch(model, n, r)
        for name, run in runners.items():
            t0 = time.perf_counter()
            run(batch)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    isa = "AVX-512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else torch.backends.cpu.get_cpu_capability()
    return f"{name}, {os.cpu_count()} cores, {isa}"


def _row(model, setting, schedule, n, times, peer, peer_schedule=None) -> dict:
    ours = statistics.median(times["pipeoptim"])
    theirs = statistics.median(times[peer])
    spread = lambda ts: (min(ts), max(ts))  # noqa: E731
    return {"model": model, "setting": setting, "schedule": schedule, "microbatches": n,
            "pipeoptim_s": round(ours, 5), "pipeoptim_min_max": "%.5f-%.5f" % spread(times["pipeoptim"]),
            "peer": peer if peer_schedule is None else f"{peer}:{peer_schedule}",
            "peer_s": round(theirs, 5), "peer_min_max": "%.5f-%.5f" % spread(times[peer]),
            "ratio": round(ours / theirs, 3), "samples_per_s": round(n / ours, 2),
            "peer_samples_per_s": round(n / theirs, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--models", nargs="+", choices=["tiny", "gpt"], default=["tiny", "gpt"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[8, 32],
                    help="N for the tiny model (the GPT runs N = 8)")
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per runtime (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--no-async", action="store_true", help="skip the asynchronous rows")
    ap.add_argument("--emulated", action="store_true", help="add the one-process rows")
    ap.add_argument("--csv", default=None, help="output CSV (default: runs/bench_runtime_peer/<time>.csv)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    from pipeoptim.runtime import launch

    rows = []
    for model in args.models:
        ns = args.microbatches if model == "tiny" else [8]
        for n in ns:
            best = None
            for schedule in SYNC:
                per_rank = launch(rank_job, STAGES, model, schedule, n, args.rounds, args.warmup, timeout_s=3600)
                times = per_rank[0]
                rows.append(_row(model, "4 processes", schedule, n, times, "torch", schedule))
                torch_median = statistics.median(times["torch"])
                if best is None or torch_median < best[1]:
                    best = (schedule, torch_median, times["torch"])
                print(_format(rows[-1]), flush=True)
            if not args.no_async:
                for schedule in ASYNC:
                    per_rank = launch(rank_job, STAGES, model, schedule, n, args.rounds, args.warmup,
                                      timeout_s=3600)
                    times = dict(per_rank[0], torch=best[2])
                    rows.append(_row(model, "4 processes", schedule, n, times, "torch", best[0]))
                    print(_format(rows[-1]) + "  (peer: torch's faster synchronous schedule, earlier run)",
                          flush=True)
        if args.emulated:
            times = emulated_job(model, 8, args.rounds, args.warmup)
            rows.append(_row(model, "emulated", "1f1b", 8, times, "plain"))
            print(_format(rows[-1]), flush=True)
    path = args.csv or os.path.join("runs", "bench_runtime_peer", time.strftime("%Y%m%d-%H%M%S") + ".csv")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write(f"# python {' '.join(sys.argv)}\n# {_cpu()}; torch {torch.__version__}\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


def _format(r: dict) -> str:
    return (f"{r['model']:5} {r['setting']:12} {r['schedule']:11} N={r['microbatches']:<3} pipeoptim "
            f"{r['pipeoptim_s'] * 1e3:8.2f} ms  {r['peer']:18} {r['peer_s'] * 1e3:8.2f} ms  "
            f"ratio {r['ratio']:.3f}  samples/s {r['samples_per_s']:.1f} vs {r['peer_samples_per_s']:.1f}")


if __name__ == "__main__":
    sys.exit(main())
