"""What does AdamW's step cost on a stage's flat buffer against the same parameters one by one, with and without
``pipeoptim.runtime.cpu_memory.keep_freed_memory``?

Why this exists: the pipeline hands torch's optimizer one flat buffer per stage, so AdamW's temporaries are the
stage's size, and glibc maps blocks that large afresh on every step (minor page faults); stepped parameter by
parameter, they are the largest parameter's size and stay in the heap. ``keep_freed_memory`` (applied by every
CPU ``Pipeline``) keeps them. Each configuration runs in a fresh interpreter (the setting is process-wide), one
thread: a GPT stage of ``bench_runtime_peer.py`` (2 Transformer blocks of width ``--width``, 512: 6.3M
parameters) stepped ``--warmup`` times untimed, then ``--steps`` times; the median time and the mean minor page
faults per step.

    python benchmarks/probes/probe_flat_step_faults.py [--steps 20] [--warmup 5] [--width 512]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = [("per parameter", "params", "default"), ("flat buffer", "flat", "default"),
           ("flat buffer, keep_freed_memory", "flat", "reuse")]

_CHILD = """
import json, resource, statistics, sys, time
import torch
from torch import nn
torch.set_num_threads(1)
layout, steps, warmup, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from pipeoptim.runtime.cpu_memory import keep_freed_memory
applied = keep_freed_memory()
torch.manual_seed(0)
layer = lambda: nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)
shapes = [p.shape for _ in range(2) for p in layer().parameters()]
if layout == "flat":
    params = [nn.Parameter(torch.randn(sum(s.numel() for s in shapes)) * 0.02)]
else:
    params = [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = torch.optim.AdamW(params, lr=1e-4)
for _ in range(warmup):
    opt.step()
took, faults = [], 0
for _ in range(steps):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    opt.step()
    took.append(time.perf_counter() - t0)
    faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"ms": statistics.median(took) * 1e3, "faults": faults / steps, "applied": applied,
                  "parameters": sum(p.numel() for p in params)}))
"""


def run_config(layout: str, malloc: str, steps: int, warmup: int, width: int = 512) -> dict:
    env = {**os.environ, "PIPEOPTIM_CPU_MALLOC": malloc}
    out = subprocess.run([sys.executable, "-c", _CHILD, layout, str(steps), str(warmup), str(width)],
                         capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the {layout} / {malloc} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--width", type=int, default=512, help="the blocks' width, a multiple of 8 (default 512)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.width < 8 or args.width % 8:
        ap.error("--width must be a positive multiple of 8 (8 attention heads)")
    for name, layout, malloc in CONFIGS:
        r = run_config(layout, malloc, args.steps, args.warmup, args.width)
        print(f"{name:32} {r['parameters'] / 1e6:.2f}M parameters: {r['ms']:7.2f} ms per step, "
              f"{r['faults']:8.1f} minor page faults per step (setting applied: {r['applied']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
