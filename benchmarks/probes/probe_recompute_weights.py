"""What should a recomputed forward read under PipeOptim: the real weights at backward time, or the forward's ŵ?
(issue 24)

PipeOptim's forward reads ŵ, a prediction of the weights real at the micro-batch's backward; its backward reads
those real weights. Activation recomputation runs the forward again inside the backward, and the policy decides
what it reads (``PipeOptimPolicy(recompute_on=...)``):
- ``backward`` (the default): the real weights then, what the backward reads and the prediction aimed at; no
  memory;
- ``forward``: a copy of the forward's ŵ kept per micro-batch in flight (memory like a stash).

Two measurements:

``--part grad``: the gradient of stage 0 of a GPT (embedding and blocks; the head and loss play the downstream
stages: they turn the stage's forward output into the gradient it receives) for a micro-batch forwarded with
version difference s and backwarded after s real AdamW steps, against an independent float64 gradient of the
same model at the real weights of backward time (what the prediction aimed at). Rows: relative error
‖g − g_ref‖/‖g_ref‖ and cosine, for no recomputation (activations from ŵ, weight reads real), recomputation on
the real weights, recomputation on the kept ŵ, and for scale the stale gradient (the weights of forward time).
The gradient the stage received was computed downstream from its forward's output (from ŵ) whatever the choice,
so the ``stage_rel_err`` columns also compare with the stage's own part of the reference: the float64
vector-Jacobian product of the stage at the real weights with that received gradient; and
``rel_err_vs_grad_at_prediction`` with the float64 gradient at ŵ itself (forward and backward at the weights the
forward read: what recomputing on the kept ŵ computes exactly).

``--part convergence``: bench_convergence's gpt4 setting (byte-level GPT, 4 stages, async-1f1b, AdamW) with
PipeOptim, every stage recomputed, both choices and no recomputation, several seeds: final validation loss.

    python benchmarks/probes/probe_recompute_weights.py --part grad
    python benchmarks/probes/probe_recompute_weights.py --part convergence --seeds 0 1 2

Writes benchmarks/results/recompute_weights_grad_warm<warm>.csv or recompute_weights_convergence[_lr<lr>].csv
(the command in every row).
"""
from __future__ import annotations

import argparse
import copy
import csv
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
COMMAND = "python benchmarks/probes/probe_recompute_weights.py " + " ".join(sys.argv[1:])


def _write(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["command"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "command": COMMAND})
    print(f"wrote {path}")


# ---- gradients -------------------------------------------------------------------------------------------
VARIANTS = ("no_recompute", "recompute_real", "recompute_kept_prediction", "stale_forward_weights")


def _stage_and_head(seed: int):
    from pipeoptim.stages.model_cut import StageModule
    from pipeoptim.models import GPTConfig, gpt_layers
    cfg = GPTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=2)
    layers = gpt_layers(cfg, seed=seed)
    return StageModule(layers[:-1]), layers[-1], cfg


def _grad_trial(variant: str, s: int, lr: float, seed: int, warm: int, trials: int):
    """Per trial (relative error, cosine) of `variant`'s stage gradient against float64 at the real weights."""
    from pipeoptim.data import stdlib_corpus
    from pipeoptim.models.gpt import lm_loss
    from pipeoptim.policies import make_policy
    from pipeoptim.stages.recompute import ALL, run_stage
    torch.manual_seed(seed)
    stage, head, cfg = _stage_and_head(seed)
    head.requires_grad_(False)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr, weight_decay=0.1)
    pol = make_policy("pipeoptim", stage, opt,
                      recompute_on="forward" if variant == "recompute_kept_prediction" else "backward")
    pol.recompute = variant.startswith("recompute")
    corpus = stdlib_corpus(max_bytes=2 << 20)
    gen = torch.Generator().manual_seed(1000 + seed)

    def data():
        return corpus.batch("train", 8, cfg.seq_len, gen)

    def plain_step(mb):
        x, y = data()
        with pol.forward(mb):
            out = stage(x)
        with pol.backward(mb):
            lm_loss(head(out), y).backward()
        pol.step()

    for i in range(warm):
        plain_step(("warm", i))
    out_rows = []
    for t in range(trials):
        x, y = data()
        fwd_real = {n: p.detach().clone() for n, p in stage.named_parameters()}
        mb = ("test", t)
        seen = {}
        hook = stage.register_forward_pre_hook(
            lambda mod, a: seen.update({n: p.detach().clone() for n, p in mod.named_parameters()}))
        with pol.forward(mb, s=s):
            out = run_stage(stage, (x,), ALL, lambda: pol.recompute_context(mb)) if pol.recompute else stage(x)
        hook.remove()
        out_d = out.detach().requires_grad_(True)
        dy, = torch.autograd.grad(lm_loss(head(out_d), y), out_d)   # what the downstream stages send back
        for i in range(s):
            plain_step(("between", t, i))
        real = {n: p.detach().clone() for n, p in stage.named_parameters()}
        pol.binding.zero_grad()
        with pol.backward(mb, s=0):
            torch.autograd.backward(out, dy)
        got = torch.cat([p.grad.detach().double().reshape(-1) for p in stage.parameters()])
        ref = _reference(stage, head, real, x, y)
        local = _reference(stage, head, real, x, y, dy)
        at_prediction = _reference(stage, head, seen, x, y)   # the gradient at ŵ, the forward's weights
        if variant == "stale_forward_weights":
            got = _reference(stage, head, fwd_real, x, y, dy)
        pol.binding.zero_grad()
        out_rows.append((float((got - ref).norm() / ref.norm()),
                         float(torch.nn.functional.cosine_similarity(got, ref, dim=0)),
                         float((got - local).norm() / local.norm()),
                         float((got - at_prediction).norm() / at_prediction.norm())))
        pol.step(skip=True)  # drop the tested gradient; the weights move only by the steps in between
    return out_rows


def _reference(stage, head, weights, x, y, dy=None):
    """float64 gradient of the stage's parameters at `weights` (the head fixed), by plain autograd; with `dy`, the
    stage's own part: its vector-Jacobian product with the gradient it received (what the stage controls)."""
    from pipeoptim.models.gpt import lm_loss
    ref_stage, ref_head = copy.deepcopy(stage).double(), copy.deepcopy(head).double()
    with torch.no_grad():
        for n, p in ref_stage.named_parameters():
            p.copy_(weights[n].double())
    ref_head.requires_grad_(False)
    params = list(ref_stage.parameters())
    if dy is not None:
        grads = torch.autograd.grad(ref_stage(x), params, dy.double())
    else:
        grads = torch.autograd.grad(lm_loss(ref_head(ref_stage(x)), y), params)
    return torch.cat([g.reshape(-1) for g in grads])


def part_grad(args) -> None:
    rows = []
    for lr in args.lrs:
        for s in args.s:
            for variant in VARIANTS:
                t0 = time.perf_counter()
                res = []
                for seed in args.seeds:
                    res += _grad_trial(variant, s, lr, seed, args.warm, args.trials)
                errs, coss, local, at_pred = ([r[i] for r in res] for i in range(4))
                row = {"lr": lr, "s": s, "variant": variant, "samples": len(res),
                       "rel_err_mean": f"{statistics.mean(errs):.3e}", "rel_err_max": f"{max(errs):.3e}",
                       "cosine_mean": f"{statistics.mean(coss):.6f}",
                       "stage_rel_err_mean": f"{statistics.mean(local):.3e}",
                       "stage_rel_err_max": f"{max(local):.3e}",
                       "rel_err_vs_grad_at_prediction": f"{statistics.mean(at_pred):.3e}",
                       "seeds": " ".join(map(str, args.seeds)),
                       "warmup_steps": args.warm, "wall_s": round(time.perf_counter() - t0, 1)}
                print(row, flush=True)
                rows.append(row)
    _write(os.path.join(RESULTS, f"recompute_weights_grad_warm{args.warm}.csv"), rows)


# ---- convergence -----------------------------------------------------------------------------------------
RUNS = {"no_recompute": None, "recompute_real": "backward", "recompute_kept_prediction": "forward"}


def part_convergence(args) -> None:
    import math

    from bench_convergence import SUITES, Task, make_optimizer
    from pipeoptim.train import Pipeline
    cfg = dict(SUITES["gpt4"])
    if args.lr:
        cfg["lr"] = args.lr
    rows = []
    for seed in args.seeds:
        for name, on in RUNS.items():
            torch.manual_seed(seed)
            task = Task("gpt", seed)
            kw = dict(checkpoint_stages=True, policy_options={"recompute_on": on}) if on else {}
            pipe = Pipeline(list(task.layers), loss_fn=task.loss_fn, optimizer=make_optimizer("adamw", cfg["lr"]),
                            devices=cfg["devices"], emulate=True, schedule="async-1f1b", policy="pipeoptim",
                            microbatches=args.window, measure_activations=True, **kw)
            t0, steps, last = time.perf_counter(), 0, []
            while steps < cfg["steps"]:
                loss = pipe.train_step(task.batch(cfg["mbs"] * args.window))
                steps += args.window
                last.append(loss)
                if not math.isfinite(loss):
                    break
            ev = task.evaluate(pipe)
            mem = [st.policy.memory_report().get("recompute_kept", 0) for w in pipe.workers
                   for st in w.stages.values()]
            act = [st.policy.peak_activation_bytes for w in pipe.workers for st in w.stages.values()]
            row = {"suite": "gpt4", "lr": cfg["lr"], "updates": steps, "window": args.window, "seed": seed,
                   "run": name, "final_val_loss": round(ev["loss"], 5),
                   "train_loss_last_window": round(last[-1], 5), "kept_prediction_bytes_per_stage":
                   " ".join(map(str, mem)), "peak_activation_bytes_per_stage": " ".join(map(str, act)),
                   "wall_s": round(time.perf_counter() - t0, 1)}
            print(row, flush=True)
            rows.append(row)
    _write(args.csv or os.path.join(RESULTS, "recompute_weights_convergence" + (f"_lr{args.lr:g}" if args.lr else "")
                                    + ".csv"), rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("grad", "convergence"), required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--s", type=int, nargs="+", default=[3, 7], help="grad: version differences (stage 0, D=4/8)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 3e-3], help="grad: AdamW learning rates")
    ap.add_argument("--warm", type=int, default=30, help="grad: AdamW steps before the measured micro-batches")
    ap.add_argument("--trials", type=int, default=3, help="grad: measured micro-batches per seed")
    ap.add_argument("--window", type=int, default=32, help="convergence: micro-batches per train_step")
    ap.add_argument("--lr", type=float, default=None, help="convergence: AdamW lr (default: the gpt4 suite's)")
    ap.add_argument("--csv", default=None, help="convergence: write here instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(RESULTS, exist_ok=True)
    (part_grad if args.part == "grad" else part_convergence)(args)


if __name__ == "__main__":
    main()
