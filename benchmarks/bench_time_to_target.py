"""Time to a target loss, per method, at D = 4, 8, 16, each method at its own best learning rate (issue 13).

Why this script exists: a user choosing between GPipe, 1F1B, interleaved 1F1B, BitPipe, PipeDream, PipeDream-2BW,
SpecTrain and PipeOptim asks how long until the model reaches loss X, and how that changes as the pipeline gets
deeper. bench_convergence.py compares methods per update at one learning rate; bench_throughput.py compares
schedules per micro-batch. Here the two factors are measured on the same model and multiplied:

    time to target = updates to reach the target  x  time per update

- Updates to reach the target: measured, by training in the single-process emulator (bench_convergence's tasks,
  pipelines and methods), the validation loss (digits: test accuracy) evaluated every `eval_every` updates and the
  crossing interpolated linearly between the two evaluations around it. Every method sees the same samples per
  update (`batch`): the synchronous schedules split them into N micro-batches, async 1F1B (PipeDream, SpecTrain,
  PipeOptim) takes one micro-batch of `batch` samples per update, 2BW D micro-batches of batch/D.
- Time per update: the pipeline simulator (pipeoptim.sim) fed with costs measured here on the same model: each
  layer's forward and backward at every micro-batch size used (summed per stage), and each method's own work per
  stage measured in a steady-state loop with the schedule's s micro-batches in flight (the optimizer step,
  PipeOptim's fused step+prediction, SpecTrain's two predictions, PipeDream's and 2BW's weight copies). Every
  method steps with torch's fused optimizer (the fastest torch step on CPU), in the runs and the timings alike.
  Costs are CPU time of the measuring thread (`time.thread_time`, one torch thread), which the other processes on
  a shared machine do not inflate the way they inflate wall time. Each
  synchronous schedule gets its best number of micro-batches N (and BitPipe its better concatenation); async
  schedules run in windows of `window` micro-batches, as the convergence runs do (fill and drain once per
  window). Interleaved 1F1B and BitPipe cut the model into 2D stages: each gets half a D-stage's measured cost.
  Communication is free (CPU processes are no model of a GPU link), which favours BitPipe and interleaved (more
  traffic). A second column ("compute ∝ samples") scales the costs linearly from the largest micro-batch, to
  separate the schedules' bubbles from this CPU's inefficiency at small micro-batches.
- The synchronous schedules compute the same update (one weight version, the mean gradient over `batch`), so
  they share one convergence run per learning rate and seed (the `sync` runs); only their time per update differs.

Evaluation without draining: an async window is one `train_step` of `window` micro-batches. Each stage copies its
real weights after every `eval_every`-th optimizer step (hooked where an LR scheduler would step); the copies of
all stages at step j are the model after j updates, evaluated when the window ends. So curves are fine-grained
while the pipeline warms up and drains only once per window.

Fairness: a learning-rate sweep (seed 0) per method and depth; each method is reported at its own best (fewest
updates to the target among runs that did not diverge; if none reached it, the lowest final loss), with 3 seeds
there (seed 0 reused), mean ± std and paired differences against PipeOptim (same seed: same initial weights and
data order). Diverged runs are counted, never dropped. At the deepest pipeline PipeOptim is also run with the
paper's s = D-k-1 and the public code's s = D-k (bench_convergence's s rules) at PipeOptim's best learning rate.

Workloads (`--workload`): `gpt16` a byte-level GPT with 16 blocks (d=64) on the Python standard library's source,
AdamW, D = 4, 8, 16 (D = 16: one block per stage); `hfgpt2` Hugging Face's GPT-2 (transformers.GPT2LMHeadModel) of
the same size on the same data, cut by pipeoptim.models.hf, 320 updates; `digits` the 8-layer conv net on sklearn's
digits, SGD-momentum, D = 4, 8 (the cheap suite); `suite` all three, one after the other; `quick` a seconds-long
digits study for the test. Another model is one more `Workload` entry with a task that bench_convergence.Task knows.

    python benchmarks/bench_time_to_target.py --workload suite --jobs 2   # the whole study (resumes what is done)
    python benchmarks/bench_time_to_target.py --workload gpt16 --jobs 2   # runs what is missing (resumes), reports
    python benchmarks/bench_time_to_target.py --workload gpt16 --report   # tables and pictures from the CSVs only
    python benchmarks/bench_time_to_target.py --quick --out /tmp/ttt      # the small form the test runs

Writes, in --out (default benchmarks/results): time_to_target_<workload>_runs.csv (one row per training run, its
curve included), _layer_costs.csv and _stage_costs.csv (the measured costs), _summary.csv (one row per method and
depth), _D<d>.png (loss against projected wall time, one line per method); prints the markdown tables.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeoptim.train import NonFiniteError

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _load_bench_convergence():
    if "bench_convergence" in sys.modules:
        return sys.modules["bench_convergence"]
    spec = importlib.util.spec_from_file_location("bench_convergence", os.path.join(HERE, "bench_convergence.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_convergence"] = module
    spec.loader.exec_module(module)
    return module


bc = _load_bench_convergence()


# ---- workloads --------------------------------------------------------------------------------------------------
def gpt_balance(n_blocks: int) -> Callable[[int], list[int]]:
    """Blocks split evenly; the embedding joins the first stage and the head the last (they are small)."""
    def balance(devices: int) -> list[int]:
        if n_blocks % devices:
            raise ValueError(f"{n_blocks} blocks do not split evenly over {devices} stages; use a depth dividing "
                             f"{n_blocks}")
        per = n_blocks // devices
        return [per + 1] + [per] * (devices - 2) + [per + 1] if devices > 1 else [n_blocks + 2]
    return balance


@dataclass(frozen=True)
class Workload:
    name: str
    task: str                      # bench_convergence.Task name
    depths: tuple[int, ...]
    optimizer: str
    lrs: tuple[float, ...]         # the sweep
    batch: int                     # samples per update, every method
    updates: int                   # budget per run
    eval_every: int
    window: int                    # micro-batches per train_step of the async schedules
    targets: tuple[float, ...]     # first: the headline target
    gpt_cfg: dict | None = None
    balance: Callable[[int], list[int]] | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    fused_optimizer: bool = True   # torch's fused step (the fastest torch offers on CPU), in runs and timings alike
    cost_repeats: int = 5          # per round, 3 rounds
    overhead_iters: int = 32
    warmup: int = 0                # updates of linear lr warm-up, every method alike (0: none)
    runs: tuple[str, ...] = ()     # the asynchronous runs the study trains (default: ASYNC_RUNS)
    widen: int = 0                 # times the sweep may be widened by 2x past an edge that holds a method's best
    costs_of: str = ""             # the workload whose measured costs this one's time model reads (default: its own)
    newton_schulz: str = "torch"   # Muon's orthogonalisation in the runs (bench_convergence.newton_schulz)
    reference: str = "pipeoptim"   # the method the report's paired differences are taken against
    train_sync: bool = True        # whether run_study trains the synchronous run (--only without "sync": no)

    def __post_init__(self):
        if self.updates % self.eval_every or any(self.window % d for d in self.depths):
            raise ValueError(f"workload {self.name}: updates must be a multiple of eval_every and window a multiple "
                             "of every depth (2BW updates once per D micro-batches)")

    @property
    def metric(self) -> str:
        return "acc" if self.task == "digits" else "loss"

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.metric == "acc" else value <= target

    def stage_balance(self, devices: int) -> list[int] | None:
        return None if self.balance is None else self.balance(devices)

    @property
    def async_runs(self) -> tuple[str, ...]:
        return self.runs or ASYNC_RUNS

    def lr_scheduler(self):
        """Pipeline's lr_scheduler: a linear warm-up over `warmup` updates, then the sweep's lr (None: none)."""
        from pipeoptim.recipes import linear_warmup
        return None if self.warmup <= 0 else linear_warmup(self.warmup)


GPT16 = dict(seq_len=32, d_model=64, n_heads=4, n_layers=16)
# gpt16-async's model, data, batch, warm-up and costs at D = 16, with Muon's orthogonalisation in fp32 (for a CPU
# without bf16): the settings of the workloads trained on one machine for issue 43
GPT16_ONE_MACHINE = dict(eval_every=32, window=256, targets=(2.5, 2.4), gpt_cfg=GPT16, balance=gpt_balance(16),
                         warmup=64, train_sync=False, costs_of="gpt16-async", newton_schulz="bf16-in-fp32")
WORKLOADS = {w.name: w for w in [
    # lr: a pilot of synchronous training plateaued at 3.1 nats with 3e-3, so the sweep brackets 1e-3 from below
    Workload("gpt16", "gpt", (4, 8, 16), "adamw", (5e-4, 1e-3, 2e-3), batch=16, updates=512, eval_every=32,
             window=256, targets=(2.5, 2.4), gpt_cfg=GPT16, balance=gpt_balance(16)),
    # issue 20's study: gpt16 with a warm-up of 64 updates for every method, the sweep widened until each best is
    # bracketed, the section-6 asynchronous methods beside the candidates (bench_convergence.CANDIDATES); four
    # widenings (lr up to 3.2e-2), as synchronous Muon was still fastest at 8e-3, then at 1.6e-2
    Workload("gpt16-async", "gpt", (4, 8, 16), "adamw", (5e-4, 1e-3, 2e-3), batch=16, updates=512, eval_every=32,
             window=256, targets=(2.5, 2.4), gpt_cfg=GPT16, balance=gpt_balance(16), warmup=64, widen=4,
             runs=("pipeoptim-2bw", "2bw", "pipeoptim-2bw-b99", "pipeoptim-exact", "stash", "nesterov",
                   "pipeoptim-nadam", "stash-dc", "zb-pipeoptim", "stash-dc10", "stash-dc100", "stash-dc1000", "stash-muon", "pipeoptim-muon",
                   "sync-muon", "2bw-muon")),
    # issue 43's update gap at D = 4, 8, 16, trained on a CPU without bf16 arithmetic: gpt16-async's model, data,
    # warm-up and costs (its Xeon-measured time per update), the four Muon runs only, each swept here with the same
    # fp32-computed bf16 orthogonalisation (torch's own is ~20x slower there), to 192 updates (the target 2.5
    # falls at 77-106 in gpt16-async)
    Workload("gpt16-lookahead", "gpt", (4, 8, 16), "adamw", (8e-3, 1.6e-2, 3.2e-2), batch=16, updates=192, widen=2,
             runs=("sync-muon", "2bw-muon", "pipeoptim-2bw-muon", "lookahead-2bw-muon"), reference="2bw-muon",
             **GPT16_ONE_MACHINE),
    # issue 43's in-flight depth: what twice the micro-batches in flight (in_flight=2, the latency-hiding variant
    # of the regime map) costs PipeOptim + Muon on async 1F1B in updates to 2.5, against in_flight=1, both trained
    # here as gpt16-lookahead's runs are; 768 updates (in_flight=1 needed 477 in gpt16-async)
    Workload("gpt16-inflight", "gpt", (16,), "adamw", (2e-3, 4e-3, 8e-3), batch=16, updates=768, widen=2,
             runs=("pipeoptim-muon", "pipeoptim-muon-inflight2"), reference="pipeoptim-muon", **GPT16_ONE_MACHINE),
    # 2x in flight did not reach 2.5 in 768 updates; over the internet it is first only if it does within ~900:
    # its best lr there (8e-3, by final loss) with 3 seeds to 1280 updates
    Workload("gpt16-inflight-long", "gpt", (16,), "adamw", (8e-3,), batch=16, updates=1280,
             runs=("pipeoptim-muon-inflight2",), reference="pipeoptim-muon-inflight2", **GPT16_ONE_MACHINE),
    # and 2BW + Muon at 4x in flight (the regime map's other latency-hiding variant), against gpt16-lookahead's
    # 2BW + Muon (1x: the same forward/backward weights, two versions suffice); 384 updates
    Workload("gpt16-inflight-2bw", "gpt", (16,), "adamw", (8e-3, 1.6e-2), batch=16, updates=384, widen=2,
             runs=("stash-2bw-muon-inflight4",), reference="stash-2bw-muon-inflight4", **GPT16_ONE_MACHINE),
    Workload("hfgpt2-async", "hfgpt2", (4, 8, 16), "adamw", (5e-4, 1e-3, 2e-3), batch=16, updates=320,
             eval_every=32, window=160, targets=(2.6, 2.5), gpt_cfg=GPT16, balance=gpt_balance(16), warmup=64, widen=2,
             runs=("pipeoptim-2bw", "2bw", "pipeoptim-exact", "stash")),
    # the same at twice the budget: at 320 updates synchronous training itself reached 2.6 in 1 seed of 3
    Workload("hfgpt2-async640", "hfgpt2", (4, 8, 16), "adamw", (5e-4, 1e-3, 2e-3), batch=16, updates=640,
             eval_every=32, window=160, targets=(2.6, 2.5), gpt_cfg=GPT16, balance=gpt_balance(16), warmup=64,
             widen=2, runs=("pipeoptim-2bw", "2bw")),
    # the fastest asynchronous Muon configuration on gpt16 (2BW) and its synchronous baseline, on hfgpt2 at 640
    # updates: the sweep is centred on both their gpt16 bests (1.6e-2); the stage costs are hfgpt2-async640's (same
    # model, batch and window) with Muon's variants measured beside them
    Workload("hfgpt2-muon640", "hfgpt2", (4, 8, 16), "adamw", (4e-3, 8e-3, 1.6e-2), batch=16, updates=640,
             eval_every=32, window=160, targets=(2.6, 2.5), gpt_cfg=GPT16, balance=gpt_balance(16), warmup=64,
             widen=2, runs=("2bw-muon", "sync-muon")),
    # Hugging Face's GPT-2 (transformers.GPT2LMHeadModel, vocabulary 256, no dropout) of gpt16's size, cut by
    # pipeoptim.models.hf into embedding / 16 blocks / norm+head, its tied embeddings two copies under the async
    # schedules; ~1.4x gpt16's cost per update, so 320 updates (window 160) and a first target of 2.6 keep the
    # whole suite under 2 hours
    Workload("hfgpt2", "hfgpt2", (4, 8, 16), "adamw", (5e-4, 1e-3, 2e-3), batch=16, updates=320, eval_every=32,
             window=160, targets=(2.6, 2.5), gpt_cfg=GPT16, balance=gpt_balance(16)),
    Workload("digits", "digits", (4, 8), "sgd", (0.0025, 0.005, 0.01), batch=32, updates=640, eval_every=32,
             window=64, targets=(0.95, 0.97)),
    # seconds-long; lr 30 diverges on purpose (the test checks that divergences are counted, never chosen)
    Workload("quick", "digits", (2, 4), "sgd", (0.005, 0.02, 30.0), batch=8, updates=16, eval_every=4, window=8,
             targets=(0.15, 0.2), seeds=(0, 1), cost_repeats=1, overhead_iters=4),
]}

SUITE = ("gpt16", "hfgpt2", "digits")   # --workload suite: the whole study as one command

# method shown to users -> (bench_convergence method whose runs give its updates, schedule that gives its time)
METHODS = {
    "gpipe": ("sync", "gpipe"),
    "1f1b": ("sync", "1f1b"),
    "interleaved": ("sync", "interleaved"),
    "bitpipe": ("sync", "bitpipe"),
    "pipedream": ("stash", "async-1f1b"),
    "2bw": ("2bw", "2bw"),
    "spectrain": ("spectrain", "async-1f1b"),
    "pipeoptim": ("pipeoptim-exact", "async-1f1b"),
    "zbv": ("sync", "zbv"),
    # issue 20's candidates (bench_convergence.CANDIDATES)
    "pipeoptim-2bw": ("pipeoptim-2bw", "2bw"),
    "pipeoptim-2bw-b99": ("pipeoptim-2bw-b99", "2bw"),
    "nesterov": ("nesterov", "async-1f1b"),
    "pipeoptim-nadam": ("pipeoptim-nadam", "async-1f1b"),
    "stash-dc": ("stash-dc", "async-1f1b"),
    "pipeoptim-zb": ("zb-pipeoptim", "async-zb"),
    "stash-dc10": ("stash-dc10", "async-1f1b"),
    "stash-dc100": ("stash-dc100", "async-1f1b"),
    "stash-dc1000": ("stash-dc1000", "async-1f1b"),
    "stash-muon": ("stash-muon", "async-1f1b"),
    "pipeoptim-muon": ("pipeoptim-muon", "async-1f1b"),
    # the synchronous schedules with the same Muon + AdamW
    "1f1b-muon": ("sync-muon", "1f1b"),
    "bitpipe-muon": ("sync-muon", "bitpipe"),
    "zbv-muon": ("sync-muon", "zbv"),
    "2bw-muon": ("2bw-muon", "2bw"),
    # issue 43: 2BW + Muon with its one update of delay predicted from the last update (PipeOptim), and twice that
    # (a look-ahead: γ = 2, the quadratic model's most stable factor at β1 = 0.95 and one update of delay)
    "pipeoptim-2bw-muon": ("pipeoptim-2bw-muon", "2bw"),
    "lookahead-2bw-muon": ("lookahead-2bw-muon", "2bw"),
    # the same schedule with twice the micro-batches in flight: timed as async-1f1b (communication is free here;
    # bench_regime_map prices the latency it hides)
    "pipeoptim-muon-inflight2": ("pipeoptim-muon-inflight2", "async-1f1b"),
    "stash-2bw-muon-inflight4": ("stash-2bw-muon-inflight4", "2bw"),
}
ASYNC_RUNS = ("stash", "2bw", "spectrain", "pipeoptim-exact")
# runs of a synchronous schedule: their updates do not depend on the depth, so they are trained once (devices 0)
SYNC_RUNS = ("sync",) + tuple(m for m, c in bc.CANDIDATES.items() if c["policy"] is None)
ABLATION = ("s-paper", "s-code")   # s-schedule is pipeoptim-exact itself (tests/test_bench_convergence.py)
REFERENCE = "pipeoptim"
# the weight policy each convergence run uses on every stage (what its per-stage work is measured with)
POLICY_OF_RUN = {"sync": "none", "stash": "stash", "2bw": "2bw", "spectrain": "spectrain",
                 "pipeoptim-exact": "pipeoptim", "s-paper": "pipeoptim", "s-code": "pipeoptim-code",
                 "none": "none", "pipeoptim-2bw": "pipeoptim-2bw", "pipeoptim-2bw-b99": "pipeoptim-2bw",
                 "nesterov": "stash", "pipeoptim-nadam": "pipeoptim", "stash-dc": "stash",
                 "zb-pipeoptim": "pipeoptim", "stash-dc10": "stash", "stash-dc100": "stash", "stash-dc1000": "stash",
                 "stash-muon": "stash-muon", "pipeoptim-muon": "pipeoptim-muon", "sync-muon": "none-muon",
                 "2bw-muon": "2bw-muon", "pipeoptim-2bw-muon": "pipeoptim-2bw-muon",
                 "lookahead-2bw-muon": "pipeoptim-2bw-muon",     # γ changes what is predicted, not its cost
                 "pipeoptim-muon-inflight2": "pipeoptim-muon",
                 "stash-2bw-muon-inflight4": "2bw-muon"}   # timed as 2BW's work (its stash copies uncounted)
# stage-cost variants measured with Muon + AdamW (bench_convergence's "muon"), not the workload's optimizer
MUON_VARIANTS = {"none-muon": ("none", {}), "stash-muon": ("stash", {}),
                 "pipeoptim-muon": ("pipeoptim", {"delta": "last_update"}), "2bw-muon": ("2bw", {}),
                 "pipeoptim-2bw-muon": ("pipeoptim", {"delta": "last_update"})}


# ---- one training run ---------------------------------------------------------------------------------------------
class Diverged(RuntimeError):
    """A stage's weights became non-finite (found at `updates`)."""

    def __init__(self, stage: int, updates: int):
        super().__init__(f"stage {stage} has non-finite weights after {updates} updates")
        self.updates = updates


class Snapshots:
    """Copies of every stage's real weights after each `every`-th optimizer step, keyed by that step count.

    Installed where an LR scheduler would step (the worker calls it right after the stage's step), so it sees the
    real weights, not a prediction. A step count is complete once every stage has passed it."""

    def __init__(self, pipe, every: int):
        self.every = every
        self.pending: dict[int, dict[int, dict]] = defaultdict(dict)
        self.stages = 0
        for w in pipe.workers:
            for chunk, st in w.stages.items():
                if chunk.replica != 0:
                    continue
                st.scheduler = _StageHook(self, chunk.stage, st, st.scheduler)
                self.stages += 1

    def record(self, stage: int, count: int, st) -> None:
        copies = {st.names[n]: p.detach().clone() for n, p in st.module.named_parameters()}
        if not all(torch.isfinite(v).all() for v in copies.values()):
            raise Diverged(stage, count)
        self.pending[count][stage] = copies

    def take(self) -> list[tuple[int, dict]]:
        """Complete snapshots, oldest first, as (updates, {global name: tensor})."""
        done = sorted(c for c, parts in self.pending.items() if len(parts) == self.stages)
        out = []
        for c in done:
            params = {}
            for part in self.pending.pop(c).values():
                params.update(part)
            out.append((c, params))
        return out


class _StageHook:
    def __init__(self, owner: Snapshots, stage: int, st, inner):
        self.owner, self.stage, self.st, self.inner, self.count = owner, stage, st, inner, 0

    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        self.count += 1
        if self.count % self.owner.every == 0:
            self.owner.record(self.stage, self.count, self.st)


def _diverged_cause(e: BaseException) -> Diverged | None:
    while e is not None:
        if isinstance(e, Diverged):
            return e
        e = e.__cause__
    return None


def train_with_snapshots(pipe, task, wl: Workload, samples_per_call: int, per_call: int):
    """Train `pipe` for wl.updates updates, `per_call` updates per train_step on `samples_per_call` samples;
    returns (curve [(updates, metric)], diverged, last train_step's loss)."""
    if wl.updates % per_call:
        raise ValueError(f"{wl.name}: {wl.updates} updates is not a whole number of windows of {per_call} updates")
    snaps = Snapshots(pipe, wl.eval_every)
    curve = [(0, task.evaluate(pipe)[wl.metric])]
    steps, diverged, loss, found = 0, False, float("nan"), None
    while steps < wl.updates and not diverged:
        try:
            loss = pipe.train_step(task.batch(samples_per_call))
        except NonFiniteError:  # the pipeline stopped at a non-finite loss or gradient, before applying it
            diverged, loss = True, float("nan")
        except Exception as e:  # noqa: BLE001 - only a divergence is expected; anything else is re-raised
            cause = _diverged_cause(e)
            if cause is None:
                raise
            diverged, found = True, cause.updates
        steps += per_call
        for count, params in snaps.take():
            if found is None or count < found:
                curve.append((count, task.evaluate_params(params)[wl.metric]))
        if not math.isfinite(loss) or not all(math.isfinite(v) for _, v in curve):
            diverged = True
    if diverged:  # the first evaluation that found it, or the end of the window whose loss was not finite
        curve.append((found if found is not None else min(steps, wl.updates), float("nan")))
    return curve, diverged, loss


def updates_to(curve: list[tuple[int, float]], target: float, wl: Workload) -> float | None:
    """First crossing of `target`, interpolated linearly between the evaluations around it; None if never."""
    prev = None
    for step, value in curve:
        if not math.isfinite(value):
            return None
        if wl.reached(value, target):
            if prev is None:
                return float(step)
            (s0, v0) = prev
            return s0 + (step - s0) * (target - v0) / (value - v0)
        prev = (step, value)
    return None


def run_curve(workload: str, method: str, devices: int, lr: float, seed: int, updates: int | None = None) -> dict:
    """One training run in this process (one thread); the row appended to the runs CSV. ``updates``: another
    budget than the workload's (probe_equal_time.py)."""
    wl = WORKLOADS[workload] if updates is None else dataclasses.replace(WORKLOADS[workload], updates=updates)
    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    task = bc.Task(wl.task, seed, wl.gpt_cfg)
    D = devices or min(wl.depths)  # sync: the update does not depend on the depth
    cfg = dict(devices=D, mbs=wl.batch, optimizer=wl.optimizer, lr=lr)
    pipe, mb_size, kw = bc.build_pipeline(method, task, cfg, wl.window, balance=wl.stage_balance(D),
                                          fused=wl.fused_optimizer, lr_scheduler=wl.lr_scheduler())
    with bc.newton_schulz(wl.newton_schulz):
        curve, diverged, loss = train_with_snapshots(pipe, task, wl, mb_size * kw["microbatches"],
                                                     bc.updates_per_call(kw, D))
    finite = [v for _, v in curve if math.isfinite(v)]
    return {"workload": workload, "method": method, "devices": devices, "lr": lr, "seed": seed,
            "updates": wl.updates, "microbatch_size": mb_size, "diverged": diverged,
            "final": curve[-1][1] if not diverged else float("nan"),
            "best": (max if wl.metric == "acc" else min)(finite) if finite else float("nan"),
            "curve": json.dumps([[s, round(v, 5) if math.isfinite(v) else None] for s, v in curve]),
            "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_key(row: dict) -> tuple:
    return (row["method"], int(row["devices"]), float(row["lr"]), int(row["seed"]))


def read_runs(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    seen = set()
    for r in rows:
        r["devices"], r["seed"], r["lr"] = int(r["devices"]), int(r["seed"]), float(r["lr"])
        r["diverged"] = r["diverged"] == "True"
        r["curve"] = [(s, float("nan") if v is None else v) for s, v in json.loads(r["curve"])]
    out = []
    for r in rows:  # a run made twice (two commands sharing the file) counts once: the first one
        if _run_key(r) not in seen:
            seen.add(_run_key(r))
            out.append(r)
    return out


def _append(path: str, row: dict) -> None:
    new = not os.path.exists(path)
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)
        fh.flush()
        os.fsync(fh.fileno())


def run_missing(wl: Workload, todo: list[tuple], path: str, jobs: int, threads: int) -> None:
    """Run every (method, devices, lr, seed) in `todo` not yet in `path`; rows are appended as runs finish."""
    done = {_run_key(r) for r in read_runs(path)}
    todo = [k for k in dict.fromkeys(todo) if (k[0], k[1], float(k[2]), k[3]) not in done]
    if not todo:
        return
    print(f"{wl.name}: {len(todo)} runs to do ({len(done)} done), {jobs} at a time", flush=True)

    def report(row):
        _append(path, row)
        print(f"  {row['method']} D={row['devices']} lr={row['lr']} seed={row['seed']}: final {row['final']:.4f}"
              f"{' DIVERGED' if row['diverged'] else ''} ({row['wall_s']} s, cpu {row['cpu_s']} s)", flush=True)

    run_curves([(wl.name, *k) for k in todo], jobs, threads, lambda _, row: report(row))


def run_curves(calls: list[tuple], jobs: int, threads: int, done: Callable[[tuple, dict], None]) -> None:
    """``run_curve(*call)`` for every call, `jobs` processes at a time (spawned, `threads` torch threads each);
    ``done(call, row)`` as each finishes (in the order they finish)."""
    if jobs <= 1:
        for call in calls:
            done(call, run_curve(*call))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(run_curve, *call): call for call in calls}
        for f in as_completed(futures):
            done(futures[f], f.result())


# ---- choosing each method's learning rate ---------------------------------------------------------------------
def run_depths(wl: Workload, run: str) -> list[int]:
    return [0] if run in SYNC_RUNS else list(wl.depths)


def best_lr(wl: Workload, rows: list[dict], run: str, devices: int) -> float | None:
    """The sweep's best lr for `run` at `devices` (seed 0 of the sweep): fewest updates to the headline target
    among runs that did not diverge; if none reached it, the best final value. None if every run diverged."""
    sweep = sweep_runs(wl, rows, run, devices)
    ok = [r for r in sweep if not r["diverged"]]
    if not ok:
        return None
    hits = [(updates_to(r["curve"], wl.targets[0], wl), r) for r in ok]
    hits = [(u, r) for u, r in hits if u is not None]
    if hits:
        return min(hits, key=lambda ur: (ur[0], ur[1]["lr"]))[1]["lr"]
    sign = -1 if wl.metric == "acc" else 1
    return min(ok, key=lambda r: sign * float(r["final"]))["lr"]


def sweep_runs(wl: Workload, rows: list[dict], run: str, devices: int) -> list[dict]:
    """The seed-0 runs of `run` at `devices` at the sweep's lrs and at those it was widened to."""
    return [r for r in rows if r["method"] == run and r["devices"] == devices and r["seed"] == wl.seeds[0]
            and r["lr"] in swept_lrs(wl)]


def swept_lrs(wl: Workload) -> set[float]:
    """The sweep's lrs and those widening may add: up to `widen` factor-2 steps past each end."""
    lo, hi = min(wl.lrs), max(wl.lrs)
    return set(wl.lrs) | {lo / 2 ** i for i in range(1, wl.widen + 1)} | {hi * 2 ** i for i in range(1, wl.widen + 1)}


def widen_sweep(wl: Workload, rows: list[dict], run: str, devices: int) -> float | None:
    """The next lr to try when `run`'s best at `devices` is the smallest or largest lr tried (so the sweep has not
    bracketed it) and the sweep may still be widened; None when it is bracketed (or cannot be)."""
    tried = sorted({r["lr"] for r in sweep_runs(wl, rows, run, devices)})
    best = best_lr(wl, rows, run, devices)
    if best is None or len(tried) < 2:
        return None
    allowed = swept_lrs(wl)
    for edge, step in ((tried[0], 0.5), (tried[-1], 2.0)):
        if best == edge and any(math.isclose(edge * step, lr) for lr in allowed):
            return next(lr for lr in allowed if math.isclose(edge * step, lr))
    return None


def plan_runs(wl: Workload, rows: list[dict], phase: str) -> list[tuple]:
    runs = ("sync",) * wl.train_sync + wl.async_runs
    pairs = [(m, d) for m in runs for d in run_depths(wl, m)]
    if phase == "sweep":
        return [(m, d, lr, wl.seeds[0]) for m, d in pairs for lr in wl.lrs]
    if phase in ("widen", "seeds"):
        pick, seeds = (widen_sweep, wl.seeds[:1]) if phase == "widen" else (best_lr, wl.seeds[1:])
        chosen = [(m, d, pick(wl, rows, m, d)) for m, d in pairs]
        return [(m, d, lr, s) for m, d, lr in chosen if lr is not None for s in seeds]
    if phase == "ablation":
        if "pipeoptim-exact" not in wl.async_runs:
            return []
        D = max(wl.depths)
        lr = best_lr(wl, rows, "pipeoptim-exact", D)
        return [] if lr is None else [(m, D, lr, s) for m in ABLATION for s in wl.seeds]
    raise ValueError(phase)


# ---- measured costs -------------------------------------------------------------------------------------------------
def microbatch_sizes(wl: Workload) -> list[int]:
    return [b for b in range(1, wl.batch + 1) if wl.batch % b == 0]


def measure_layer_costs(wl: Workload) -> list[dict]:
    """Median forward and backward seconds of every layer at every micro-batch size (3 interleaved rounds)."""
    from pipeoptim.sim import profile_stages
    task = bc.Task(wl.task, 0, wl.gpt_cfg)
    samples = defaultdict(list)
    for _ in range(3):
        for size in microbatch_sizes(wl):
            x, y = task.batch(size)
            r = profile_stages(task.layers, x, loss_fn=lambda out: task.loss_fn(out, y), repeats=wl.cost_repeats,
                               clock=time.thread_time)
            for layer, (f, b) in enumerate(zip(r["forward"], r["backward"])):
                samples[(layer, size)].append((f, b))
    return [{"layer": layer, "microbatch_size": size, "forward_s": statistics.median(f for f, _ in v),
             "backward_s": statistics.median(b for _, b in v)} for (layer, size), v in sorted(samples.items())]


def steady_s(devices: int, window: int, stage: int) -> tuple[int, int]:
    """(forward s, SpecTrain's backward look-ahead) of a micro-batch in the steady state of async 1F1B."""
    from pipeoptim.runtime.plan import Plan
    from pipeoptim.schedules import get_schedule
    from pipeoptim.schedules.actions import Chunk, Forward
    plan = Plan(get_schedule("async-1f1b", devices, window))
    mb = window // 2
    return plan.s_forward(Forward(mb, stage)), plan.s_backward.get((mb, Chunk(0, stage)), 0)


STAGE_VARIANTS = ("none", "stash", "2bw", "spectrain", "pipeoptim", "pipeoptim-code", "pipeoptim-2bw")


def needed_variants(wl: Workload) -> tuple[str, ...]:
    """The stage-cost variants the workload's time model reads: the standard ones, and the Muon ones when the
    workload trains a Muon run."""
    runs = {"sync"} | set(wl.async_runs)
    return STAGE_VARIANTS + tuple(v for v in MUON_VARIANTS if any(POLICY_OF_RUN.get(r) == v for r in runs))


def measure_stage_overheads(wl: Workload, variants: tuple[str, ...] = STAGE_VARIANTS) -> list[dict]:
    """Per depth, stage and weight policy: the policy's own seconds per micro-batch around the forward and the
    backward (entering and leaving its contexts: predictions, swaps) and per optimizer step (the step itself, fused
    predictions, weight copies), in a steady-state loop that keeps the schedule's s micro-batches in flight.
    A MUON_VARIANTS variant steps with Muon + AdamW (bench_convergence's "muon", momentum 0.95) instead of the
    workload's optimizer."""
    from pipeoptim.optim import as_optimizer
    from pipeoptim.policies import make_policy
    from pipeoptim.train import StageModule
    import copy
    task = bc.Task(wl.task, 0, wl.gpt_cfg)
    x, _ = task.batch(1)
    inputs = []
    with torch.no_grad():
        h = x
        for layer in task.layers:
            inputs.append(h)
            h = StageModule([layer])(*(h if isinstance(h, tuple) else (h,)))
    rows = []
    for D in wl.depths:
        balance = wl.stage_balance(D) or _even(len(task.layers), D)
        starts = [sum(balance[:k]) for k in range(D)]
        for k in range(D):
            s, look = steady_s(D, wl.window, k)
            for variant in variants:
                module = StageModule([copy.deepcopy(m) for m in task.layers[starts[k]:starts[k] + balance[k]]])
                options = {}
                if variant in MUON_VARIANTS:
                    policy, options = MUON_VARIANTS[variant]
                    opt = as_optimizer(bc.make_optimizer("muon", min(wl.lrs), beta1=0.95)(module.parameters()))
                else:
                    policy = "pipeoptim" if variant.startswith("pipeoptim") else variant
                    opt = bc.make_optimizer(wl.optimizer, min(wl.lrs), wl.fused_optimizer)(module.parameters())
                per_update = D if variant in TWO_BW_VARIANTS else 1
                pol = make_policy(policy, module, opt, update_every=per_update, **options)
                s_v = float(D - k) if variant == "pipeoptim-code" else float(s)
                fo, bo, st = _policy_loop(pol, module, inputs[starts[k]], s_v, float(look), int(s),
                                          iters=wl.overhead_iters * per_update)
                pol.close()
                rows.append({"devices": D, "stage": k, "variant": variant, "s": s_v, "lookahead": look,
                             "forward_overhead_s": fo, "backward_overhead_s": bo, "step_s": st})
    return rows


# stage work measured with one update per D micro-batches
TWO_BW_VARIANTS = ("2bw", "pipeoptim-2bw", "2bw-muon", "pipeoptim-2bw-muon")


def _even(layers: int, devices: int) -> list[int]:
    from pipeoptim.stages.partition import balance_by_layers
    return balance_by_layers(layers, devices)


def _policy_loop(pol, module, x, s: float, look: float, in_flight: int, iters: int) -> tuple[float, float, float]:
    fwd, bwd, step = [], [], []
    pending = []
    warm = in_flight + 4
    for i in range(warm + iters):
        t0 = time.thread_time()
        ctx = pol.forward(i, s=s, lookahead=look)
        ctx.__enter__()
        t1 = time.thread_time()
        y = module(*x) if isinstance(x, tuple) else module(x)
        t2 = time.thread_time()
        ctx.__exit__(None, None, None)
        t3 = time.thread_time()
        pending.append((i, y))
        if i >= warm:
            fwd.append((t1 - t0) + (t3 - t2))
        if len(pending) > in_flight:
            j, yj = pending.pop(0)
            t4 = time.thread_time()
            ctx = pol.backward(j, s=look)
            ctx.__enter__()
            t5 = time.thread_time()
            carried = [t for t in (yj if isinstance(yj, tuple) else (yj,)) if t.requires_grad]
            torch.autograd.backward(carried, [torch.ones_like(t) for t in carried])
            t6 = time.thread_time()
            ctx.__exit__(None, None, None)
            t7 = time.thread_time()
            if i >= warm:
                bwd.append((t5 - t4) + (t7 - t6))
            if pol.should_step():
                t8 = time.thread_time()
                pol.step(next_s=s)
                t9 = time.thread_time()
                if i >= warm:
                    step.append(t9 - t8)
    for j, _ in pending:
        pol.discard(j)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(step)


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _read_csv(path: str) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def load_or_measure_costs(wl: Workload, out: str, measure: bool = True) -> "MeasuredCosts":
    paths = [os.path.join(out, f"time_to_target_{wl.costs_of or wl.name}_{kind}.csv")
             for kind in ("layer_costs", "stage_costs")]
    if not all(os.path.exists(p) for p in paths):
        if not measure:
            raise SystemExit(f"no measured costs in {out} for {wl.name}; run without --report first")
        print(f"{wl.name}: measuring per-layer and per-stage costs (1 thread)", flush=True)
        _write_csv(paths[0], measure_layer_costs(wl))
        _write_csv(paths[1], measure_stage_overheads(wl, needed_variants(wl)))
    stage_rows = _read_csv(paths[1])
    missing = tuple(v for v in needed_variants(wl) if not any(r["variant"] == v for r in stage_rows))
    if missing:   # a run added to the workload after its costs were measured: measure only its variants
        if not measure:
            raise SystemExit(f"no stage costs in {paths[1]} for {', '.join(missing)}; run without --report first")
        print(f"{wl.name}: measuring the stage costs of {', '.join(missing)} (1 thread)", flush=True)
        stage_rows += [{k: str(v) for k, v in r.items()} for r in measure_stage_overheads(wl, missing)]
        _write_csv(paths[1], stage_rows)
    return MeasuredCosts(wl, _read_csv(paths[0]), stage_rows)


class MeasuredCosts:
    """Measured costs of one workload, and the simulator's time per update for each method and depth."""

    def __init__(self, wl: Workload, layer_rows: list[dict], stage_rows: list[dict]):
        self.wl = wl
        self.layer = {(int(r["layer"]), int(r["microbatch_size"])): (float(r["forward_s"]), float(r["backward_s"]))
                      for r in layer_rows}
        self.stage = {(int(r["devices"]), int(r["stage"]), r["variant"]):
                      (float(r["forward_overhead_s"]), float(r["backward_overhead_s"]), float(r["step_s"]))
                      for r in stage_rows}
        self.layers = 1 + max(layer for layer, _ in self.layer)

    def compute(self, devices: int, size: int, linear: bool) -> tuple[list[float], list[float]]:
        """Per-stage forward and backward seconds of a micro-batch of `size` samples."""
        balance = self.wl.stage_balance(devices) or _even(self.layers, devices)
        ref = self.wl.batch if linear else size
        scale = size / ref
        fwd, bwd, at = [], [], 0
        for n in balance:
            fwd.append(scale * sum(self.layer[(j, ref)][0] for j in range(at, at + n)))
            bwd.append(scale * sum(self.layer[(j, ref)][1] for j in range(at, at + n)))
            at += n
        return fwd, bwd

    def time_per_update(self, schedule: str, devices: int, policy: str, linear: bool = False) -> dict:
        """Seconds per optimizer update of `schedule` at `devices` with each stage running `policy`'s work."""
        from pipeoptim.schedules import get_schedule
        from pipeoptim.schedules.errors import ScheduleConfigError
        from pipeoptim.sim import Costs as SimCosts, simulate
        D, wl = devices, self.wl
        over = [self.stage[(D, k, policy)] for k in range(D)]  # (around forward, around backward, step) per stage
        if schedule in ("async-1f1b", "2bw", "async-zb"):
            size = wl.batch // D if schedule == "2bw" else wl.batch
            fwd, bwd = self.compute(D, size, linear)
            costs = SimCosts(forward=tuple(f + o[0] for f, o in zip(fwd, over)),
                             backward=tuple(b + o[1] for b, o in zip(bwd, over)), step=tuple(o[2] for o in over))
            sim = simulate(get_schedule(schedule, D, wl.window), costs)
            updates = wl.window // D if schedule == "2bw" else wl.window
            return {"time_s": sim.makespan / updates, "microbatches": wl.window, "microbatch_size": size,
                    "variant": "", "bubble": sim.bubble_ratio}
        best = None
        for N in microbatch_sizes(wl):  # N micro-batches of batch/N samples
            size = wl.batch // N
            fwd, bwd = self.compute(D, size, linear)
            step = [o[2] for o in over]
            around_f, around_b = [o[0] for o in over], [o[1] for o in over]
            if schedule in ("interleaved", "bitpipe", "zbv"):  # 2D stages: half a D-stage's work each
                fwd, bwd, step = ([v / 2 for v in xs for _ in (0, 1)] for xs in (fwd, bwd, step))
                around_f, around_b = ([v for v in xs for _ in (0, 1)] for xs in (around_f, around_b))
            costs = SimCosts(forward=tuple(f + o for f, o in zip(fwd, around_f)),
                             backward=tuple(b + o for b, o in zip(bwd, around_b)), step=tuple(step))
            variants = [{"concat": c, "bwd_ratio": sum(costs.backward) / sum(costs.forward)}
                        for c in ("reference", "paced")] \
                if schedule == "bitpipe" else [{}]
            for kw in variants:
                try:
                    sched = get_schedule(schedule, D, N, **kw)
                except ScheduleConfigError:
                    continue
                sim = simulate(sched, costs)
                row = {"time_s": sim.makespan, "microbatches": N, "microbatch_size": size,
                       "variant": kw.get("concat", ""), "bubble": sim.bubble_ratio}
                if best is None or row["time_s"] < best["time_s"]:
                    best = row
        if best is None:
            raise ValueError(f"{schedule} has no valid number of micro-batches for batch {wl.batch} on {D} devices")
        return best


# ---- the study ------------------------------------------------------------------------------------------------
def run_study(wl: Workload, out: str, jobs: int, threads: int, only: tuple[str, ...] = (),
              depths: tuple[int, ...] = (), screen: bool = False) -> None:
    """Train what is missing of `wl`'s study (resumes); ``only``: just these runs (an asynchronous run of the
    workload, or "sync"; two commands with disjoint ``only`` can share the runs file); ``depths``: only at these depths; ``screen``: only the lr sweep (seed 0, widened
    until bracketed), not the other seeds."""
    if depths:
        if not set(depths) <= set(wl.depths):
            raise SystemExit(f"--depths {' '.join(map(str, depths))}: workload {wl.name} runs at depths "
                             f"{' '.join(map(str, wl.depths))}")
        wl = dataclasses.replace(wl, depths=tuple(depths))
    if only:
        unknown = sorted(set(only) - set(wl.async_runs) - {"sync"})
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: not a run of workload {wl.name} "
                             f"(its runs: sync {' '.join(wl.async_runs)})")
        wl = dataclasses.replace(wl, runs=tuple(m for m in only if m != "sync"), train_sync="sync" in only)
    if jobs > 2:
        print(f"note: {jobs} processes at once on this shared machine; the study's timings assume at most 2",
              file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    load_or_measure_costs(wl, out)
    path = os.path.join(out, f"time_to_target_{wl.name}_runs.csv")
    run_missing(wl, plan_runs(wl, read_runs(path), "sweep"), path, jobs, threads)
    for _ in range(wl.widen):   # one more lr past the edge per round, until every best is bracketed
        run_missing(wl, plan_runs(wl, read_runs(path), "widen"), path, jobs, threads)
    for phase in () if screen else ("seeds", "ablation"):
        run_missing(wl, plan_runs(wl, read_runs(path), phase), path, jobs, threads)


@dataclass
class MethodResult:
    method: str
    devices: int
    lr: float | None
    time: dict = field(default_factory=dict)          # time_per_update's row
    time_linear: dict = field(default_factory=dict)
    per_seed_updates: dict = field(default_factory=dict)   # seed -> updates or None
    final: dict = field(default_factory=dict)              # seed -> final metric (nan: diverged)
    diverged_sweep: int = 0
    diverged_seeds: int = 0
    sweep_runs: int = 0
    seeds: int = 0

    @property
    def per_seed_time(self) -> dict:
        t = self.time["time_s"]
        return {s: (None if u is None else u * t) for s, u in self.per_seed_updates.items()}


def summarise(wl: Workload, rows: list[dict], costs: MeasuredCosts, target: float) -> list[MethodResult]:
    """One MethodResult per (method, depth): the best lr of the sweep and its seeds."""
    out = []
    for D in wl.depths:
        for name, (run, schedule) in METHODS.items():
            res = _result(wl, rows, costs, target, name, run, schedule, D)
            if res is not None:
                out.append(res)
        D_max = max(wl.depths)
        if D == D_max:
            for run in ABLATION:
                res = _result(wl, rows, costs, target, run, run, "async-1f1b", D,
                              lr=best_lr(wl, rows, "pipeoptim-exact", D))
                if res is not None:
                    out.append(res)
    return out


def _result(wl, rows, costs, target, name, run, schedule, D, lr=None) -> MethodResult | None:
    from pipeoptim.schedules.errors import ScheduleConfigError
    rd = 0 if run in SYNC_RUNS else D
    if lr is None:
        lr = best_lr(wl, rows, run, rd)
    mine = [r for r in rows if r["method"] == run and r["devices"] == rd]
    if not mine:
        return None
    sweep = [] if run in ABLATION else sweep_runs(wl, rows, run, rd)
    res = MethodResult(name, D, lr, diverged_sweep=sum(r["diverged"] for r in sweep), sweep_runs=len(sweep))
    try:
        res.time = costs.time_per_update(schedule, D, POLICY_OF_RUN[run])
        res.time_linear = costs.time_per_update(schedule, D, POLICY_OF_RUN[run], linear=True)
    except (ScheduleConfigError, ValueError) as e:
        print(f"  {name} at D={D}: no time per update ({e})", file=sys.stderr)
        return None
    at = [r for r in mine if r["lr"] == lr and r["seed"] in wl.seeds] if lr is not None else []
    for r in at:
        res.per_seed_updates[r["seed"]] = None if r["diverged"] else updates_to(r["curve"], target, wl)
        res.final[r["seed"]] = float("nan") if r["diverged"] else float(r["final"])
    res.diverged_seeds = sum(r["diverged"] for r in at)
    res.seeds = len(at)
    return res


def _ms(vals: list[float], fmt: str = "{:.1f}") -> str:
    """mean ± std of the finite values (the std without a sign)."""
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    if not vals:
        return "–"
    if len(vals) == 1:
        return fmt.format(vals[0])
    return f"{fmt.format(statistics.mean(vals))} ± {fmt.replace('+', '').format(statistics.stdev(vals))}"


def _mean_finite(vals) -> float | str:
    vals = [v for v in vals if math.isfinite(v)]
    return statistics.mean(vals) if vals else ""


def _paired(res: MethodResult, ref: MethodResult | None) -> str:
    if ref is None or res is ref:
        return "–"
    a, b = res.per_seed_time, ref.per_seed_time
    diffs = [a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None]
    if not diffs:
        return "–"
    return _ms(diffs, "{:+.2f}") + f" (n={len(diffs)})"


def _time_of(res: MethodResult, linear: bool = False) -> float | None:
    ups = [u for u in res.per_seed_updates.values() if u is not None]
    if not ups:
        return None
    return statistics.mean(ups) * (res.time_linear if linear else res.time)["time_s"]


def _rank_key(res: MethodResult):
    reached = sum(u is not None for u in res.per_seed_updates.values())
    t = _time_of(res)
    return (-(reached == res.seeds and res.seeds > 0), t if t is not None else math.inf)


def report(wl: Workload, out: str) -> list[dict]:
    path = os.path.join(out, f"time_to_target_{wl.name}_runs.csv")
    rows = read_runs(path)
    if not rows:
        raise SystemExit(f"no runs in {path}; run the study first (without --report)")
    costs = load_or_measure_costs(wl, out, measure=False)
    metric = "test accuracy" if wl.metric == "acc" else "validation loss"
    summary = []
    for ti, target in enumerate(wl.targets):
        results = summarise(wl, rows, costs, target)
        print(f"\n#### {wl.name}: time to {metric} {'≥' if wl.metric == 'acc' else '≤'} {target}"
              f"{' (headline target)' if ti == 0 else ''}\n")
        for D in wl.depths:
            at = [r for r in results if r.devices == D and r.method in METHODS]
            ref = next((r for r in at if r.method == wl.reference), None)
            print(f"D = {D}:\n")
            print("| method | lr (best of sweep) | updates to target (mean ± std) | reached | time per update, ms "
                  f"[N × micro-batch] | **time to target, s** | paired Δ vs {wl.reference}, s | compute ∝ samples: "
                  "time per update, ms / to target, s | diverged (sweep, seeds) | final " + wl.metric + " |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for r in sorted(at, key=_rank_key):
                ups = list(r.per_seed_updates.values())
                reached = sum(u is not None for u in ups)
                t, tl = r.time, r.time_linear
                detail = f"{t['microbatches']} × {t['microbatch_size']}" + (f", {t['variant']}" if t["variant"] else "")
                times = list(r.per_seed_time.values())
                tt_lin = _time_of(r, linear=True)
                lr = "all diverged" if r.lr is None else f"{r.lr:g}"
                print(f"| {r.method} | {lr} | {_ms(ups)} | {reached}/{r.seeds} | {1e3 * t['time_s']:.1f} [{detail}] "
                      f"| **{_ms(times, '{:.2f}')}** | {_paired(r, ref)} | {1e3 * tl['time_s']:.1f} / "
                      f"{'–' if tt_lin is None else f'{tt_lin:.2f}'} | {r.diverged_sweep}/{r.sweep_runs}, "
                      f"{r.diverged_seeds}/{r.seeds} | {_ms(list(r.final.values()), '{:.4f}')} |")
                summary.append({"workload": wl.name, "target": target, "devices": D, "method": r.method,
                                "lr": r.lr, "seeds": r.seeds, "reached": reached,
                                "updates_mean": statistics.mean([u for u in ups if u is not None]) if reached else "",
                                "updates_std": statistics.stdev([u for u in ups if u is not None]) if reached > 1
                                else "",
                                "time_per_update_s": t["time_s"], "microbatches": t["microbatches"],
                                "microbatch_size": t["microbatch_size"], "schedule_variant": t["variant"],
                                "bubble": t["bubble"], "time_to_target_s": _time_of(r) if reached else "",
                                "time_to_target_std_s": statistics.stdev([x for x in times if x is not None])
                                if reached > 1 else "",
                                "time_per_update_linear_s": tl["time_s"],
                                "time_to_target_linear_s": tt_lin if tt_lin is not None else "",
                                "diverged_sweep": r.diverged_sweep, "sweep_runs": r.sweep_runs,
                                "diverged_seeds": r.diverged_seeds,
                                "final_mean": _mean_finite(r.final.values())})
            print()
        if ti == 0:
            _ablation_table(wl, results)
        _overview_table(wl, results, target)
    _sweep_table(wl, rows)
    _write_csv(os.path.join(out, f"time_to_target_{wl.name}_summary.csv"), summary)
    _plot(wl, rows, costs, out)
    print(f"\nwrote {out}/time_to_target_{wl.name}_summary.csv and time_to_target_{wl.name}_D<d>.png")
    return summary


def _overview_table(wl: Workload, results: list[MethodResult], target: float) -> None:
    """Methods × depths: time to target (mean over the seeds that reached it), the first one in bold."""
    rows = [r for r in results if r.method in METHODS]
    print(f"overview: projected seconds to {target} (mean over seeds; k/n = seeds that reached it), each method at its "
          "best lr; first to the target in bold; in brackets the same with compute ∝ samples\n")
    print("| method | " + " | ".join(f"D = {D}" for D in wl.depths) + " |")
    print("|---|" + "---|" * len(wl.depths))
    first = {}
    for D in wl.depths:
        at = sorted((r for r in rows if r.devices == D), key=_rank_key)
        if at and _time_of(at[0]) is not None:
            first[D] = at[0].method
    for name in (m for m in METHODS if any(x.method == m for x in rows)):   # the methods this workload trains
        cells = []
        for D in wl.depths:
            r = next((x for x in rows if x.devices == D and x.method == name), None)
            if r is None:
                cells.append("–")
                continue
            t, tl = _time_of(r), _time_of(r, linear=True)
            n = sum(u is not None for u in r.per_seed_updates.values())
            if t is None:
                cells.append(f"not reached (0/{r.seeds})")
                continue
            cell = f"{t:.2f}" + (f" ({n}/{r.seeds})" if n < r.seeds else "") + f" [{tl:.2f}]"
            cells.append(f"**{cell}**" if first.get(D) == name else cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()


def _ablation_table(wl: Workload, results: list[MethodResult]) -> None:
    D = max(wl.depths)
    base = next((r for r in results if r.devices == D and r.method == REFERENCE), None)
    abl = [r for r in results if r.devices == D and r.method in ABLATION]
    if base is None or base.lr is None or not abl:
        return
    print(f"s ablation, PipeOptim at D = {D}, lr {base.lr:g} (PipeOptim's best), target {wl.targets[0]}:\n")
    print("| s rule | updates to target | reached | time per update, ms | time to target, s | paired Δ updates vs "
          "schedule-derived s | final " + wl.metric + " | paired Δ final |")
    print("|---|---|---|---|---|---|---|---|")
    names = {REFERENCE: "schedule-derived (warm-up min(j, D−k−1))", "s-paper": "paper: D−k−1", "s-code": "code: D−k"}
    for r in [base] + abl:
        ups = list(r.per_seed_updates.values())
        d_up = [r.per_seed_updates[s] - base.per_seed_updates[s] for s in r.per_seed_updates
                if s in base.per_seed_updates and r.per_seed_updates[s] is not None
                and base.per_seed_updates[s] is not None]
        seeds = sorted(r.per_seed_updates)
        d_fin = [r.final[s] - base.final[s] for s in r.final if s in base.final]
        print(f"| {names[r.method]} | {_ms(ups)} | {sum(u is not None for u in ups)}/{len(seeds)} | "
              f"{1e3 * r.time['time_s']:.1f} | {_ms(list(r.per_seed_time.values()), '{:.2f}')} | "
              f"{'–' if r is base else _ms(d_up, '{:+.1f}')} | {_ms(list(r.final.values()), '{:.4f}')} | "
              f"{'–' if r is base else _ms(d_fin, '{:+.4f}')} |")
    print()


def _sweep_table(wl: Workload, rows: list[dict]) -> None:
    print(f"\nlearning-rate sweep (seed {wl.seeds[0]}): updates to {wl.targets[0]} (final {wl.metric}); "
          "'div' = diverged, '>U' = not reached in the budget\n")
    lrs = sorted(lr for lr in swept_lrs(wl) if any(x["lr"] == lr for x in rows))
    print("| run | D | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |")
    print("|---|---|" + "---|" * len(lrs) + "---|")
    for run in ("sync",) * wl.train_sync + wl.async_runs:
        for d in run_depths(wl, run):
            cells = []
            for lr in lrs:
                r = next((x for x in rows if x["method"] == run and x["devices"] == d and x["lr"] == lr
                          and x["seed"] == wl.seeds[0]), None)
                if r is None:
                    cells.append("not run")
                elif r["diverged"]:
                    cells.append("div")
                else:
                    u = updates_to(r["curve"], wl.targets[0], wl)
                    cells.append(f"{'>' + str(wl.updates) if u is None else f'{u:.0f}'} ({float(r['final']):.3f})")
            lr = best_lr(wl, rows, run, d)
            print(f"| {run} | {'any' if d == 0 else d} | " + " | ".join(cells) + f" | {'–' if lr is None else f'{lr:g}'} |")


def _plot(wl: Workload, rows: list[dict], costs: MeasuredCosts, out: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    results = summarise(wl, rows, costs, wl.targets[0])
    for D in wl.depths:
        fig, ax = plt.subplots(figsize=(7.5, 4.4))
        lows = []
        for r in sorted((r for r in results if r.devices == D and r.method in METHODS), key=lambda r: r.method):
            run = METHODS[r.method][0]
            rd = 0 if run in SYNC_RUNS else D
            curves = [x["curve"] for x in rows if x["method"] == run and x["devices"] == rd and x["lr"] == r.lr
                      and x["seed"] in wl.seeds]
            by_step = defaultdict(list)
            for c in curves:
                for s, v in c:
                    by_step[s].append(v)
            steps = sorted(s for s, v in by_step.items() if len(v) == len(curves) and all(map(math.isfinite, v)))
            if not steps:
                continue
            mean = [statistics.mean(by_step[s]) for s in steps]
            lows.append(min(mean))
            style = "--" if run in SYNC_RUNS else "-"
            ax.plot([s * r.time["time_s"] for s in steps], mean, style, lw=2.0 if r.method == REFERENCE else 1.2,
                    label=f"{r.method} (lr {r.lr:g})")
        ax.axhline(wl.targets[0], color="k", lw=0.8, ls=":")
        ax.set_xlabel("projected wall time, s (updates × simulated time per update)")
        ax.set_ylabel("test accuracy" if wl.metric == "acc" else "validation loss (nats/byte)")
        if wl.metric == "loss" and lows:
            ax.set_ylim(min(lows) - 0.05, wl.targets[0] + 0.8)
        elif wl.metric == "acc":
            ax.set_ylim(max(0.0, wl.targets[0] - 0.3), 1.0)
        ax.set_title(f"{wl.name}, D = {D}: mean over seeds, each method at its best lr")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"time_to_target_{wl.name}_D{D}.png"), dpi=110)
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS) + ["suite"],
                    help="one or more workloads, one after the other; suite: " + " ".join(SUITE))
    ap.add_argument("--quick", action="store_true", help="the seconds-long digits study (same as --workload quick)")
    ap.add_argument("--report", action="store_true", help="only print tables and draw pictures from the CSVs")
    ap.add_argument("--jobs", type=int, default=2, help="training runs at once (each one thread); at most 2 here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="+", default=(), metavar="RUN",
                    help="train only these of the workload's runs now ('sync' or its asynchronous ones; the rest "
                         "later; the report covers every run found)")
    ap.add_argument("--depths", nargs="+", type=int, default=(), metavar="D",
                    help="train only at these of the workload's depths now")
    ap.add_argument("--screen", action="store_true",
                    help="only the lr sweep (seed 0, widened until each best is bracketed): the screen that picks "
                         "which methods get the other seeds")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.workload = args.workload or ["quick"]
    if not args.workload:
        ap.error("give --workload NAME (or --quick)")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    torch.set_num_threads(args.threads)
    names = [n for name in args.workload for n in (SUITE if name == "suite" else [name])]
    print("command: python " + " ".join([os.path.relpath(os.path.abspath(__file__))] +
                                        (list(argv) if argv is not None else sys.argv[1:])), flush=True)
    t0 = time.perf_counter()
    for name in dict.fromkeys(names):
        t1 = time.perf_counter()
        if not args.report:
            run_study(WORKLOADS[name], args.out, args.jobs, args.threads, tuple(args.only), tuple(args.depths),
                      args.screen)
        report(WORKLOADS[name], args.out)
        print(f"{name}: {time.perf_counter() - t1:.0f} s", flush=True)
    print(f"wall time of this command: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
