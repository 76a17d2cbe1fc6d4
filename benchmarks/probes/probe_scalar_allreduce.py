"""What does summing a few scalars over the pipeline's processes cost, by all-reduce and by ``RankSum``'s star?

Why this exists: a pipeoptim iteration sums its scalars over every rank once (the squared gradient norm, the
losses, the times, the skipped updates: six float64 numbers), for clipping, the non-finite check and a loss every
rank reports; torch.distributed.pipelining's schedules run none (their loss stays on the last stage, and they
neither clip nor skip). On the tiny model of bench_runtime_peer.py a step takes a few tens of milliseconds, so
this one reduction is a visible share of the gap between the two runtimes there. The probe times both ways of
doing it on gloo: ``dist.all_reduce`` (a ring on the process group's worker thread) and
``pipeoptim.runtime.scalars.RankSum`` (rank 0 gathers, sums and sends back by point-to-point messages: what the
executor uses on gloo). ``--procs`` processes (one thread each), ``--rounds`` reductions of six float64 numbers
after a barrier and 20 untimed ones, the two ways alternating in blocks; each rank's median and mean, in ms.

    python benchmarks/probes/probe_scalar_allreduce.py [--procs 4] [--rounds 300]
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
    from pipeoptim.runtime.scalars import RankSum
    init_from_env("cpu")
    torch.set_num_threads(1)
    scalars = torch.zeros(6, dtype=torch.float64)
    star = RankSum("cpu", star=True)
    ways = {"all_reduce": lambda: dist.all_reduce(scalars), "RankSum (star)": lambda: star([0.0] * 6)}
    took: dict[str, list[float]] = {name: [] for name in ways}
    for block in range(4):
        for name, reduce in ways.items():
            for _ in range(20 if block == 0 else 0):
                reduce()
            dist.barrier()
            for _ in range(-(-rounds // 4)):
                t0 = time.perf_counter()
                reduce()
                took[name].append(time.perf_counter() - t0)
    return {name: {"median_ms": statistics.median(t) * 1e3, "mean_ms": statistics.fmean(t) * 1e3}
            for name, t in took.items()}


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
        print(f"rank {r}: " + "; ".join(f"{name} median {t['median_ms']:.3f} ms, mean {t['mean_ms']:.3f} ms"
                                        for name, t in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
