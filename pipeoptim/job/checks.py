"""``check``: every check of a run's ``TrainConfig`` that can fail before torch is imported.

``check(config)`` answers a wrong field or combination (the schedule and the policy, the prediction and the delay
rules, where the ranks run, a Hugging Face config; the data and the tokenizer through ``data_checks``) as fast as
``--help``, with a ``ConfigError`` naming the flag and the fix, and fills in what the run derives (the model's
sizes, the learning rate, what a prepared folder or a tokenizer records). What the checked configuration then means
to a rank (its optimizer, its policy's options) is ``derived``'s.
"""
from __future__ import annotations

import math
import sys

from ..data import VOCAB_SIZE  # bytes, unless --tokenizer (pipeoptim.data loads torch only when it reads text)
from .config import OPTIMIZERS, SIZES, TrainConfig, apply_recipe, checkpoint_stages_spec, default_lr
from .data_checks import _check_data, _check_tokens, _prepared_config, _tokenizer_identity
from .derived import _cores, _delay_hparams, _muon_scale, _predict_from, _schedule_params, emulation_words

__all__ = ["check"]


def check(config: TrainConfig) -> TrainConfig:
    """``config`` checked, with the fields it derives filled in; a ``ConfigError`` saying what is wrong and how to
    fix it otherwise. Imports no torch (but for ``device='cuda'``, which counts the GPUs). A configuration it
    returned is returned as it is."""
    from ..errors import ConfigError
    if isinstance(config, TrainConfig) and config.checked:
        return config
    from ..runtime.config import check_policy, make_schedule, stages_for
    from ..runtime.plan import Plan
    _check_fields(config)
    args = apply_recipe(config)
    if isinstance(args.checkpoint_stages, str):  # the flag's spelling, from Python
        args = args.replace(checkpoint_stages=checkpoint_stages_spec(args.checkpoint_stages))
    if args.hf_set and not args.hf_config:
        raise ConfigError("--hf-set changes the config of --hf-config; give --hf-config PATH_OR_NAME too")
    hf_spec = None
    if args.hf_config:
        if args.model in SIZES and args.model != "small":
            raise ConfigError(f"--hf-config {args.hf_config} is the model; drop --model {args.model}")
        hf_spec = _hf_spec(args)
        args = args.replace(model=f"hf-{hf_spec['model_type']}")  # what the rest of the run and a resume see
    d, h, L, T = SIZES[args.model] if hf_spec is None else _hf_sizes(hf_spec)
    # fails here, before any process starts
    sched = make_schedule(args.schedule, args.stages, args.microbatches, **_schedule_params(args))
    policy = check_policy(sched, args.policy)
    Plan(sched)
    if args.stream:
        from ..runtime.stream import check_stream
        check_stream(sched)
    _check_delay(args, sched)
    if stages_for(args.schedule, args.stages) > L + 2:
        raise ConfigError(f"schedule {args.schedule!r} on {args.stages} devices needs "
                          f"{stages_for(args.schedule, args.stages)} stages but model {args.model!r} has {L + 2} "
                          "layers; use a bigger --model or fewer --stages")
    _check_where(args)
    if args.checkpoint_stages:
        from ..stages.partition import balance_by_layers  # the Pipeline's cut of the model's L + 2 layers (no torch)
        from ..stages.recompute import CheckpointStagesError, parse_checkpoint_stages
        try:
            parse_checkpoint_stages(args.checkpoint_stages,
                                    balance_by_layers(L + 2, stages_for(args.schedule, args.stages)))
        except CheckpointStagesError as e:
            raise ConfigError(f"--checkpoint-stages: {e.problem} (--model {args.model}, --stages {args.stages}, "
                              f"--schedule {args.schedule})") from None
    if args.tokenizer and not args.model.startswith("hf-"):
        raise ConfigError(f"--tokenizer needs a Hugging Face model (--model hf-gpt2 or hf-llama); --model "
                          f"{args.model} reads bytes")
    prepared = _check_data(args.data, T) if args.data else None  # a prepare-data folder: its manifest
    if args.model.startswith("hf-"):
        try:
            from ..models.hf import require_transformers
            require_transformers()
        except ImportError as e:
            raise ConfigError(f"--model {args.model}: {e}") from None
    cfg = args.replace(d_model=d, n_heads=h, n_layers=L, seq_len=T, policy=policy, vocab_size=VOCAB_SIZE,
                       cores=_cores(), lr_given=args.lr is not None,
                       lr=args.lr if args.lr is not None else args.recipe_lr or default_lr(args.schedule,
                                                                                            args.optimizer))
    _check_prediction(cfg)
    cfg = cfg.replace(predict_from=_predict_from(cfg),  # what runs, as history.json and the checkpoint record it
                      muon_scale=_muon_scale(cfg) if cfg.optimizer == "muon" else None)
    if prepared:
        cfg = cfg.replace(**_prepared_config(cfg, prepared))
    cfg = cfg.replace(emulation=emulation_words(cfg))
    if cfg.tokenizer:
        cfg = cfg.replace(vocab_size=_check_tokens(cfg))
        if not prepared:  # (a prepared folder records its tokenizer's files itself)
            cfg = cfg.replace(tokenizer_sha256=_tokenizer_identity(cfg.tokenizer))
    if hf_spec is not None:
        spec = _hf_spec(cfg, cfg.vocab_size) if cfg.vocab_size != VOCAB_SIZE else hf_spec
        cfg = cfg.replace(hf_spec=spec, hf_model=f"{spec['model_type']} (config sha256 {spec['sha256'][:16]})")
        for note in spec["notes"]:
            print(f"pipeoptim train: --hf-config: {note}", file=sys.stderr)
    return cfg.replace(checked=True)


def _check_fields(config: TrainConfig) -> None:
    """Each field on its own, as the command line's parser checks its flag (a TrainConfig made in Python has not
    been through it): a ConfigError naming the field, its flag and what it takes."""
    from ..delay import LR_RULES, MOMENTUM_RULES
    from ..errors import ConfigError
    from ..runtime.config import SCHEDULES
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"a run's configuration is a pipeoptim.job.TrainConfig, not {type(config).__name__}")

    def bad(name: str, takes: str):
        flag = "--" + name.replace("_", "-")
        return ConfigError(f"{name} ({flag}) must be {takes}, got {getattr(config, name)!r}")

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    for name in ("stages", "dp", "microbatches", "microbatch_size", "steps", "keep_checkpoints"):
        if not whole(getattr(config, name)) or getattr(config, name) < 1:
            raise bad(name, "a whole number >= 1")
    for name in ("save_every", "eval_every", "delay_warmup"):
        if not whole(getattr(config, name)) or getattr(config, name) < 0:
            raise bad(name, "a whole number >= 0")
    if not whole(config.seed):
        raise bad("seed", "a whole number")
    if config.update_every is not None and (not whole(config.update_every) or config.update_every < 1):
        raise bad("update_every", "None or a whole number >= 1")
    if config.port is not None and (not whole(config.port) or not 1 <= config.port <= 65535):
        raise bad("port", "None or a port number (1 to 65535)")
    for name in ("clip", "dc"):
        if not number(getattr(config, name)) or getattr(config, name) < 0:
            raise bad(name, "a finite number >= 0")
    if config.weight_decay is not None and (not number(config.weight_decay) or config.weight_decay < 0):
        raise bad("weight_decay", "None or a finite number >= 0")
    if config.momentum is not None and not number(config.momentum):
        raise bad("momentum", "None or a number in [0, 1)")
    for name in ("lr", "watchdog_s"):
        if getattr(config, name) is not None and (not number(getattr(config, name)) or getattr(config, name) <= 0):
            raise bad(name, "None or a finite number > 0")
    choices = {"model": SIZES, "schedule": SCHEDULES, "optimizer": OPTIMIZERS, "device": ("cpu", "cuda"),
               "precision": ("fp32", "bf16"), "on_nonfinite": ("stop", "skip"), "delay_lr": LR_RULES,
               "delay_momentum": MOMENTUM_RULES, "muon_scale": (None, "original", "adamw"),
               "predict_from": (None, "optimizer", "last_update"), "resume": (False, True, "auto")}
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise bad(name, "one of " + ", ".join(map(repr, allowed)))
    for name in ("stream", "overwrite", "allow_dp_change", "emulate", "no_progress"):
        if not isinstance(getattr(config, name), bool):
            raise bad(name, "True or False")
    if config.resume and config.overwrite:
        raise ConfigError("resume (--resume) continues the run in run_dir and overwrite (--overwrite) deletes it: "
                          "give one of the two")
    if isinstance(config.checkpoint_stages, str):
        try:
            checkpoint_stages_spec(config.checkpoint_stages)
        except ValueError as e:
            raise ConfigError(f"checkpoint_stages (--checkpoint-stages): {e}") from None
    elif not (config.checkpoint_stages in (None, True) or isinstance(config.checkpoint_stages, dict)):
        raise bad("checkpoint_stages", "None, True (every stage), a dict {stage: 'all' or [layer, ...]} or the "
                                       "flag's spelling ('all', '0,1', '1:0-2')")
    if config.hf_set is not None and (isinstance(config.hf_set, str) or
                                      not all(isinstance(x, str) for x in config.hf_set)):
        raise bad("hf_set", "None or a list of 'KEY=VALUE' strings")
    for name in ("hf_config", "data", "tokenizer", "link", "straggler", "recipe", "policy"):
        if getattr(config, name) is not None and not isinstance(getattr(config, name), str):
            raise bad(name, "None or a string")
    if not isinstance(config.run_dir, str) or not config.run_dir:
        raise bad("run_dir", "a folder's path")
    if config.link:
        from ..links import LinkSpecError, parse_link
        try:
            parse_link(config.link)
        except LinkSpecError as e:
            raise ConfigError(f"link (--link): {e}") from None


def _check_where(args: TrainConfig) -> None:
    """The checks of where the ranks run: emulated links and devices, data parallelism, GPUs."""
    from ..errors import ConfigError
    from .torchrun_env import torchrun_env
    if (args.link or args.straggler) and args.emulate:
        raise ConfigError("--link and --straggler emulate a network and a slow device between the stage processes; "
                          "--emulate runs every stage in one process. Drop --emulate")
    if args.link and args.device == "cuda":
        raise ConfigError("--link delays the CPU processes' messages (gloo); on GPUs the transfers are NCCL's own. "
                          "Use --device cpu with --link")
    if args.link:
        here = torchrun_env()
        if here is not None and here.local_world_size != here.world_size:
            raise ConfigError(f"--link emulates a network by comparing the ranks' wall clocks, which only one machine "
                              f"shares, but torchrun runs {here.local_world_size} of the {here.world_size} ranks "
                              "here: run the emulation on one node, or drop --link on a real network")
    if args.straggler:
        from ..links import LinkSpecError, parse_straggler
        try:
            parse_straggler(args.straggler, args.stages)
        except LinkSpecError as e:
            raise ConfigError(str(e)) from None
    if args.dp > 1 and args.emulate:
        raise ConfigError(f"--dp {args.dp} runs {args.stages} x {args.dp} processes; --emulate runs one pipeline in "
                          f"this process. Drop --emulate, or emulate one pipeline on the same rows with --dp 1 "
                          f"--microbatch-size {args.microbatch_size * args.dp}")
    if args.device == "cuda":
        import torch
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        here = torchrun_env()  # under torchrun: this node's processes, one GPU each
        if found < (1 if args.emulate else here.local_world_size if here else args.stages * args.dp):
            need = ("a GPU (--emulate runs every stage on one)" if args.emulate
                    else f"{here.local_world_size} GPUs on this node (one per process torchrun starts here)" if here
                    else f"{args.stages * args.dp} GPUs (one per stage and replica)")
            raise ConfigError(f"--device cuda needs {need}; found {found}. Use --device cpu")


def _check_prediction(cfg: TrainConfig) -> None:
    from ..errors import ConfigError
    delta = _predict_from(cfg)
    if delta != "optimizer" and cfg.policy != "pipeoptim":
        raise ConfigError(f"--predict-from {delta} chooses PipeOptim's Δ, but the policy is {cfg.policy}; use "
                          "--policy pipeoptim or drop --predict-from")
    m = cfg.momentum
    if m is not None and not 0.0 <= m < 1.0:
        raise ConfigError(f"--momentum must be in [0, 1) (β1 or momentum), got {m}")
    dc = cfg.dc
    if dc and cfg.policy != "stash":
        raise ConfigError(f"--dc {dc} corrects stashed gradients; use it with --policy stash (and --schedule "
                          "async-1f1b or async-zb)")
    if not 0.0 <= dc < math.inf:
        raise ConfigError(f"--dc must be a finite number >= 0, got {dc}")
    if cfg.muon_scale and cfg.optimizer != "muon":
        raise ConfigError(f"--muon-scale {cfg.muon_scale} sets how Muon scales its update, but the optimizer is "
                          f"{cfg.optimizer}; use --optimizer muon or drop --muon-scale")
    if cfg.optimizer == "muon" and cfg.policy == "pipeoptim" and delta == "optimizer":
        raise ConfigError("--optimizer muon has no prediction rule of its own (Muon + AdamW); predict from the last "
                          "applied update: --predict-from last_update")


def _check_delay(cfg: TrainConfig, sched) -> None:
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


def _hf_spec(args: TrainConfig, vocab_size: int | None = None) -> dict:
    """--hf-config and --hf-set as the model a run builds (models.hf_config.resolve), or a ConfigError."""
    from ..errors import ConfigError
    try:
        from ..models.hf import require_transformers
        require_transformers()
        from ..models.hf_config import HFConfigError, resolve
        spec = resolve(args.hf_config, args.hf_set, vocab_size)
    except (ImportError, HFConfigError) as e:
        raise ConfigError(str(e)) from None
    return spec


def _hf_sizes(spec: dict) -> tuple:
    """(d_model, n_heads, n_layers, seq_len) of an --hf-config model: windows of 64 tokens, or its positions."""
    return spec["hidden"], spec["heads"], spec["layers"], min(64, spec["max_positions"] or 64)
