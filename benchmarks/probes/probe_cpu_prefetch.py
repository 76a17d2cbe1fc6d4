"""Does the cpu backend reach the memory floor of its access pattern here, and what does software prefetch add?

Why this exists: issue 23 measured in-place Adam predict on an AVX2-only AMD EPYC at 0.79-0.91x the speed of
``addcmul_`` on the same three buffers (reads w, m, v; writes w back: 16 B per element, no arithmetic to speak
of), where AVX-512 Xeons ran it at 0.93-0.94x. The predict loop does a square root and a division per element;
on that EPYC the hardware prefetchers alone did not keep three input streams ahead of the loop, and asking for
each input's line some distance early closed the gap. The cpu backend now prefetches by default with the
distance its instruction set's loops were measured best with (``cpu_prefetch_bytes``; ``set_cpu_prefetch`` and
``PIPEOPTIM_CPU_PREFETCH`` change it).

Each round times every variant once, back to back, in a fixed order: the kernels with the given prefetch
distances (0 = off), ``addcmul_`` with in-place predict's traffic, and torch's fused Adam step on one flat
tensor (its best case, 28 B per element). Machines shared with other tenants move a call's time by up to 2x
from round to round, so the ratios are paired: the median over rounds of one variant's time over another's in
the same round, with a 90 % bootstrap interval (``bench_runtime_peer.paired_ratio``).

    python benchmarks/probes/probe_cpu_prefetch.py [--sizes 8M,64M] [--rounds 41] [--prefetch 0,default,256,2048]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(HERE.parent))

import pipeoptim_kernels as pk  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_runtime_peer", HERE / "bench_runtime_peer.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)
_kernels_spec = importlib.util.spec_from_file_location("bench_kernels", HERE / "bench_kernels.py")
bench_kernels = importlib.util.module_from_spec(_kernels_spec)
_kernels_spec.loader.exec_module(bench_kernels)

FLOOR, FUSED = "addcmul_ (in place's traffic, 16 B)", "torch fused Adam step (28 B)"


def with_prefetch(nbytes: int, fn):
    """fn run with the cpu backend prefetching nbytes ahead (-1: its instruction set's default)."""
    return bench_kernels.with_cpu_setting("set_cpu_prefetch", nbytes, fn)


def variants(n: int, distances: list[int]) -> dict:
    """name -> call, over fresh buffers of n float32 elements (Adam state as after 10 steps)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g)
    state = {"exp_avg": torch.randn(n, generator=g) * 1e-3, "exp_avg_sq": torch.rand(n, generator=g) * 1e-6}
    grad = torch.randn(n, generator=g) * 1e-3
    group = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3).param_groups[0]
    scratch, out, w_step = w.clone(), torch.empty_like(w), w.clone()
    step_state = {k: v.clone() for k, v in state.items()}
    flat = torch.nn.Parameter(w.clone())
    flat.grad = grad
    fused = torch.optim.Adam([flat], lr=1e-3, fused=True)
    fused.state[flat] = {"step": torch.tensor(10.0), **{k: v.clone() for k, v in state.items()}}
    kernels = {
        "in-place predict": lambda: pk.predict("adam", scratch, state, group, step=10, s=3, out=scratch,
                                               backend="cpu"),
        "predict into a separate buffer": lambda: pk.predict("adam", w, state, group, step=10, s=3, out=out,
                                                             backend="cpu"),
        "step+predict": lambda: pk.step_predict("adam", w_step, grad, step_state, group, step=10, s=3, out=out,
                                                backend="cpu"),
    }
    calls = {f"{name}, prefetch {label(d)}": with_prefetch(d, fn) for name, fn in kernels.items() for d in distances}
    calls[FLOOR] = lambda: scratch.addcmul_(state["exp_avg"], state["exp_avg_sq"], value=1e-30)
    calls[FUSED] = fused.step
    return calls


def label(distance: int) -> str:
    if distance == -1:
        return f"default ({pk.compiled.load().cpu_isa()}: {default_bytes()} B)"
    return "off" if distance == 0 else f"{distance} B"


def default_bytes() -> int:
    module = pk.compiled.load()
    previous = module.set_cpu_prefetch(-1)
    try:
        return module.cpu_prefetch_bytes()
    finally:
        module.set_cpu_prefetch(previous)


def measure(n: int, distances: list[int], rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    calls = variants(n, distances)
    times = {name: [] for name in calls}
    for r in range(warmup + rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(took)
    return times


def report(n: int, times: dict[str, list[float]], distances: list[int]) -> list[str]:
    lines = [f"{bench_kernels.size_label(n)} float32 elements; median ms over rounds, then paired ratios "
             f"(median of per-round ratios, 90 % bootstrap interval):"]
    for name, ts in times.items():
        lines.append(f"  {name:66} {statistics.median(ts) * 1e3:9.3f} ms")

    def paired(a: str, b: str) -> str:
        med, lo, hi = peer.paired_ratio(times[a], times[b])
        return f"{med:.3f} ({lo:.3f}-{hi:.3f})"

    for d in distances:
        p = f", prefetch {label(d)}"
        lines.append(f"  prefetch {label(d)}:")
        lines.append(f"    in-place predict's speed / addcmul_'s (the same traffic; 1.0 = the floor): "
                     f"{paired(FLOOR, 'in-place predict' + p)}")
        lines.append(f"    predict into a separate buffer / fused Adam step (time; 16/28 = 0.571 the bytes' ratio): "
                     f"{paired('predict into a separate buffer' + p, FUSED)}")
        lines.append(f"    step+predict / fused Adam step (time; 32/28 = 1.143 the bytes' ratio): "
                     f"{paired('step+predict' + p, FUSED)}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="8M,64M", help="comma list of buffer lengths (default 8M,64M)")
    ap.add_argument("--rounds", type=int, default=41, help="timed rounds (default 41)")
    ap.add_argument("--prefetch", default="0,default",
                    help="comma list of prefetch distances in bytes, 0 = off, 'default' = the instruction set's "
                         "(default: 0,default)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    if "cpu" not in pk.available_backends():
        ap.error("the cpu backend is not built: run `bash scripts/install.sh` first")
    try:
        sizes = [bench_kernels.parse_size(s) for s in args.sizes.split(",")]
        distances = [-1 if d.strip() == "default" else int(d) for d in args.prefetch.split(",")]
    except ValueError as e:
        ap.error(f"--sizes takes sizes like 8M,64M and --prefetch numbers of bytes or 'default': {e}")
    if args.rounds < 3 or any(d < -1 or d > 1 << 20 for d in distances):
        ap.error("--rounds must be >= 3 and each --prefetch distance from 0 to 1048576 bytes, or 'default'")
    command = "python benchmarks/probes/probe_cpu_prefetch.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# {command}", f"# {peer._cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"cpu isa {pk.compiled.cpu_isa()}, rounds {args.rounds}"]
    print("\n".join(lines), flush=True)
    for n in sizes:
        block = report(n, measure(n, distances, args.rounds), distances)
        print("\n".join(block), flush=True)
        lines += block
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
