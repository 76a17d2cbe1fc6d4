"""Why the asynchronous runs of the gpt16 time-to-target study stop near 3.1 nats/byte (RESULTS.md section 6).

Two ways to train the study's 16-block byte-level GPT (AdamW, 16 samples per update, seed 0) for a few updates:

- ``--pipeline METHOD``: the study's own path (bench_convergence.build_pipeline with gpt_balance, the fused
  optimizer, Snapshots), in windows of ``--window`` micro-batches; prints the snapshot evaluation, the pipeline's
  own evaluation and the training loss, so the three can be compared.
- default: plain PyTorch with no pipeline: one optimizer over the whole model, one update per micro-batch, stage k
  computing micro-batch t (forward and backward) on its weights ``lags[k]`` updates old (PipeDream's weight
  stashing when lags[k] = D-1-k), the gradient applied to the current weights; one endless window. ``--balance``
  and ``--lags`` choose which layers are stale and by how much, ``--sync-first`` trains without staleness first,
  ``--warmup`` ramps the lr up linearly.

    python benchmarks/probes/probe_gpt16_staleness.py --pipeline stash --devices 4 --updates 128 --window 32
    python benchmarks/probes/probe_gpt16_staleness.py --devices 4 --updates 128                # lags 3,2,1,0
    python benchmarks/probes/probe_gpt16_staleness.py --balance 1,4,13 --lags 0,3,0 --updates 128
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def _study():
    if "bench_time_to_target" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_time_to_target",
                                                      os.path.join(HERE, "bench_time_to_target.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_time_to_target"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_time_to_target"]


def run_pipeline(method: str, devices: int, lr: float, updates: int, window: int, every: int) -> None:
    ttt = _study()
    bc = ttt.bc
    wl = dataclasses.replace(ttt.WORKLOADS["gpt16"], updates=updates, window=window, depths=(devices,))
    torch.manual_seed(0)
    task = bc.Task(wl.task, 0, wl.gpt_cfg)
    pipe, mb, kw = bc.build_pipeline(method, task, dict(devices=devices, mbs=wl.batch, optimizer=wl.optimizer, lr=lr),
                                     window, balance=wl.stage_balance(devices), fused=wl.fused_optimizer)
    per_update = devices if method == "2bw" else 1
    snaps = ttt.Snapshots(pipe, every)
    done = 0
    while done < updates:
        loss = pipe.train_step(task.batch(mb * kw["microbatches"]))
        done += kw["microbatches"] // per_update
        for count, params in snaps.take():
            print(f"{method} D={devices} lr={lr:g}: after {count} updates snapshot {task.evaluate_params(params)['loss']:.4f}",
                  flush=True)
        if done % every == 0:
            print(f"{method} D={devices} lr={lr:g}: after {done} updates evaluate(pipe) "
                  f"{task.evaluate(pipe)['loss']:.4f}, last train_step loss {loss:.4f}", flush=True)


def run_reference(balance: list[int], lags: list[int], lr: float, updates: int, every: int, sync_first: int,
                  warmup: int = 0) -> None:
    ttt = _study()
    bc = ttt.bc
    torch.manual_seed(0)
    task = bc.Task("gpt", 0, ttt.GPT16)
    layers = task.layers
    if sum(balance) != len(layers) or len(lags) != len(balance):
        raise SystemExit(f"--balance must sum to {len(layers)} layers and --lags give one lag per stage")
    starts = [sum(balance[:k]) for k in range(len(balance))]
    stages = [torch.nn.Sequential(*layers[s:s + n]) for s, n in zip(starts, balance)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    history = [[copy.deepcopy(st)] for st in stages]   # newest last
    for t in range(1, updates + 1):
        x, y = task.batch(16)
        for group in opt.param_groups:   # linear lr warm-up over `warmup` updates
            group["lr"] = lr * min(1.0, t / warmup) if warmup else lr
        used = [h[max(0, len(h) - 1 - (lag if t > sync_first else 0))] for h, lag in zip(history, lags)]
        for u in used:
            u.zero_grad(set_to_none=True)
        h = x
        for u in used:
            h = u(h)
        loss = task.loss_fn(h, y)
        loss.backward()
        for st, u in zip(stages, used):
            for p, q in zip(st.parameters(), u.parameters()):
                p.grad = q.grad.clone()
        opt.step()
        for k, st in enumerate(stages):
            history[k] = (history[k] + [copy.deepcopy(st)])[-(max(lags) + 1):]
        if t % every == 0:
            print(f"reference balance={balance} lags={lags} sync_first={sync_first} warmup={warmup} lr={lr:g}: after {t} updates "
                  f"validation {task.evaluate_params(dict(model.named_parameters()))['loss']:.4f}, "
                  f"train {loss.item():.4f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", metavar="METHOD", help="run the study's pipeline path with this bench method")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--balance", help="reference: layers per stage, e.g. 1,4,13 (default: gpt_balance(16)(devices))")
    ap.add_argument("--lags", help="reference: updates of staleness per stage (default: D-1-k)")
    ap.add_argument("--sync-first", type=int, default=0, help="reference: updates without staleness first")
    ap.add_argument("--warmup", type=int, default=0, help="reference: linear lr warm-up over this many updates")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--updates", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--every", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.pipeline:
        run_pipeline(args.pipeline, args.devices, args.lr, args.updates, args.window, args.every)
        return 0
    balance = [int(v) for v in args.balance.split(",")] if args.balance else _study().gpt_balance(16)(args.devices)
    lags = [int(v) for v in args.lags.split(",")] if args.lags else [len(balance) - 1 - k for k in range(len(balance))]
    run_reference(balance, lags, args.lr, args.updates, args.every, args.sync_first, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
