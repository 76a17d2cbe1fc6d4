"""Kernel benchmark: fused prediction against per-tensor eager, torch._foreach and the copy bandwidth.

Every variant runs on the same parameters, laid out as a GPT-2-style model's parameter list (views into
one flat buffer), interleaved round by round so that load on this shared machine hits all of them
alike. The reported time is each variant's median over the rounds, with the fastest and slowest round
beside it; every ratio is a ratio of two printed medians (so a reader can check it against the times),
with the lowest and highest ratio of the two variants within one round beside it (how far load on the
machine moved it). Below 8M parameters a round times several calls of a variant in a row, so that each
is measured on its own warm buffers.

    python benchmarks/bench_kernels.py                       # CPU, all rules, 1M / 8M / 64M parameters
    python benchmarks/bench_kernels.py --sizes 64M,256M --rules adam
    python benchmarks/bench_kernels.py --device cuda --sizes 256M,1G --rules adam,sgd   # on a GPU
    python benchmarks/bench_kernels.py --device cpu --quick --out /tmp/k.csv            # seconds: a dry run
    python benchmarks/bench_kernels.py --replot benchmarks/results/kernels_cpu.csv       # its picture, redrawn

Output goes to a fresh folder, runs/bench_kernels/<date-time>/kernels_<device>.csv and .png, unless --out
names the CSV (the committed results are benchmarks/results/kernels_cpu*.csv: name one to replace it).

On a GPU each round times several back-to-back calls of a variant between two CUDA events, after
writing over a scratch buffer twice the L2's size (so no variant starts on another's cached lines);
data is made on the GPU. The yardsticks there: the copy bandwidth, torch's fused and foreach Adam
steps over the parameter list (what a training loop runs) and over one flat tensor, and a per-tensor
loop of plain torch ops (no argument checks of ours, which a GPU would otherwise wait on). Rows are
appended to the CSV as each rule and size finishes, so a run cut short keeps what it measured.

Bytes per element are the minimal traffic of one pass, and GB/s is counted at them: predict reads w and
the state entries the rule uses and writes ŵ (Adam: 4+4+4 read, 4 written = 16 B; into a separate buffer
the CPU also reads the output lines before writing them, 4 B more that the minimal count leaves out,
unless it streams the stores); Adam step+predict reads w, g, m, v and writes w, m, v, ŵ = 32 B (ŵ may go
over the spent gradient: same count, but then every write lands on a line just read); torch's fused
Adam step is 28 B; copy is 8 B (on the CPU it moves 12: the destination line is read before it is
written, so a kernel can show more GB/s than copy_ without beating the memory). The floor for a kernel
is its bytes over the best rate this machine's memory sustains; the same run measures the best
candidates for that rate: torch's fused Adam step, and addcmul_ with in-place Adam predict's exact
traffic.

On the CPU, the cpu backend writes a separate output with streaming stores when the op's buffers are
larger than the last-level cache (the auto mode users get); the "ordinary stores" rows force them off,
so the table shows what skipping the output's read-for-ownership is worth on this machine. The "no
prefetch" rows turn the cpu backend's software prefetch off (its distance, per instruction set, is in the
header; 0 means those rows time the same code), so a run shows what it is worth on the machine it runs on.
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import pipeoptim_kernels as pk  # noqa: E402
from pipeoptim_kernels import rules  # noqa: E402

RUNS = HERE.parent / "runs" / "bench_kernels"
FUSED = "torch fused Adam step"
CPU_PREDICT_TARGET, CPU_STEP_TARGET = 16 / 28, 1.15   # the CPU targets, as times / the fused Adam step

HYPER = {
    "sgd": ("SGD", dict(lr=0.05, momentum=0.9)),
    "adam": ("Adam", dict(lr=1e-3)),
    "adamw": ("AdamW", dict(lr=1e-3, weight_decay=0.01)),
    "rmsprop": ("RMSprop", dict(lr=1e-3, centered=True)),
    "adagrad": ("Adagrad", dict(lr=1e-2)),
    "adamax": ("Adamax", dict(lr=2e-3)),
    "nadam": ("NAdam", dict(lr=2e-3)),
    "radam": ("RAdam", dict(lr=1e-3)),
}


def gpt2_shapes(numel: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-style stack (d_model 1024) with about `numel` parameters."""
    d = 1024 if numel >= 16 * 1024 * 1024 else 256
    layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    per_layer = sum(math.prod(s) for s in layer)
    shapes = []
    while sum(math.prod(s) for s in shapes) + per_layer <= numel:
        shapes += layer
    rest = numel - sum(math.prod(s) for s in shapes)
    if rest:
        shapes.append((rest,))  # an embedding-like remainder
    return shapes


def size_label(n: int) -> str:
    return f"{n / 2**20:.0f}M" if n >= 1 << 20 else f"{n / 2**10:.0f}K"


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


class Buffers:
    """Flat w, grad, out and state for one rule, plus per-parameter views of each."""

    def __init__(self, rule: str, n: int, device: str, shapes):
        gen = torch.Generator(device=device).manual_seed(0)  # made where it is used: no host-to-GPU copies
        self.n = n
        self.w = torch.randn(n, generator=gen, device=device)
        self.grad = torch.randn(n, generator=gen, device=device) * 1e-2
        self.out = torch.empty(n, device=device)
        self.scratch = self.w.clone()
        cls, hp = HYPER[rule]
        self.group = {"lr": hp["lr"], **_defaults(cls, hp)}
        self.state = {}
        for name in rules.STATE_ENTRIES[rule]:
            if name == "mu_product":
                self.state[name] = torch.tensor(0.5)
            elif name == "grad":
                self.state[name] = self.grad
            elif name in ("exp_avg", "momentum_buffer", "grad_avg"):
                self.state[name] = torch.randn(n, generator=gen, device=device) * 1e-2
            else:
                self.state[name] = (torch.rand(n, generator=gen, device=device) + 0.5) * 1e-4
        self.shapes = shapes

    def views(self, t: torch.Tensor) -> list[torch.Tensor]:
        out, off = [], 0
        for s in self.shapes:
            k = math.prod(s)
            out.append(t[off:off + k])
            off += k
        return out


def _defaults(cls: str, hp: dict) -> dict:
    p = torch.nn.Parameter(torch.zeros(1))
    group = getattr(torch.optim, cls)([p], **hp).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def foreach_predict(plan: rules.PredictPlan, ws, outs, views) -> None:
    """The plan's formula with torch._foreach ops over the parameter list (what a foreach optimizer does)."""
    num = torch._foreach_mul(ws, plan.cw) if plan.cw else None
    for t, c in ((plan.m, plan.cm), (plan.g, plan.cg)):
        if t is not None:
            term = torch._foreach_mul(views[id(t)], c)
            num = term if num is None else torch._foreach_add(num, term)
    if plan.den == rules.DEN_SQRT:
        var = views[id(plan.v)]
        if plan.vc is not None:
            var = torch._foreach_sub(var, torch._foreach_mul(views[id(plan.vc)], views[id(plan.vc)]))
        den = torch._foreach_sqrt(var)
        torch._foreach_mul_(den, plan.dscale)
        torch._foreach_add_(den, plan.eps)
        num = torch._foreach_div(num, den)
    elif plan.den == rules.DEN_LINEAR:
        num = torch._foreach_div(num, views[id(plan.v)])
    if plan.lam:
        torch._foreach_add_(num, ws, alpha=plan.lam)
    torch._foreach_mul_(num, -plan.scale)
    torch._foreach_add_(num, ws)
    torch._foreach_copy_(outs, num)


def plain_predict(plan: rules.PredictPlan, w, out, m=None, g=None, v=None, vc=None) -> None:
    """The plan's formula on one tensor with plain torch ops: what a per-tensor loop without our checks costs."""
    num = w * plan.cw if plan.cw else torch.zeros_like(w)
    if m is not None:
        num = num.add_(m, alpha=plan.cm)
    if g is not None:
        num = num.add_(g, alpha=plan.cg)
    if plan.den == rules.DEN_SQRT:
        var = v if vc is None else v - vc * vc
        num = num.div_(var.sqrt().mul_(plan.dscale).add_(plan.eps))
    elif plan.den == rules.DEN_LINEAR:
        num = num.div_(v)
    if plan.lam:
        num = num.add_(w, alpha=plan.lam)
    torch.add(w, num, alpha=-plan.scale, out=out)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_variants(variants: dict, device: str, rounds: int, repeats: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant in each round, running them round-robin. With repeats > 1 (buffers
    that fit in the cache, or always on a GPU), a round makes one untimed call and then times `repeats`
    calls in a row, so a variant is not charged for the previous one's evictions or for waking the
    threads; on a GPU between CUDA events, after flushing the L2."""
    for fn in variants.values():  # warm-up (JIT, page faults, caches)
        fn()
    sync(device)
    times = {k: [] for k in variants}
    flush = l2_flusher(device)
    for _ in range(rounds):
        for name, fn in variants.items():
            if repeats > 1:
                fn()
            if device == "cuda":
                flush()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / repeats)
                continue
            sync(device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            sync(device)
            times[name].append((time.perf_counter() - t0) / repeats)
    return times


def l2_flusher(device: str):
    """A function that overwrites twice the GPU's L2 (60 MB on an H200) with zeros; a no-op on the CPU."""
    if device != "cuda":
        return lambda: None
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 64 << 20)
    scratch = torch.empty(max(2 * l2, 1 << 20) // 4, device=device)
    return scratch.zero_


def ratio(times: dict[str, list[float]], name: str, base: str) -> tuple[float, float, float]:
    """(median time of name / median time of base, lowest and highest ratio of the two within one round).

    The first is what a reader can check against the medians printed; the range says how far load on
    the machine moved it (each round times the two close together)."""
    per_round = [a / b for a, b in zip(times[name], times[base])]
    return statistics.median(times[name]) / statistics.median(times[base]), min(per_round), max(per_round)


def with_cpu_setting(setter: str, value, fn):
    """fn run with one of the cpu backend's run-time settings (``set_cpu_stream``, ``set_cpu_prefetch``) at value,
    restored afterwards."""
    def run():
        set_ = getattr(pk.compiled.load(), setter)
        previous = set_(value)
        try:
            fn()
        finally:
            set_(previous)
    return run


def ordinary_stores(fn):
    """fn run with the cpu backend's streaming stores turned off."""
    return with_cpu_setting("set_cpu_stream", 0, fn)


def no_prefetch(fn):
    """fn run with the cpu backend's software prefetch turned off."""
    return with_cpu_setting("set_cpu_prefetch", 0, fn)


def predict_bytes(plan: rules.PredictPlan) -> int:
    return 4 * (1 + len(plan.tensors())) + 4


def bench_rule(rule: str, n: int, device: str, rounds: int, compiled_backend: str, repeats: int = 1,
               gpu_rows: bool = False) -> list[dict]:
    """Every variant's row for `rule` at n parameters, each round timing `repeats` calls in a row.
    gpu_rows: the rows of a GPU run (bf16 out, Triton, torch's Adam over the parameter list), which a
    --quick run on the CPU adds to try them out."""
    gpu_rows = gpu_rows or device == "cuda"
    shapes = gpt2_shapes(n)
    b = Buffers(rule, n, device, shapes)
    step, s = 10, 3
    plan = rules.predict_plan(rule, b.state, b.group, step, s, "exact")
    ws, outs = b.views(b.w), b.views(b.out)
    views = {id(t): b.views(t) for t in plan.tensors().values()}
    state_views = {k: (b.views(v) if v.dim() else None) for k, v in b.state.items()}
    per_state = [{k: (state_views[k][i] if state_views[k] is not None else b.state[k]) for k in b.state}
                 for i in range(len(shapes))]
    copy_src = b.w

    def per_tensor():
        for i in range(len(shapes)):
            pk.predict(rule, ws[i], per_state[i], b.group, step=step, s=s, out=outs[i], backend="eager")

    plan_views = {k: views.get(id(t)) for k, t in (("m", plan.m), ("g", plan.g), ("v", plan.v), ("vc", plan.vc))
                  if t is not None}

    def torch_loop():
        for i in range(len(shapes)):
            plain_predict(plan, ws[i], outs[i], **{k: v[i] for k, v in plan_views.items()})

    variants = {
        "copy": lambda: b.out.copy_(copy_src),
        "per-tensor eager": per_tensor,
        "per-tensor torch loop": torch_loop,
        "foreach": lambda: foreach_predict(plan, ws, outs, views),
        "flat eager": lambda: pk.predict(rule, b.w, b.state, b.group, step=step, s=s, out=b.out, backend="eager"),
        compiled_backend: lambda: pk.predict(rule, b.w, b.state, b.group, step=step, s=s, out=b.out,
                                             backend=compiled_backend),
        # in place into a scratch copy of w (writes land on lines just read: no read-for-ownership)
        f"{compiled_backend} in place": lambda: pk.predict(rule, b.scratch, b.state, b.group, step=step, s=s,
                                                           out=b.scratch, backend=compiled_backend),
    }
    if device == "cpu":
        variants["cpu ordinary stores"] = ordinary_stores(variants[compiled_backend])
        variants["cpu no prefetch"] = no_prefetch(variants[compiled_backend])
        variants["cpu in place, no prefetch"] = no_prefetch(variants["cpu in place"])
    if gpu_rows:
        out_bf16 = torch.empty(n, device=device, dtype=torch.bfloat16)
        variants[f"{compiled_backend} bf16 out"] = lambda: pk.predict(rule, b.w, b.state, b.group, step=step, s=s,
                                                                      out=out_bf16, backend=compiled_backend)
        if "triton" in pk.available_backends():
            variants["triton"] = lambda: pk.predict(rule, b.w, b.state, b.group, step=step, s=s, out=b.out,
                                                    backend="triton")
    if rule == "adam":
        # torch's fused Adam on one flat parameter: its best case (over a list of ~800 tensors its CPU
        # kernel was 10x slower here), so the yardstick is as strong as it gets.
        flat = torch.nn.Parameter(b.w.clone())
        flat.grad = b.grad
        fused = torch.optim.Adam([flat], lr=1e-3, fused=True)
        fused.state[flat] = {"step": torch.tensor(10.0, device=device), "exp_avg": b.state["exp_avg"].clone(),
                             "exp_avg_sq": b.state["exp_avg_sq"].clone()}
        st = {"exp_avg": b.state["exp_avg"].clone(), "exp_avg_sq": b.state["exp_avg_sq"].clone()}
        variants["torch fused Adam step"] = fused.step
        variants[f"{compiled_backend} step+predict"] = lambda: pk.step_predict(
            "adam", b.w, b.grad, st, b.group, step=step, s=s, out=b.out, backend=compiled_backend)
        if device == "cpu":
            variants["cpu step+predict ordinary stores"] = ordinary_stores(variants["cpu step+predict"])
            variants["cpu step+predict, no prefetch"] = no_prefetch(variants["cpu step+predict"])
        # ŵ written over the gradient, which the step has finished reading (its own copy: it is consumed).
        spent_grad = b.grad.clone()
        variants[f"{compiled_backend} step+predict, ŵ over grad"] = lambda: pk.step_predict(
            "adam", b.w, spent_grad, st, b.group, step=step, s=s, out=spent_grad, backend=compiled_backend)

        fused_state = {k: fused.state[flat][k] for k in ("exp_avg", "exp_avg_sq")}

        def fused_step_then_predict():
            fused.step()
            pk.predict("adam", flat.detach(), fused_state, b.group, step=step, s=s, out=b.out, backend=compiled_backend)
        variants["torch fused Adam step + predict"] = fused_step_then_predict
        if gpu_rows:  # what a training loop runs: the optimizer over the parameter list
            for impl in ("fused", "foreach"):
                params = [torch.nn.Parameter(t) for t in b.views(b.w.clone())]
                for p, gv in zip(params, b.views(b.grad)):
                    p.grad = gv
                opt = torch.optim.Adam(params, lr=1e-3, **{impl: True})
                for p, m, v in zip(params, b.views(b.state["exp_avg"].clone()), b.views(b.state["exp_avg_sq"].clone())):
                    opt.state[p] = {"step": torch.tensor(10.0, device=device), "exp_avg": m, "exp_avg_sq": v}
                variants[f"torch {impl} Adam step, parameter list"] = opt.step
            if "triton" in pk.available_backends():
                st_triton = {k: v.clone() for k, v in st.items()}
                variants["triton step+predict"] = lambda: pk.step_predict(
                    "adam", b.w, b.grad, st_triton, b.group, step=step, s=s, out=b.out, backend="triton")
        # A plain torch op with in-place Adam predict's memory traffic (reads w, m, v; writes w back): the
        # floor this machine's memory sets for that access pattern, measured in the same run.
        variants["addcmul_ (same traffic as in place)"] = lambda: b.scratch.addcmul_(
            b.state["exp_avg"], b.state["exp_avg_sq"], value=1e-30)
    round_times = time_variants(variants, device, rounds, repeats)
    times = {k: statistics.median(v) for k, v in round_times.items()}
    vs_fused = {k: ratio(round_times, k, FUSED) for k in times} if FUSED in times else {}
    nbytes = predict_bytes(plan)
    byte_table = {"copy": 8, f"{compiled_backend} in place": nbytes, "cpu in place, no prefetch": nbytes, FUSED: 28,
                  "cpu step+predict, no prefetch": 32,
                  "torch fused Adam step, parameter list": 28, "torch foreach Adam step, parameter list": 28,
                  f"{compiled_backend} bf16 out": nbytes - 2, "triton step+predict": 32,
                  f"{compiled_backend} step+predict": 32, "cpu step+predict ordinary stores": 32,
                  f"{compiled_backend} step+predict, ŵ over grad": 32,
                  "torch fused Adam step + predict": 28 + 16, "addcmul_ (same traffic as in place)": 16}
    copy_bw = 8 * n / times["copy"]
    rows = []
    for name, sec in times.items():
        bpe = byte_table.get(name, nbytes)
        bw = bpe * n / sec
        fused = vs_fused.get(name, ("", "", ""))
        rows.append({"device": device, "rule": rule, "params": n, "variant": name, "ms": round(sec * 1e3, 3),
                     "ms_min": round(min(round_times[name]) * 1e3, 3), "ms_max": round(max(round_times[name]) * 1e3, 3),
                     "bytes_per_param": bpe, "GB_s": round(bw / 1e9, 2), "frac_copy_bw": round(bw / copy_bw, 3),
                     "speedup_vs_per_tensor": round(times["per-tensor eager"] / sec, 2),
                     "speedup_vs_torch_loop": round(times["per-tensor torch loop"] / sec, 2),
                     "speedup_vs_foreach": round(times["foreach"] / sec, 2),
                     **{k: (round(v, 3) if v != "" else "") for k, v in zip(
                         ("time_vs_fused_adam", "time_vs_fused_adam_min", "time_vs_fused_adam_max"), fused)}})
    return rows


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}"


def _timed(r: dict) -> str:
    """A row's median time with its fastest and slowest round."""
    return f"{_ms(r['ms'])} ms [{_ms(r['ms_min'])}-{_ms(r['ms_max'])}]"


def _vs_fused(r: Optional[dict]) -> str:
    """A row's time / the fused Adam step's: the ratio of the two medians, [lowest-highest within a round]."""
    if not r:
        return "-"
    return f"{r['time_vs_fused_adam']:.2f} [{r['time_vs_fused_adam_min']:.2f}-{r['time_vs_fused_adam_max']:.2f}]"


def summarize(rows: list[dict], compiled_backend: str) -> list[str]:
    """The issue's targets, checked on the measured rows: every ratio is one of two medians printed
    (in this summary or in the CSV), with the range of that ratio within one round in brackets."""
    if compiled_backend == "cuda":
        return summarize_gpu(rows, "cuda")
    lines = []
    by = {(r["rule"], r["params"], r["variant"]): r for r in rows}
    pad = " " * 17
    for (rule, n, variant), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if variant != compiled_backend:
            continue
        pt = by.get((rule, n, "per-tensor eager"))
        line = (f"{rule:8s} {size_label(n):>8s}  {compiled_backend} predict {_timed(r)}  {r['GB_s']:.1f} GB/s at "
                f"{r['bytes_per_param']} B/param  {pt['ms'] / r['ms']:.1f}x faster than per-tensor eager "
                f"({_ms(pt['ms'])} ms)")
        fused = by.get(("adam", n, FUSED))
        if fused and rule == "adam":
            get = lambda v: by.get(("adam", n, v))  # noqa: E731
            ip, floor = get(f"{compiled_backend} in place"), get("addcmul_ (same traffic as in place)")
            sp, both = get(f"{compiled_backend} step+predict"), get("torch fused Adam step + predict")
            over_grad = get(f"{compiled_backend} step+predict, ŵ over grad")
            line += (f"\n{pad}time / torch's fused Adam step ({_timed(fused)}, 28 B/param), each a ratio of the "
                     f"medians [lowest-highest within a round]:"
                     f"\n{pad}predict {_vs_fused(r)}, in place {_vs_fused(ip)} ({_timed(ip)})"
                     + (f", ordinary stores {_vs_fused(get('cpu ordinary stores'))}" if get("cpu ordinary stores")
                        else "")
                     + f" (target <= {CPU_PREDICT_TARGET:.2f} on CPU)")
            if floor:
                line += (f"\n{pad}addcmul_ with in-place predict's traffic {_timed(floor)} = {_vs_fused(floor)}; "
                         f"in-place predict runs at {floor['ms'] / ip['ms']:.2f}x its speed")
                ip_off = get("cpu in place, no prefetch")
                if ip_off:
                    line += f" ({floor['ms'] / ip_off['ms']:.2f}x with no prefetch)"
            line += (f"\n{pad}step+predict {_timed(sp)} = {_vs_fused(sp)}"
                     + (f", ordinary stores {_vs_fused(get('cpu step+predict ordinary stores'))}"
                        if get("cpu step+predict ordinary stores") else "")
                     + (f", no prefetch {_vs_fused(get('cpu step+predict, no prefetch'))}"
                        if get("cpu step+predict, no prefetch") else "")
                     + f", ŵ over grad {_vs_fused(over_grad)} (target <= {CPU_STEP_TARGET:.2f} on CPU); "
                     f"{both['ms'] / sp['ms']:.2f}x faster than the fused step then predict ({_ms(both['ms'])} ms)")
        lines.append(line)
    return lines


def summarize_gpu(rows: list[dict], backend: str) -> list[str]:
    """The GPU targets: predict at >= 0.9x the copy bandwidth and >= 5x a per-tensor torch loop;
    step+predict faster than torch's fused Adam step followed by a predict."""
    lines = []
    by = {(r["rule"], r["params"], r["variant"]): r for r in rows}
    for (rule, n, variant), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if variant != backend:
            continue
        line = (f"{rule:8s} {size_label(n):>8s}  {backend} {_timed(r)}  {r['GB_s']:7.1f} GB/s  "
                f"{r['frac_copy_bw']:.2f}x copy bw (target >= 0.90)  {r['speedup_vs_torch_loop']:.1f}x "
                f"per-tensor torch loop (target >= 5)")
        for other in (f"{backend} bf16 out", "triton", f"{backend} in place"):
            if (rule, n, other) in by:
                line += f"; {other} {by[(rule, n, other)]['frac_copy_bw']:.2f}x copy bw"
        if rule == "adam":
            sp, both = by[("adam", n, f"{backend} step+predict")], by[("adam", n, "torch fused Adam step + predict")]
            line += (f"\n{'':17s}step+predict {_timed(sp)}: {both['ms'] / sp['ms']:.2f}x faster than torch's fused "
                     f"step then predict ({_ms(both['ms'])} ms; target > 1), {_vs_fused(sp)}x torch's fused step on "
                     f"one tensor ({_ms(by[('adam', n, FUSED)]['ms'])} ms)")
            for impl in ("fused", "foreach"):
                row = by.get(("adam", n, f"torch {impl} Adam step, parameter list"))
                if row:
                    line += f", {row['ms'] / sp['ms']:.2f}x faster than {impl} Adam over the parameter list"
            tsp = by.get(("adam", n, "triton step+predict"))
            if tsp:
                line += f"; triton step+predict {_timed(tsp)}"
        lines.append(line)
    return lines


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV this script wrote, with numbers as numbers. A CSV written before the ratios were
    ratios of medians (no time_vs_fused_adam_min column) gets them recomputed from its medians, without a
    per-round range (None)."""
    def value(text: str):
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    with open(path) as f:
        lines = [line for line in f if not line.startswith("#")]
    rows = [{k: value(v) for k, v in r.items()} for r in csv.DictReader(lines)]
    if rows and "time_vs_fused_adam_min" not in rows[0]:
        fused = {(r["rule"], r["params"]): r["ms"] for r in rows if r["variant"] == FUSED}
        for r in rows:
            base = fused.get((r["rule"], r["params"]))
            r["time_vs_fused_adam"] = r["ms"] / base if base else ""
            r["time_vs_fused_adam_min"] = r["time_vs_fused_adam_max"] = None
    return rows


def fresh_output_folder(root: Optional[Path] = None) -> Path:
    """A new folder under root (default RUNS) named by the date and time (a suffix when two runs start in one
    second)."""
    root = RUNS if root is None else root
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        folder = root / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise RuntimeError(f"could not make a fresh folder under {root}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sizes", default=None, help="comma list, e.g. 1M,8M,64M (default CPU 1M,8M,64M; GPU 256M,1G)")
    ap.add_argument("--rules", default=",".join(pk.BUILTIN_RULES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5,
                    help="GPU: back-to-back calls timed per round between CUDA events (CPU: by size, up to 8M elements)")
    ap.add_argument("--quick", action="store_true",
                    help="a dry run in seconds: 256K parameters, adam and sgd, 2 rounds (sizes/rules given win), "
                         "with the GPU run's extra rows")
    ap.add_argument("--out", default=None,
                    help="CSV path; the picture goes beside it as .png (default: a fresh folder "
                         "runs/bench_kernels/<date-time>/kernels_<device>.csv, so no earlier result is overwritten; "
                         "the committed results are benchmarks/results/kernels_cpu*.csv)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--replot", metavar="CSV", default=None,
                    help="measure nothing: draw the picture of an earlier run's CSV beside it (.png)")
    args = ap.parse_args(argv)
    if args.replot:
        picture = Path(args.replot).with_suffix(".png")
        plot(read_rows(Path(args.replot)), picture)
        print(f"wrote {picture}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU; run on CPU with --device cpu")
    default_sizes, default_rules = ("1M,8M,64M" if args.device == "cpu" else "256M,1G"), ",".join(pk.BUILTIN_RULES)
    if args.quick:
        default_sizes, default_rules, args.rounds, args.calls = "256K", "adam,sgd", 2, 1
    sizes = [parse_size(x) for x in (args.sizes or default_sizes).split(",")]
    rules_arg = args.rules if args.rules != ",".join(pk.BUILTIN_RULES) else default_rules
    rule_list = [r.strip() for r in rules_arg.split(",")]
    for r in rule_list:
        if r not in HYPER:
            ap.error(f"unknown rule {r!r}; choose from {', '.join(HYPER)}")
    compiled_backend = "cuda" if args.device == "cuda" else "cpu"
    if compiled_backend not in pk.available_backends():
        ap.error(f"the {compiled_backend} backend is not built: run `pip install --no-build-isolation -e .` first")
    command = "python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = f"# {command}\n# torch {torch.__version__}, " + (
        f"{torch.cuda.get_device_name()}, {args.calls} calls per round" if args.device == "cuda" else
        f"threads {torch.get_num_threads()}, cpu isa {pk.compiled.cpu_isa()}, cpu streaming stores from "
        f"{pk.compiled.load().cpu_stream_threshold_bytes() / 2**20:.0f} MiB per op, cpu prefetch "
        f"{pk.compiled.load().cpu_prefetch_bytes()} B ahead") + f", rounds {args.rounds}"
    print(header, flush=True)
    out = Path(args.out) if args.out else fresh_output_folder() / f"kernels_{args.device}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, writer = [], None
    with open(out, "w", newline="") as f:
        f.write(header + "\n")
        for n in sizes:
            for rule in rule_list:
                t0 = time.time()
                repeats = args.calls if args.device == "cuda" or args.quick else max(1, (8 << 20) // n)
                new_rows = bench_rule(rule, n, args.device, args.rounds, compiled_backend, repeats, gpu_rows=args.quick)
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(new_rows[0]))
                    writer.writeheader()
                writer.writerows(new_rows)
                f.flush()  # a run cut short keeps every rule and size it finished
                rows += new_rows
                print(f"  {rule} {size_label(n)} done in {time.time() - t0:.0f} s", flush=True)
    if not args.no_plot:
        plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out}" + ("" if args.no_plot else f" and {out.with_suffix('.png')}"))
    print("times: median over the rounds [fastest-slowest round]; ratios: of two medians printed here or in the CSV "
          "[lowest-highest within a round]")
    print("\n".join(summarize(rows, compiled_backend)))
    if args.quick and compiled_backend != "cuda":
        print("the GPU summary, from these CPU rows (a dry run of its code):")
        print("\n".join(summarize_gpu(rows, compiled_backend)))
    return 0


def plot(rows: list[dict], path: Path) -> list[str]:
    """Left: Adam's kernels as time / torch's fused Adam step at each size (the ratio of the medians, with
    the range within one round), step+predict included, against the CPU targets. Right: every rule at the
    largest size in GB/s counted at its minimal bytes, beside what copy_ and the fused Adam step reach in
    the same run, so the memory floor is stated in the same units instead of as a multiple of copy_.
    Returns the legend's labels (what the picture shows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = rows[0]["device"]
    backend = "cuda" if device == "cuda" else "cpu"
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 7), gridspec_kw={"width_ratios": [1, 1.4]})

    adam = [r for r in rows if r["rule"] == "adam" and r["time_vs_fused_adam"] != ""]
    sizes = sorted({r["params"] for r in adam})
    kernels = [(f"{backend}", "predict, separate ŵ (16 B)"), (f"{backend} in place", "predict in place (16 B)"),
               ("addcmul_ (same traffic as in place)", "addcmul_: in place's traffic, no maths (16 B)"),
               (f"{backend} step+predict", "step+predict (32 B)"),
               (f"{backend} step+predict, ŵ over grad", "step+predict, ŵ over the gradient (32 B)"),
               ("torch fused Adam step + predict", "fused Adam step, then predict (28 + 16 B)")]
    kernels = [(v, label) for v, label in kernels if any(r["variant"] == v for r in adam)]
    width = 0.8 / max(1, len(kernels))
    ranges = all(r["time_vs_fused_adam_min"] is not None for r in adam)
    for j, (variant, label) in enumerate(kernels):
        found = [(i, next((r for r in adam if r["params"] == n and r["variant"] == variant), None))
                 for i, n in enumerate(sizes)]
        xs = [i + j * width for i, r in found if r]
        sel = [r for _, r in found if r]
        ys = [r["time_vs_fused_adam"] for r in sel]
        err = None
        if ranges:
            err = [[y - r["time_vs_fused_adam_min"] for y, r in zip(ys, sel)],
                   [r["time_vs_fused_adam_max"] - y for y, r in zip(ys, sel)]]
        left.bar(xs, ys, width, yerr=err, capsize=2, label=label)
    left.axhline(1.0, color="k", lw=0.8, label="torch's fused Adam step (28 B)")
    if device == "cpu":
        left.axhline(CPU_PREDICT_TARGET, color="tab:blue", lw=0.8, ls=":", label="predict target 16/28")
        left.axhline(CPU_STEP_TARGET, color="tab:red", lw=0.8, ls=":", label=f"step+predict target {CPU_STEP_TARGET}")
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [size_label(n) for n in sizes])
    left.set_xlabel("Adam, parameters")
    left.set_ylabel("time / torch's fused Adam step (ratio of medians" +
                    (";\nbars: lowest-highest within a round)" if ranges else ")"))
    left.set_title("Adam kernels against torch's fused Adam step", fontsize=10)
    left.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))

    largest = max(r["params"] for r in rows)
    sel = [r for r in rows if r["params"] == largest]
    rule_names = list(dict.fromkeys(r["rule"] for r in sel))
    variants = ["per-tensor eager", "foreach", "flat eager", f"{backend} ordinary stores", backend,
                f"{backend} in place", "triton"]
    variants = [v for v in variants if any(r["variant"] == v for r in sel)]
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        vals = [next((r["GB_s"] for r in sel if r["rule"] == rn and r["variant"] == v), 0) for rn in rule_names]
        right.bar([i + j * width for i in range(len(rule_names))], vals, width, label=v)
    nbytes = {rn: next(r["bytes_per_param"] for r in sel if r["rule"] == rn and r["variant"] == backend)
              for rn in rule_names}
    right.set_xticks([i + 0.4 - width / 2 for i in range(len(rule_names))],
                     [f"{rn}\n{nbytes[rn]} B/param" for rn in rule_names])
    copies = [r["GB_s"] for r in sel if r["variant"] == "copy"]
    copy_note = ", 12 moved: the destination line is read first" if device == "cpu" else ""
    right.axhline(statistics.median(copies), color="k", lw=0.8, ls="--",
                  label=f"copy_ (8 B/param counted{copy_note})")
    fused = next((r for r in sel if r["variant"] == FUSED), None)
    if fused:
        right.axhline(fused["GB_s"], color="k", lw=0.8,
                      label="torch's fused Adam step (28 B/param): the memory rate a streaming op reaches here")
    right.set_ylabel("GB/s counted at the minimal bytes per parameter\n(what the kernel must read and write)")
    right.set_title(f"every rule, {size_label(largest)} params on {device}: GB/s at the minimal bytes", fontsize=10)
    right.legend(ncol=3, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.text(0.5, 0.01, "The memory floor: no kernel takes less than its bytes per parameter over the rate this "
             "machine's memory sustains. GB/s here counts only the bytes a kernel must move"
             + (", so a kernel above the copy_ line has not beaten the memory: copy_ moves 12 B for the 8 counted"
                if device == "cpu" else "")
             + ".\nThe fused Adam step's rate (28 B) and addcmul_ (in-place predict's 16 B, no arithmetic) are this "
             "run's measures of what the memory allows; the kernels' best is to match them.",
             ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    labels = [t.get_text() for ax in (left, right) for t in ax.get_legend().get_texts()]
    plt.close(fig)
    return labels


if __name__ == "__main__":
    sys.exit(main())
