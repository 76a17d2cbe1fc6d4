"""What weight prediction costs per step, by policy and by swap mechanism, eager vs compiled kernels.

Two questions, two tables (CSV under benchmarks/results/, one row per variant):

1. `predictor_mechanisms.csv` — the weight handling alone on a GPT-style stage of ~63M parameters
   (well past the 260 MiB L3 here): lending ŵ to one forward by each mechanism (swap: predict into a
   buffer and swap storage pointers; pointer: predict and re-point every parameter; inplace: stash,
   predict in place, restore), the optimizer step alone, a step followed by a predict, and the fused
   step+predict. Nominal bytes per parameter (Adam, fp32) give an effective bandwidth.
2. `predictor_policies.csv` — one 1F1B steady-state micro-batch step (forward, backward, optimizer step)
   of a smaller GPT stage under every policy, time relative to `none` (naive async, no prediction) and
   the extra weight memory each policy holds.

The machine is shared and noisy: variants are interleaved round by round (in a rotating order); within a
round each variant keeps its fastest sample (interference only ever adds time), times reported are the
fastest over all rounds, and every ratio is the median of the per-round ratios from the same run.

    python benchmarks/bench_predictor.py                  # both parts, ~2-3 minutes on 2 CPU cores
    python benchmarks/bench_predictor.py --part policies --rounds 5
    python benchmarks/bench_predictor.py --device cuda --mech-layers 24   # on a GPU
"""
from __future__ import annotations

import argparse
import copy
import csv
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pipeoptim.prediction.flat import bind  # noqa: E402
from pipeoptim.policies import make_policy  # noqa: E402
from pipeoptim.prediction.predictor import (Predictor, SavedWeights, available_mechanisms,  # noqa: E402
                                            default_mechanism)

RESULTS = HERE / "results"


class Block(nn.Module):
    """A pre-norm GPT block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def gpt_stage(d: int, layers: int, heads: int) -> nn.Module:
    return nn.Sequential(*[Block(d, heads) for _ in range(layers)])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def clock(fn, device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of fn(). CPU time is less disturbed by other processes
    on a shared machine (it still sees their cache and memory traffic); on a GPU only wall time means much."""
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


# ---- part 1: mechanisms on flat buffers ---------------------------------------------------------------------------


def mechanisms(args, device) -> list[dict]:
    torch.manual_seed(0)
    stage = gpt_stage(args.mech_d, args.mech_layers, 16).to(device)
    n = sum(p.numel() for p in stage.parameters())
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-4, fused=True)
    binding = bind(stage, optimizer)
    saved = SavedWeights(binding)
    with torch.no_grad():
        for g in binding.groups:
            g.grad.normal_(0, 1e-3)
    optimizer.step()  # state exists, predictions are active
    for g in binding.groups:
        g.grad.normal_(0, 1e-3)
    # "swap" needs torch >= 2.12; the default mechanism ("swap", else "pointer") carries the other rows.
    default = default_mechanism()
    preds = {(mech, backend): Predictor(binding, saved, mechanism=mech, backend=backend)
             for mech in available_mechanisms() for backend in ("auto", "eager")}
    def lend(p):
        def run():
            p.invalidate()  # time a real prediction, not the reuse of a cached one
            with p.lend(2.0):
                pass
        return run

    def step():
        optimizer.step()

    def step_then_predict(p):
        def run():
            optimizer.step()
            p.predict(2.0)
        return run

    def fused(p):
        return lambda: p.step_predict(2.0)

    lend_bytes = {"swap": 16, "pointer": 16, "inplace": 32}
    variants = [  # label, function, nominal bytes per parameter (Adam fp32)
        ("optimizer.step (torch fused Adam)", step, 28),
        *[(f"lend: {m}, compiled", lend(preds[m, "auto"]), lend_bytes[m]) for m in available_mechanisms()],
        *[(f"lend: {m}, eager", lend(preds[m, "eager"]), lend_bytes[m]) for m in dict.fromkeys((default, "inplace"))],
        (f"step then predict, compiled ({default})", step_then_predict(preds[default, "auto"]), 44),
        (f"fused step_predict, compiled ({default})", fused(preds[default, "auto"]), 32),
        (f"fused step_predict, eager ({default})", fused(preds[default, "eager"]), 32),
    ]
    wall = {label: [] for label, _, _ in variants}
    cpu = {label: [] for label, _, _ in variants}
    for fn in (v[1] for v in variants):  # warm-up
        fn()
    for r in range(args.rounds):
        for label, fn, _ in rotated(variants, r):
            samples = [clock(fn, device) for _ in range(args.reps)]
            wall[label].append(min(w for w, _ in samples))
            cpu[label].append(min(c for _, c in samples))
    first = variants[0][0]
    rows = []
    for label, _, nbytes in variants:
        t = min(wall[label])
        rows.append({"variant": label, "params": n, "ms": round(t * 1e3, 2),
                     "nominal_B_per_param": nbytes, "GB_per_s": round(nbytes * n / t / 1e9, 2),
                     "ratio_to_step": ratio(wall[label], wall[first]),
                     "cpu_ms": round(min(cpu[label]) * 1e3, 2),
                     "cpu_ratio_to_step": ratio(cpu[label], cpu[first])})
    return rows


def ratio(xs, bases) -> float:
    """Median of per-round ratios (each round's variants ran back to back)."""
    return round(statistics.median(a / b for a, b in zip(xs, bases)), 3)


# ---- part 2: policies in a 1F1B steady state ------------------------------------------------------------------------


def policy_variants() -> list[tuple[str, str, dict]]:
    """label, policy, options; the fused and eager rows use the default mechanism ("swap" from torch 2.12)."""
    default = default_mechanism()
    return [
        ("none", "none", {}),
        ("stash", "stash", {}),
        ("2bw", "2bw", {"update_every": None}),  # m = the micro-batches in flight
        ("spectrain", "spectrain", {}),
        *[(f"pipeoptim {m}", "pipeoptim", {"mechanism": m, "fused": False}) for m in available_mechanisms()],
        (f"pipeoptim {default}+fused", "pipeoptim", {"mechanism": default, "fused": True}),
        (f"pipeoptim {default} eager", "pipeoptim", {"mechanism": default, "fused": False, "backend": "eager"}),
        (f"pipeoptim {default}+fused eager", "pipeoptim", {"mechanism": default, "fused": True, "backend": "eager"}),
    ]


class Timed:
    """Runs one policy through 1F1B micro-batch steps and times the whole step and the policy's own calls."""

    def __init__(self, label, name, options, stage, args, device):
        self.label = label
        self.stage = copy.deepcopy(stage)
        self.optimizer = torch.optim.Adam(self.stage.parameters(), lr=1e-4, fused=True)
        depth = args.stages - args.stage  # micro-batches in flight on this stage
        options = {k: (depth if v is None else v) for k, v in options.items()}
        self.policy = make_policy(name, self.stage, self.optimizer, **options)
        self.depth, self.device, self.args = depth, device, args
        k, d = args.stage, args.stages
        self.s_fwd = (k // 2 + d - k - 1) if name == "spectrain" else d - k - 1
        self.s_bwd = k // 2 if name == "spectrain" else 0
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.mb, self.flights = 0, {}

    def _input(self):
        a = self.args
        return torch.randn(a.batch, a.seq, a.d, generator=self.gen).to(self.device).requires_grad_(True)

    def forward(self, s):
        t0 = time.perf_counter()
        cm = self.policy.forward(self.mb, s=s)
        cm.__enter__()
        t1 = time.perf_counter()
        y = self.stage(self._input())
        t2 = time.perf_counter()
        cm.__exit__(None, None, None)
        self.flights[self.mb] = y
        self.mb += 1
        return (t1 - t0) + (time.perf_counter() - t2)

    def backward(self):
        mb = min(self.flights)
        y = self.flights.pop(mb)
        t0 = time.perf_counter()
        cm = self.policy.backward(mb, s=self.s_bwd)
        cm.__enter__()
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y) / y.numel())
        t2 = time.perf_counter()
        cm.__exit__(None, None, None)
        if self.policy.should_step():
            self.policy.step(next_s=self.s_fwd)
        return (t1 - t0) + (time.perf_counter() - t2)

    def round(self, steps) -> tuple[float, float]:
        """Warm-up forwards, `steps` timed steady-state steps (1 forward + 1 backward + step), drain."""
        for j in range(self.depth - 1):
            self.forward(min(j, self.s_fwd))
        totals, cpus, policy_times = [], [], []
        for _ in range(steps):
            (wall, cpu), = [clock(lambda: policy_times.append(self.forward(self.s_fwd) + self.backward()),
                                  self.device)]
            totals.append(wall)
            cpus.append(cpu)
        while self.flights:
            self.backward()
        if self.policy.in_flight == () and self.policy._backwards:
            self.policy.step()
        return min(totals), min(cpus), min(policy_times)


def policies(args, device) -> list[dict]:
    torch.manual_seed(0)
    stage = gpt_stage(args.d, args.layers, args.heads).to(device)
    n = sum(p.numel() for p in stage.parameters())
    runs = [Timed(label, name, opts, stage, args, device) for label, name, opts in policy_variants()]
    for r in runs:  # warm-up: a few steps so that every optimizer has state
        r.round(2)
    totals = {r.label: [] for r in runs}
    cpus = {r.label: [] for r in runs}
    own = {r.label: [] for r in runs}
    for i in range(args.rounds):
        for r in rotated(runs, i):
            total, cpu, mine = r.round(args.steps)
            totals[r.label].append(total)
            cpus[r.label].append(cpu)
            own[r.label].append(mine)
    rows = []
    base_own = own["none"]
    weight_bytes = n * 4
    for r in runs:
        t = min(totals[r.label])
        rows.append({
            "policy": r.label, "params": n, "step_ms": round(t * 1e3, 2),
            "ratio_to_none": ratio(totals[r.label], totals["none"]),
            "cpu_ratio_to_none": ratio(cpus[r.label], cpus["none"]),
            "policy_ms": round(min(own[r.label]) * 1e3, 2),
            "overhead_ms_vs_none": round(statistics.median(a - b for a, b in zip(own[r.label], base_own)) * 1e3, 2),
            "extra_bytes": r.policy.extra_weight_bytes(),
            "extra_vs_weights": round(r.policy.extra_weight_bytes() / weight_bytes, 3),
        })
    return rows


def rotated(items, k):
    """The variants in round k's order: rotated, so that no variant always runs right after the same one."""
    k %= len(items)
    return items[k:] + items[:k]


def write(rows, name, command, out_dir=RESULTS):
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    with path.open("w", newline="") as f:
        f.write(f"# {command}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def show(rows):
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("all", "mechanisms", "policies"), default="all")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (ratios are medians over rounds)")
    ap.add_argument("--reps", type=int, default=2, help="mechanisms: calls per variant per round")
    ap.add_argument("--mech-d", type=int, default=1024, help="mechanisms: model width")
    ap.add_argument("--mech-layers", type=int, default=5, help="mechanisms: GPT blocks (12.6M params each at 1024)")
    ap.add_argument("--d", type=int, default=512, help="policies: model width")
    ap.add_argument("--layers", type=int, default=2, help="policies: GPT blocks in the stage")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size")
    ap.add_argument("--steps", type=int, default=2, help="policies: timed steps per round")
    ap.add_argument("--stages", type=int, default=4, help="pipeline depth D")
    ap.add_argument("--stage", type=int, default=2, help="this stage's index k (D-k micro-batches in flight)")
    ap.add_argument("--out-dir", default=str(RESULTS), help="where the CSV files go (default benchmarks/results)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0: torch's default); 1 is steadier when other jobs share the cores")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 <= args.stage < args.stages:
        ap.error("--stage must be in [0, --stages)")
    device = torch.device(args.device)
    command = "python benchmarks/bench_predictor.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(command.strip())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    if args.part in ("all", "mechanisms"):
        rows = mechanisms(args, device)
        print(f"\nweight handling on a {rows[0]['params'] / 1e6:.1f}M-parameter GPT stage (Adam, fp32)")
        show(rows)
        print("->", write(rows, "predictor_mechanisms.csv", command, Path(args.out_dir)))
    if args.part in ("all", "policies"):
        rows = policies(args, device)
        print(f"\n1F1B micro-batch step on a {rows[0]['params'] / 1e6:.1f}M-parameter GPT stage, stage "
              f"{args.stage} of {args.stages} ({args.stages - args.stage} in flight), Adam")
        show(rows)
        print("->", write(rows, "predictor_policies.csv", command, Path(args.out_dir)))
    print("\ncommand:", command.strip())


if __name__ == "__main__":
    main()
