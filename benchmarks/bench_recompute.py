"""What activation recomputation saves and costs: peak activation memory per stage and time per window, for
async-1f1b (PipeOptim) and 1f1b at D = 4 and 8, recomputing no stage, the first half of the stages (which hold the
most micro-batches) or every stage (issue 24).

The GPT is sized so that activations dominate: d_model 64, 8 blocks, 256 tokens per sequence, 4 sequences per
micro-batch (a block's parameters are 12·d² = 49 K floats, its activations for one micro-batch ~1 M floats), cut
into D stages; N = 2·D micro-batches per window, so stage 0 holds D in flight (both schedules).

Memory, two ways:
- per stage, the peak bytes that forwards in flight had saved for their backwards (``peak_activation_bytes``: every
  saved tensor's storage, counted once per forward, weights excluded; with recomputation the checkpointed regions'
  inputs, which is what the forward keeps);
- for the whole emulated pipeline (all stages in one process), the process's real peak: peak RSS of a fresh
  process during the timed windows minus its RSS before them, with glibc returning every block over 64 KiB to the
  system (MALLOC_MMAP_THRESHOLD_=65536), so it includes what the bookkeeping cannot see: the recomputation's
  transient activations in the backward, gradients, the optimizer's first-step state, temporaries.

Time: the three pipelines of a setting (the three recomputation choices) are built in one process and their
``train_step`` windows alternate (one untimed each first), so both see the same machine load; the median over ``--windows`` of
each, as the process's CPU time (one thread: what the window computes, robust to other processes on a shared
machine) and as wall time.

    python benchmarks/bench_recompute.py                      # all 8 settings, ~5 min on 2 loaded cores
    python benchmarks/bench_recompute.py --quick              # a small model, one setting, seconds

Writes benchmarks/results/recompute_memory.csv (the command in every row). Each setting runs in its own process.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
SETTINGS = [(sched, D) for D in (4, 8) for sched in ("async-1f1b", "1f1b")]
FIELDS = ["schedule", "policy", "devices", "microbatches", "recompute", "d_model", "blocks", "seq_len",
          "microbatch_size", "act_mib_per_stage", "act_mib_stage0", "act_mib_total", "rss_peak_delta_mib",
          "window_cpu_s", "window_wall_s", "window_cpu_s_all", "cpu", "command"]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


MODES = {"off": lambda D: (), "first half": lambda D: list(range(D // 2)), "every stage": lambda D: True}


def _build(args, recompute: str):
    import torch
    from pipeoptim.models import GPTConfig, gpt_layers
    from pipeoptim.models.gpt import lm_loss
    from pipeoptim.train import Pipeline
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.blocks)
    N = 2 * args.devices
    policy = "pipeoptim" if args.schedule.startswith("async") else None
    pipe = Pipeline(gpt_layers(cfg, seed=0), loss_fn=lm_loss, devices=args.devices, schedule=args.schedule,
                    policy=policy, microbatches=N, emulate=True, checkpoint_stages=MODES[recompute](args.devices),
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), measure_activations=True)
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, 256, (N * args.microbatch_size, cfg.seq_len + 1), generator=gen)
        return x[:, :-1], x[:, 1:]
    return pipe, batch


def memory(args) -> dict:
    """One setting in this fresh process: activation bytes per stage and the real peak of a timed window."""
    pipe, batch = _build(args, args.recompute)
    pipe.train_step(batch())   # untimed: first-step allocations (optimizer state, stashes, predictions)
    base = _rss_mib()
    pipe.train_step(batch())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    acts = [0] * pipe.schedule.num_stages
    for w in pipe.workers:
        for chunk, st in w.stages.items():
            acts[chunk.stage] = max(acts[chunk.stage], st.policy.peak_activation_bytes)
    mib = [a / 2**20 for a in acts]
    return {"schedule": args.schedule, "policy": pipe.policy_name, "devices": args.devices,
            "microbatches": pipe.schedule.num_microbatches, "recompute": args.recompute,
            "d_model": args.d_model, "blocks": args.blocks, "seq_len": args.seq_len,
            "microbatch_size": args.microbatch_size, "act_mib_per_stage": " ".join(f"{m:.1f}" for m in mib),
            "act_mib_stage0": round(mib[0], 2), "act_mib_total": round(sum(mib), 2),
            "rss_peak_delta_mib": round(max(0.0, peak - base), 1), "cpu": _cpu()}


def timing(args) -> dict:
    """Both pipelines of a setting in this process, their windows alternating: {recompute: (cpu s, wall s) lists}."""
    pipes = {rc: _build(args, rc) for rc in MODES}
    out = {rc: [] for rc in MODES}
    for i in range(args.windows + 1):
        for rc, (pipe, batch) in pipes.items():
            b = batch()
            c0, t0 = time.process_time(), time.perf_counter()
            pipe.train_step(b)
            if i:  # the first window of each is untimed
                out[rc].append((time.process_time() - c0, time.perf_counter() - t0))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small model and two settings (seconds)")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--windows", type=int, default=3, help="timed windows per setting (median)")
    ap.add_argument("--csv", default=os.path.join(RESULTS, "recompute_memory.csv"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # memory|timing,schedule,D[,recompute]: here
    args = ap.parse_args(argv)
    if args.one:
        what, sched, D, *rc = args.one.split(",")
        args.schedule, args.devices, args.recompute = sched, int(D), (rc or ["off"])[0]
        import torch
        torch.set_num_threads(1)
        print(json.dumps(memory(args) if what == "memory" else timing(args)))
        return
    settings = SETTINGS
    if args.quick:
        args.d_model, args.blocks, args.seq_len, args.microbatch_size, args.windows = 16, 4, 32, 2, 1
        settings = [("async-1f1b", 4)]
    command = "python benchmarks/bench_recompute.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    passthrough = ["--d-model", str(args.d_model), "--blocks", str(args.blocks), "--seq-len", str(args.seq_len),
                   "--microbatch-size", str(args.microbatch_size), "--windows", str(args.windows)]
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    def run(what: str) -> dict:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", what, *passthrough], env=env,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    for sched, D in settings:
        times = run(f"timing,{sched},{D}")
        for rc in MODES:
            cpu_s, wall_s = [t[0] for t in times[rc]], [t[1] for t in times[rc]]
            row = dict(run(f"memory,{sched},{D},{rc}"), window_cpu_s=round(statistics.median(cpu_s), 3),
                       window_wall_s=round(statistics.median(wall_s), 3),
                       window_cpu_s_all=" ".join(f"{t:.3f}" for t in cpu_s), command=command.strip())
            print(row, flush=True)
            rows.append(row)
        with open(args.csv, "w", newline="") as f:   # rewritten after each setting: a timeout keeps what finished
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
