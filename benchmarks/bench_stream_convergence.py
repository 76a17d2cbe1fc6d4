"""Does running an asynchronous pipeline as a stream change what it learns?

Why this exists: ``Pipeline(stream=True)`` (``pipeoptim train --stream``) keeps micro-batches in flight from one
``train_step`` to the next, so the pipeline fills once instead of filling and draining in every window; that is
what makes the asynchronous schedules level with or ahead of torch's fastest synchronous one
(``bench_runtime_peer.py``). It also changes which weights a micro-batch meets: in a window the first micro-batches
run on a drained pipeline (less stale) and the last ones' updates land before the next window starts; in a stream
every micro-batch sees the steady state's staleness. With the main job's 8 micro-batches per window on 4 stages,
that is most of each window. The stream is off by default until this is measured; this script measures it.

Each configuration trains ``pipeoptim train`` (emulated, one thread, so each run is deterministic and runs
beside another) as windows and as a stream, at 3 seeds and at every learning rate of its sweep, with the same
samples and updates in both modes (the stream drains once, at the end). Evaluation and checkpoints drain a stream,
so both modes evaluate and save only at the end. Per run: the validation loss at the end (``pipeoptim train``'s
fixed held-out batch) and the mean training loss over the last tenth of the windows. The report gives each mode
its own best learning rate (lowest mean validation loss over the seeds; marked when the best is at the sweep's
edge, i.e. not bracketed) and the paired differences, stream minus windows, seed by seed, at the two modes' best
learning rates and at every learning rate.

Configurations (``--configs``): ``main`` the main job as it was until its default changed (async 1F1B with
PipeOptim, AdamW); ``2bw-n`` PipeDream-2BW with one update per window (``--update-every 8``: the fastest stream of
``bench_runtime_peer.py``), AdamW; ``2bw-n-pipeoptim`` the same with PipeOptim's policy (each forward on the
weights predicted for its backward: as windows there is nothing to predict, as a stream the one update the next
window's first forwards would miss); ``2bw-muon`` the ``async-transformer-muon`` recipe (2BW, Muon + AdamW); ``2bw-muon-pipeoptim`` the same with
PipeOptim's prediction from the last update in place of 2BW's double buffer (``--modes windows``: the main job's
default since it was measured here).

    python benchmarks/bench_stream_convergence.py [--configs main 2bw-n] [--seeds 0 1 2] [--jobs 2]
    python benchmarks/bench_stream_convergence.py --report    # the tables from the CSV only

Writes benchmarks/results/stream_convergence.csv (one row per run; runs already there are not run again; a
comment line before each invocation's first row names its command and the CPU) and prints the tables in markdown.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_runtime_peer as peer  # noqa: E402  (the CPU's description)

RESULTS = os.path.join(HERE, "results")
# configuration -> (pipeoptim train flags, learning rates swept)
CONFIGS = {
    "main": (("--schedule", "async-1f1b", "--policy", "pipeoptim", "--optimizer", "adamw"), (1.5e-3, 3e-3, 6e-3)),
    "2bw-n": (("--schedule", "2bw", "--update-every", "8"), (1.5e-3, 3e-3, 6e-3)),
    "2bw-n-pipeoptim": (("--schedule", "2bw", "--policy", "pipeoptim", "--update-every", "8"), (1.5e-3, 3e-3, 6e-3)),
    "2bw-muon": (("--recipe", "async-transformer-muon"), (8e-3, 1.6e-2, 3.2e-2)),
    # PipeDream-2BW (an update every --stages micro-batches) with PipeOptim's prediction from the last applied
    # update instead of 2BW's double buffer, and the recipe's Muon + AdamW: each forward runs on the weights
    # predicted for its backward (the one update between them).
    "2bw-muon-pipeoptim": (("--schedule", "2bw", "--policy", "pipeoptim", "--predict-from", "last_update",
                            "--optimizer", "muon", "--muon-scale", "adamw", "--momentum", "0.95",
                            "--weight-decay", "0.1"), (1.6e-2, 3.2e-2, 6.4e-2)),
    # asynchronous 1F1B (an update every micro-batch, stage k D-k-1 updates stale) with the same Muon + AdamW:
    # PipeOptim's prediction from the last applied update against stashing (each forward's weights kept for its
    # backward), the candidates for the main job's default
    "async-muon-pipeoptim": (("--schedule", "async-1f1b", "--policy", "pipeoptim", "--predict-from", "last_update",
                              "--optimizer", "muon", "--muon-scale", "adamw", "--momentum", "0.95",
                              "--weight-decay", "0.1"), (8e-3, 1.6e-2, 3.2e-2)),
    "async-muon-stash": (("--schedule", "async-1f1b", "--policy", "stash", "--optimizer", "muon",
                          "--muon-scale", "adamw", "--momentum", "0.95", "--weight-decay", "0.1"),
                         (8e-3, 1.6e-2, 3.2e-2)),
}
MODES = ("windows", "stream")
FIELDS = ("config", "mode", "lr", "seed", "windows", "val_loss", "tail_loss", "finished", "wall_s")


def train_args(config: str, mode: str, lr: float, seed: int, windows: int, run_dir: str) -> list[str]:
    flags, _ = CONFIGS[config]
    args = [sys.executable, "-m", "pipeoptim.cli", "train", *flags, "--lr", repr(lr), "--seed", str(seed),
            "--steps", str(windows), "--emulate", "--no-progress", "--eval-every", "0", "--save-every", "0",
            "--run-dir", run_dir]
    return args + (["--stream"] if mode == "stream" else [])


def run_one(config: str, mode: str, lr: float, seed: int, windows: int) -> dict:
    """One ``pipeoptim train`` run in a temporary run directory; its end-of-run numbers as a CSV row."""
    with tempfile.TemporaryDirectory(prefix="stream_conv_") as tmp:
        run_dir = os.path.join(tmp, "run")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        done = subprocess.run(train_args(config, mode, lr, seed, windows, run_dir), env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - start
        history_path = os.path.join(run_dir, "history.json")
        if not os.path.exists(history_path):
            raise RuntimeError(f"{config} {mode} lr {lr} seed {seed}: pipeoptim train wrote no history "
                               f"(exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        with open(history_path) as f:
            history = json.load(f)["history"]
    losses = [h["loss"] for h in history]
    val = next((h["val_loss"] for h in reversed(history) if h.get("val_loss") is not None), math.nan)
    # finite losses only: a run that stopped at a non-finite loss is marked unfinished, its tail is what came before
    tail = [x for x in losses[-max(1, windows // 10):] if math.isfinite(x)]
    finished = done.returncode == 0 and len(history) == windows and math.isfinite(val)
    return dict(config=config, mode=mode, lr=lr, seed=seed, windows=windows, val_loss=val,
                tail_loss=statistics.fmean(tail) if tail else math.nan, finished=finished, wall_s=round(wall, 1))


def _key(row: dict) -> tuple:
    return row["config"], row["mode"], float(row["lr"]), int(row["seed"]), int(row["windows"])


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for r in rows:
        r["lr"], r["seed"], r["windows"] = float(r["lr"]), int(r["seed"]), int(r["windows"])
        r["val_loss"], r["tail_loss"] = float(r["val_loss"]), float(r["tail_loss"])
        r["finished"] = r["finished"] == "True"
    return rows


def append_row(path: str, row: dict, command: str | None) -> None:
    """One run's row; ``command`` (a comment line naming the command and the CPU) goes first when given: the
    first row of each invocation, so the CSV names every command that added rows."""
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        if command:
            f.write(command)
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow({k: row[k] for k in FIELDS})


def best_lr(rows: list[dict], config: str, mode: str, seeds: list[int]) -> tuple[float | None, bool]:
    """The lr with the lowest mean validation loss over ``seeds`` (runs that did not finish count as inf), and
    whether it is bracketed (a swept lr on each side)."""
    lrs = sorted({r["lr"] for r in rows if r["config"] == config and r["mode"] == mode})
    means = {}
    for lr in lrs:
        vals = [r["val_loss"] if r["finished"] else math.inf for r in rows
                if r["config"] == config and r["mode"] == mode and r["lr"] == lr and r["seed"] in seeds]
        if len(vals) == len(seeds):
            means[lr] = statistics.fmean(vals)
    if not means:
        return None, False
    lr = min(means, key=means.get)
    return lr, 0 < lrs.index(lr) < len(lrs) - 1


def _by_seed(rows, config, mode, lr, seeds, field="val_loss"):
    got = {r["seed"]: (r[field] if r["finished"] else math.nan) for r in rows
           if r["config"] == config and r["mode"] == mode and r["lr"] == lr}
    return [got.get(s, math.nan) for s in seeds]


def report(rows: list[dict], configs: list[str], seeds: list[int]) -> str:
    out = []
    for config in configs:
        lrs = sorted({r["lr"] for r in rows if r["config"] == config})
        if not lrs:
            continue
        out.append(f"\n### {config} (`pipeoptim train {' '.join(CONFIGS[config][0]) or '(defaults)'}`), "
                   f"seeds {', '.join(map(str, seeds))}\n")
        out.append("| lr | windows: validation loss per seed (mean) | stream: validation loss per seed (mean) | "
                   "stream − windows per seed | tail training loss, stream − windows (mean) |")
        out.append("|---|---|---|---|---|")
        for lr in lrs:
            w, s = (_by_seed(rows, config, m, lr, seeds) for m in MODES)
            tw, ts = (_by_seed(rows, config, m, lr, seeds, "tail_loss") for m in MODES)
            diff = [b - a for a, b in zip(w, s)]
            tdiff = [b - a for a, b in zip(tw, ts)]
            out.append(f"| {lr:g} | {_fmt(w)} ({_mean(w)}) | {_fmt(s)} ({_mean(s)}) | {_fmt(diff, signed=True)} | "
                       f"{_mean(tdiff, signed=True)} |")
        best = {m: best_lr(rows, config, m, seeds) for m in MODES}
        said = "; ".join(f"{m}: {lr:g}{'' if bracketed else ' (at the sweep edge: not bracketed)'}"
                         for m, (lr, bracketed) in best.items() if lr is not None)
        out.append(f"\nEach mode's best lr (lowest mean validation loss): {said}.")
        if all(lr is not None for lr, _ in best.values()):
            w = _by_seed(rows, config, "windows", best["windows"][0], seeds)
            s = _by_seed(rows, config, "stream", best["stream"][0], seeds)
            diff = [b - a for a, b in zip(w, s)]
            out.append(f"At each mode's best: windows {_mean(w)}, stream {_mean(s)}; stream − windows per seed "
                       f"{_fmt(diff, signed=True)} (mean {_mean(diff, signed=True)}; the stream lower in "
                       f"{sum(d < 0 for d in diff)} of {len(diff)}).")
    return "\n".join(out)


def _fmt(xs, signed=False):
    return ", ".join(("nan" if not math.isfinite(x) else f"{x:+.4f}" if signed else f"{x:.4f}") for x in xs)


def _mean(xs, signed=False):
    if not all(math.isfinite(x) for x in xs):
        return "n/a"
    m = statistics.fmean(xs)
    return f"{m:+.4f}" if signed else f"{m:.4f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["main", "2bw-n"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", help="learning rates to sweep (default: each config's)")
    ap.add_argument("--windows", type=int, default=200, help="train_step calls per run (the main job's 200)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each one thread)")
    ap.add_argument("--csv", default=os.path.join(RESULTS, "stream_convergence.csv"))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="windows, stream or both (default both: the paired comparison this script exists for)")
    ap.add_argument("--report", action="store_true", help="print the tables from the CSV, run nothing")
    args = ap.parse_args(argv)
    if args.windows < 1 or args.jobs < 1:
        ap.error("--windows and --jobs must be at least 1")
    if args.lrs and not all(lr > 0 for lr in args.lrs):
        ap.error(f"--lrs must be positive learning rates, got {args.lrs}")

    rows = read_rows(args.csv)
    if not args.report:
        done = {_key(r) for r in rows}
        todo = [(c, m, lr, s, args.windows) for c in args.configs for lr in (args.lrs or CONFIGS[c][1])
                for s in args.seeds for m in args.modes if (c, m, lr, s, args.windows) not in done]
        command = (f"# python benchmarks/bench_stream_convergence.py {' '.join(sys.argv[1:] if argv is None else argv)}"
                   f"\n# {peer._cpu()}; each run one thread, emulated\n")
        print(f"{len(todo)} runs to do ({len(done)} in {args.csv} already)", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            for i, row in enumerate(pool.map(lambda t: run_one(*t), todo)):
                append_row(args.csv, row, command if i == 0 else None)
                rows.append(row)
                print(f"  {row['config']:9} {row['mode']:7} lr {row['lr']:<8g} seed {row['seed']}: validation "
                      f"{row['val_loss']:.4f}, tail {row['tail_loss']:.4f}, {row['wall_s']} s"
                      f"{'' if row['finished'] else ' (did not finish)'}", flush=True)
    rows = [r for r in rows if r["windows"] == args.windows]
    print(report(rows, args.configs, args.seeds))


if __name__ == "__main__":
    main()
