"""``pipeoptim train``: train a small GPT-style byte-level model on the Python standard library's source.

The default is the project's showcase: 4 pipeline stages as 4 local processes on CPU (gloo), asynchronous
1F1B with PipeOptim weight prediction and AdamW, a progress bar with loss, tokens/s and bubble time, a
checkpoint and a loss plot under ``--run-dir``; the last line printed is ``final loss: <float>``.
``--emulate`` runs the same schedule in one process (on ``--device``); ``--device cuda`` uses NCCL, one GPU
per stage. ``--model hf-gpt2`` / ``hf-llama`` train a Hugging Face GPT-2 / Llama built from a config (random
init, nothing downloaded) on the meta device, each rank materialising only its own stages
(``pip install 'pipeoptim[hf]'``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

__all__ = ["add_arguments", "register", "run", "main"]

SIZES = {  # name -> (d_model, n_heads, n_layers, seq_len)
    "tiny": (32, 2, 2, 32),
    "small": (64, 4, 4, 64),
    "medium": (128, 4, 6, 128),
    "hf-gpt2": (64, 4, 4, 64),   # transformers.GPT2LMHeadModel, meta-built
    "hf-llama": (64, 4, 4, 64),  # transformers.LlamaForCausalLM, meta-built
}
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", choices=SIZES, default="small",
                   help="tiny, small (default, 0.2M params), medium: the project's GPT; hf-gpt2, hf-llama: Hugging "
                        "Face models of the small size from configs (needs pip install 'pipeoptim[hf]')")
    p.add_argument("--stages", type=int, default=4, help="pipeline devices = processes (default 4)")
    p.add_argument("--schedule", default="async-1f1b",
                   help="gpipe, 1f1b, interleaved, chimera, bitpipe, async-1f1b, 2bw (default async-1f1b)")
    p.add_argument("--policy", default=None,
                   help="weight policy for async schedules: pipeoptim (default), none, stash, spectrain, 2bw")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per schedule window (default 8)")
    p.add_argument("--microbatch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--steps", type=int, default=200, help="schedule windows (train_step calls) to run (default 200)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL, a GPU per stage")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: off)")
    p.add_argument("--run-dir", default="runs/train", help="checkpoint, loss plot and history go here")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --run-dir")
    p.add_argument("--emulate", action="store_true", help="run every stage in this process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _config(args) -> dict:
    from .runtime.config import check_policy, make_schedule
    from .runtime.plan import Plan
    d, h, L, T = SIZES[args.model]
    sched = make_schedule(args.schedule, args.stages, args.microbatches)  # fails here, before any process starts
    policy = check_policy(sched, args.policy)
    Plan(sched)
    from .runtime.config import stages_for
    if stages_for(args.schedule, args.stages) > L + 2:
        from .runtime.plan import ConfigError
        raise ConfigError(f"schedule {args.schedule!r} on {args.stages} devices needs "
                          f"{stages_for(args.schedule, args.stages)} stages but model {args.model!r} has {L + 2} "
                          "layers; use a bigger --model or fewer --stages")
    if args.device == "cuda":
        import torch
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < (1 if args.emulate else args.stages):
            from .runtime.plan import ConfigError
            need = ("a GPU (--emulate runs every stage on one)" if args.emulate
                    else f"{args.stages} GPUs (one per stage)")
            raise ConfigError(f"--device cuda needs {need}; found {found}. Use --device cpu")
    if args.model.startswith("hf-"):
        from .runtime.plan import ConfigError
        try:
            from .models.hf import require_transformers
            require_transformers()
        except ImportError as e:
            raise ConfigError(f"--model {args.model}: {e}") from None
    plain = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}  # picklable
    return dict(plain, d_model=d, n_heads=h, n_layers=L, seq_len=T, policy=policy)


def _optimizer(cfg):
    import torch
    name, lr = cfg["optimizer"], cfg["lr"]
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr)
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)
    return lambda ps: torch.optim.RMSprop(ps, lr=lr)


def train_worker(cfg: dict) -> dict:
    """Runs on every rank (or once, emulated); returns the loss history."""
    import torch

    from .data import stdlib_corpus
    from .models import GPTConfig, gpt_layers
    from .models.gpt import lm_loss
    from .train import Pipeline

    torch.manual_seed(cfg["seed"])
    total_steps = cfg["steps"]
    windows = cfg["microbatches"]
    sched_steps = total_steps * (windows if cfg["schedule"] in ("async-1f1b",) else 1)
    warm = max(1, sched_steps // 20)
    lr_lambda = lambda i: min(1.0, (i + 1) / warm) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(i, sched_steps) / sched_steps)))  # noqa: E731
    hf = cfg["model"].startswith("hf-")
    if hf:
        model_kw = _hf_model(cfg)
    else:
        mcfg = GPTConfig(seq_len=cfg["seq_len"], d_model=cfg["d_model"], n_heads=cfg["n_heads"],
                         n_layers=cfg["n_layers"])
        model_kw = dict(layers=gpt_layers(mcfg, seed=cfg["seed"]), loss_fn=lm_loss)
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)  # noqa: E731
    pipe = Pipeline(optimizer=_optimizer(cfg), lr_scheduler=schedule,
                    devices=cfg["stages"], schedule=cfg["schedule"], policy=cfg["policy"],
                    microbatches=cfg["microbatches"], clip_norm=cfg["clip"] or None, precision=cfg["precision"],
                    emulate=cfg["emulate"], device=cfg["device"], seed=cfg["seed"], **model_kw)
    rank = 0 if cfg["emulate"] else int(os.environ.get("RANK", "0"))
    corpus = stdlib_corpus(max_bytes=4 << 20)
    gen = torch.Generator().manual_seed(cfg["seed"])
    history: list[dict] = []
    run_dir = cfg["run_dir"]
    ckpt = os.path.join(run_dir, "checkpoint")
    start = 0
    if cfg["resume"]:
        extra = pipe.load(ckpt)
        gen.set_state(extra["gen"])
        history = extra["history"]
        start = pipe.step_count
    B = cfg["microbatches"] * cfg["microbatch_size"]
    tokens_per_step = B * cfg["seq_len"]
    bar = None
    if rank == 0 and not cfg["no_progress"]:
        from tqdm import tqdm
        bar = tqdm(total=total_steps, initial=start, desc=f"{cfg['schedule']}+{cfg['policy']}", file=sys.stderr,
                   dynamic_ncols=True)
    t_run = time.perf_counter()
    for step in range(start, total_steps):
        batch = corpus.batch("train", B, cfg["seq_len"], gen)
        if hf:  # Hugging Face's loss takes the input ids as labels and shifts them itself
            batch = (batch[0], batch[0])
        t0 = time.perf_counter()
        loss = pipe.train_step(batch)
        dt = time.perf_counter() - t0
        st = pipe.last_stats
        history.append({"step": step + 1, "loss": loss, "tokens_per_s": tokens_per_step / dt,
                        "bubble": st["bubble"], "grad_norm": st["grad_norm"]})
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                            bubble=f"{st['bubble'] * 100:.0f}%")
            bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_run
    val_batch = corpus.batch("val", B, cfg["seq_len"], torch.Generator().manual_seed(1234))
    val = pipe.eval_step((val_batch[0], val_batch[0]) if hf else val_batch)
    pipe.save(ckpt, extra={"gen": gen.get_state(), "history": history})
    if rank == 0:
        _write_outputs(run_dir, history, cfg)
    return {"history": history, "val_loss": val, "elapsed": elapsed, "rank": rank}


def _hf_model(cfg: dict) -> dict:
    """Pipeline arguments for a Hugging Face model of the configured size, built on meta (no memory: each rank
    materialises its own stages from the seed)."""
    import torch
    import transformers

    from .models.hf import causal_lm_layers
    from .runtime.config import make_schedule
    d, h, L, T = cfg["d_model"], cfg["n_heads"], cfg["n_layers"], cfg["seq_len"]
    common = dict(vocab_size=256, bos_token_id=0, eos_token_id=0)
    if cfg["model"] == "hf-gpt2":
        config = transformers.GPT2Config(n_layer=L, n_embd=d, n_head=h, n_positions=T, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(num_hidden_layers=L, hidden_size=d, intermediate_size=4 * d,
                                          num_attention_heads=h, num_key_value_heads=h, max_position_embeddings=T,
                                          **common)
        cls = transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    cut = causal_lm_layers(model)
    synchronous = make_schedule(cfg["schedule"], cfg["stages"], cfg["microbatches"]).synchronous
    return dict(layers=cut.layers, loss_fn=cut.loss_fn, init_fn=cut.init_fn,
                **({"tied": cut.tied} if synchronous else {"copies": cut.tied}))


def _write_outputs(run_dir: str, history: list[dict], cfg: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "history.json"), "w") as f:
        json.dump({"config": {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool, type(None)))},
                   "history": history}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history])
    ax.set_xlabel("schedule window (train_step)")
    ax.set_ylabel("training loss (nats/byte)")
    model = cfg["model"] if cfg["model"].startswith("hf-") else f"{cfg['model']} GPT"
    ax.set_title(f"{model}, {cfg['stages']} stages, {cfg['schedule']} + {cfg['policy']}, {cfg['optimizer']}")
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "loss.png"), dpi=100)
    plt.close(fig)


def run(args) -> int:
    from .runtime.launcher import launch
    from .runtime.plan import ConfigError
    try:
        cfg = _config(args)
    except ConfigError as e:
        print(f"pipeoptim train: invalid configuration: {e}", file=sys.stderr)
        return 2
    if args.resume and not os.path.exists(os.path.join(args.run_dir, "checkpoint", "meta.pt")):
        print(f"pipeoptim train: --resume but no checkpoint in {args.run_dir}/checkpoint; run without --resume "
              "first", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.emulate:
        import torch
        torch.set_num_threads(max(1, torch.get_num_threads()))
        result = train_worker(cfg)
    else:
        result = launch(train_worker, args.stages, cfg, timeout_s=None)[0]
    hist = result["history"]
    if not hist:
        print(f"nothing to do: the checkpoint is already at step {args.steps}", file=sys.stderr)
    else:
        first, last = hist[0]["loss"], hist[-1]["loss"]
        tail = hist[-max(1, len(hist) // 10):]
        print(f"steps {hist[0]['step']}..{hist[-1]['step']}: loss {first:.4f} -> {last:.4f}; "
              f"{sum(h['tokens_per_s'] for h in tail) / len(tail):,.0f} tokens/s; "
              f"bubble {100 * sum(h['bubble'] for h in tail) / len(tail):.0f}%; "
              f"validation loss {result['val_loss']:.4f}; wall {time.perf_counter() - t0:.0f} s")
        print(f"run directory: {os.path.abspath(args.run_dir)} (checkpoint/, loss.png, history.json)")
    print(f"final loss: {hist[-1]['loss'] if hist else float('nan'):.4f}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to a ``pipeoptim`` argparse subparsers object."""
    p = subparsers.add_parser("train", help="train a small GPT on the stdlib corpus through a pipeline",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="pipeoptim train", description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
