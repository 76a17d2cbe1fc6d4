"""Runtime benchmark: what the executor achieves on this machine, and what that predicts at scale.

1. tokens/s, bubble fraction and memory per schedule and weight policy: D=4 processes (gloo, 1 thread each)
   training a small GPT on the stdlib corpus. Memory per rank (= per stage, or per device's chunks for
   interleaved/bidirectional schedules): the peak activation bytes (what the forwards in flight saved for
   their backwards, counted by the policy's saved-tensor hooks, summed over the device's chunks' peaks),
   the policy's extra weight bytes (prediction buffer, stashes incl. their pool, last gradient, averages:
   the peak, since stash buffers are pooled, not freed) and the process's peak RSS (mostly torch itself).
2. measured per-op costs (forward, backward, step, predict of one stage, in this process) fed to
   ``pipeoptim.sim`` for D = 8, 16, 32 projections (N = 2D), makespan and bubble per schedule.

    python benchmarks/bench_runtime.py [--steps 6] [--out benchmarks/results]

Writes runtime_throughput.csv and runtime_projection.csv and prints the command line. Timings on a shared
2-core machine are noisy: 4 processes share 2 cores, so the bubble includes waiting for a core.
"""
from __future__ import annotations

import argparse
import csv
import os
import resource
import sys
import time

import torch

CASES = [("gpipe", None), ("1f1b", None), ("interleaved", None), ("chimera", None), ("bitpipe", None),
         ("async-1f1b", "none"), ("async-1f1b", "stash"), ("async-1f1b", "spectrain"), ("async-1f1b", "pipeoptim"),
         ("2bw", "2bw")]


def _model():
    from pipeoptim.models import GPTConfig, gpt_layers
    cfg = GPTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=6)
    return cfg, gpt_layers(cfg)


def rank_job(schedule: str, policy, steps: int, N: int, mbs: int) -> dict:
    from pipeoptim.data import stdlib_corpus
    from pipeoptim.models.gpt import lm_loss
    from pipeoptim.train import Pipeline
    cfg, layers = _model()
    pipe = Pipeline(layers, loss_fn=lm_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                    schedule=schedule, policy=policy, microbatches=N, measure_activations=True)
    corpus = stdlib_corpus(max_bytes=1 << 20)
    gen = torch.Generator().manual_seed(0)
    batches = [corpus.batch("train", N * mbs, cfg.seq_len, gen) for _ in range(steps + 2)]
    for b in batches[:2]:
        pipe.train_step(b)
    t0 = time.perf_counter()
    bubbles = []
    for b in batches[2:]:
        pipe.train_step(b)
        bubbles.append(pipe.last_stats["bubble"])
    dt = time.perf_counter() - t0
    stages = pipe.workers[0].stages.values()
    extra = sum(st.policy.extra_weight_bytes() for st in stages)
    acts = sum(st.policy.peak_activation_bytes for st in stages)
    return {"tokens_per_s": steps * N * mbs * cfg.seq_len / dt, "bubble": sum(bubbles) / len(bubbles),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "extra_weight_bytes": extra,
            "activation_bytes": acts}


def measure_costs(mbs: int, repeats: int = 5) -> dict:
    """Per-op seconds of one stage (the model cut in 4), measured in this process on one thread."""
    from pipeoptim.policies import make_policy
    torch.set_num_threads(1)
    cfg, layers = _model()
    stage = torch.nn.Sequential(*layers[1:3])  # two blocks: a middle stage
    x = torch.randn(mbs, cfg.seq_len, cfg.d_model)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    pol = make_policy("pipeoptim", stage, opt)
    f = b = st = pr = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        with pol.forward(i, s=0):
            y = stage(x.requires_grad_())
        t1 = time.perf_counter()
        with pol.backward(i):
            y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        pol.step()
        pol.predictor.invalidate()  # time the prediction itself (a forward with s > 0 makes the same call)
        t3 = time.perf_counter()
        pol.predictor.predict(2)
        t4 = time.perf_counter()
        f, b, st, pr = min(f, t1 - t0), min(b, t2 - t1), min(st, t3 - t2), min(pr, t4 - t3)
    act_bytes = x.numel() * 4
    return {"forward": f, "backward": b, "step": st, "predict": pr, "activation_bytes": act_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--only", nargs="*", help="schedule names to run (default all)")
    args = ap.parse_args(argv)
    from pipeoptim.runtime import launch
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for sched, pol in CASES:
        if args.only and sched not in args.only:
            continue
        res = launch(rank_job, 4, sched, pol, args.steps, args.microbatches, args.microbatch_size, timeout_s=600)
        row = {"schedule": sched, "policy": pol or "none", "devices": 4, "microbatches": args.microbatches,
               "tokens_per_s": round(res[0]["tokens_per_s"]), "bubble": round(res[0]["bubble"], 3)}
        for r, x in enumerate(res):
            row[f"act_peak_kb_rank{r}"] = round(x["activation_bytes"] / 1024)
            row[f"extra_weight_kb_rank{r}"] = round(x["extra_weight_bytes"] / 1024)
        for r, x in enumerate(res):
            row[f"rss_mb_rank{r}"] = round(x["rss_mb"])
        rows.append(row)
        print(row, flush=True)
    path = os.path.join(args.out, "runtime_throughput.csv")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")

    from pipeoptim.runtime.config import make_schedule
    from pipeoptim.sim import Costs, simulate
    c = measure_costs(args.microbatch_size)
    print("measured per-stage costs (s):", {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in c.items()})
    proj = []
    for D in (8, 16, 32):
        N = 2 * D
        costs = Costs(forward=c["forward"], backward=c["backward"], step=c["step"], predict=c["predict"],
                      activation_bytes=c["activation_bytes"], p2p_latency=5e-5, p2p_bandwidth=1e9)
        for name in ("gpipe", "1f1b", "interleaved", "chimera", "bitpipe", "async-1f1b"):
            sched = make_schedule(name, D, N)
            r = simulate(sched, costs, prediction=(name == "async-1f1b"))
            proj.append({"devices": D, "microbatches": N, "schedule": name, "makespan_s": round(r.makespan, 5),
                         "bubble_ratio": round(r.bubble_ratio, 4),
                         "microbatches_per_s": round(N / r.makespan, 1)})
    path2 = os.path.join(args.out, "runtime_projection.csv")
    with open(path2, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(proj[0]))
        w.writeheader()
        w.writerows(proj)
    for p in proj:
        print(p)
    print(f"wrote {path2}")
    print("command: python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
