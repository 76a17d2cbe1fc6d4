"""Does posting every receive of an iteration when it starts make gloo cheaper than posting one ahead?

Why this exists: gloo hands a message over only once both ends have posted theirs. A receive posted before the
message is sent lets the sender's own ``isend`` write it at once; a receive posted after makes the receiver's
"ready" notice travel to the sender's I/O thread (``gloo_tcp_loop``), which then writes it. pipeoptim's runtime
posted one receive ahead per channel, so whenever a sender ran ahead of its receiver (GPipe's forward phase,
every warm-up) each message took the second way; on 4 processes sharing 2 cores the I/O threads then spent
more CPU than the whole step's compute, most of it in ``epoll_wait``. On gloo the runtime now posts every
receive it can know when an iteration starts (``runtime/comm.py``); NCCL keeps one ahead.

This probe runs, on 4 gloo processes (one thread each) in the same job, the same stages of
``bench_runtime_peer.py``'s tiny model (8 x Linear(64, 64), micro-batches of 1 x 64: per-action overhead) three
ways, step by step in alternating order: pipeoptim posting every receive ahead (what it does on gloo), pipeoptim
posting one ahead (what it did, and does on NCCL), and torch.distributed.pipelining's schedule with the same
AdamW step. Per step: the wall time of the slowest rank, the CPU time of every thread of every rank, and the CPU
time of gloo's I/O threads alone (``/proc/self/task/*/schedstat``, Linux), summed over the ranks; medians over
the rounds and paired ratios against torch's (the median of the per-round ratios, with its 90 % bootstrap
interval).

    python benchmarks/probes/probe_recv_posting.py [--schedules gpipe 1f1b] [--microbatches 8 32] [--rounds 30]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # benchmarks/
import bench_runtime_peer as peer  # noqa: E402

WAYS = ("all ahead", "one ahead", "torch")
MEASURES = ("wall", "cpu", "gloo_io_cpu")


def gloo_io_cpu_s() -> float:
    """CPU seconds so far of this process's gloo I/O threads (NaN where /proc has no per-thread schedstat)."""
    total = 0.0
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "gloo_tcp_loop":
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) * 1e-9
    except OSError:
        return float("nan")
    return total


def rank_job(schedule: str, n: int, rounds: int, warmup: int) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    ahead, torch_step, _ = peer._runtimes("tiny", schedule, n)
    one, _, _ = peer._runtimes("tiny", schedule, n)
    one._runner.p2p.post_all_ahead = False  # (before its first iteration, when no receive is posted yet)
    runners = {"all ahead": lambda b: ahead.train_step(b), "one ahead": lambda b: one.train_step(b),
               "torch": torch_step}
    times = {way: {m: [] for m in MEASURES} for way in WAYS}
    for r in range(warmup + rounds):
        batch = peer._batch("tiny", n, r)
        order = list(runners.items()) if r % 2 == 0 else list(runners.items())[::-1]
        for way, run in order:
            dist.barrier()
            w0, c0, g0 = time.perf_counter(), time.process_time(), gloo_io_cpu_s()
            run(batch)
            took = torch.tensor([time.perf_counter() - w0, time.process_time() - c0, gloo_io_cpu_s() - g0],
                                dtype=torch.float64)
            wall = took[:1].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            sums = took[1:].clone()
            dist.all_reduce(sums)
            if r >= warmup:
                for m, v in zip(MEASURES, [float(wall)] + sums.tolist()):
                    times[way][m].append(v)
    return times


def rows_of(schedule: str, n: int, times: dict) -> list[dict]:
    rows = []
    for way in WAYS:
        row = {"schedule": schedule, "microbatches": n, "way": way}
        for m in MEASURES:
            row[f"{m}_ms"] = round(statistics.median(times[way][m]) * 1e3, 3)
            if way != "torch":
                med, lo, hi = peer.paired_ratio(times[way][m], times["torch"][m])
                row[f"{m}_vs_torch"] = round(med, 3)
                row[f"{m}_vs_torch_90ci"] = f"{lo:.3f}-{hi:.3f}"
            else:
                row[f"{m}_vs_torch"], row[f"{m}_vs_torch_90ci"] = 1.0, ""
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b"], default=["gpipe", "1f1b"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--rounds", type=int, default=30, help="timed steps per way (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or min(args.microbatches) < 1:
        ap.error("--rounds and --microbatches must be >= 1, --warmup >= 0")
    from pipeoptim.runtime import launch
    rows = []
    print(f"# {peer._cpu()}; torch {torch.__version__}; 4 gloo processes, 1 thread each; medians of "
          f"{args.rounds} rounds; vs torch: paired ratio (90 % interval)")
    for schedule in args.schedules:
        for n in args.microbatches:
            times = launch(rank_job, peer.STAGES, schedule, n, args.rounds, args.warmup, timeout_s=3600)[0]
            for row in rows_of(schedule, n, times):
                rows.append(row)
                print(f"{schedule:5} N={n:<3} {row['way']:9}  " + "  ".join(
                    f"{m} {row[f'{m}_ms']:8.2f} ms" + ("" if row["way"] == "torch" else
                                                       f" ({row[f'{m}_vs_torch']:.3f}, {row[f'{m}_vs_torch_90ci']})")
                    for m in MEASURES), flush=True)
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            f.write(f"# python {' '.join(sys.argv)}\n# {peer._cpu()}; torch {torch.__version__}\n")
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
