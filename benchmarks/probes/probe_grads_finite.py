"""What does an asynchronous step's finiteness check cost on a stage's flat gradient buffer?

Why this exists: an asynchronous schedule without clipping skips a step whose gradient holds an inf or a NaN
(``DeviceWorker.grads_finite``), so every step reads the whole gradient once more. Summing it in float64 made
a float64 copy of the buffer (8 bytes written and read per element on top of the 4 read; on the CPU a block that
size is also mapped afresh); a float32 sum reads the 4 bytes and nothing else, and only a sum that is not
finite is redone in float64. For scale, the same process times torch's AdamW step on the same buffer (as the
pipeline hands it over: the stage's parameters as views of one flat buffer) and a plain ``sum`` of it, the
memory floor of any check that reads every element (4 bytes per element).

One thread, with ``pipeoptim.runtime.cpu_memory.keep_freed_memory`` applied as every CPU ``Pipeline`` applies it; each
size is a stage of ``bench_runtime_peer.py``: the tiny model's (2 x Linear(64, 64)) and the GPT's (2 Transformer
blocks of width 512). Medians of ``--repeats`` calls after ``--warmup`` untimed ones.

    python benchmarks/probes/probe_grads_finite.py [--repeats 20] [--warmup 3] [--width 512]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from torch import nn

CHECKS = {
    "float64 sum (before)": lambda g: math.isfinite(float(g.sum(dtype=torch.float64))),
    "float32 sum, float64 if not finite (now)": lambda g: math.isfinite(float(g.sum(dtype=torch.float32)))
    or math.isfinite(float(g.sum(dtype=torch.float64))),
}


def stage_shapes(model: str, width: int) -> list[torch.Size]:
    if model == "tiny":
        return [p.shape for _ in range(2) for p in nn.Linear(64, 64).parameters()]
    layer = lambda: nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)  # noqa: E731
    return [p.shape for _ in range(2) for p in layer().parameters()]


def _median_us(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e6


def measure(model: str, repeats: int, warmup: int, width: int = 512) -> dict:
    """Per check, microseconds per call; also AdamW's step and a plain sum over the same buffer."""
    shapes = stage_shapes(model, width)
    n = sum(s.numel() for s in shapes)
    torch.manual_seed(0)
    flat = torch.randn(n) * 0.02
    grad = torch.randn(n) * 1e-3
    views, grads, at = [], [], 0
    for s in shapes:
        views.append(nn.Parameter(flat[at:at + s.numel()].view(s)))
        grads.append(grad[at:at + s.numel()].view(s))
        at += s.numel()
    for p, g in zip(views, grads):
        p.grad = g
    out = {"parameters": n}
    for name, check in CHECKS.items():
        assert check(grad)
        out[name] = _median_us(lambda: check(grad), repeats, warmup)
    out["plain float32 sum (floor)"] = _median_us(lambda: float(grad.sum()), repeats, warmup)
    opt = torch.optim.AdamW(views, lr=1e-4)
    out["AdamW step (scale)"] = _median_us(opt.step, repeats, warmup)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    ap.add_argument("--width", type=int, default=512, help="the GPT blocks' width, a multiple of 8 (default 512)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if args.width < 8 or args.width % 8:
        ap.error("--width must be a positive multiple of 8 (8 attention heads)")
    from pipeoptim.runtime.cpu_memory import keep_freed_memory
    torch.set_num_threads(1)
    applied = keep_freed_memory()
    print(f"# one thread; keep_freed_memory applied: {applied}")
    for model in ("tiny", "gpt"):
        r = measure(model, args.repeats, args.warmup, args.width)
        print(f"{model} stage, {r.pop('parameters') / 1e6:.4f}M parameters:", flush=True)
        for name, us in r.items():
            print(f"  {name:42} {us:10.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
