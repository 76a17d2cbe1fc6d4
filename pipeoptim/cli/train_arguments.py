"""``pipeoptim train``'s flags: the parser, the defaults they stand for, and the named recipes they can apply.

Cheap on purpose (no torch, nothing heavy imported): ``pipeoptim --help`` builds this parser, and a wrong flag is
answered before anything loads. The flags are the fields of ``pipeoptim.job.TrainConfig`` (its defaults are theirs:
a test keeps the two equal); the checks that need more than one flag at a time are ``job.checks``'.
"""
from __future__ import annotations

import argparse

from ..delay import LR_RULES, MOMENTUM_RULES
from ..job.config import (ASYNC_1F1B_ADAMW_LR, ASYNC_1F1B_MUON_LR, DEFAULT_LR, OPTIMIZERS, SIZES,
                          checkpoint_stages_spec)

from .arg_types import non_negative_float as _non_negative_float
from .arg_types import non_negative_int as _non_negative_int
from .arg_types import port as _port
from .arg_types import positive_float as _positive_float
from .arg_types import positive_int as _positive_int

__all__ = ["add_arguments", "recipe_names"]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ..runtime.config import ASYNC_POLICIES, SCHEDULES  # no torch: the names only
    p.add_argument("--model", choices=SIZES, default="small",
                   help="tiny, small (0.2M params), medium: the project's GPT; hf-gpt2, hf-llama: Hugging "
                        "Face models of the small size from configs (needs pip install 'pipeoptim[hf]')")
    p.add_argument("--hf-config", default=None, metavar="PATH_OR_NAME",
                   help="train your own Hugging Face causal LM instead of --model: a config.json, a folder holding "
                        "one, or a model name in the local Hugging Face cache (nothing is downloaded; a model_type "
                        "that needs its own code is refused, never run). Random init on the meta device, each rank "
                        "building only its stages; bytes (vocabulary 256) unless --tokenizer")
    p.add_argument("--hf-set", action="append", default=None, metavar="KEY=VALUE",
                   help="--hf-config: change one config entry (repeatable), e.g. --hf-set num_hidden_layers=4 "
                        "--hf-set hidden_size=128 --hf-set vocab_size=512; a key the config lacks or a value of the "
                        "wrong type is refused, naming it")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on this text file, or on every text file under this folder, byte by byte (or "
                        "through --tokenizer); the last 5%% of every file is held out for validation (default: "
                        "the Python standard library's source, every 20th file held out); or a folder of pipeoptim "
                        "prepare-data (a large corpus: tokenized once, read by index, opened only by the ranks "
                        "of the first and last stage)")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="hf-gpt2/hf-llama/--hf-config only: tokenize the text with this local tokenizer (a "
                        "tokenizer.json, "
                        "a folder saved with save_pretrained, or a name in the Hugging Face cache; nothing is "
                        "downloaded); the model's vocabulary takes its size (default: bytes, vocabulary 256)")
    p.add_argument("--stages", type=_positive_int, default=4,
                   help="pipeline devices per replica (processes = stages x dp; under torchrun its WORLD_SIZE "
                        "must be stages x dp)")
    p.add_argument("--dp", type=_positive_int, default=1,
                   help="data-parallel replicas of the pipeline: each trains on its own share of a batch dp times "
                        "as large (--microbatches x --microbatch-size rows each); synchronous schedules average the "
                        "gradients over the replicas before the step, asynchronous ones each stage's at every step")
    p.add_argument("--schedule", action=_Given, choices=SCHEDULES, default="async-1f1b",
                   help="pipeline schedule (pipeoptim schedule NAME draws one); every schedule of pipeoptim "
                        "schedule trains")
    p.add_argument("--policy", action=_Given, choices=ASYNC_POLICIES, default=None,
                   help="weight policy of an asynchronous schedule (default: pipeoptim; 2bw for --schedule 2bw; "
                        "none for synchronous schedules)")
    p.add_argument("--update-every", type=_positive_int, default=None, metavar="M",
                   help="--schedule 2bw: micro-batches per optimizer step (default: --stages, the fewest 2bw "
                        "allows; it must divide --microbatches). --update-every equal to --microbatches takes one "
                        "step per window, as a synchronous schedule does: the fastest 2bw stream")
    p.add_argument("--stream", action="store_true",
                   help="async-1f1b and 2bw: keep the micro-batches in flight from one window to the next (the "
                        "pipeline fills once and never drains between windows; evaluation and checkpoints "
                        "drain it first). Faster per window, but it learns less per update, as more micro-batches "
                        "see the full staleness (on the default run, each at its best --lr: validation loss "
                        "+0.026; README, 'Windows or a stream')")
    p.add_argument("--recipe", choices=recipe_names(), default=None,
                   help="a measured asynchronous configuration by name (pipeoptim.recipes): it sets --schedule, "
                        "--policy, --optimizer, --momentum and --weight-decay (and the --delay-* rules, --predict-from "
                        "or --muon-scale it uses); a "
                        "flag you also give must agree with it, even at its default value; without --lr, the lr it "
                        "was measured at on --stages devices (async-transformer 5e-4 at 4, 8 and 16; "
                        "async-transformer-muon 3.2e-2 at 4, 1.6e-2 at 8 and 16), another depth needs --lr. "
                        "async-transformer-muon: PipeDream-2BW with Muon + "
                        "AdamW (--muon-scale adamw), the fastest asynchronous configuration on a 16-block GPT, at the "
                        "synchronous --lr; async-transformer: PipeDream-2BW with AdamW, at about a quarter of the "
                        "synchronous --lr")
    p.add_argument("--optimizer", action=_Given, choices=OPTIMIZERS, default="muon",
                   help="optimizer of every stage; muon: torch.optim.Muon on the 2-D weights beside AdamW on the "
                        "rest, predicted with --predict-from last_update; nadam: NAdam with decoupled weight decay")
    p.add_argument("--muon-scale", action=_Given, choices=("original", "adamw"), default=None,
                   help="--optimizer muon: how Muon's update is scaled (default: adamw, to AdamW's RMS, torch's "
                        "adjust_lr_fn='match_rms_adamw', so --lr and --weight-decay serve both; what every Muon "
                        "result here was measured with); original: torch's own scale, by the matrix's shape, with "
                        "AdamW at lr 1e-3 on the rest and --weight-decay on AdamW only")
    p.add_argument("--momentum", action=_Given, type=float, default=None,
                   help="β1 of adamw/adam/nadam, momentum of sgd/muon (default: 0.9; muon 0.95)")
    p.add_argument("--weight-decay", action=_Given, type=_non_negative_float, default=None,
                   help="decoupled weight decay of adamw/nadam/muon (default: 0.01; muon 0.1)")
    p.add_argument("--dc", type=_non_negative_float, default=0.0,
                   help="--policy stash: DC-ASGD's delay compensation λ, g + λ·g⊙g⊙(w_now − w_stash) (0: off)")
    p.add_argument("--predict-from", action=_Given, choices=("optimizer", "last_update"), default=None,
                   help="PipeOptim's Δ: the optimizer's own rule or the last applied update (any optimizer) "
                        "(default: last_update for muon, which has no rule of its own; optimizer otherwise)")
    p.add_argument("--delay-lr", action=_Given, choices=LR_RULES, default="none",
                   help="asynchronous schedules: each stage's lr as a function of its delay τ (pipemare: "
                        "lr/τ^(1−min(k/K,1)); graphcore: lr·(0.25+0.75·(1−τ/τmax)))")
    p.add_argument("--delay-momentum", action=_Given, choices=MOMENTUM_RULES, default="none",
                   help="asynchronous schedules: each stage's momentum/β1 as a function of its delay (nesterov: "
                        "m+τ(0.99−m)/P; graphcore: 1−(1−m)(0.1+0.9(1−τ/τmax)))")
    p.add_argument("--delay-warmup", action=_Given, type=_non_negative_int, default=0,
                   help="warm-up K in updates for the delay rules (pipemare's K; else a linear ramp)")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help=f"peak learning rate (default: {ASYNC_1F1B_MUON_LR:g} for async-1f1b with muon, the default "
                        f"pair; {ASYNC_1F1B_ADAMW_LR:g} for async-1f1b with adamw; {DEFAULT_LR:g} otherwise: each "
                        "the best of a 3-seed sweep on the default run, docs/getting-started.md; with --recipe, the "
                        "lr the recipe was measured at); a linear warm-up over 5%% of the updates, then cosine to a "
                        "tenth; with --resume a value you give applies from the checkpoint's step on, and without "
                        "one the checkpoint's stays")
    p.add_argument("--microbatches", type=_positive_int, default=8, help="micro-batches per schedule window")
    p.add_argument("--microbatch-size", type=_positive_int, default=4, help="sequences per micro-batch")
    p.add_argument("--steps", type=_positive_int, default=200, help="schedule windows (train_step calls) to run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL, a GPU per stage")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="training precision")
    p.add_argument("--checkpoint-stages", type=_checkpoint_stages, default=None, metavar="SPEC",
                   help="recompute activations in the backward (any --policy; the recomputation reads the weights the "
                        "policy's backward reads): 'all', stages '0,1', or layers within a stage '0,1:0-2' (stage 0 "
                        "whole, layers 0 to 2 of stage 1, each recomputed on its own) (default: none)")
    p.add_argument("--clip", type=_non_negative_float, default=1.0,
                   help="gradient clipping norm (0: off); with --resume a new value applies")
    p.add_argument("--run-dir", default="runs/train", help="checkpoint/, loss.png and history.json go here")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", nargs="?", const=True, default=False, choices=["auto"],
                       help="continue from the newest intact checkpoint in --run-dir/checkpoint. --resume auto: "
                            "the same where a checkpoint was committed, else start afresh; one command for a "
                            "run's first start and every restart (torchrun --max-restarts, a scheduler's requeue)")
    start.add_argument("--overwrite", action="store_true",
                       help="start afresh in a --run-dir that holds an earlier run: its checkpoints, history.json "
                            "and loss.png are deleted first")
    p.add_argument("--allow-dp-change", action="store_true",
                   help="--resume with another --dp than the checkpoint's: the global batch changes (dp x "
                        "--microbatches x --microbatch-size sequences per window) at the same learning rate; "
                        "without this flag such a resume is refused, saying what would change")
    p.add_argument("--save-every", type=_non_negative_int, default=50,
                   help="write a checkpoint every N windows, and at the end (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=_positive_int, default=2,
                   help="keep the newest K checkpoints (2: one to fall back on)")
    p.add_argument("--eval-every", type=_non_negative_int, default=20,
                   help="validation loss every N windows (on one fixed held-out batch), and at the end (0: only "
                        "at the end)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a NaN/inf loss or gradient: stop with a checkpoint of the last finite state, or skip "
                        "that update and go on")
    p.add_argument("--watchdog-s", type=_positive_float, default=None,
                   help="seconds a rank may make no progress before the job ends naming it (default: "
                        "max(300, 20 x the slowest step))")
    p.add_argument("--port", type=_port, default=None,
                   help="rendezvous port (default: a free one, so several runs can share a machine)")
    p.add_argument("--emulate", action="store_true", help="run every stage in this process")
    p.add_argument("--link", type=_link_spec, default=None, metavar="SPEC",
                   help="benchmarks: emulate a network between the stage processes, every message delivered "
                        "after latency + bytes/bandwidth: a profile (nvlink, infiniband, ethernet-10g, internet) or "
                        "latency=30ms,bandwidth=100Mbit. Labelled as emulation in the outputs")
    p.add_argument("--straggler", type=_straggler_spec, default=None, metavar="STAGE:FACTOR",
                   help="benchmarks: emulate a slow device, e.g. 1:1.5 (pipeline device 1's compute takes 1.5x as "
                        "long: it sleeps 0.5x each op's time). Labelled as emulation in the outputs")
    p.add_argument("--seed", type=int, default=0, help="seeds the model's initial weights and the data order")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(_given=frozenset())  # the recipe flags given (_Given adds them): a recipe compares those
    return p


def recipe_names() -> list[str]:
    from ..recipes import names  # no torch
    return names()


class _Given(argparse.Action):
    """Store a flag's value and note that it was given on the command line: a recipe then compares every flag
    given, whether or not its value equals the default."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, "_given", set(getattr(namespace, "_given", ())) | {self.dest})


def _checkpoint_stages(text: str):
    try:
        return checkpoint_stages_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _link_spec(text: str) -> str:
    from ..links import LinkSpecError, parse_link
    try:
        parse_link(text)
    except LinkSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _straggler_spec(text: str) -> str:
    from ..links import LinkSpecError, parse_straggler
    try:
        parse_straggler(text)
    except LinkSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


