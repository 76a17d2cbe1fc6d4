"""Convergence benchmark: does asynchronous 1F1B with PipeOptim train as well as synchronous training, and better
than the other asynchronous weight policies? (issue 6)

Why this script exists: the weight policies are proven *correct* by the unit tests (they read the weights they
claim to read); whether that matters for *learning* is an empirical question, answered here on real data that is
on every machine, with several seeds, through the single-process emulator (``Pipeline(..., emulate=True)``).

Workloads (``--suite``):
  digits4 / digits8  an 8-layer conv net on scikit-learn's 8x8 digits, SGD with momentum, cut into 4 or 8 stages
                     (the same model both times, so only the pipeline depth, i.e. the staleness, changes)
  gpt4               a small byte-level GPT on the Python standard library's source, AdamW, 4 stages
  gpt4adam           the same with Adam (no weight decay)
  ablate-digits8 / ablate-gpt4
                     PipeOptim exact with three ways of giving s: the schedule-derived s (what the runtime passes),
                     the paper's s = D-k-1 (constant, also during warm-up) and the public code's s = D-k; and
                     ``reference``: the public code's rule as a whole (its Δ and ε, mode "reference", with its s)
  gpt4-zb            gpt4's setting with the asynchronous zero-bubble schedule (async-zb: split backward, device
                     k runs each weight gradient k micro-batches late, a step after every W) against async-1f1b

Methods: ``sync`` (1F1B with one micro-batch per step: every update sees one weight version, the staleness-free
reference with the same samples per update and the same number of updates as the async runs), ``none`` (naive
async 1F1B), ``stash`` (PipeDream), ``2bw`` (PipeDream-2BW: D micro-batches of size b/D accumulated per update, so
samples per update and updates match the others), ``spectrain`` (the paper's s: forward floor(k/2) + D-k-1,
backward floor(k/2); benchmarks/RESULTS.md's ``spectrain-paper`` rows were run with a subclass doing this before the
runtime passed the look-ahead itself, its ``spectrain`` rows with the forward s missing it), ``pipeoptim-paper``,
``pipeoptim-exact``. Suite gpt4-zb adds ``zb-pipeoptim`` (async-zb + PipeOptim exact, s from the schedule: the steps
until the micro-batch's W, D-1 on every stage in steady state), ``zb-pipeoptim-sI`` (the same with s counted only to
the I, D-k-1, the other candidate) and ``zb-none`` (async-zb without prediction).

Every asynchronous run is a stream of ``train_step`` windows of ``--window`` micro-batches (each micro-batch is a
mini-batch and a step); each window warms up and drains, so a small share of micro-batches sees less staleness
than in an endless stream.

    python benchmarks/bench_convergence.py --suite digits4 [--seeds 0 1 2] [--steps 600]
    python benchmarks/bench_convergence.py --report          # tables (markdown) + curves from the CSVs
    python benchmarks/bench_convergence.py --check-executor  # emulator == 2-process executor on these settings?

Writes benchmarks/results/convergence_<suite>.csv (one row per run), convergence_<suite>_curves.csv (eval
points) and, with --report, convergence_summary.csv, convergence_<suite>.png; prints the reproducing command.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("sync", "none", "stash", "2bw", "spectrain", "pipeoptim-paper", "pipeoptim-exact")
ZB_METHODS = ("zb-none", "zb-pipeoptim", "zb-pipeoptim-sI")
# s ablation: method -> (prediction mode, the policy's s_rule); "code" is the public code's s = D - k
ABLATION = {"s-schedule": ("exact", "schedule"), "s-paper": ("exact", "paper"), "s-code": ("exact", "reference"),
            "reference": ("reference", "reference")}
# Issue 20's candidates for training Transformers asynchronously: a schedule and weight policy, plus what each changes
# of the run's optimizer (its kind and β1; the lr stays the sweep's) and the delay-aware rules (pipeoptim.delay).
CANDIDATES = {
    # PipeOptim predicting 2BW's one update of delay (2BW: D micro-batches of b/D per update, two versions)
    "pipeoptim-2bw": dict(schedule="2bw", policy="pipeoptim"),
    # the same with β1 = 0.99, which the quadratic model finds raises prediction's stability limit 3.5x
    "pipeoptim-2bw-b99": dict(schedule="2bw", policy="pipeoptim", beta1=0.99),
    # the ICML 2025 Nesterov paper's recipe: stash + NAdam β1 0.99 (decoupled decay), PipeMare lr, its momentum rule
    "nesterov": dict(schedule="async-1f1b", policy="stash", optimizer="nadam", beta1=0.99,
                     delay=dict(lr="pipemare", momentum="nesterov", warmup=128)),
    # PipeOptim's prediction with the same optimizer and rules
    "pipeoptim-nadam": dict(schedule="async-1f1b", policy="pipeoptim", optimizer="nadam", beta1=0.99,
                            delay=dict(lr="pipemare", momentum="nesterov", warmup=128)),
    # DC-ASGD's delay compensation on stash (benchmarks/quadratic_delay_model.md)
    "stash-dc": dict(schedule="async-1f1b", policy="stash", policy_options=dict(dc=1.0)),
    # its λ swept up: with Adam's small gradients, g⊙g⊙Δw at λ = 1 is a ~1e-4 relative correction
    "stash-dc10": dict(schedule="async-1f1b", policy="stash", policy_options=dict(dc=10.0)),
    "stash-dc100": dict(schedule="async-1f1b", policy="stash", policy_options=dict(dc=100.0)),
    "stash-dc1000": dict(schedule="async-1f1b", policy="stash", policy_options=dict(dc=1000.0)),
    # Muon for the 2-D weights + AdamW for the rest, at the sweep's lr for both (Muon's updates scaled to AdamW's
    # RMS, torch's adjust_lr_fn="match_rms_adamw"), momentum 0.95: stashed, and predicted from the last update
    "stash-muon": dict(schedule="async-1f1b", policy="stash", optimizer="muon", beta1=0.95),
    "pipeoptim-muon": dict(schedule="async-1f1b", policy="pipeoptim", optimizer="muon", beta1=0.95,
                           policy_options=dict(delta="last_update")),
    # 2BW (one update of delay, the delay the 2026 reports find Muon robust to) with the same Muon + AdamW, plain
    # and with PipeOptim predicting the one remaining update from the last one
    "2bw-muon": dict(schedule="2bw", policy="2bw", optimizer="muon", beta1=0.95),
    "pipeoptim-2bw-muon": dict(schedule="2bw", policy="pipeoptim", optimizer="muon", beta1=0.95,
                               policy_options=dict(delta="last_update")),
    # the same prediction doubled (γ = 2: ŵ = w − 2·s·lr·Δ), a look-ahead past the backward's weights: in the
    # quadratic model (quadratic_delay_model.md) at β1 = 0.95 and one update of delay the most stable γ
    # (lr·curvature up to 5.4 against 4.0 at γ = 1), and a faster contraction than γ = 1 at every lr·curvature > 0.1
    "lookahead-2bw-muon": dict(schedule="2bw", policy="pipeoptim", optimizer="muon", beta1=0.95,
                               policy_options=dict(delta="last_update", extrapolate=2.0)),
    # PipeOptim + Muon on async 1F1B with twice the micro-batches in flight (in_flight=2: device d warms up with
    # 2(D-d-1) forwards, which hides a slow link's latency): what the doubled staleness costs in updates
    "pipeoptim-muon-inflight2": dict(schedule="async-1f1b", schedule_options=dict(in_flight=2), policy="pipeoptim",
                                     optimizer="muon", beta1=0.95, policy_options=dict(delta="last_update")),
    # 2BW + Muon with 4x the micro-batches in flight: up to 4 updates between a forward and its backward, so a
    # stash (a weight version per micro-batch in flight) instead of 2BW's two versions
    "stash-2bw-muon-inflight4": dict(schedule="2bw", schedule_options=dict(in_flight=4), policy="stash",
                                     optimizer="muon", beta1=0.95),
    # the synchronous baseline with the same Muon + AdamW (policy None: one micro-batch per step, as "sync")
    "sync-muon": dict(schedule="1f1b", policy=None, optimizer="muon", beta1=0.95),
}

# suite -> settings. lr chosen so that the synchronous reference converges and staleness is visible (see RESULTS.md)
SUITES = {
    "digits4": dict(task="digits", devices=4, optimizer="sgd", lr=0.005, steps=640, mbs=32, eval_every=32,
                    target=0.95, methods=METHODS),
    "digits8": dict(task="digits", devices=8, optimizer="sgd", lr=0.005, steps=640, mbs=32, eval_every=32,
                    target=0.95, methods=METHODS),
    "digits8-hilr": dict(task="digits", devices=8, optimizer="sgd", lr=0.01, steps=640, mbs=32, eval_every=32,
                         target=0.95, methods=METHODS),
    "gpt4": dict(task="gpt", devices=4, optimizer="adamw", lr=3e-4, steps=384, mbs=8, eval_every=32,
                 target=2.6, methods=METHODS),
    "gpt4adam": dict(task="gpt", devices=4, optimizer="adam", lr=3e-4, steps=384, mbs=8, eval_every=32,
                     target=2.6, methods=METHODS),
    "ablate-digits8": dict(task="digits", devices=8, optimizer="sgd", lr=0.005, steps=640, mbs=32, eval_every=32,
                           target=0.95, methods=tuple(ABLATION)),
    "ablate-gpt4": dict(task="gpt", devices=4, optimizer="adamw", lr=3e-4, steps=384, mbs=8, eval_every=32,
                        target=2.6, methods=tuple(ABLATION)),
    "gpt4-zb": dict(task="gpt", devices=4, optimizer="adamw", lr=3e-4, steps=384, mbs=8, eval_every=32,
                    target=2.6, methods=("sync", "pipeoptim-exact") + ZB_METHODS),
}


# ---- models and data ------------------------------------------------------------------------------------------
def digits_net(seed: int) -> list[nn.Module]:
    """8 parameterised layers (6 conv, 2 linear) so that 8 stages hold one layer each and 4 stages two."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        c = lambda i, o: nn.Conv2d(i, o, 3, padding=1)  # noqa: E731
        layers = [nn.Sequential(c(1, 32), nn.ReLU()), nn.Sequential(c(32, 32), nn.ReLU()),
                nn.Sequential(c(32, 32), nn.ReLU(), nn.MaxPool2d(2)), nn.Sequential(c(32, 64), nn.ReLU()),
                nn.Sequential(c(64, 64), nn.ReLU()), nn.Sequential(c(64, 64), nn.ReLU(), nn.MaxPool2d(2)),
                nn.Sequential(nn.Flatten(), nn.Linear(256, 128), nn.ReLU()), nn.Linear(128, 10)]
        for layer in layers:  # He init: with torch's default init this plain 8-layer net barely trains
            for m in layer.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                    nn.init.zeros_(m.bias)
        return layers
    finally:
        torch.random.set_rng_state(state)


GPT_CFG = dict(seq_len=64, d_model=64, n_heads=4, n_layers=2)  # 4 layers: embedding, 2 blocks, head


class Task:
    """Data stream, model layers, loss and evaluation (on a plain nn.Sequential holding the pipeline's weights)."""

    def __init__(self, name: str, seed: int, gpt_cfg: dict | None = None):
        self.name = name
        self.gen = torch.Generator().manual_seed(1000 + seed)
        if name == "digits":
            from pipeoptim.data import digits
            (self.xtr, self.ytr), (self.xte, self.yte) = digits(seed=0)  # same split for every seed
            self.layers = digits_net(seed)
            self.loss_fn = F.cross_entropy
        elif name in ("gpt", "hfgpt2"):
            from pipeoptim.data import stdlib_corpus
            from pipeoptim.models import GPTConfig
            self.cfg = GPTConfig(**(GPT_CFG if gpt_cfg is None else gpt_cfg))
            self.corpus = stdlib_corpus(max_bytes=2 << 20)
            if name == "gpt":
                from pipeoptim.models import gpt_layers
                from pipeoptim.models.gpt import lm_loss
                self.layers, self.loss_fn = gpt_layers(self.cfg, seed=seed), lm_loss
            else:
                self._hf_gpt2(seed)
            g = torch.Generator().manual_seed(7)  # fixed validation windows for every run
            self.val = [self._lm_batch("val", 32, g) for _ in range(8)]
        else:
            raise ValueError(f"unknown task {name!r}; choose 'digits', 'gpt' or 'hfgpt2'")

    def _hf_gpt2(self, seed: int) -> None:
        """Hugging Face's GPT-2 of the same size (vocabulary 256, no dropout), cut into embedding / blocks / head;
        its tied input and output embeddings are one weight under a synchronous schedule and two copies that
        start equal under an asynchronous one (``pipeline_kw``)."""
        from pipeoptim.models.hf import byte_level_config, causal_lm_layers
        c = self.cfg
        config, cls = byte_level_config("gpt2", d_model=c.d_model, n_heads=c.n_heads, n_layers=c.n_layers,
                                        seq_len=c.seq_len)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            cut = causal_lm_layers(cls(config))
        self.layers, self.loss_fn, self.tied = cut.layers, cut.loss_fn, cut.tied

    def pipeline_kw(self, synchronous: bool) -> dict:
        """Extra Pipeline arguments of this task's model (tied embeddings of the HF GPT-2)."""
        tied = getattr(self, "tied", [])
        return {} if not tied else {"tied": tied} if synchronous else {"copies": tied}

    def _lm_batch(self, split: str, size: int, gen: torch.Generator):
        x, y = self.corpus.batch(split, size, self.cfg.seq_len, gen)
        return (x, x) if self.name == "hfgpt2" else (x, y)  # Hugging Face's loss shifts the labels itself

    def batch(self, size: int):
        if self.name == "digits":
            idx = torch.randint(0, len(self.ytr), (size,), generator=self.gen)
            return self.xtr[idx], self.ytr[idx]
        return self._lm_batch("train", size, self.gen)

    def evaluate(self, pipe) -> dict:
        """Test accuracy and loss (digits) or validation loss (gpt) of the pipeline's real weights."""
        return self.evaluate_params(pipe.named_parameters())

    @torch.no_grad()
    def evaluate_params(self, named: dict) -> dict:
        """The same for weights given by global parameter name (e.g. copies taken during a run)."""
        model = nn.Sequential(*[m for m in self.layers])  # architecture only; weights loaded below
        params = {k: v.detach().float() for k, v in named.items()}
        missing, unexpected = model.load_state_dict(params, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"pipeline parameter names do not match the layer list: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        model.eval()
        if self.name == "digits":
            logits = model(self.xte)
            return {"acc": (logits.argmax(1) == self.yte).float().mean().item(),
                    "loss": F.cross_entropy(logits, self.yte).item()}
        from pipeoptim.train import StageModule  # runs layers whose outputs are tuples (the HF cut) like a stage
        whole = StageModule(list(model))
        losses = [self.loss_fn(whole(x), y).item() for x, y in self.val]
        return {"loss": sum(losses) / len(losses)}


# ---- PipeOptim predicting only up to the input-gradient pass (async-zb ablation) ------------------------------
def _register_input_s_policy():
    """PipeOptim predicting each forward only up to its micro-batch's input-gradient pass I (not to its W): the
    runtime passes the steps up to the W, so the table of steps up to the I is set per stage after the Pipeline
    is built (``input_s``: micro-batch -> s)."""
    from pipeoptim.policies import POLICIES, PipeOptimPolicy, register_policy
    if "pipeoptim-sI" in POLICIES:
        return

    class InputSPolicy(PipeOptimPolicy):
        name = "pipeoptim-sI"
        input_s: dict = {}

        @contextmanager
        def forward(self, mb, s=0, lookahead=0):
            with super().forward(mb, s=self.input_s[mb], lookahead=lookahead):
                yield

        def _apply_step(self, next_s):
            super()._apply_step(None)    # the next forward's s is not the runtime's: predict at that forward

    register_policy(InputSPolicy)


# ---- one run ------------------------------------------------------------------------------------------------
def method_config(method: str, devices: int, mbs: int, window: int) -> dict:
    """Pipeline keyword arguments and the per-micro-batch size for `method`."""
    if method in CANDIDATES:
        c = CANDIDATES[method]
        if c["policy"] is None:
            return dict(schedule=c["schedule"], policy=None, microbatches=1), mbs
        kw = dict(schedule=c["schedule"], policy=c["policy"], microbatches=window,
                  policy_options=dict(c.get("policy_options", {})))
        if c.get("schedule_options"):
            kw["schedule_options"] = dict(c["schedule_options"])
        if c.get("delay"):
            kw["delay_hparams"] = dict(c["delay"])
        if c["schedule"] != "2bw":
            return kw, mbs
        if mbs % devices:
            raise ValueError(f"{method} splits each update's {mbs} samples into {devices} micro-batches; use a "
                             f"micro-batch size divisible by {devices}")
        return kw, mbs // devices
    if method == "sync":
        return dict(schedule="1f1b", policy=None, microbatches=1), mbs
    if method == "2bw":
        if mbs % devices:
            raise ValueError(f"2bw splits each update's {mbs} samples into {devices} micro-batches; use a "
                             f"micro-batch size divisible by {devices}")
        return dict(schedule="2bw", policy="2bw", microbatches=window), mbs // devices
    if method in ABLATION:
        mode, s_rule = ABLATION[method]
        return dict(schedule="async-1f1b", policy="pipeoptim", policy_options={"mode": mode, "s_rule": s_rule},
                    microbatches=window), mbs
    if method in ZB_METHODS:
        if method == "zb-pipeoptim-sI":
            _register_input_s_policy()
        pol = {"zb-none": "none", "zb-pipeoptim": "pipeoptim", "zb-pipeoptim-sI": "pipeoptim-sI"}[method]
        return dict(schedule="async-zb", policy=pol, microbatches=window), mbs
    pol = {"pipeoptim-paper": ("pipeoptim", {"mode": "paper"}),
           "pipeoptim-exact": ("pipeoptim", {"mode": "exact"})}.get(method, (method, {}))
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of "
                     f"{', '.join(METHODS + ZB_METHODS + tuple(ABLATION) + tuple(CANDIDATES))}")
    return dict(schedule="async-1f1b", policy=pol[0], policy_options=pol[1], microbatches=window), mbs


def make_optimizer(name: str, lr: float, fused: bool = False, beta1: float = 0.9):
    """fused=True: torch's fused implementation of the same update (the fastest torch step on CPU; NAdam has
    none). ``beta1``: SGD's momentum or the Adam family's β1."""
    extra = {"fused": True} if fused else {}
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=beta1, **extra)
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(beta1, 0.999), weight_decay=0.1, **extra)
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr, betas=(beta1, 0.999), **extra)
    if name == "nadam":  # decoupled decay, as AdamW's
        return lambda ps: torch.optim.NAdam(ps, lr=lr, betas=(beta1, 0.999), weight_decay=0.1,
                                            decoupled_weight_decay=True)
    if name == "muon":
        from pipeoptim.optim import muon_at_adamw_scale
        return muon_at_adamw_scale(lr, momentum=beta1, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd, adam, adamw, nadam or muon")


NEWTON_SCHULZ = ("torch", "bf16-in-fp32")


def _bf16_newton_schulz_in_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                                eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton–Schulz orthogonalisation (torch/optim/_muon.py: bf16 operands, five quintic
    iterations) with every product computed in fp32 and rounded to bf16 where torch's bf16 operation rounds.

    Why: on a CPU without bf16 arithmetic (AVX2) torch's bf16 matmul is ~20x slower than fp32 (a 64x256 pair
    1.26 ms against 64 us on the EPYC here), and the orthogonalisation then dominates a Muon run. Operation by
    operation it rounds as torch's does (on that EPYC each matmul and addmm came out bit-equal); a different
    summation order still moves an element by one bf16 ulp now and then, which the next iterations carry on, as
    another CPU's bf16 kernels would: after five iterations ~0.1-0.6 % of the result's norm
    (tests/test_bench_convergence.py bounds one iteration to a ulp and five to 2 %)."""
    a, b, c = ns_coefficients

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    x = bf16(grad)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = bf16(x / bf16(x.norm()).clamp(min=eps))
    for _ in range(ns_steps):
        gram = bf16(x @ x.T)
        update = bf16(torch.addmm(gram, gram, gram, beta=b, alpha=c))
        x = bf16(torch.addmm(x, update, x, beta=a))
    if grad.size(0) > grad.size(1):
        x = x.T
    return x.bfloat16()


@contextmanager
def newton_schulz(kind: str) -> Iterator[None]:
    """Run torch.optim.Muon's orthogonalisation as `kind`: "torch" (its own, bf16) or "bf16-in-fp32"
    (_bf16_newton_schulz_in_fp32, for CPUs without bf16 arithmetic). Benchmarks only: it replaces a private
    function of torch.optim._muon while the block runs."""
    if kind not in NEWTON_SCHULZ:
        raise ValueError(f"newton_schulz must be one of {', '.join(NEWTON_SCHULZ)}, got {kind!r}")
    from torch.optim import _muon
    if kind == "torch":
        yield
        return
    if not hasattr(_muon, "_zeropower_via_newtonschulz"):
        raise RuntimeError("this torch's Muon has no _zeropower_via_newtonschulz to replace; use newton_schulz='torch'")
    own = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = _bf16_newton_schulz_in_fp32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = own


def updates_per_call(kw: dict, devices: int) -> int:
    """Optimizer updates per train_step of a method's Pipeline arguments (2BW: one per D micro-batches)."""
    return kw["microbatches"] // (devices if kw["schedule"] == "2bw" else 1)


def build_pipeline(method: str, task: "Task", cfg: dict, window: int, balance=None, fused: bool = False,
                   lr_scheduler=None):
    """The emulated pipeline `method` trains with, and the micro-batch size and Pipeline arguments it used.
    ``cfg``: devices, mbs, optimizer, lr (a suite's settings); ``fused``: torch's fused optimizer step;
    ``lr_scheduler``: Pipeline's (e.g. a warm-up). A candidate (CANDIDATES) brings its own optimizer kind and β1."""
    from pipeoptim.schedules import get_schedule
    from pipeoptim.train import Pipeline
    D = cfg["devices"]
    kw, mb_size = method_config(method, D, cfg["mbs"], window)
    synchronous = get_schedule(kw["schedule"], D, kw["microbatches"], **kw.get("schedule_options", {})).synchronous
    own = CANDIDATES.get(method, {})
    optimizer = make_optimizer(own.get("optimizer", cfg["optimizer"]), cfg["lr"], fused and "optimizer" not in own,
                               beta1=own.get("beta1", 0.9))
    pipe = Pipeline(list(task.layers), loss_fn=task.loss_fn, optimizer=optimizer, devices=D, emulate=True,
                    balance=balance, lr_scheduler=lr_scheduler, **kw, **task.pipeline_kw(synchronous))
    if method in ABLATION:     # the constant s rules need each stage's place, which Pipeline does not pass
        for w in pipe.workers:
            for chunk, st in w.stages.items():
                st.policy.place(chunk.stage, D)
    if method == "zb-pipeoptim-sI":
        from pipeoptim.schedules import input_version_difference
        to_input = input_version_difference(pipe.schedule)
        for w in pipe.workers:
            for chunk, st in w.stages.items():
                st.policy.input_s = {mb: float(s) for (stage, mb), s in to_input.items() if stage == chunk.stage}
    return pipe, mb_size, kw


def run_one(suite: str, method: str, seed: int, cfg: dict, window: int) -> tuple[dict, list[dict]]:
    torch.manual_seed(seed)
    task = Task(cfg["task"], seed)
    D = cfg["devices"]
    pipe, mb_size, kw = build_pipeline(method, task, cfg, window)
    per_call = updates_per_call(kw, D)
    curve, steps, t0, train_losses = [], 0, time.perf_counter(), []
    diverged = False
    while steps < cfg["steps"]:
        loss = pipe.train_step(task.batch(mb_size * kw["microbatches"]))
        steps += per_call
        train_losses.append(loss)
        if not math.isfinite(loss):
            diverged = True
        if steps % cfg["eval_every"] < per_call or steps >= cfg["steps"] or diverged:
            ev = task.evaluate(pipe)
            curve.append({"suite": suite, "method": method, "seed": seed, "step": steps,
                          "train_loss": sum(train_losses) / len(train_losses), **ev})
            train_losses = []
        if diverged:
            break
    metric = "acc" if cfg["task"] == "digits" else "loss"
    better = (lambda v: v >= cfg["target"]) if metric == "acc" else (lambda v: v <= cfg["target"])
    hit = next((c["step"] for c in curve if better(c[metric])), None)
    mem = defaultdict(int)
    params = defaultdict(int)
    for w in pipe.workers:
        for chunk, st in w.stages.items():
            mem[chunk.stage] += st.policy.extra_weight_bytes()
            params[chunk.stage] += sum(p.numel() * p.element_size() for p in st.module.parameters())
    last = curve[-1]
    row = {"suite": suite, "method": method, "seed": seed, "devices": D, "optimizer": cfg["optimizer"],
           "lr": cfg["lr"], "steps": steps, "microbatch_size": mb_size, "window": kw["microbatches"],
           "final_" + metric: round(last[metric], 5), "final_train_loss": round(last["train_loss"], 5),
           "diverged": diverged, f"steps_to_{metric}_{cfg['target']}": hit if hit is not None else "",
           "extra_weight_bytes_per_stage": " ".join(str(mem[k]) for k in sorted(mem)),
           "extra_weight_frac_per_stage": " ".join(f"{mem[k] / params[k]:.2f}" if params[k] else "0"
                                                    for k in sorted(mem)),
           "wall_s": round(time.perf_counter() - t0, 1)}
    if metric == "acc":
        row["final_loss"] = round(last["loss"], 5)
    return row, curve


# ---- is the emulator what the distributed executor does, for these settings? --------------------------------
CHECK_METHODS = ("sync", "none", "stash", "2bw", "spectrain", "pipeoptim-paper", "pipeoptim-exact")


def _train_few(method: str, emulate: bool, devices: int, windows: int, window: int) -> dict:
    """A few windows of digits training (SGD-momentum, the digits suites' lr); returns the final parameters."""
    from pipeoptim.train import Pipeline
    torch.manual_seed(0)
    task = Task("digits", 0)
    kw, mb_size = method_config(method, devices, 8, window)
    pipe = Pipeline(list(task.layers), loss_fn=task.loss_fn, optimizer=make_optimizer("sgd", 0.005),
                    devices=devices, emulate=emulate, **kw)
    for _ in range(windows):
        pipe.train_step(task.batch(mb_size * kw["microbatches"]))
    return {k: v.detach().clone() for k, v in pipe.named_parameters().items()}


def check_executor(devices: int = 2, windows: int = 3, window: int = 8) -> list[dict]:
    """Train each method with the distributed executor (``devices`` gloo processes) and with the emulator; report
    the largest parameter difference. The runtime's own test covers AdamW on a GPT; this covers SGD on digits."""
    from pipeoptim.runtime import launch
    rows = []
    for m in CHECK_METHODS:
        dist = {}
        for part in launch(_train_few, devices, m, False, devices, windows, window, timeout_s=300):
            dist.update(part)
        emu = _train_few(m, True, devices, windows, window)
        if set(dist) != set(emu):
            raise RuntimeError(f"{m}: executor and emulator hold different parameters")
        diff = max((dist[k] - emu[k]).abs().max().item() for k in emu)
        per = 1 if m == "sync" else window // (devices if m == "2bw" else 1)
        rows.append({"method": m, "devices": devices, "updates": windows * per,
                     "max_abs_param_diff": diff, "bitwise_equal": all(torch.equal(dist[k], emu[k]) for k in emu)})
        print(rows[-1], flush=True)
    return rows


def _append(path: str, rows: list[dict]) -> None:
    new = not os.path.exists(path)
    fields = list(rows[0])
    if not new:
        with open(path, newline="") as fh:
            header = next(csv.reader(fh), None)
        if header != fields:
            raise RuntimeError(f"{path} has columns {header}, this run writes {fields}; move the old file away")
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)


def run_suite(args) -> None:
    cfg = dict(SUITES[args.suite])
    for k in ("lr", "steps"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    methods = args.methods or cfg["methods"]
    out_runs = os.path.join(args.out, f"convergence_{args.suite}.csv")
    out_curves = os.path.join(args.out, f"convergence_{args.suite}_curves.csv")
    done = set()
    if os.path.exists(out_runs) and not args.fresh:
        with open(out_runs, newline="") as fh:
            done = {(r["method"], int(r["seed"])) for r in csv.DictReader(fh)}
    elif args.fresh:
        for p in (out_runs, out_curves):
            if os.path.exists(p):
                os.remove(p)
    for seed in args.seeds:           # seed-major: a cut-short suite still has every method for the first seeds
        for method in methods:
            if (method, seed) in done:
                print(f"skip {method} seed {seed} (already in {out_runs})", flush=True)
                continue
            row, curve = run_one(args.suite, method, seed, cfg, args.window)
            _append(out_runs, [row])
            _append(out_curves, curve)
            print(row, flush=True)
    print(f"wrote {out_runs} and {out_curves}")


# ---- report -------------------------------------------------------------------------------------------------
def _read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _ms(vals: list[float]) -> str:
    """mean ± std over the finite values; non-finite ones (diverged runs) are counted, not averaged."""
    bad = sum(not math.isfinite(v) for v in vals)
    vals = [v for v in vals if math.isfinite(v)]
    tail = f" ({bad} non-finite)" if bad else ""
    if not vals:
        return "–" + tail
    if len(vals) == 1:
        return f"{vals[0]:.4f}" + tail
    return f"{statistics.mean(vals):.4f} ± {statistics.stdev(vals):.4f}" + tail


def report(out: str) -> None:
    suites = [s for s in SUITES if os.path.exists(os.path.join(out, f"convergence_{s}.csv"))]
    if not suites:
        raise SystemExit(f"no convergence_<suite>.csv in {out}; run a --suite first")
    summary = []
    for suite in suites:
        rows = _read(os.path.join(out, f"convergence_{suite}.csv"))
        metric = "final_acc" if "final_acc" in rows[0] else "final_loss"
        hit_col = next(k for k in rows[0] if k.startswith("steps_to_"))
        by = defaultdict(list)
        for r in rows:
            by[r["method"]].append(r)
        cfg = SUITES[suite]
        print(f"\n### {suite}: {cfg['task']}, D={cfg['devices']}, {cfg['optimizer']} lr={rows[0]['lr']}, "
              f"{rows[0]['steps']} updates\n")
        ref = "sync" if "sync" in by else "s-schedule"
        ref_by_seed = {r["seed"]: float(r[metric]) for r in by.get(ref, [])}
        print(f"| method | seeds | {metric} (mean ± std) | paired Δ vs {ref} (same seeds) | {hit_col} (mean; runs that reached it) | final train loss "
              f"| extra weight bytes per stage (seed {by[next(iter(by))][0]['seed']}) | fraction of stage weights |")
        print("|---|---|---|---|---|---|---|---|")
        known = METHODS + ZB_METHODS + tuple(ABLATION)
        for m in [m for m in known if m in by] + [m for m in by if m not in known]:   # e.g. retired methods' rows
            rs = by[m]
            vals = [float(r[metric]) for r in rs]
            hits = [int(r[hit_col]) for r in rs if r[hit_col] != ""]
            hit = f"{statistics.mean(hits):.0f} ({len(hits)}/{len(rs)})" if hits else f"never (0/{len(rs)})"
            tl = [float(r["final_train_loss"]) for r in rs]
            div = sum(r["diverged"] == "True" for r in rs)
            paired = [float(r[metric]) - ref_by_seed[r["seed"]] for r in rs if r["seed"] in ref_by_seed]
            print(f"| {m}{' (' + str(div) + ' diverged)' if div else ''} | {len(rs)} | {_ms(vals)} | "
                  f"{_ms(paired) if m != ref else '–'} | {hit} | "
                  f"{_ms(tl)} | {rs[0]['extra_weight_bytes_per_stage']} | {rs[0]['extra_weight_frac_per_stage']} |")
            fin = [v for v in vals if math.isfinite(v)]
            summary.append({"suite": suite, "method": m, "seeds": len(rs), "metric": metric,
                            "mean": statistics.mean(fin) if fin else "", "std": statistics.stdev(fin) if len(fin) > 1
                            else "", "non_finite": len(vals) - len(fin),
                            "steps_to_target_mean": statistics.mean(hits) if hits else "",
                            "reached": f"{len(hits)}/{len(rs)}",
                            "extra_weight_bytes_per_stage": rs[0]["extra_weight_bytes_per_stage"]})
        _plot(out, suite, metric.replace("final_", ""))
    with open(os.path.join(out, "convergence_summary.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    print(f"\nwrote {os.path.join(out, 'convergence_summary.csv')} and convergence_<suite>.png")


def _plot(out: str, suite: str, metric: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    curves = _read(os.path.join(out, f"convergence_{suite}_curves.csv"))
    by = defaultdict(lambda: defaultdict(list))
    for c in curves:
        by[c["method"]][int(c["step"])].append(float(c[metric]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m, pts in by.items():
        xs = sorted(pts)
        mean = [statistics.mean(pts[x]) for x in xs]
        lo = [min(pts[x]) for x in xs]
        hi = [max(pts[x]) for x in xs]
        line, = ax.plot(xs, mean, label=m, lw=1.6 if m in ("sync", "pipeoptim-exact", "s-schedule", "zb-pipeoptim")
                        else 1.0)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
    cfg = SUITES[suite]
    ax.set_xlabel("optimizer updates")
    ax.set_ylabel("test accuracy" if metric == "acc" else "validation loss (nats/byte)")
    if metric == "acc":
        ax.set_ylim(0.5, 1.0)
    else:  # the first evaluations dwarf the differences at the end
        low = min(statistics.mean(v) for pts in by.values() for v in pts.values())
        ax.set_ylim(low - 0.05, low + 0.75)
    ax.set_title(f"{suite}: D={cfg['devices']}, {cfg['optimizer']}, mean over seeds (band: min–max)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"convergence_{suite}.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES))
    ap.add_argument("--report", action="store_true", help="summarise every convergence_<suite>.csv in --out")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", help="subset of the suite's methods")
    ap.add_argument("--steps", type=int, help="optimizer updates per run (default: the suite's)")
    ap.add_argument("--lr", type=float, help="learning rate (default: the suite's)")
    ap.add_argument("--window", type=int, default=32, help="micro-batches per train_step for async schedules")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="delete this suite's CSVs first (default: resume)")
    ap.add_argument("--check-executor", action="store_true",
                    help="compare the emulator with the 2-process distributed executor on digits (SGD)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if not (args.suite or args.report or args.check_executor):
        ap.error("give --suite NAME (run), --report (summarise) or --check-executor")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    print("command: python " + " ".join([os.path.relpath(os.path.abspath(__file__))] +
                                        (list(argv) if argv is not None else sys.argv[1:])), flush=True)
    if args.check_executor:
        rows = check_executor()
        path = os.path.join(args.out, "convergence_executor_check.csv")
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {path}")
    if args.suite:
        run_suite(args)
    if args.report:
        report(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
