"""Where does an emulated step spend the time that the staged floor does not?

Why this exists: issue 23 asks that an emulated ``Pipeline`` on ``bench_runtime_peer.py``'s tiny model (8 x
Linear(64, 64), micro-batches of 1 x 64: almost all per-action overhead) take at most 1.3x the plain unpipelined
step. Cutting the graph at every stage boundary (``bench_runtime_peer.staged_runner``, the same stages run by
hand) already costs about 1.2x, so what is left is the runtime's own work per action. This probe says where that
work goes, so that the next change aims at the largest piece instead of a guess:

- by part, side by side with the staged floor in one process, rounds alternating: an emulated 1F1B step
  (``policy="none"``, N micro-batches on 4 devices) timed in its forwards, backwards, optimizer steps with the
  global norm, and the rest (the emulator's loop, the copies it hands over, ``begin``/``end``, the stats, and
  the tensors freed between the timed calls); the staged step likewise in its forwards, backwards, optimizer
  steps and the rest (its loop, and what it frees there). Each timed call carries the timer's own cost
  (printed), once per call;
- by piece, each timed alone (``timeit``) on the same stages: a weight policy's forward and backward as the
  worker runs them (``call_forward`` and ``call_backward``) and as ``with`` scopes,
  the stage module's wrapper (``StageModule`` around the stage against the stage itself), one activation's copy,
  and the worker's lookup of what it knows of an action.

One thread. ``--model gpt`` runs the same on the GPT of ``bench_runtime_peer.py`` (there the per-action work is
noise beside the compute).

    python benchmarks/probes/probe_emulator_overhead.py [--model tiny] [--microbatches 8] [--rounds 150] [--out PATH]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time
import timeit

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # benchmarks/
import bench_runtime_peer as peer  # noqa: E402

PARTS = ("forward", "backward", "step", "sq_norm")  # the DeviceWorker methods timed by part


@contextlib.contextmanager
def timed_methods(cls, names, totals: collections.Counter, calls: collections.Counter):
    """Inside, each method ``names`` of ``cls`` adds its wall time to ``totals[name]`` (and counts its calls)."""
    originals = {name: getattr(cls, name) for name in names}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0
                calls[name] += 1
        return timed
    for name, fn in originals.items():
        setattr(cls, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(cls, name, fn)


def timer_cost_us() -> float:
    """What one timed call adds over a plain one (the wrapper's two clock reads and its frame)."""
    totals, calls = collections.Counter(), collections.Counter()

    class Plain:
        def f(self):
            return None
    p = Plain()
    bare = min(timeit.repeat(p.f, number=20000, repeat=5)) / 20000
    with timed_methods(Plain, ["f"], totals, calls):
        wrapped = min(timeit.repeat(p.f, number=20000, repeat=5)) / 20000
    return (wrapped - bare) * 1e6


def staged_by_part(model: str, n: int):
    """``bench_runtime_peer.staged_runner``'s step with its forwards, backwards and optimizer steps timed apart."""
    loss_fn = peer._loss(model)
    stages = [peer._stage(model, i) for i in range(peer.STAGES)]
    opts = [peer._adamw(st.parameters()) for st in stages]
    totals = collections.Counter()

    def step(batch):
        x, t = batch
        clock = time.perf_counter
        start = clock()
        for xm, tm in zip(x.chunk(n), t.chunk(n)):
            ins, outs = [], []
            h = xm
            t0 = clock()
            for i, st in enumerate(stages):
                h = h.detach().requires_grad_(h.is_floating_point() and i > 0)
                ins.append(h)
                h = st(h)
                outs.append(h)
            loss = loss_fn(outs[-1], tm) / n
            t1 = clock()
            totals["forward"] += t1 - t0
            loss.backward()
            for i in range(peer.STAGES - 2, -1, -1):
                outs[i].backward(ins[i + 1].grad)
            totals["backward"] += clock() - t1
        t0 = clock()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=False)
        totals["step"] += clock() - t0
        totals["total"] += clock() - start
    return step, totals


def by_part(model: str, n: int, rounds: int, warmup: int) -> dict:
    """Milliseconds per step, by part, for the emulated pipeline and the staged floor: means over the timed
    rounds, the two alternating round by round; and the timed calls per step."""
    from pipeoptim.runtime.emulator import Emulator
    from pipeoptim.runtime.worker import DeviceWorker
    from pipeoptim.train import Pipeline

    ours_t, ours_calls = collections.Counter(), collections.Counter()
    run_t, run_calls = collections.Counter(), collections.Counter()
    with timed_methods(DeviceWorker, PARTS, ours_t, ours_calls), timed_methods(Emulator, ["run"], run_t, run_calls):
        pipe = Pipeline(stages=lambda i: peer._stage(model, i), devices=peer.STAGES, emulate=True,
                        loss_fn=peer._loss(model), optimizer=peer._adamw, schedule="1f1b", policy="none",
                        microbatches=n)
        staged, staged_t = staged_by_part(model, n)
        for r in range(warmup + rounds):
            if r == warmup:
                for c in (ours_t, ours_calls, run_t, run_calls, staged_t):
                    c.clear()
            batch = peer._batch(model, n, r)
            pipe.train_step(batch)
            staged(batch)
    per_step = lambda c, k: 1e3 * c[k] / rounds  # noqa: E731
    ours = {k: per_step(ours_t, k) for k in PARTS}
    ours["total"] = per_step(run_t, "run")
    ours["rest"] = ours["total"] - sum(ours[k] for k in PARTS)
    staged_ms = {k: per_step(staged_t, k) for k in ("forward", "backward", "step", "total")}
    staged_ms["rest"] = staged_ms["total"] - sum(staged_ms[k] for k in ("forward", "backward", "step"))
    calls = {k: ours_calls[k] / rounds for k in PARTS}
    return {"ours": ours, "staged": staged_ms, "calls_per_step": calls}


def _nothing() -> None:
    return None


def extra_us(fn, base, rounds: int = 7, number: int = 2000) -> float:
    """Microseconds per call that ``fn`` takes beyond ``base``: the difference of their fastest rounds, the two
    timed in alternating rounds so that a burst of load elsewhere reaches both minima alike."""
    fn_us, base_us = [], []
    for _ in range(rounds):
        fn_us.append(timeit.timeit(fn, number=number) / number * 1e6)
        base_us.append(timeit.timeit(base, number=number) / number * 1e6)
    return min(fn_us) - min(base_us)


def pieces_us(model: str) -> dict:
    """Microseconds per call of the per-action pieces, each timed alone on the tiny pipeline's second device."""
    from pipeoptim.schedules.actions import Forward
    from pipeoptim.train import Pipeline

    pipe = Pipeline(stages=lambda i: peer._stage(model, i), devices=peer.STAGES, emulate=True,
                    loss_fn=peer._loss(model), optimizer=peer._adamw, schedule="1f1b", policy="none", microbatches=8)
    pipe.train_step(peer._batch(model, 8, 0))
    worker = pipe.workers[1]
    st = next(iter(worker.stages.values()))
    policy, module = st.policy, st.module
    op = next(a for a in worker.plan.actions[1] if isinstance(a, Forward))
    x = peer._batch(model, 8, 0)[0].chunk(8)[0]
    with torch.no_grad():
        h = pipe.workers[0].stages[next(iter(pipe.workers[0].stages))].module(x)

    def scope_cycle():
        with policy.forward(0, s=0, lookahead=0):
            pass
        with policy.backward(0, s=0):
            pass

    def call_cycle():  # what the worker runs
        policy.call_forward(0, 0, 0, _nothing)
        policy.call_backward(0, 0, _nothing)
    inner = module.layers[0]
    each = lambda fn: min(timeit.repeat(fn, number=5000, repeat=5)) / 5000 * 1e6  # noqa: E731
    # (a forward in flight needs grad mode)
    out = {"policy's call_forward + call_backward (the runtime's)": each(call_cycle),
           "policy scopes, one forward + one backward (with forms)": each(scope_cycle)}
    with torch.no_grad():
        out["stage module wrapper (StageModule(stage) - stage)"] = extra_us(lambda: module(h), lambda: inner(h))
        out["one activation's copy (clone)"] = each(lambda: h.clone())
    out["the worker's lookup of an action (_about)"] = each(lambda: worker._about(op))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", choices=["tiny", "gpt"], default="tiny")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=150, help="timed steps of each (default 150)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.microbatches < 1:
        ap.error("--rounds and --microbatches must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    parts = by_part(args.model, args.microbatches, args.rounds, args.warmup)
    ours, staged, calls = parts["ours"], parts["staged"], parts["calls_per_step"]
    actions = calls["forward"] + calls["backward"]
    timer = timer_cost_us()
    timer_ms = timer * sum(calls.values()) / 1e3  # the timed calls' own cost: mostly outside what they time
    lines = [f"# python {' '.join(sys.argv)}", f"# {peer._cpu()}; torch {torch.__version__}; 1 thread",
             f"{args.model} model, emulated 1F1B on {peer.STAGES} devices, N = {args.microbatches}: "
             f"{actions:.0f} forward and backward actions per step. Extra: (pipeoptim - staged) / those actions.",
             "", f"{'part':36} {'pipeoptim ms':>13} {'staged ms':>10} {'extra us per action':>20}"]
    for part, theirs in (("forward", "forward"), ("backward", "backward"), ("step", "step")):
        mine = ours[part] + (ours["sq_norm"] if part == "step" else 0.0)
        label = "optimizer steps + global norm" if part == "step" else f"{part}s"
        lines.append(f"{label:36} {mine:13.3f} {staged[theirs]:10.3f} "
                     f"{1e3 * (mine - staged[theirs]) / actions:20.2f}")
    lines.append(f"{'the rest (loop, copies, frees, ...)':36} {ours['rest']:13.3f} {staged['rest']:10.3f} "
                 f"{1e3 * (ours['rest'] - staged['rest']) / actions:20.2f}")
    own = "  of it, this probe's own timer"
    lines.append(f"{own:36} {timer_ms:13.3f} {'':10} {1e3 * timer_ms / actions:20.2f}   "
                 f"({sum(calls.values()):.0f} timed calls x {timer:.2f} us)")
    lines.append(f"{'the step':36} {ours['total']:13.3f} {staged['total']:10.3f} "
                 f"{1e3 * (ours['total'] - staged['total']) / actions:20.2f}")
    lines += ["", "pieces, each timed alone (us per call):"]
    lines += [f"  {name:56} {us:7.2f}" for name, us in pieces_us(args.model).items()]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
