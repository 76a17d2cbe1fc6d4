"""How far torch's fused Adam's second moment lies from the float64 update rule, beside ours.

Why this exists: tests/gpu compares our fused step with torch.optim's own step on the GPU. On the H200 (torch
2.11) the first run failed for every fused case and none of the foreach ones: torch's fused CUDA Adam casts β2
to float32 before it forms 1 − β2, so its v = β2·v + (1 − β2)·g² is 1.3e-5 relatively off the rule at
β2 = 0.999 and 1.7e-4 at 0.9999, where torch's foreach Adam, its CPU fused Adam and our kernels are within a few
float32 ulps. This probe prints, for one step from v = 0, the worst and median relative error of each against
the float64 rule (relative to the magnitude of the terms, as tests/kernel_reference.assert_second_moment_close
measures it), so that the comparison the GPU test makes can be read and repeated.

    python benchmarks/probes/probe_fused_adam_second_moment.py --device cuda   # the GPU run's numbers
    python benchmarks/probes/probe_fused_adam_second_moment.py --device cpu  # the same on the CPU (fused: exact there)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
import pipeoptim_kernels as pk  # noqa: E402
from kernel_reference import reference_second_moment, second_moment_scale  # noqa: E402

CASES = [("adam", "Adam", dict(lr=1e-2, weight_decay=0.1)),
         ("adam", "Adam", dict(lr=1e-3, betas=(0.95, 0.9999))),
         ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True))]


def relative_error(v: torch.Tensor, v_ref: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|v − v_ref| over the terms' magnitude, NaN counted as infinitely off."""
    return ((v.double().cpu() - v_ref).abs() / scale).nan_to_num(nan=float("inf"))


def probe(device: str, n: int, seed: int) -> list[dict]:
    rows = []
    ours = [b for b in (("cuda", "triton") if device == "cuda" else ("cpu",)) if b in pk.available_backends()]
    for rule, cls, hp in CASES:
        gen = torch.Generator().manual_seed(seed)
        w0, g = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
        v_ref, _ = reference_second_moment(torch.zeros(n), g, w0, hp, rule)
        scale = second_moment_scale(torch.zeros(n), g, w0, hp, rule)
        for impl in ("fused", "foreach"):
            p = torch.nn.Parameter(w0.clone())
            opt = getattr(torch.optim, cls)([p], **hp, **{impl: True})
            p.grad = g.clone()
            opt.step()
            rel = relative_error(opt.state[p]["exp_avg_sq"], v_ref, scale)
            rows.append(dict(case=f"{cls} {hp}", who=f"torch {impl}", worst=rel.max().item(),
                             median=rel.median().item()))
        group = dict(opt.param_groups[0])
        for backend in ours:
            w = w0.clone()
            st = {k: torch.zeros(n, device=device) for k in ("exp_avg", "exp_avg_sq")}
            if hp.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros(n, device=device)
            out = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)
            pk.step_predict(rule, w, g, st, group, step=0, s=2, out=out, backend=backend)
            rel = relative_error(st["exp_avg_sq"], v_ref, scale)
            rows.append(dict(case=f"{cls} {hp}", who=f"pipeoptim {backend}", worst=rel.max().item(),
                             median=rel.median().item()))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--n", type=int, default=(1 << 20) + 3, help="elements (default 2^20 + 3: an odd tail)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch sees no GPU: run with --device cpu, or on the GPU machine")
    eps = torch.finfo(torch.float32).eps
    print(f"v = β2·v + (1 − β2)·g² after one step from v = 0, {args.n} elements on {args.device}, torch "
          f"{torch.__version__}: relative error against the float64 rule (float32 eps = {eps:.2e})")
    print(f"{'case':<58} {'who':<18} {'worst':>10} {'median':>10}")
    for r in probe(args.device, args.n, args.seed):
        print(f"{r['case']:<58} {r['who']:<18} {r['worst']:>10.3e} {r['median']:>10.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
