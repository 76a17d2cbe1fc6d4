"""What ``pipeoptim train`` does, whichever way it was started: the arguments, the configuration and its checks,
the run directory and resume, the per-rank worker and the outputs.

Two modules start a run and both import this one: ``cli.train`` (the subcommand; the local launcher or
``--emulate``) and ``cli.torchrun`` (one rank of a torchrun job). Keeping the shared work here, below both, is
what lets ``cli.train`` hand a torchrun process to ``cli.torchrun`` without the two importing each other.
``cli.train`` re-exports the names that code and tests reach as ``pipeoptim.cli.train.X``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time

from ..data import VOCAB_SIZE  # bytes, unless --tokenizer (pipeoptim.data loads torch only when it reads text)
from ..delay import LR_RULES, MOMENTUM_RULES

__all__ = ["SIZES", "OPTIMIZERS", "NONFINITE_EXIT", "RESUME_MUST_MATCH", "RECIPE_FLAGS", "RUN_DIR_ENTRIES",
           "add_arguments", "default_lr", "recipe_names", "apply_recipe", "emulation_words", "train_worker",
           "resume_config", "check_run_dir", "outputs_from_checkpoint", "report"]

SIZES = {  # name -> (d_model, n_heads, n_layers, seq_len)
    "tiny": (32, 2, 2, 32),
    "small": (64, 4, 4, 64),
    "medium": (128, 4, 6, 128),
    "hf-gpt2": (64, 4, 4, 64),   # transformers.GPT2LMHeadModel, meta-built
    "hf-llama": (64, 4, 4, 64),  # transformers.LlamaForCausalLM, meta-built
}
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "nadam", "muon")  # muon: Muon on the matrices + AdamW
# --lr when none is given. On the default run (the small GPT, 4 stages, 8 micro-batches, AdamW; 3 seeds, each lr
# bracketed on both sides) asynchronous 1F1B learned best at a quarter of the lr that suited the synchronous weights
# (2BW with one update per window, GPipe's weights): 7.5e-4 against 3e-3, validation 2.051 against 2.223 at 3e-3.
DEFAULT_LR, ASYNC_1F1B_ADAMW_LR = 3e-3, 7.5e-4
# The main job's default pair, asynchronous 1F1B + PipeOptim's prediction from the last update + Muon at AdamW's
# scale: the best lr of the same 3-seed sweep, bracketed on both sides (docs/getting-started.md, "The main job").
ASYNC_1F1B_MUON_LR = 8e-3
NONFINITE_EXIT = 3
# what a resumed run must share with the checkpoint it resumes, and why (the rest may change: stages, schedule
# with the same optimizer steps per window, micro-batch size, --steps, --data; --lr and --clip apply, said so)
_DO_NOT_FIT = "its weights and optimizer state do not fit"
RESUME_MUST_MATCH = {
    "model": _DO_NOT_FIT, "optimizer": _DO_NOT_FIT, "precision": _DO_NOT_FIT,
    "tokenizer": "its embedding rows are that tokenizer's token ids",
    "hf_config": _DO_NOT_FIT, "hf_set": _DO_NOT_FIT,
    "muon_scale": "Muon's steps would change size mid-run (its --lr was chosen for the scale it was written with)",
    "hf_model": "the model that --hf-config builds has changed (its config.json was edited?), so " + _DO_NOT_FIT,
    "seed": "a resumed run continues the checkpoint's random state (the data order), so another seed would "
            "change nothing",
}


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
    p.set_defaults(_flag_defaults={dest: p.get_default(dest) for dest in RECIPE_FLAGS})
    return p


def default_lr(schedule: str, optimizer: str) -> float:
    """The peak lr a run gets without --lr (``DEFAULT_LR`` but for the measured asynchronous pairs)."""
    measured = {("async-1f1b", "adamw"): ASYNC_1F1B_ADAMW_LR, ("async-1f1b", "muon"): ASYNC_1F1B_MUON_LR}
    return measured.get((schedule, optimizer), DEFAULT_LR)


def recipe_names() -> list[str]:
    from ..recipes import names  # no torch
    return names()


# the flags a recipe may set, as they are spelled on the command line
RECIPE_FLAGS = {"schedule": "--schedule", "policy": "--policy", "optimizer": "--optimizer", "momentum": "--momentum",
                "weight_decay": "--weight-decay", "delay_lr": "--delay-lr", "delay_momentum": "--delay-momentum",
                "delay_warmup": "--delay-warmup", "predict_from": "--predict-from", "muon_scale": "--muon-scale"}


class _Given(argparse.Action):
    """Store a flag's value and note that it was given on the command line: a recipe then compares every flag
    given, whether or not its value equals the default."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, "_given", set(getattr(namespace, "_given", ())) | {self.dest})


def apply_recipe(args) -> None:
    """Set the flags `--recipe` names; a flag the user gave with another value is an error, never overridden (even
    when the value given is the flag's default). Without --lr, the lr the recipe was measured at on --stages
    devices, or a ConfigError naming the depths it was measured on."""
    if not getattr(args, "recipe", None):
        return
    from ..recipes import get
    from ..errors import ConfigError
    recipe = get(args.recipe)
    given = getattr(args, "_given", None)  # None: args not made by this parser (compare with the defaults)
    defaults = getattr(args, "_flag_defaults", {})
    for dest, value in recipe.cli_flags().items():
        current = getattr(args, dest)
        was_given = dest in given if given is not None else current != defaults.get(dest)
        if was_given and current != value:
            raise ConfigError(f"--recipe {recipe.name} sets {RECIPE_FLAGS[dest]} {value} but you gave "
                              f"{RECIPE_FLAGS[dest]} {current}; drop one of the two (pipeoptim.recipes says what the "
                              "recipe was measured with)")
        setattr(args, dest, value)
    if getattr(args, "lr", None) is None:
        try:
            args.recipe_lr = recipe.lr_for(args.stages)
        except ValueError as e:
            raise ConfigError(f"--recipe {recipe.name} without --lr: {e} with --lr") from None


def _checkpoint_stages(text: str):
    """--checkpoint-stages: 'all' -> True; '0,1:0-2,1:5' -> {0: 'all', 1: [0, 1, 2, 5]} (Pipeline's forms)."""
    if text.strip() == "all":
        return True
    out: dict[int, object] = {}
    try:
        for item in text.split(","):
            stage, _, layers = item.strip().partition(":")
            k = int(stage)
            if not layers:
                out[k] = "all"
                continue
            lo, _, hi = layers.partition("-")
            chosen = list(range(int(lo), int(hi or lo) + 1))
            if not chosen or min(chosen) < 0 or k < 0:
                raise ValueError
            if out.get(k) != "all":
                out[k] = sorted(set(out.get(k, [])) | set(chosen))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'all', stage indices '0,1', or layers within a stage "
                                         "'1:0-2' (stage 1, its layers 0 to 2)") from None
    return out


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


def emulation_words(cfg: dict) -> str:
    """What a run emulates (``--link``, ``--straggler``), for every output that shows its numbers; '' if nothing."""
    from ..links import parse_link, parse_straggler
    parts = []
    if cfg.get("link"):
        parts.append(f"link {parse_link(cfg['link']).describe()}")
    if cfg.get("straggler"):
        device, factor = parse_straggler(cfg["straggler"])
        parts.append(f"straggler device {device} x{factor:g}")
    return ("emulated: " + "; ".join(parts)) if parts else ""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {text}")
    return value


def _schedule_params(cfg: dict) -> dict:
    """The schedule's own parameters among the flags: 2bw's ``update_every`` when given."""
    return {} if cfg.get("update_every") is None else {"update_every": cfg["update_every"]}


def _updates_per_window(cfg: dict) -> int:
    """Optimizer steps stage 0 takes per window of the run ``cfg`` (what the LR scheduler counts)."""
    from ..runtime.config import make_schedule
    from ..schedules.actions import Step
    sched = make_schedule(cfg["schedule"], cfg["stages"], cfg["microbatches"], **_schedule_params(cfg))
    return sum(1 for a in sched.actions[0] if isinstance(a, Step) and a.stage == 0 and a.replica == 0)


def _config(args) -> dict:
    from ..runtime.config import check_policy, make_schedule
    from ..runtime.plan import Plan
    apply_recipe(args)
    if getattr(args, "hf_set", None) and not getattr(args, "hf_config", None):
        from ..errors import ConfigError
        raise ConfigError("--hf-set changes the config of --hf-config; give --hf-config PATH_OR_NAME too")
    hf_spec = _hf_spec(args) if getattr(args, "hf_config", None) else None
    d, h, L, T = SIZES[args.model] if hf_spec is None else _hf_sizes(hf_spec)
    # fails here, before any process starts
    sched = make_schedule(args.schedule, args.stages, args.microbatches, **_schedule_params(vars(args)))
    policy = check_policy(sched, args.policy)
    Plan(sched)
    if args.stream:
        from ..runtime.stream import check_stream
        check_stream(sched)
    _check_delay(vars(args), sched)
    from ..runtime.config import stages_for
    if stages_for(args.schedule, args.stages) > L + 2:
        from ..errors import ConfigError
        raise ConfigError(f"schedule {args.schedule!r} on {args.stages} devices needs "
                          f"{stages_for(args.schedule, args.stages)} stages but model {args.model!r} has {L + 2} "
                          "layers; use a bigger --model or fewer --stages")
    if (args.link or args.straggler) and args.emulate:
        from ..errors import ConfigError
        raise ConfigError("--link and --straggler emulate a network and a slow device between the stage processes; "
                          "--emulate runs every stage in one process. Drop --emulate")
    if args.link and args.device == "cuda":
        from ..errors import ConfigError
        raise ConfigError("--link delays the CPU processes' messages (gloo); on GPUs the transfers are NCCL's own. "
                          "Use --device cpu with --link")
    if args.link:
        from .torchrun_env import torchrun_env
        here = torchrun_env()
        if here is not None and here.local_world_size != here.world_size:
            from ..errors import ConfigError
            raise ConfigError(f"--link emulates a network by comparing the ranks' wall clocks, which only one machine "
                              f"shares, but torchrun runs {here.local_world_size} of the {here.world_size} ranks "
                              "here: run the emulation on one node, or drop --link on a real network")
    if args.straggler:
        from ..links import LinkSpecError, parse_straggler
        from ..errors import ConfigError
        try:
            parse_straggler(args.straggler, args.stages)
        except LinkSpecError as e:
            raise ConfigError(str(e)) from None
    if args.dp > 1 and args.emulate:
        from ..errors import ConfigError
        raise ConfigError(f"--dp {args.dp} runs {args.stages} x {args.dp} processes; --emulate runs one pipeline in "
                          f"this process. Drop --emulate, or emulate one pipeline on the same rows with --dp 1 "
                          f"--microbatch-size {args.microbatch_size * args.dp}")
    if args.device == "cuda":
        import torch
        from .torchrun_env import torchrun_env
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        here = torchrun_env()  # under torchrun: this node's processes, one GPU each
        if found < (1 if args.emulate else here.local_world_size if here else args.stages * args.dp):
            from ..errors import ConfigError
            need = ("a GPU (--emulate runs every stage on one)" if args.emulate
                    else f"{here.local_world_size} GPUs on this node (one per process torchrun starts here)" if here
                    else f"{args.stages * args.dp} GPUs (one per stage and replica)")
            raise ConfigError(f"--device cuda needs {need}; found {found}. Use --device cpu")
    if args.checkpoint_stages:
        from ..recompute import CheckpointStagesError, parse_checkpoint_stages
        from ..errors import ConfigError
        from ..partition import balance_by_layers   # the Pipeline's cut of the model's L + 2 layers (no torch)
        try:
            parse_checkpoint_stages(args.checkpoint_stages,
                                    balance_by_layers(L + 2, stages_for(args.schedule, args.stages)))
        except CheckpointStagesError as e:
            raise ConfigError(f"--checkpoint-stages: {e.problem} (--model {args.model}, --stages {args.stages}, "
                              f"--schedule {args.schedule})") from None
    if args.tokenizer and not args.model.startswith("hf-"):
        from ..errors import ConfigError
        raise ConfigError(f"--tokenizer needs a Hugging Face model (--model hf-gpt2 or hf-llama); --model "
                          f"{args.model} reads bytes")
    prepared = _check_data(args.data, T) if args.data else None  # a prepare-data folder: its manifest
    if args.model.startswith("hf-"):
        from ..errors import ConfigError
        try:
            from ..models.hf import require_transformers
            require_transformers()
        except ImportError as e:
            raise ConfigError(f"--model {args.model}: {e}") from None
    plain = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}  # picklable
    cfg = dict(plain, d_model=d, n_heads=h, n_layers=L, seq_len=T, policy=policy, vocab_size=VOCAB_SIZE,
               cores=_cores(), lr_given=args.lr is not None,
               lr=args.lr if args.lr is not None else getattr(args, "recipe_lr", None) or
               default_lr(args.schedule, args.optimizer))
    _check_prediction(cfg)
    cfg.update(predict_from=_predict_from(cfg),  # what runs, as history.json and the checkpoint record it
               muon_scale=_muon_scale(cfg) if cfg["optimizer"] == "muon" else None)
    if prepared:
        cfg.update(_prepared_config(args, prepared))
    cfg["emulation"] = emulation_words(cfg)
    if args.tokenizer:
        cfg["vocab_size"] = _check_tokens(cfg)
        if not prepared:  # (a prepared folder records its tokenizer's files itself)
            cfg["tokenizer_sha256"] = _tokenizer_identity(args.tokenizer)
    if hf_spec is not None:
        cfg["hf_spec"] = _hf_spec(args, cfg["vocab_size"]) if cfg["vocab_size"] != VOCAB_SIZE else hf_spec
        cfg["hf_model"] = f"{hf_spec['model_type']} (config sha256 {cfg['hf_spec']['sha256'][:16]})"
        for note in cfg["hf_spec"]["notes"]:
            print(f"pipeoptim train: --hf-config: {note}", file=sys.stderr)
    return cfg


def _check_data(path: str, seq_len: int) -> dict | None:
    """ConfigError unless --data can fill a window of ``seq_len`` in each split; a folder of ``pipeoptim
    prepare-data`` returns its manifest (read from the manifest and the shards' sizes: no token is read)."""
    from ..data import DataError, check_text
    from ..errors import ConfigError
    from ..token_shards import SPLITS, is_prepared, read_manifest
    try:
        if is_prepared(path):
            manifest = read_manifest(path)
            counts = {s: manifest["splits"][s]["tokens"] for s in SPLITS}
            if min(counts.values()) < seq_len + 2:
                raise ConfigError(f"--data: {path} holds {counts['train']} training and {counts['val']} held-out "
                                  f"tokens, too few for one window of {seq_len} tokens and the next ({seq_len + 2} "
                                  "needed in each): prepare more text")
            return manifest
        check_text(path, seq_len)
        return None
    except DataError as e:
        raise ConfigError(f"--data: {e}") from None
    except OSError as e:
        raise ConfigError(f"--data: {path} cannot be read: {e.strerror or e}") from None


def _load_tokenizer(name: str):
    from ..data import DataError, load_tokenizer
    from ..errors import ConfigError
    try:
        return load_tokenizer(name)
    except DataError as e:
        raise ConfigError(f"--tokenizer: {e}") from None


def _corpus(cfg: dict):
    """The run's text: --data or the standard library's source, as bytes or through --tokenizer."""
    from ..data import stdlib_corpus, text_corpus
    encode = _load_tokenizer(cfg["tokenizer"])[0] if cfg.get("tokenizer") else None
    if cfg.get("data"):
        return text_corpus(cfg["data"], encode=encode)
    return stdlib_corpus(max_bytes=4 << 20, encode=encode)


def _check_tokens(cfg: dict) -> int:
    """The tokenizer's vocabulary size, after checking that the tokenized text fills a window in each split."""
    from ..errors import ConfigError
    if cfg.get("prepared"):  # checked against the folder's manifest (_prepared_config): no text to tokenize
        return cfg["vocab_size"]
    vocab = _load_tokenizer(cfg["tokenizer"])[1]
    corpus = _corpus(cfg)
    train, val, T = corpus.train.numel(), corpus.val.numel(), cfg["seq_len"]
    if min(train, val) < T + 2:
        raise ConfigError(f"--tokenizer {cfg['tokenizer']}: the text makes {train} training and {val} validation "
                          f"tokens, too few for one window of {T} tokens and the next ({T + 2} needed in each); "
                          "give more text with --data")
    top = max(int(corpus.train.max()), int(corpus.val.max()))
    if top >= vocab:  # the embedding has one row per id: such an id would end in an IndexError on the first stage
        raise ConfigError(f"--tokenizer {cfg['tokenizer']}: the text has token id {top}, but the tokenizer's "
                          f"vocabulary size is {vocab} (ids 0 to {vocab - 1}), which sizes the model's embedding; "
                          "the tokenizer's files disagree with each other (added tokens beyond its vocabulary?): "
                          "save it again with save_pretrained, or give its tokenizer.json")
    return vocab


def _tokenizer_identity(name: str) -> str:
    """The sha256 of a --tokenizer's files: a resume checks that the embedding rows still mean the same tokens."""
    from ..data import DataError
    from ..errors import ConfigError
    from ..token_shards import tokenizer_sha256
    try:
        return tokenizer_sha256(name)
    except DataError as e:
        raise ConfigError(f"--tokenizer: {e}") from None


def _refuse_changed_tokenizer(directory: str, saved: dict, mine: dict) -> None:
    """ConfigError when the --tokenizer's files changed under the same name since the checkpoint was written (its
    embedding and head rows are the old tokenizer's ids); checkpoints that did not record them are not checked."""
    from ..errors import ConfigError
    before, now = saved.get("tokenizer_sha256"), mine.get("tokenizer_sha256")
    if before is None or before == now:
        return
    sizes = f"vocabulary {saved.get('vocab_size')} then, {mine.get('vocab_size')} now"
    raise ConfigError(f"the tokenizer {mine['tokenizer']} changed since {directory} was written (its files' sha256 "
                      f"{before[:12]} then, {str(now)[:12]} now; {sizes}): the checkpoint's token embedding and "
                      "output head have one row per token id of the old tokenizer. Resume with the tokenizer's files "
                      "as they were, or start a new run in another --run-dir")


def _cores() -> int:
    """CPU cores this process may run on (what the ranks of a CPU run share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _ranks_here(cfg: dict) -> int:
    """The ranks that run on this machine: every stage of every replica, or under torchrun this node's processes."""
    return cfg.get("local_ranks", cfg["stages"] * cfg.get("dp", 1))


def _oversubscribed(cfg: dict) -> bool:
    """More CPU ranks than cores: a rank's idle share then includes waiting for a core, not only the bubble."""
    here = _ranks_here(cfg)
    return cfg["device"] == "cpu" and not cfg["emulate"] and here > cfg.get("cores", here)


def _optimizer(cfg):
    import torch
    name, lr = cfg["optimizer"], cfg["lr"]
    m = cfg.get("momentum")
    b1 = 0.9 if m is None else m
    wd = (0.1 if name == "muon" else 0.01) if cfg.get("weight_decay") is None else cfg["weight_decay"]
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, 0.999), weight_decay=wd)
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, 0.999))
    if name == "nadam":
        return lambda ps: torch.optim.NAdam(ps, lr=lr, betas=(b1, 0.999), weight_decay=wd,
                                            decoupled_weight_decay=True)
    if name == "muon":
        from ..optim import muon_and_adamw, muon_at_adamw_scale
        if _muon_scale(cfg) == "adamw":
            return muon_at_adamw_scale(lr, momentum=0.95 if m is None else m, weight_decay=wd)
        return muon_and_adamw(lr=lr, momentum=0.95 if m is None else m, adamw_betas=(0.9, 0.999),
                              adamw_weight_decay=wd)
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=b1)
    return lambda ps: torch.optim.RMSprop(ps, lr=lr)


def _predict_from(cfg: dict) -> str:
    """PipeOptim's Δ: --predict-from when given; otherwise the last applied update for Muon (it has no rule of
    its own to predict with) and the optimizer's own rule for the rest."""
    if cfg.get("predict_from"):
        return cfg["predict_from"]
    return "last_update" if cfg["optimizer"] == "muon" and cfg["policy"] == "pipeoptim" else "optimizer"


def _muon_scale(cfg: dict) -> str:
    """--muon-scale when given; otherwise adamw, the scale every Muon result here was measured at."""
    return cfg.get("muon_scale") or "adamw"


def _policy_options(cfg: dict) -> dict:
    delta, dc = _predict_from(cfg), cfg.get("dc", 0.0)
    if cfg["policy"] == "pipeoptim" and delta != "optimizer":
        return {"delta": delta}
    return {"dc": dc} if cfg["policy"] == "stash" and dc else {}


def _check_prediction(cfg: dict) -> None:
    from ..errors import ConfigError
    delta = _predict_from(cfg)
    if delta != "optimizer" and cfg["policy"] != "pipeoptim":
        raise ConfigError(f"--predict-from {delta} chooses PipeOptim's Δ, but the policy is {cfg['policy']}; use "
                          "--policy pipeoptim or drop --predict-from")
    m = cfg.get("momentum")
    if m is not None and not 0.0 <= m < 1.0:
        raise ConfigError(f"--momentum must be in [0, 1) (β1 or momentum), got {m}")
    dc = cfg.get("dc", 0.0)
    if dc and cfg["policy"] != "stash":
        raise ConfigError(f"--dc {dc} corrects stashed gradients; use it with --policy stash (and --schedule "
                          "async-1f1b or async-zb)")
    if not 0.0 <= dc < math.inf:
        raise ConfigError(f"--dc must be a finite number >= 0, got {dc}")
    if cfg.get("muon_scale") and cfg["optimizer"] != "muon":
        raise ConfigError(f"--muon-scale {cfg['muon_scale']} sets how Muon scales its update, but the optimizer is "
                          f"{cfg['optimizer']}; use --optimizer muon or drop --muon-scale")
    if cfg["optimizer"] == "muon" and cfg["policy"] == "pipeoptim" and delta == "optimizer":
        raise ConfigError("--optimizer muon has no prediction rule of its own (Muon + AdamW); predict from the last "
                          "applied update: --predict-from last_update")


def _check_delay(cfg: dict, sched) -> None:
    from ..delay import DelayRules
    from ..errors import ConfigError
    try:
        rules = DelayRules.of(_delay_hparams(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if rules.active and sched.synchronous:
        raise ConfigError(f"--delay-lr/--delay-momentum/--delay-warmup adapt each stage to its delay, but "
                          f"--schedule {sched.name} is synchronous (every delay is 0); use --schedule async-1f1b, "
                          "async-zb or 2bw, or drop the --delay-* flags")


def _delay_hparams(cfg: dict) -> dict:
    return {"lr": cfg.get("delay_lr", "none"), "momentum": cfg.get("delay_momentum", "none"),
            "warmup": cfg.get("delay_warmup", 0)}


def train_worker(cfg: dict) -> dict:
    """Runs on every rank (or once, emulated); returns the loss history."""
    import torch

    from ..links import parse_link, parse_straggler
    from ..models import GPTConfig, gpt_layers
    from ..models.gpt import lm_loss
    from ..train import NonFiniteError, Pipeline

    torch.manual_seed(cfg["seed"])
    total_steps = cfg["steps"]
    sched_steps = total_steps * _updates_per_window(cfg)
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
    dp = cfg.get("dp", 1)
    pipe = Pipeline(optimizer=_optimizer(cfg), lr_scheduler=schedule,
                    devices=cfg["stages"], dp=dp, schedule=cfg["schedule"], policy=cfg["policy"],
                    microbatches=cfg["microbatches"], clip_norm=cfg["clip"] or None, precision=cfg["precision"],
                    emulate=cfg["emulate"], device=cfg["device"], seed=cfg["seed"], on_nonfinite=cfg["on_nonfinite"],
                    watchdog_s=cfg["watchdog_s"], delay_hparams=_delay_hparams(cfg),
                    policy_options=_policy_options(cfg), checkpoint_stages=cfg.get("checkpoint_stages") or (),
                    stream=cfg.get("stream", False), schedule_options=_schedule_params(cfg) or None,
                    link=parse_link(cfg["link"]) if cfg.get("link") else None,
                    straggler=parse_straggler(cfg["straggler"]) if cfg.get("straggler") else None, **model_kw)
    rank = 0 if cfg["emulate"] else int(os.environ.get("RANK", "0"))
    from ..train_batches import for_rank
    batches = for_rank(cfg, pipe, rank, lambda: _corpus(cfg))  # read only where the first or last stage is
    history: list[dict] = []
    run_dir = cfg["run_dir"]
    ckpt = os.path.join(run_dir, "checkpoint")
    start = 0
    if cfg.get("resume_from"):
        extra = pipe.load(cfg["resume_from"])
        batches.restore(extra, pipe.step_count)  # the data order goes on where the checkpoint's stopped
        history = extra["history"]
        start = pipe.step_count
        changed = _apply_lr(pipe, cfg["lr"], lr_lambda) if cfg.get("lr_given", True) else []
        if rank == 0:
            for line in changed + _changed_clip(extra.get("config") or {}, cfg):
                print(f"pipeoptim train: {line}", file=sys.stderr)
    resumed = len(history)  # the history entries of the run(s) this one continues

    def save() -> str:
        directory = pipe.save(ckpt, extra={**batches.state(), "history": history,
                                           "config": resume_config(cfg)}, keep=cfg["keep_checkpoints"])
        if rank == 0:  # the outputs follow every commit, so a run that dies leaves those of its newest checkpoint
            _write_outputs(run_dir, history, cfg)
        return directory

    B = cfg["microbatches"] * cfg["microbatch_size"]  # rows per replica; every rank draws all dp x B of them
    tokens_per_step = dp * B * cfg["seq_len"]
    bar = None
    idle = "idle" if _oversubscribed(cfg) or cfg["emulate"] else "bubble"
    if rank == 0 and not cfg["no_progress"]:
        from tqdm import tqdm
        if idle == "idle":
            said = _EMULATED if cfg["emulate"] else _OVERSUBSCRIBED
            print(f"pipeoptim train: {said.format(here=_ranks_here(cfg), **cfg)}", file=sys.stderr)
        bar = tqdm(total=total_steps, initial=start, desc=f"{cfg['schedule']}+{cfg['policy']}", file=sys.stderr,
                   dynamic_ncols=True)
    val_batch = batches.val(dp * B)  # fixed; this replica's rows
    if hf:
        val_batch = (val_batch[0], val_batch[0])
    t_run = time.perf_counter()
    stopped = None
    preempted = None  # the step after which every rank stopped on SIGTERM (a checkpoint of it is written below)
    with _stop_on_sigterm(pipe):
        for step in range(start, total_steps):
            batch = batches.train(dp * B)  # this replica's rows of the global batch
            if hf:  # Hugging Face's loss takes the input ids as labels and shifts them itself
                batch = (batch[0], batch[0])
            t0 = time.perf_counter()
            try:
                loss = pipe.train_step(batch)
            except NonFiniteError as e:  # raised on every rank at this same step
                stopped = str(e)
                loss = pipe.last_stats["loss"]
            dt = time.perf_counter() - t0
            st = pipe.last_stats
            history.append({"step": step + 1, "loss": loss, "tokens_per_s": tokens_per_step / dt,
                            "bubble": st["bubble"], "grad_norm": st["grad_norm"], "skipped": st.get("nonfinite", 0),
                            "val_loss": None})
            if stopped:
                break
            if st.get("stop") and step + 1 < total_steps:  # agreed by every rank at this same step
                preempted = step + 1
                if bar is not None:
                    bar.write(f"step {step + 1}: SIGTERM: stopping with a checkpoint of this step")
                break
            if step + 1 == total_steps or (cfg["eval_every"] and (step + 1) % cfg["eval_every"] == 0):
                history[-1]["val_loss"] = pipe.eval_step(val_batch)
            if bar is not None:
                if not math.isfinite(loss) or st.get("nonfinite"):
                    bar.write(f"step {step + 1}: NaN or inf (loss {loss:.4g}); {st.get('nonfinite', 0)} update(s) "
                              "skipped (--on-nonfinite skip)")
                bar.set_postfix({"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_step / dt:,.0f}",
                                 idle: f"{st['bubble'] * 100:.0f}%",
                                 **({"emulated": cfg["emulation"].removeprefix("emulated: ")}
                                    if cfg.get("emulation") else {})})
                bar.update(1)
            if cfg["save_every"] and (step + 1) % cfg["save_every"] == 0 and step + 1 < total_steps:
                save()
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t_run
        val = float("nan")
        if not stopped and history and history[-1].get("val_loss") is not None:
            val = history[-1]["val_loss"]
        # a resume with nothing left to do writes nothing (the checkpoint it came from is already this state);
        # still inside: a second SIGTERM (a scheduler's, after the agent's) must not end a rank mid-save
        directory = save() if start < total_steps else cfg["resume_from"]
    return {"history": history, "val_loss": val, "elapsed": elapsed, "rank": rank, "stopped": stopped,
            "checkpoint": directory, "start": resumed, "preempted": preempted}


@contextlib.contextmanager
def _stop_on_sigterm(pipe):
    """While inside, SIGTERM asks the job to stop (``Pipeline.request_stop``) instead of ending this process:
    every rank then stops after the same step and the run saves a checkpoint of it. A cluster's scheduler sends
    SIGTERM some time before it kills a job; the launcher and torchrun's agent pass it on to every rank. Outside
    (and off the main thread, where Python cannot take signals), SIGTERM keeps its previous meaning."""
    import threading

    from ..runtime.launcher import sigterm_received
    if sigterm_received():  # it came while the stages were being built (the launcher's workers record it)
        pipe.request_stop()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: pipe.request_stop())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_OVERSUBSCRIBED = ("{here} ranks share {cores} CPU core(s): the progress bar's 'idle' is each rank's idle share, "
                   "which here includes waiting for a core, so it measures the machine more than the schedule's "
                   "bubble (pipeoptim schedule NAME -D {stages} -N {microbatches} gives the schedule's own)")
_EMULATED = ("--emulate runs the {stages} stages one after another in this process: the progress bar's 'idle' is "
             "each stage's share of waiting for the others (about 1 - 1/{stages}), not the schedule's bubble "
             "(pipeoptim schedule {schedule} -D {stages} -N {microbatches} gives that)")


def _apply_lr(pipe, lr: float, lr_lambda) -> list[str]:
    """After a resume: make ``lr`` the peak of the learning-rate schedule, which the checkpoint restored with
    the old run's peak; the schedule continues at its step. Param groups with another peak (Muon's AdamW
    groups) keep theirs. Returns what changed, in words."""
    old = None
    for w in pipe.workers:
        for st in w.stages.values():
            outer = st.scheduler
            sched = getattr(outer, "inner", outer)  # delay-aware hyper-parameters wrap the LR schedule
            old = sched.base_lrs[0] if old is None else old
            if old == lr:
                continue
            undelayed = []
            for i, group in enumerate(st.optimizer.param_groups):
                if sched.base_lrs[i] == old:
                    sched.base_lrs[i] = group["initial_lr"] = lr
                undelayed.append(sched.base_lrs[i] * lr_lambda(sched.last_epoch))
            sched._last_lr = undelayed
            if outer is sched:
                for group, value in zip(st.optimizer.param_groups, undelayed):
                    group["lr"] = value
            else:  # the wrapper holds the undelayed lr and applies this stage's factor to it
                outer._lr = undelayed
                outer._apply()
    if old is None or old == lr:
        return []
    return [f"--lr {lr:g} applies from step {pipe.step_count} on: the checkpoint was written with --lr {old:g} "
            "(the learning-rate schedule goes on from where it was, with the new peak)"]


def _changed_clip(saved: dict, cfg: dict) -> list[str]:
    if "clip" not in saved or saved["clip"] == cfg["clip"]:
        return []
    new = f"--clip {cfg['clip']:g}" + (" (off)" if not cfg["clip"] else "")
    return [f"{new} applies from here on: the checkpoint was written with --clip {saved['clip']:g}"]


def resume_config(cfg: dict) -> dict:
    """What a checkpoint records of the run that wrote it, for ``--resume`` to check."""
    out = {k: cfg.get(k) for k in (*RESUME_MUST_MATCH, "schedule", "stages", "microbatches", "clip")}
    out["update_every"] = cfg.get("update_every")
    out["updates_per_window"] = _updates_per_window(cfg)
    out["dp"], out["microbatch_size"] = cfg.get("dp", 1), cfg["microbatch_size"]
    out["tokenizer_sha256"], out["vocab_size"] = cfg.get("tokenizer_sha256"), cfg.get("vocab_size")
    out["delay"] = _delay_hparams(cfg)
    out["data"] = cfg.get("prepared")  # a prepare-data folder: what its tokens are (None: plain text)
    return out


def _resume_point(root: str, cfg: dict) -> tuple[str, int, dict]:
    """The checkpoint ``--resume`` continues from (the newest intact one; each one passed over is printed
    as a warning), its step and its ``extra``, after checking its files (read with weights_only: no code
    runs) and that this run can continue it; ConfigError or CheckpointError says why not."""
    from ..runtime import checkpoint_files as files
    from ..runtime.checkpoint import inspect
    from ..errors import ConfigError
    if not files.list_steps(root) and os.path.exists(os.path.join(root, "meta.pt")):
        print(f"pipeoptim train: warning: {root} was written by an older pipeoptim (no manifest): its files "
              "cannot be checked", file=sys.stderr)
        directory, step, meta = inspect(root)
        return directory, step, meta.get("extra", {})
    directory, manifest, skipped = files.newest_and_skipped(root, warn=False)
    directory, step, meta = inspect(directory, manifest)
    extra = meta.get("extra", {})
    saved = extra.get("config")
    if saved:
        mine = resume_config(cfg)
        _refuse_changed(directory, saved, mine)
        _refuse_changed_data(directory, saved, mine)
        before = saved.get("delay", _delay_hparams({}))
        if before != mine["delay"]:
            flags = lambda d: f"--delay-lr {d['lr']} --delay-momentum {d['momentum']} --delay-warmup {d['warmup']}"  # noqa: E731
            raise ConfigError(f"{directory} was written with {flags(before)} and this run asks for "
                              f"{flags(mine['delay'])}: the learning-rate schedule's state would not carry over. "
                              f"Resume with {flags(before)}, or start a new run in another --run-dir")
        _refuse_changed_tokenizer(directory, saved, mine)
        _check_dp_change(directory, saved, mine, cfg.get("allow_dp_change", False))
        if saved["updates_per_window"] != mine["updates_per_window"]:
            def what(c):
                m = c.get("update_every")
                return f"{c['schedule']} with {c['microbatches']} micro-batches" + \
                    ("" if m is None else f" and --update-every {m}")
            raise ConfigError(f"{directory} was written by schedule {what(saved)} "
                              f"({saved['updates_per_window']} optimizer steps per window); {what(mine)} takes "
                              f"{mine['updates_per_window']}, so the learning-rate schedule would not carry over. "
                              "Resume with a schedule, micro-batch count and --update-every that step as often "
                              "(stage counts may differ)")
    for d, problem in skipped:  # set aside: never counted again (pruning would keep them, not intact ones)
        print(f"pipeoptim train: warning: skipping a checkpoint: {problem}; set it aside as {files.set_aside(d)}",
              file=sys.stderr)
    return directory, step, extra


def _check_dp_change(directory: str, saved: dict, mine: dict, allowed: bool) -> None:
    """A resume with another --dp changes the global batch (each replica trains on its own share of dp x the
    rows) at the same learning rate: refused with what changes, unless ``allowed`` (--allow-dp-change), which
    says it. Checkpoints from before --dp was recorded are not checked."""
    from ..errors import ConfigError
    if "dp" not in saved or saved["dp"] == mine["dp"]:
        return

    def rows(c):
        return (f"--dp {c['dp']}: {c['dp']} x {c['microbatches']} micro-batches x {c.get('microbatch_size', '?')} "
                f"sequences = {c['dp'] * c['microbatches'] * c.get('microbatch_size', 0)} sequences per window")
    what = (f"{directory} was written with {rows(saved)}; this run asks for {rows(mine)}. The global batch "
            "changes while the learning rate and its schedule go on as they were (nothing is rescaled with the "
            "batch)")
    if not allowed:
        raise ConfigError(f"{what}. Resume with --dp {saved['dp']}, or accept the change with --allow-dp-change")
    print(f"pipeoptim train: --allow-dp-change: {what}", file=sys.stderr)


def _prepared_config(args, manifest: dict) -> dict:
    """The run's entries for a prepare-data folder: the vocabulary of its tokens and what a checkpoint records
    of them; ConfigError when --model or --tokenizer cannot read those tokens."""
    from ..data import DataError
    from ..errors import ConfigError
    from ..token_shards import BYTES, data_sha256, tokenizer_sha256
    tok = manifest["tokenizer"]
    if tok["name"] == BYTES and args.tokenizer:
        raise ConfigError(f"--data {args.data} holds bytes (prepared without --tokenizer): drop --tokenizer, or "
                          f"prepare the text again with pipeoptim prepare-data --tokenizer {args.tokenizer}")
    if tok["name"] != BYTES and not args.model.startswith("hf-"):
        raise ConfigError(f"--data {args.data} holds token ids of the tokenizer {tok['name']} (vocabulary "
                          f"{tok['vocab_size']}); --model {args.model} reads bytes: use --model hf-gpt2 or hf-llama, "
                          "or prepare the text without --tokenizer")
    if tok["name"] != BYTES and args.tokenizer:
        try:
            given = tokenizer_sha256(args.tokenizer)
        except (DataError, OSError) as e:
            raise ConfigError(f"--tokenizer: {e}") from None
        if given != tok["sha256"]:
            raise ConfigError(f"--data {args.data} was prepared with the tokenizer {tok['name']} (files sha256 "
                              f"{tok['sha256'][:12]}), and --tokenizer {args.tokenizer} is another (sha256 "
                              f"{given[:12]}): drop --tokenizer (the folder needs none), or prepare the text again "
                              "with this one")
    return {"vocab_size": int(tok["vocab_size"]),
            "prepared": {"data_sha256": data_sha256(manifest), "tokenizer": tok["name"],
                         "tokenizer_sha256": tok["sha256"], "path": os.path.abspath(args.data)}}


def _refuse_changed_data(directory: str, saved: dict, mine: dict) -> None:
    """ConfigError naming what changed when the checkpoint was trained on a prepare-data folder and this run's
    --data holds other tokens (another tokenizer, or other text): the batches would not continue its order."""
    from ..errors import ConfigError
    before, now = saved.get("data"), mine.get("data")
    same = lambda a, b: a["data_sha256"] == b["data_sha256"]  # noqa: E731  (tokenizer, dtype, every shard's hash)
    if not before or (now and same(before, now)):
        return
    fix = (f"Resume with --data {before['path']} (or a copy of it), or start a new run in another --run-dir")
    if not now:
        raise ConfigError(f"{directory} was trained on the prepared data {before['path']} and this run's --data is "
                          f"plain text: the batches would not continue its order. {fix}")
    if (before["tokenizer"], before["tokenizer_sha256"]) != (now["tokenizer"], now["tokenizer_sha256"]):
        what = (f"the tokenizer changed: {before['tokenizer']} (files sha256 {str(before['tokenizer_sha256'])[:12]}) "
                f"then, {now['tokenizer']} ({str(now['tokenizer_sha256'])[:12]}) now")
    else:
        what = (f"its tokens changed (same tokenizer, other text: data sha256 {before['data_sha256'][:12]} then, "
                f"{now['data_sha256'][:12]} now)")
    raise ConfigError(f"{directory} was trained on the prepared data {before['path']}, and in --data {now['path']} "
                      f"{what}. {fix}")


def _refuse_changed(directory: str, saved: dict, mine: dict) -> None:
    """ConfigError naming both values if this run asks for another value of a flag that must match the
    checkpoint (checkpoints from before a flag was recorded are not checked for it)."""
    from ..errors import ConfigError

    def flag(key, value):
        key = key.replace("_", "-")
        return f"no --{key}" if value is None else f"--{key} {value}"
    for key, why in RESUME_MUST_MATCH.items():
        if key in saved and saved[key] != mine[key]:
            raise ConfigError(f"{directory} was written with {flag(key, saved[key])} and this run asks for "
                              f"{flag(key, mine[key])}: {why}. Resume with {flag(key, saved[key])}, or start a new "
                              "run in another --run-dir")


# what a run writes in its --run-dir, and whether each is a folder
RUN_DIR_ENTRIES = {"checkpoint": True, "history.json": False, "loss.png": False, ".lock": False}


def check_run_dir(run_dir: str) -> None:
    """ConfigError naming the path and the fix if the run could not write its outputs in ``run_dir``: a file
    where a folder goes (or the other way round), or a directory it cannot create or write in. Checked before
    any rank starts, so that a run never trains and then fails at its first checkpoint."""
    import tempfile

    from ..errors import ConfigError
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"--run-dir {run_dir} is a file, not a folder: give a folder (it is created if missing)")
    for name, folder in RUN_DIR_ENTRIES.items():
        path = os.path.join(run_dir, name)
        if os.path.lexists(path) and os.path.isdir(path) != folder:
            want, found = ("a folder", "a file") if folder else ("a file", "a folder")
            if folder and os.path.islink(path) and not os.path.exists(path):
                found = "a broken link"
            raise ConfigError(f"{path} is {found}, but pipeoptim train writes {want} there ({name}); move it "
                              f"away, or give this run another --run-dir")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
        if os.path.isdir(ckpt := os.path.join(run_dir, "checkpoint")):
            with tempfile.TemporaryFile(dir=ckpt):
                pass
    except OSError as e:
        where = e.filename or run_dir
        raise ConfigError(f"cannot write in {where}: {e.strerror or e}; give a --run-dir you can write to (or "
                          "fix its permissions)") from None


@contextlib.contextmanager
def _run_dir_lock(run_dir: str):
    """Hold ``run_dir`` for this run: a second run given the same directory fails at once, naming this one
    (the lock goes with this process, however it ends; its file is removed when the run ends)."""
    import fcntl

    from ..errors import ConfigError
    check_run_dir(run_dir)
    path = os.path.join(run_dir, ".lock")
    try:
        f = open(path, "a+")
    except OSError as e:
        raise ConfigError(f"cannot create {path}: {e.strerror or e}; give a --run-dir you can write to") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process"
        f.close()
        raise ConfigError(f"{run_dir} is in use by another pipeoptim train ({holder}); give this run its own "
                          "--run-dir") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        yield
    finally:
        with contextlib.suppress(OSError):  # still locked: no other run can have taken it meanwhile
            os.remove(path)
        f.close()


def _hf_spec(args, vocab_size: int | None = None) -> dict:
    """--hf-config and --hf-set as the model a run builds (models.hf_config.resolve), or a ConfigError; sets
    args.model to hf-<model_type> (what the rest of the run and a resume see)."""
    from ..errors import ConfigError
    if args.model in SIZES and args.model != "small":
        raise ConfigError(f"--hf-config {args.hf_config} is the model; drop --model {args.model}")
    try:
        from ..models.hf import require_transformers
        require_transformers()
        from ..models.hf_config import HFConfigError, resolve
        spec = resolve(args.hf_config, args.hf_set, vocab_size)
    except (ImportError, HFConfigError) as e:
        raise ConfigError(str(e)) from None
    args.model = f"hf-{spec['model_type']}"
    return spec


def _hf_sizes(spec: dict) -> tuple:
    """(d_model, n_heads, n_layers, seq_len) of an --hf-config model: windows of 64 tokens, or its positions."""
    return spec["hidden"], spec["heads"], spec["layers"], min(64, spec["max_positions"] or 64)


def _hf_model(cfg: dict) -> dict:
    """Pipeline arguments for a Hugging Face model of the configured size, built on meta (no memory: each rank
    materialises its own stages from the seed)."""
    import torch

    from ..models.hf import byte_level_config, causal_lm_layers
    from ..runtime.config import make_schedule
    if cfg.get("hf_spec"):  # --hf-config: the user's model, checked by _config
        from ..models.hf_config import build
        model = build(cfg["hf_spec"])
    else:
        config, cls = byte_level_config(cfg["model"].removeprefix("hf-"), d_model=cfg["d_model"],
                                        n_heads=cfg["n_heads"], n_layers=cfg["n_layers"], seq_len=cfg["seq_len"])
        config.vocab_size = cfg["vocab_size"]  # the tokenizer's (--tokenizer), else 256 bytes
        with torch.device("meta"):
            model = cls(config)
    cut = causal_lm_layers(model)
    synchronous = make_schedule(cfg["schedule"], cfg["stages"], cfg["microbatches"]).synchronous
    return dict(layers=cut.layers, loss_fn=cut.loss_fn, init_fn=cut.init_fn,
                **({"tied": cut.tied} if synchronous else {"copies": cut.tied}))


def _strict_json(value):
    """``value`` with every NaN and infinity as None: history.json is strict JSON (null), which any reader takes."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _replace_file(path: str, write) -> None:
    """Write ``path`` whole or not at all: ``write(f)`` into a temporary file beside it, then rename it over."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _write_outputs(run_dir: str, history: list[dict], cfg: dict) -> None:
    """history.json and loss.png of ``history`` (each replaced whole, so a reader never sees half of one)."""
    os.makedirs(run_dir, exist_ok=True)
    config = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool, type(None)))}
    text = json.dumps(_strict_json({"config": config, "history": history}), indent=1, allow_nan=False)
    _replace_file(os.path.join(run_dir, "history.json"), lambda f: f.write(text.encode()))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from ..viz import plot_training
    fig, ax = plt.subplots(figsize=(6, 3.5))
    model = cfg["model"] if cfg["model"].startswith("hf-") else f"{cfg['model']} GPT"
    from ..token_shards import BYTES
    prepared = cfg.get("prepared")  # a prepare-data folder holds tokens of its tokenizer, given or not
    unit = "nats/token" if cfg.get("tokenizer") or (prepared and prepared["tokenizer"] != BYTES) else "nats/byte"
    plot_training(ax, history, unit=unit,
                  title=f"{model}, {cfg['stages']} stages, {cfg['schedule']} + {cfg['policy']}, {cfg['optimizer']}")
    fig.tight_layout()
    _replace_file(os.path.join(run_dir, "loss.png"), lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)


def outputs_from_checkpoint(run_dir: str, cfg: dict) -> str | None:
    """Write history.json and loss.png from the newest committed checkpoint under ``run_dir`` (the history it
    holds: what a ``--resume`` continues), whatever state the outputs were left in by a run that died; its
    directory, or None when there is none (the outputs are then left as they are). Only meta.pt is read (its
    hash checked against the manifest, then ``torch.load(weights_only=True)``), never the parts."""
    from ..runtime import checkpoint_files as files
    from ..runtime.checkpoint import read
    for _, directory in files.list_steps(os.path.join(run_dir, "checkpoint")):
        try:
            record = files.check_sizes(directory)["files"].get("meta.pt")
            if record is None or files.check_hash(directory, "meta.pt", record) is not None:
                continue
            history = read(os.path.join(directory, "meta.pt")).get("extra", {}).get("history")
        except files.CheckpointError:  # not committed, or damaged: the one before it
            continue
        if history is not None:
            _write_outputs(run_dir, history, cfg)
            return directory
    return None


def _newest_checkpoint(root: str, failure: str = "") -> str:
    """A line pointing at what a later --resume would continue from, or '' when there is nothing. Not the
    checkpoint that ``failure`` names (the job failed loading it: resuming from it would fail again)."""
    from ..runtime import checkpoint_files as files
    try:
        directory, manifest = files.newest(root, warn=False)
    except (FileNotFoundError, files.CheckpointError):
        return ""
    if directory in failure:
        return (f"{directory} (step {manifest['step']}) is the newest checkpoint whose files are intact, but the "
                "failure above names it, so --resume would meet it again: move it aside (--resume then takes the "
                "one before it), or start afresh in another --run-dir")
    return f"the newest intact checkpoint is {directory} (step {manifest['step']}); continue with --resume"


def _claim_run_dir(args, ckpt_root: str) -> bool:
    """A run directory holding an earlier run's checkpoints is continued (--resume) or deleted first
    (--overwrite), never silently overwritten; ConfigError says which flag to use. Returns whether this run
    resumes: --resume auto does where a checkpoint was committed, and starts afresh where none was (a first
    start, or a restart of a run that failed before its first commit: nothing of it can be lost)."""
    from ..runtime import checkpoint_files as files
    from ..errors import ConfigError
    earlier = sorted(os.listdir(ckpt_root)) if os.path.isdir(ckpt_root) else []
    if args.resume == "auto":
        if files.has_committed(ckpt_root):
            return True
        if earlier:
            print(f"pipeoptim train: --resume auto: {ckpt_root} holds no committed checkpoint (only what a run "
                  f"stopped while writing left: {', '.join(earlier)}); starting afresh", file=sys.stderr)
        return False
    if args.resume:
        if not files.list_steps(ckpt_root) and not os.path.exists(os.path.join(ckpt_root, "meta.pt")):
            raise ConfigError(f"--resume: no checkpoint in {ckpt_root}: a run writes one every --save-every "
                              "windows and at its end. Start this run without --resume")
    elif earlier and not args.overwrite:
        steps = files.list_steps(ckpt_root)
        what = f"checkpoints up to step {steps[0][0]}" if steps else f"{len(earlier)} checkpoint file(s)"
        raise ConfigError(f"{args.run_dir} holds an earlier run ({what} in {ckpt_root}): continue it with "
                          "--resume, or start afresh with --overwrite (deletes its checkpoints, history.json and "
                          "loss.png), or give this run its own --run-dir")
    elif args.overwrite:
        import shutil
        shutil.rmtree(ckpt_root, ignore_errors=True)
        for name in ("history.json", "loss.png"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.run_dir, name))
        if earlier:
            print(f"pipeoptim train: --overwrite: deleted the earlier run's checkpoints, history.json and loss.png "
                  f"in {args.run_dir}", file=sys.stderr)
    return bool(args.resume)


def _idle_words(cfg: dict, percent: float) -> str:
    if cfg.get("emulate"):
        return (f"idle {percent:.0f}% (--emulate: the stages run one after another, so it is not the schedule's "
                "bubble); ")
    if _oversubscribed(cfg):
        return (f"idle {percent:.0f}% ({_ranks_here(cfg)} ranks on {cfg['cores']} core(s): it measures the "
                "machine, not the schedule's bubble); ")
    return f"bubble {percent:.0f}%; "


def _outputs_on_the_way_out(run_dir: str, cfg: dict) -> None:
    """After a run ended early (a signal, a dead rank): its outputs from its newest committed checkpoint. A
    second Ctrl-C while they are written leaves the ones the last checkpoint wrote, which are whole."""
    try:
        outputs_from_checkpoint(run_dir, cfg)
    except (OSError, KeyboardInterrupt) as e:
        print(f"pipeoptim train: history.json and loss.png not rewritten ({type(e).__name__}: {e}); those of the "
              "last checkpoint stay", file=sys.stderr)


def _nothing_to_do(at: int, steps: int, resume_from: str, extra: dict) -> None:
    done = extra.get("history") or [{}]
    print(f"nothing to do: step {at} of {steps} already reached ({resume_from})", file=sys.stderr)
    print(f"final loss: {done[-1].get('loss', float('nan')):.4f}")


def report(result: dict, cfg: dict, args, t0: float) -> int:
    """Print the run's summary and ``final loss``; the exit status (``NONFINITE_EXIT`` after a NaN stop)."""
    hist = result["history"][result.get("start", 0):]  # this run's steps: not the resumed run's
    if not hist:
        print(f"nothing to do: step {result.get('start', 0)} of {args.steps} already reached", file=sys.stderr)
    else:
        first, last = hist[0]["loss"], hist[-1]["loss"]
        tail = hist[-max(1, len(hist) // 10):]
        print(f"steps {hist[0]['step']}..{hist[-1]['step']}: loss {first:.4f} -> {last:.4f}; "
              f"{sum(h['tokens_per_s'] for h in tail) / len(tail):,.0f} tokens/s; "
              + _idle_words(cfg, 100 * sum(h['bubble'] for h in tail) / len(tail))
              + (f"validation loss {result['val_loss']:.4f}; " if math.isfinite(result["val_loss"]) else "")
              + f"wall {time.perf_counter() - t0:.0f} s"
              + (f" ({cfg['emulation']})" if cfg.get("emulation") else ""))
        print(f"run directory: {os.path.abspath(args.run_dir)} (checkpoint/, loss.png, history.json)")
    if result.get("preempted"):
        print(f"pipeoptim train: stopped by SIGTERM after step {result['preempted']} of {args.steps}: every rank "
              f"stopped after that step, whose checkpoint is {result['checkpoint']}; continue with --resume",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    if result.get("stopped"):
        print(f"pipeoptim train: stopped at {result['stopped']}", file=sys.stderr)
        print(f"pipeoptim train: checkpoint of the last finite state: {result['checkpoint']}; after a fix, "
              "continue with --resume (with a lower --lr or a --clip, which the resumed run applies). If the "
              "loss had been climbing, the weights have diverged and no learning rate brings them back: start "
              "again with --overwrite and a lower --lr", file=sys.stderr)
        return NONFINITE_EXIT
    print(f"final loss: {hist[-1]['loss'] if hist else float('nan'):.4f}")
    return 0
