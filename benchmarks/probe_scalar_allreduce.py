"""What does one all-reduce of a few scalars cost between the pipeline's processes?

Why this exists: a pipeoptim iteration all-reduces its scalars once (the squared gradient norm, the losses, the
times, the skipped updates: six float64 numbers), for clipping, the non-finite check and a loss every rank
reports; torch.distributed.pipelining's schedules run none (their loss stays on the last stage, and they neither
clip nor skip). On the tiny model of bench_runtime_peer.py a step takes a few tens of milliseconds, so this one
collective is a visible share of the gap between the two runtimes there. The probe times it alone: ``--procs``
processes on gloo (one thread each), ``--rounds`` all-reduces of six float64 numbers after a barrier and 20
untimed ones; each rank's median and mean, in milliseconds.

    python benchmarks/probe_scalar_allreduce.py [--procs 4] [--rounds 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def rank_job(rounds: int) -> dict:
    import torch.distributed as dist

    from pipeoptim.runtime.dist_env import init_from_env
    init_from_env("cpu")
    torch.set_num_threads(1)
    scalars = torch.zeros(6, dtype=torch.float64)
    for _ in range(20):
        dist.all_reduce(scalars)
    dist.barrier()
    took = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dist.all_reduce(scalars)
        took.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(took) * 1e3, "mean_ms": statistics.fmean(took) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--procs", type=int, default=4, help="processes (default 4, as bench_runtime_peer.py runs)")
    ap.add_argument("--rounds", type=int, default=300, help="timed all-reduces (default 300)")
    args = ap.parse_args(argv)
    if args.procs < 2 or args.rounds < 1:
        ap.error("--procs must be >= 2 and --rounds >= 1")
    from pipeoptim.runtime import launch
    per_rank = launch(rank_job, args.procs, args.rounds, timeout_s=600)
    for r, res in enumerate(per_rank):
        print(f"rank {r}: median {res['median_ms']:.3f} ms, mean {res['mean_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
