"""Throughput projections: BitPipe against 1F1B, interleaved 1F1B and Chimera, and asynchronous against
synchronous 1F1B, at D = 8, 16, 32, from per-op costs measured on this machine (issue 6).

Why this script exists: no machine here has 8-32 accelerators, so the pipeline simulator (``pipeoptim.sim``) is fed
with the forward, backward, optimizer-step and weight-prediction times of one real pipeline stage, measured here
(one transformer block of a small GPT, one CPU thread), and projects makespans and bubbles for large D. The model
is scaled with D (one block per device, "one D-th of the model" per stage); schedules that cut it finer
(interleaved with 2 chunks, BitPipe's 2D stages) get proportionally smaller per-stage costs (sim's convention).

Cost scenarios per D and N:
  measured    backward/forward as measured here
  B=F, B=2F   the forward as measured, backward forced to 1x / 2x forward (the papers' two usual assumptions)
Communication: free (``comm=free``), or an *assumed* link on which sending one stage's activation takes
``--comm-frac`` of a forward and mirror all-reduces run at the same bandwidth (``comm=assumed``). The CPU
processes here have no interconnect that resembles a GPU cluster's, so no measured link is used.

Async 1F1B (no flush, a step after every micro-batch, PipeOptim's prediction before forwards with s > 0) is
compared with synchronous 1F1B per N micro-batches of a long run: for async, the extra time of a 2N-micro-batch
window over an N window (fill and drain paid once per run, not per N).

    python benchmarks/bench_throughput.py [--dims 8 16 32] [--n-per-d 2 4] [--comm-frac 0.1]
    python benchmarks/bench_throughput.py --costs benchmarks/results/throughput_costs.csv   # re-project only

Writes benchmarks/results/throughput_costs.csv (measured costs; not with --costs, which reuses costs measured
before, so that a change to a schedule moves only that schedule's rows), throughput_projection.csv (one row per
schedule, D, N, scenario), throughput_speedup.png; prints the reproducing command. BitPipe appears with its three
orders (reference: the published one; greedy; paced).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import replace

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SYNC = ("gpipe", "1f1b", "interleaved", "chimera", "bitpipe")


def measure_costs(d_model: int, seq_len: int, mbs: int, repeats: int) -> dict:
    """Median seconds of forward, backward, AdamW step and PipeOptim prediction (exact, s=2) of one GPT block."""
    from pipeoptim.models import GPTConfig
    from pipeoptim.models.gpt import Block
    from pipeoptim.policies import make_policy
    cfg = GPTConfig(seq_len=seq_len, d_model=d_model, n_heads=max(1, d_model // 64), n_layers=1)
    torch.manual_seed(0)
    block = Block(cfg)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    pol = make_policy("pipeoptim", block, opt)
    x = torch.randn(mbs, seq_len, d_model)
    times = {"forward": [], "backward": [], "step": [], "predict": []}
    for i in range(repeats + 2):
        xi = x.clone().requires_grad_()
        t0 = time.perf_counter()
        with pol.forward(("m", i), s=0):
            y = block(xi)
        t1 = time.perf_counter()
        with pol.backward(("m", i)):
            y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        pol.step()  # next_s unknown: a plain optimizer step, no fused prediction
        t3 = time.perf_counter()
        pol.predictor.invalidate()
        t4 = time.perf_counter()
        with pol.forward(("p", i), s=2):  # the prediction happens on entry; the forward itself is not timed
            t5 = time.perf_counter()
        pol.discard(("p", i))
        if i >= 2:
            for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2), ("predict", t5 - t4)):
                times[k].append(v)
    pol.close()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    med["activation_bytes"] = float(x.numel() * x.element_size())
    med["param_bytes"] = float(sum(p.numel() * p.element_size() for p in block.parameters()))
    med["params"] = sum(p.numel() for p in block.parameters())
    return med


def load_costs(path: str) -> dict:
    """The costs row of a throughput_costs.csv written by an earlier run."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if len(rows) != 1 or not {"forward", "backward", "step", "predict", "activation_bytes"} <= set(rows[0]):
        raise SystemExit(f"{path} is not a throughput_costs.csv (one row with forward, backward, step, predict, "
                         "activation_bytes); run without --costs to measure")
    return {k: float(v) for k, v in rows[0].items()}


def scenarios(c: dict, comm_frac: float):
    from pipeoptim.sim import Costs
    base = Costs(forward=c["forward"], backward=c["backward"], step=c["step"], predict=c["predict"],
                 activation_bytes=c["activation_bytes"], param_bytes=c["param_bytes"])
    bw = c["activation_bytes"] / (comm_frac * c["forward"])  # bytes per second such that one send = frac x F
    for ratio_name, ratio in (("measured", None), ("B=F", 1.0), ("B=2F", 2.0)):
        costs = base if ratio is None else replace(base, backward=c["forward"] * ratio)
        yield ratio_name, "free", costs
        yield ratio_name, "assumed", replace(costs, p2p_bandwidth=bw, allreduce_bandwidth=bw)


def project(c: dict, dims, n_per_d, comm_frac: float) -> list[dict]:
    from pipeoptim.schedules.registry import get_schedule
    from pipeoptim.sim import compare, simulate
    rows = []
    for D in dims:
        for k in n_per_d:
            N = k * D
            for ratio_name, comm, costs in scenarios(c, comm_frac):
                for r in compare(D, N, costs, names=list(SYNC)):
                    if "error" in r:
                        rows.append({"devices": D, "microbatches": N, "bwd": ratio_name, "comm": comm,
                                     "schedule": r["schedule"], "error": r["error"]})
                        continue
                    rows.append({"devices": D, "microbatches": N, "bwd": ratio_name, "comm": comm,
                                 "schedule": r["schedule"], "time_per_N_s": r["makespan"],
                                 "bubble": r["bubble_ratio"], "microbatches_per_s": N / r["makespan"],
                                 "weight_copies": r["weight_copies"], "peak_activations": r["peak_activations"]})
                if N % D == 0:            # BitPipe's third order (compare() gives reference and paced)
                    g = simulate(get_schedule("bitpipe", D, N, concat="greedy"), costs)
                    rows.append({"devices": D, "microbatches": N, "bwd": ratio_name, "comm": comm,
                                 "schedule": "bitpipe[greedy]", "time_per_N_s": g.makespan, "bubble": g.bubble_ratio,
                                 "microbatches_per_s": N / g.makespan, "weight_copies": max(g.weight_copies),
                                 "peak_activations": max(g.peak_activations)})
                # async 1F1B, steady state: what each further N micro-batches cost (with PipeOptim's prediction)
                for pred in (False, True):
                    a = simulate(get_schedule("async-1f1b", D, N), costs, prediction=pred)
                    b = simulate(get_schedule("async-1f1b", D, 2 * N), costs, prediction=pred)
                    per_n = b.makespan - a.makespan
                    work = (sum(b.busy) - sum(a.busy)) / D
                    rows.append({"devices": D, "microbatches": N, "bwd": ratio_name, "comm": comm,
                                 "schedule": "async-1f1b" + ("+predict" if pred else ""), "time_per_N_s": per_n,
                                 "bubble": 1 - work / per_n, "microbatches_per_s": N / per_n,
                                 "weight_copies": max(a.weight_copies), "peak_activations": max(a.peak_activations)})
    # speed-ups against the best synchronous non-BitPipe schedule of the same (D, N, scenario)
    groups = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["devices"], r["microbatches"], r["bwd"], r["comm"]), []).append(r)
    for key, rs in groups.items():
        best = max((r for r in rs if r["schedule"].split("[")[0] in ("1f1b", "interleaved", "chimera")),
                   key=lambda r: r["microbatches_per_s"])
        one = next(r for r in rs if r["schedule"] == "1f1b")
        for r in rs:
            r["vs_best_sync"] = r["microbatches_per_s"] / best["microbatches_per_s"]
            r["best_sync"] = best["schedule"]
            r["vs_1f1b"] = r["microbatches_per_s"] / one["microbatches_per_s"]
    return rows


def _write(path: str, rows: list[dict]) -> None:
    fields = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def _table(rows: list[dict], comm: str, n_per_d: int) -> None:
    names = ["1f1b", "interleaved", "chimera[reference]", "chimera[paced]", "bitpipe[reference]", "bitpipe[greedy]",
             "bitpipe[paced]", "async-1f1b", "async-1f1b+predict"]
    print(f"\nthroughput relative to sync 1F1B (N = {n_per_d}D, comm={comm}); bubble in brackets\n")
    print("| D | B/F | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r0 in rows:
        if r0["schedule"] != "1f1b" or r0["comm"] != comm or r0["microbatches"] != n_per_d * r0["devices"]:
            continue
        cells = []
        for n in names:
            r = next((x for x in rows if x["schedule"] == n and x["comm"] == comm and x["devices"] == r0["devices"]
                      and x["microbatches"] == r0["microbatches"] and x["bwd"] == r0["bwd"]), None)
            bubble = max(r["bubble"], 0.0) if r and "error" not in r else 0.0   # no "-0.00" from rounding
            cells.append("–" if r is None or "error" in r else f"{r['vs_1f1b']:.3f} ({bubble:.2f})")
        print(f"| {r0['devices']} | {r0['bwd']} | " + " | ".join(cells) + " |")


def _plot(rows: list[dict], path: str, n_per_d: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    names = ["interleaved", "chimera[reference]", "chimera[paced]", "bitpipe[reference]", "bitpipe[paced]",
             "async-1f1b+predict"]
    for ax, bwd in zip(axes, ("measured", "B=F", "B=2F")):
        dims = sorted({r["devices"] for r in rows})
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = []
            for D in dims:
                r = next((x for x in rows if x["schedule"] == n and x["comm"] == "free" and x["devices"] == D
                          and x["microbatches"] == n_per_d * D and x["bwd"] == bwd), None)
                vals.append(r["vs_1f1b"] if r and "error" not in r else 0)
            ax.bar([j + i * width for j in range(len(dims))], vals, width, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(dims))], [f"D={D}" for D in dims])
        ax.set_title(f"backward: {bwd}, N={n_per_d}D, free comm")
        ax.set_ylim(0.8, None)
    axes[0].set_ylabel("throughput / sync 1F1B")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--n-per-d", type=int, nargs="+", default=[2, 4], help="N = k x D micro-batches per window")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--comm-frac", type=float, default=0.1,
                    help="assumed link: one activation send takes this fraction of a forward")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--costs", help="a throughput_costs.csv from an earlier run: project with those costs instead "
                                    "of measuring again")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if any(D < 2 or D % 2 for D in args.dims):
        ap.error("--dims must be even and >= 2 (Chimera and BitPipe pair rank r with D-1-r)")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    print("command: python " + " ".join([os.path.relpath(os.path.abspath(__file__))] +
                                        (list(argv) if argv is not None else sys.argv[1:])), flush=True)
    if args.costs:
        c = load_costs(args.costs)
        args.d_model, args.seq_len, args.microbatch_size, args.threads = (
            int(c[k]) for k in ("d_model", "seq_len", "microbatch_size", "threads"))
    else:
        c = measure_costs(args.d_model, args.seq_len, args.microbatch_size, args.repeats)
    source = f"costs from {args.costs} for" if args.costs else "measured"
    print(f"{source} one GPT block (d_model={args.d_model}, seq {args.seq_len}, micro-batch {args.microbatch_size}, "
          f"{int(c['params'])} params, {args.threads} thread): forward {c['forward'] * 1e3:.2f} ms, backward "
          f"{c['backward'] * 1e3:.2f} ms (B/F {c['backward'] / c['forward']:.2f}), AdamW step {c['step'] * 1e3:.3f} ms,"
          f" prediction {c['predict'] * 1e3:.3f} ms")
    if not args.costs:
        _write(os.path.join(args.out, "throughput_costs.csv"),
               [{"d_model": args.d_model, "seq_len": args.seq_len, "microbatch_size": args.microbatch_size,
                 "threads": args.threads, **c}])
    rows = project(c, args.dims, args.n_per_d, args.comm_frac)
    _write(os.path.join(args.out, "throughput_projection.csv"), rows)
    for k in args.n_per_d:
        for comm in ("free", "assumed"):
            _table(rows, comm, k)
    _plot(rows, os.path.join(args.out, "throughput_speedup.png"), args.n_per_d[0])
    print(f"\nwrote {args.out}/throughput_costs.csv, throughput_projection.csv, throughput_speedup.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
