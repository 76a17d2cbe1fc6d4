"""A large GPT through the runtime: built on the meta device, cut into 4 pipeline stages, each stage
materialised only where it runs; per rank memory, build time and the cost of weight prediction in an
asynchronous 1F1B step.

    python benchmarks/bench_large.py --params 1e9 --mode emulate --csv benchmarks/results/large_cpu.csv
    python benchmarks/bench_large.py --device cuda --mode emulate --policies pipeoptim,none --csv PATH
    python benchmarks/bench_large.py --quick --device cpu --mode both        # a tiny model, seconds

Modes: ``emulate`` (every stage in one process on --device), ``processes`` (4 real processes on gloo, CPU; one
stage each), ``both``. Every (mode, policy) runs in a fresh process, so peak memory is its own; its CSV rows are
written as soon as it finishes (a timeout keeps what finished). Per stage: parameter, gradient, optimizer-state
and prediction-buffer bytes (from the flat buffers themselves), the process's peak RSS (and on CUDA the peak
allocated GPU memory), build time (meta model -> materialised, initialised, bound stages), the median time of an
async-1f1b schedule window (``train_step``: N micro-batches through the 4 stages, one optimizer step per
micro-batch per stage) and one prediction pass over the stage's weights.

The prediction's share of a window is measured inside the ``pipeoptim`` run, two ways:
- side by side: timed windows alternate between prediction on and off (off: forwards read the current weights
  and the optimizer steps with torch's own fused AdamW, exactly what policy ``none`` does), so both medians come
  from the same process, memory and machine load; share = (t_on - t_off) / t_on;
- by its parts, inside the windows with prediction on: the time of every separate prediction pass plus, for
  steps fused with the next prediction, the fused call's time minus the stage's median plain optimizer step
  (timed in the windows without prediction); share = that sum / the window. It is steadier than the difference
  of two whole windows when the machine is shared.
When the ``none`` policy also ran, a ``share`` row sets its window (a separate process, run after) beside them.

The model has a multiple of 4 decoder blocks and the stages are cut by parameter count, so each stage holds a
quarter of the blocks (the first also the embedding, the last the head).

Both policies step with the same ``torch.optim.AdamW(fused=True)``; ``pipeoptim`` replaces its step by the fused
step+predict kernel. Data: the stdlib byte corpus (pipeoptim.data); nothing is downloaded; no transformers needed.
Before building, the memory the run needs is estimated and compared with what the machine has free: a run that
cannot fit is refused with the estimate (``--force`` runs it anyway).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STAGES = 4
FIELDS = ["kind", "mode", "device", "precision", "policy", "model_params", "d_model", "n_layers", "seq_len",
          "microbatches", "microbatch_size", "rank", "stage", "stage_params", "param_bytes", "grad_bytes",
          "optim_bytes", "pred_bytes", "state_bytes", "state_frac_of_model", "peak_rss_mib", "peak_gpu_mib",
          "build_s", "window_s", "window_s_all", "window_s_without_prediction", "window_s_without_all",
          "tokens_per_window", "predict_pass_ms", "prediction_s_per_window", "prediction_separate_s",
          "prediction_fused_extra_s", "separate_predictions",
          "fused_steps", "window_s_none", "prediction_share", "prediction_share_by_parts", "note"]


def model_config(args):
    from pipeoptim.models import GPTConfig
    layers = STAGES * max(1, round(args.params / (12 * args.d_model ** 2) / STAGES))
    return GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads,
                     n_layers=layers)


def count_params(cfg) -> int:
    d, V, T, L = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.n_layers
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return V * d + T * d + L * block + 2 * d + V * d


def bytes_per_param(precision: str) -> float:
    """Flat buffers per parameter: weights, gradients, AdamW's two moments, the prediction on 3 of 4 stages, plus
    one stage's freshly materialised weights while the binding copies them (the build's peak)."""
    if precision == "bf16":  # fp32 master + bf16 working weights, bf16 + fp32 gradients
        return 4 + 2 + 2 + 4 + 8 + 2 * 0.75 + 4 / STAGES
    return 4 + 4 + 8 + 4 * 0.75 + 4 / STAGES


def available_bytes(device: str) -> int:
    if device == "cuda":
        import torch
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def stage_memory(st) -> dict:
    b = st.policy.binding
    params = sum(_nbytes(g.w) + (_nbytes(g.work) if g.mixed else 0) for g in b.groups)
    grads = sum(_nbytes(g.grad) + (_nbytes(g.master_grad) if g.mixed else 0) for g in b.groups)
    optim = sum(sum(_nbytes(t) for t in g.state.values()) + sum(_nbytes(t) for t in g.scalars.values())
                for g in b.groups)
    pred = st.policy.extra_weight_bytes()
    return {"stage_params": sum(g.numel for g in b.groups), "param_bytes": params, "grad_bytes": grads,
            "optim_bytes": optim, "pred_bytes": pred, "state_bytes": params + grads + optim + pred}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def predict_pass_ms(st, device: str) -> float | None:
    """One prediction of the whole stage into its prediction buffer (none for a stage that never predicts)."""
    predictor = getattr(st.policy, "predictor", None)
    if predictor is None or predictor.nbytes() == 0:
        return None
    best = math.inf
    for _ in range(3):
        predictor.invalidate()
        _sync(device)
        t0 = time.perf_counter()
        predictor.predict(1.0)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    predictor.invalidate()
    return 1e3 * best


def set_prediction(pipe, on: bool) -> None:
    """Prediction on (the pipeoptim policy as built) or off (forwards read the real weights, the optimizer takes
    its own step: what policy 'none' does) for every stage of this process."""
    for w in pipe.workers:
        for st in w.stages.values():
            predictor = getattr(st.policy, "predictor", None)
            if predictor is None:
                continue
            st.policy.fused = on
            if on:
                predictor.__dict__.pop("active", None)
            else:
                predictor.active = lambda s: False


class PredictionClock:
    """Times the prediction work of this process's stages inside the windows: separate prediction passes, fused
    step+predict calls, and plain optimizer steps (the baseline a fused call is charged against)."""

    def __init__(self, pipe, device: str):
        self.device, self.on = device, True
        self.calls: dict = {}  # (stage, kind, on) -> [seconds]
        for w in pipe.workers:
            for st in w.stages.values():
                predictor = getattr(st.policy, "predictor", None)
                if predictor is None:
                    continue
                stage = st.chunk.stage
                predictor._predict_into = self._timed(predictor._predict_into, stage, "predict")
                predictor.step_predict = self._timed(predictor.step_predict, stage, "fused")
                st.optimizer.step = self._timed(st.optimizer.step, stage, "step")

    def _timed(self, fn, stage: int, kind: str):
        def run(*args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(self.device)
            self.calls.setdefault((stage, kind, self.on), []).append(time.perf_counter() - t0)
            return out
        return run

    def take(self) -> dict:
        """The records of the window just run (prediction on), cleared; plain steps of windows without
        prediction stay, as the baseline."""
        out = {(stage, kind): times for (stage, kind, on), times in self.calls.items() if on}
        self.calls = {k: v for k, v in self.calls.items() if not k[2]}
        return out

    def prediction(self, records: dict) -> dict:
        """Seconds of prediction work in one window's records: separate passes, plus each fused step+predict
        minus the stage's median plain step (that extra is below 0 where the fused call beats torch's own
        step, as on a tiny model, where per-call overhead dominates)."""
        separate_s, fused_extra_s, separate, fused = 0.0, 0.0, 0, 0
        for (stage, kind), times in records.items():
            if kind == "predict":
                separate_s += sum(times)
                separate += len(times)
            elif kind == "fused":
                plain = self.calls.get((stage, "step", False))
                fused_extra_s += sum(times) - (statistics.median(plain) if plain else 0.0) * len(times)
                fused += len(times)
        return {"seconds": separate_s + fused_extra_s, "separate_s": separate_s, "fused_extra_s": fused_extra_s,
                "separate": separate, "fused": fused}


def measure(cfg: dict) -> list[dict]:
    """Runs in a fresh process (one per rank in 'processes' mode): build, train, report this process's stages."""
    import torch

    from pipeoptim.data import stdlib_corpus
    from pipeoptim.models import GPTConfig, gpt_init_fn, gpt_layers
    from pipeoptim.models.gpt import lm_loss
    from pipeoptim.stages.partition import balance_by_cost
    from pipeoptim.train import Pipeline

    emulate, device = cfg["mode"] == "emulate", cfg["device"]
    mcfg = GPTConfig(**cfg["model"])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if not emulate:  # the build time starts once every rank is up, not while the processes start
        import torch.distributed as dist

        from pipeoptim.runtime.dist_env import init_from_env
        init_from_env(device)
        dist.barrier()
    t0 = time.perf_counter()
    layers = gpt_layers(mcfg, device="meta")
    balance = balance_by_cost([sum(p.numel() for p in layer.parameters()) for layer in layers], STAGES)
    pipe = Pipeline(layers, balance=balance, init_fn=gpt_init_fn(mcfg), loss_fn=lm_loss, seed=0,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
                    devices=STAGES, schedule="async-1f1b", policy=cfg["policy"], microbatches=cfg["microbatches"],
                    precision=cfg["precision"], emulate=emulate, device=device)
    _sync(device)
    build_s = time.perf_counter() - t0
    corpus = stdlib_corpus(max_bytes=1 << 20)
    gen = torch.Generator().manual_seed(0)
    B = cfg["microbatches"] * cfg["microbatch_size"]
    ab = cfg["policy"] == "pipeoptim"
    clock = PredictionClock(pipe, device) if ab else None
    times, times_off, parts = [], [], []
    plan = [True] * cfg["warmup"]  # timed windows alternate on/off (on first, then off first, ...)
    for i in range(cfg["steps"]):
        plan += [True, False][::1 if i % 2 == 0 else -1] if ab else [True]
    for i, on in enumerate(plan):
        batch = corpus.batch("train", B, mcfg.seq_len, gen)
        if ab:
            set_prediction(pipe, on)
            clock.on = on
        _sync(device)
        t1 = time.perf_counter()
        loss = pipe.train_step(batch)
        _sync(device)
        dt = time.perf_counter() - t1
        if i >= cfg["warmup"]:
            (times if on else times_off).append(dt)
        if ab and on:
            records = clock.take()
            if i >= cfg["warmup"]:
                parts.append((records, dt))
    if ab:
        set_prediction(pipe, True)
        parts = [(clock.prediction(records), dt) for records, dt in parts]  # against every plain step timed
    if not math.isfinite(loss):
        raise RuntimeError(f"the loss is {loss}: the measurement trained on garbage")
    rank = "all" if emulate else str(int(os.environ.get("RANK", "0")))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else ""
    rows = []
    for w in pipe.workers:
        for chunk, st in sorted(w.stages.items(), key=lambda kv: kv[0].stage):
            pass_ms = predict_pass_ms(st, device)
            rows.append({"kind": "stage", "rank": rank, "stage": chunk.stage, **stage_memory(st),
                         "peak_rss_mib": round(peak_rss, 1),
                         "peak_gpu_mib": round(peak_gpu, 1) if peak_gpu != "" else "", "build_s": round(build_s, 3),
                         "window_s": round(statistics.median(times), 4),
                         "window_s_all": " ".join(f"{t:.4f}" for t in times),
                         **({"window_s_without_prediction": round(statistics.median(times_off), 4),
                             "window_s_without_all": " ".join(f"{t:.4f}" for t in times_off),
                             "prediction_share": round(1 - statistics.median(times_off) / statistics.median(times), 4),
                             "prediction_s_per_window": round(statistics.mean(p["seconds"] for p, _ in parts), 4),
                             "prediction_separate_s": round(statistics.mean(p["separate_s"] for p, _ in parts), 4),
                             "prediction_fused_extra_s": round(statistics.mean(p["fused_extra_s"] for p, _ in parts),
                                                               4),
                             "separate_predictions": parts[-1][0]["separate"], "fused_steps": parts[-1][0]["fused"],
                             "prediction_share_by_parts": round(statistics.mean(p["seconds"] / t for p, t in parts), 4)}
                            if ab else {}),
                         "tokens_per_window": B * mcfg.seq_len,
                         "predict_pass_ms": "" if pass_ms is None else round(pass_ms, 3),
                         "note": f"final loss {loss:.4f}"})
    return rows


def run_measurement(args, mode: str, policy: str, mcfg) -> list[dict]:
    from pipeoptim.runtime import launch
    cfg = {"mode": mode, "device": args.device, "policy": policy, "precision": args.precision,
           "microbatches": args.microbatches, "microbatch_size": args.microbatch_size, "warmup": args.warmup,
           "steps": args.steps, "model": {"vocab_size": mcfg.vocab_size, "seq_len": mcfg.seq_len,
                                          "d_model": mcfg.d_model, "n_heads": mcfg.n_heads, "n_layers": mcfg.n_layers}}
    cores = os.cpu_count() or 1
    if mode == "emulate":
        parts = launch(measure, 1, cfg, timeout_s=args.timeout_s, threads=args.threads or cores)
    else:
        parts = launch(measure, STAGES, cfg, timeout_s=args.timeout_s, threads=args.threads or max(1, cores // STAGES))
    rows = [row for part in parts for row in part]
    whole = sum(r["state_bytes"] for r in rows)
    common = {"mode": mode, "device": args.device, "precision": args.precision, "policy": policy,
              "model_params": count_params(mcfg), "d_model": mcfg.d_model, "n_layers": mcfg.n_layers,
              "seq_len": mcfg.seq_len, "microbatches": args.microbatches, "microbatch_size": args.microbatch_size}
    for r in rows:
        r.update(common, state_frac_of_model=round(r["state_bytes"] / whole, 4))
    return rows


def share_row(rows: list[dict], mode: str, args, mcfg) -> dict | None:
    """The pipeoptim run's windows with and without prediction (slowest rank), and policy none's beside them."""
    stages = [r for r in rows if r["kind"] == "stage" and r["mode"] == mode]
    mine = [r for r in stages if r["policy"] == "pipeoptim"]
    if not mine:
        return None
    t_on = max(r["window_s"] for r in mine)
    t_off = max(r["window_s_without_prediction"] for r in mine)
    # the prediction work of all stages: in one process (emulated) every stage row carries the process's total;
    # across processes the ranks predict at the same time, so the slowest rank's work is what the window waits on
    by_parts = max(r["prediction_share_by_parts"] for r in mine)
    none = [r["window_s"] for r in stages if r["policy"] == "none"]
    return {"kind": "share", "mode": mode, "device": args.device, "precision": args.precision, "policy": "pipeoptim",
            "model_params": count_params(mcfg), "d_model": mcfg.d_model, "n_layers": mcfg.n_layers,
            "seq_len": mcfg.seq_len, "microbatches": args.microbatches, "microbatch_size": args.microbatch_size,
            "window_s": t_on, "window_s_without_prediction": t_off, "prediction_share": round(1 - t_off / t_on, 4),
            "prediction_share_by_parts": by_parts, "window_s_none": max(none) if none else "",
            "note": "prediction_share = 1 - t_without / t_with, windows alternating in one process; by_parts: the "
                    "prediction's own time inside the windows; window_s_none: policy none in its own process"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mode", choices=("emulate", "processes", "both"), default="emulate",
                   help="emulate: all stages in one process on --device; processes: 4 processes on gloo (CPU)")
    p.add_argument("--policies", default="pipeoptim,none",
                   help="comma-separated weight policies (default pipeoptim,none)")
    p.add_argument("--params", type=float, default=1e9, help="target parameter count (default 1e9)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 64 on cpu, 256 on cuda)")
    p.add_argument("--microbatches", type=int, default=8,
                   help="micro-batches per schedule window (default 8 = 2 x stages: a steady state between fill and "
                        "drain, where steps fuse with the next prediction)")
    p.add_argument("--microbatch-size", type=int, default=None,
                   help="sequences per micro-batch (default: 1 on cpu, 4 on cuda)")
    p.add_argument("--warmup", type=int, default=None, help="untimed windows first (default: 1 on cpu, 2 on cuda)")
    p.add_argument("--steps", type=int, default=None, help="timed windows (default: 2 on cpu, 5 on cuda)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="fp32, or bf16 working weights over fp32 masters (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--csv", default=None, help="CSV file the rows are appended to as they finish")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per measurement (default 3600)")
    p.add_argument("--quick", action="store_true", help="a tiny model and one timed window: checks the script")
    p.add_argument("--force", action="store_true", help="run even when the memory estimate exceeds what is free")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: all cores emulated, cores/4 per process otherwise)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    for name, on_cpu, on_cuda in (("precision", "fp32", "bf16"), ("seq_len", 64, 256), ("microbatch_size", 1, 4),
                                  ("warmup", 1, 2), ("steps", 2, 5)):
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    if args.quick:
        args.params, args.d_model, args.heads, args.seq_len = 2e5, 64, 4, 32
        args.warmup, args.steps, args.microbatch_size = 1, 1, 2
        args.timeout_s = min(args.timeout_s, 300.0)
    return args


def check(args, mcfg) -> str | None:
    """Why this run cannot start, or None."""
    import torch
    policies = [s for s in args.policies.split(",") if s]
    from pipeoptim.policies import POLICIES
    bad = [s for s in policies if s not in POLICIES or s == "2bw"]
    if not policies or bad:
        return f"--policies {args.policies!r}: choose from {', '.join(p for p in POLICIES if p != '2bw')}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda but no GPU is visible; use --device cpu"
    if args.device == "cuda" and args.mode != "emulate":
        need = STAGES
        if torch.cuda.device_count() < need:
            return (f"--mode {args.mode} --device cuda runs one process per GPU and needs {need} GPUs (found "
                    f"{torch.cuda.device_count()}); use --mode emulate for every stage on one GPU")
    if args.d_model % args.heads:
        return f"--d-model {args.d_model} is not a multiple of --heads {args.heads}"
    need = count_params(mcfg) * bytes_per_param(args.precision)
    need += (0.6e9 if args.device == "cpu" else 0.0) * (STAGES if args.mode != "emulate" else 1)
    free = available_bytes(args.device)
    if need > 0.9 * free and not args.force:
        return (f"a {count_params(mcfg) / 1e9:.2f}B-parameter model needs about {need / 2**30:.1f} GiB "
                f"({bytes_per_param(args.precision):.1f} B/param {args.precision} + process overhead) but "
                f"{free / 2**30:.1f} GiB is free on {args.device}; use a smaller --params (or --force)")
    return None


def main(argv=None) -> int:
    args = parse(argv)
    mcfg = model_config(args)
    problem = check(args, mcfg)
    if problem:
        print(f"bench_large: {problem}", file=sys.stderr)
        return 2
    modes = ["emulate", "processes"] if args.mode == "both" else [args.mode]
    policies = [s for s in args.policies.split(",") if s]
    print(f"GPT {count_params(mcfg) / 1e6:.1f}M parameters (d_model {mcfg.d_model}, {mcfg.n_layers} blocks), "
          f"{STAGES} stages, async-1f1b, {args.microbatches} x {args.microbatch_size} x {mcfg.seq_len} tokens per "
          f"window, {args.precision}, {args.device}", flush=True)
    out = None
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        new = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
        if not new:
            with open(args.csv, newline="") as f:
                header = next(csv.reader(f), [])
            if header != FIELDS:
                sys.exit(f"bench_large: {args.csv} has other columns than this version writes (an older run's "
                         "file?): pass a new --csv path, or move that file away")
        out = open(args.csv, "a", newline="")
        writer = csv.DictWriter(out, fieldnames=FIELDS)
        if new:
            writer.writeheader()
    rows = []

    def emit(new_rows):
        for r in new_rows:
            rows.append(r)
            print("  " + ", ".join(f"{k}={r[k]}" for k in FIELDS if r.get(k) not in (None, "")), flush=True)
            if out is not None:
                writer.writerow(r)
        if out is not None:
            out.flush()

    for mode in modes:
        for policy in policies:
            print(f"== {mode}, policy {policy}", flush=True)
            emit(run_measurement(args, mode, policy, mcfg))
        share = share_row(rows, mode, args, mcfg)
        if share:
            emit([share])
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
