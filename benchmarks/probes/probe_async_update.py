"""Can asynchronous 1F1B, which updates after every micro-batch, be faster than a synchronous schedule?

Why this exists: issue 23 expects the asynchronous schedules, having no flush, to beat torch's fastest
synchronous schedule. Asynchronous 1F1B takes N optimizer updates per stage in a window of N micro-batches, where
a synchronous schedule takes one; what it saves is the fill and the drain. On D devices that idle while they
wait, a 1F1B window lasts about N + D - 1 slots of a micro-batch's forward and backward (f + b) plus one update
(u), and an asynchronous stream's N slots plus N updates. The stream is the faster one only when

    (N - 1) * u  <  (D - 1) * (f + b)

This probe measures both sides on one thread, for ``bench_runtime_peer.py``'s model cut as its ``--ranks`` rows
are:
- f + b: each stage's forward and backward of one micro-batch, run as the runtime runs them (the graph cut at
  the stage's input, which arrives detached; the last stage's backward from its loss);
- u: each stage's update as the runtime takes it in an asynchronous schedule (``DeviceWorker.step``: the
  finiteness check, the optimizer's step, the gradient zeroed), on an emulated async-1f1b ``Pipeline`` of the
  same stages after one window.
It prints both sides with the slowest stage's values (the slowest stage sets the pace), the two windows they
predict, their ratio, and how much longer a micro-batch's forward and backward would have to take for the
stream to break even (``--rows-per-microbatch`` raises f + b, and u stays the same). The windows leave out the
messages and the per-action work, which the runtime's windows add to both (``bench_runtime_peer.py`` measures
those); what the comparison says is whether the updates cost more than the drain saves. torch's interleaved and
ZBV schedules idle less than 1F1B, so against them the bar is higher still. Medians of ``--rounds`` timings after
``--warmup`` untimed ones.

    python benchmarks/probes/probe_async_update.py [--model gpt] [--ranks 2] [--microbatches 8]
        [--rows-per-microbatch 1] [--optimizer adamw-fused] [--rounds 15] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # benchmarks/
import bench_runtime_peer as peer  # noqa: E402


def windows(n: int, d: int, fb: float, u: float) -> dict:
    """What the model above predicts for a window of ``n`` micro-batches on ``d`` devices, with ``fb`` a
    micro-batch's forward and backward and ``u`` an update (seconds): the 1F1B window, the asynchronous
    stream's, their ratio, and the factor by which ``fb`` would have to grow for the two to be equal."""
    sync = (n + d - 1) * fb + u
    stream = n * (fb + u)
    return {"sync": sync, "stream": stream, "ratio": stream / sync,
            "break_even": (n - 1) * u / ((d - 1) * fb) if d > 1 else float("inf")}


def _median_s(fn, rounds: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_backward_s(model: str, ranks: int, rows: int, rounds: int, warmup: int) -> list[float]:
    """Each stage's forward and backward of one micro-batch, the graph cut at its input."""
    stages = [peer._stage(model, i, ranks) for i in range(ranks)]
    loss_fn = peer._loss(model)
    x, t = peer._batch(model, 1, 0, rows)
    inputs = [x]
    with torch.no_grad():
        for st in stages[:-1]:
            inputs.append(st(inputs[-1]))
    out = []
    for i, st in enumerate(stages):
        last = i == ranks - 1
        grad = None if last else torch.randn_like(st(inputs[i]))

        def run(i=i, st=st, last=last, grad=grad):
            h = inputs[i].detach().requires_grad_(inputs[i].is_floating_point())
            y = st(h)
            if last:
                loss_fn(y, t).backward()
            else:
                y.backward(grad)
        out.append(_median_s(run, rounds, warmup))
    return out


def update_s(model: str, ranks: int, rows: int, n: int, optimizer: str, rounds: int, warmup: int) -> list[float]:
    """Each stage's asynchronous update as the runtime takes it, on an emulated async-1f1b Pipeline."""
    from pipeoptim.schedules.actions import Step
    from pipeoptim.train import Pipeline

    pipe = Pipeline(stages=lambda i: peer._stage(model, i, ranks), devices=ranks, emulate=True,
                    loss_fn=peer._loss(model), optimizer=peer.OPTIMIZERS[optimizer], schedule="async-1f1b",
                    policy="none", microbatches=n)
    pipe.train_step(peer._batch(model, n, 0, rows))  # one window: state, flat buffers and memory settings in place
    out = []
    for d, w in enumerate(pipe.workers):
        index, action = next((j, a) for j, a in enumerate(w.plan.actions[d]) if isinstance(a, Step))
        out.append(_median_s(lambda w=w, index=index, action=action: w.step(index, action), rounds, warmup))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", choices=["gpt", "tiny"], default="gpt")
    ap.add_argument("--ranks", type=int, choices=[2, 4], default=2, help="devices, the model cut as in "
                    "bench_runtime_peer.py's rows on that many processes (default 2)")
    ap.add_argument("--microbatches", type=int, default=8, help="N, micro-batches per window (default 8)")
    ap.add_argument("--rows-per-microbatch", type=int, default=1, metavar="B",
                    help="rows per micro-batch (default 1: the GPT's 1 x 64 tokens)")
    ap.add_argument("--optimizer", choices=sorted(peer.OPTIMIZERS), default="adamw-fused")
    ap.add_argument("--rounds", type=int, default=15, help="timed calls per measurement (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.microbatches < 2 or args.rows_per_microbatch < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--microbatches must be >= 2, --rows-per-microbatch and --rounds >= 1, --warmup >= 0")
    torch.set_num_threads(1)
    n, d = args.microbatches, args.ranks
    fb = forward_backward_s(args.model, d, args.rows_per_microbatch, args.rounds, args.warmup)
    u = update_s(args.model, d, args.rows_per_microbatch, n, args.optimizer, args.rounds, args.warmup)
    lines = [f"# python {' '.join(sys.argv)}", f"# {peer._cpu()}; torch {torch.__version__}; 1 thread",
             f"{args.model} cut in {d} stages, N = {n}, {args.rows_per_microbatch} row(s) per micro-batch, "
             f"{args.optimizer}; medians of {args.rounds}", ""]
    for i in range(d):
        lines.append(f"stage {i}: forward + backward {fb[i] * 1e3:9.3f} ms   update {u[i] * 1e3:9.3f} ms")
    FB, U = max(fb), max(u)
    p = windows(n, d, FB, U)
    lines += ["",
              f"(N - 1) * u = {(n - 1) * U * 1e3:.1f} ms against (D - 1) * (f + b) = {(d - 1) * FB * 1e3:.1f} ms "
              "(the slowest stage's)",
              f"predicted window (compute and updates, no messages): 1F1B {p['sync'] * 1e3:.1f} ms, "
              f"asynchronous 1F1B as a stream {p['stream'] * 1e3:.1f} ms: ratio {p['ratio']:.3f}",
              f"the stream breaks even when a micro-batch's forward and backward take {p['break_even']:.2f}x as long"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
