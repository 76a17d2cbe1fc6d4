"""``pipeoptim train``'s flags made into one checked configuration (the ``cfg`` dict every rank receives).

``_config(args)`` runs every check that can fail before torch is imported (the data, the tokenizer, the schedule
and the policy, the prediction and the delay rules, a Hugging Face config), so that a wrong combination is
answered as fast as ``--help``; the helpers here also tell the worker what the configuration means (its
optimizer, its policy's options, how many ranks share this machine).
"""
from __future__ import annotations

import math
import os
import sys

from ..data import VOCAB_SIZE  # bytes, unless --tokenizer (pipeoptim.data loads torch only when it reads text)
from .train_arguments import SIZES, apply_recipe, default_lr

__all__ = ["emulation_words"]


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
        from ..stages.recompute import CheckpointStagesError, parse_checkpoint_stages
        from ..errors import ConfigError
        from ..stages.partition import balance_by_layers   # the Pipeline's cut of the model's L + 2 layers (no torch)
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
    from ..data.token_shards import SPLITS, is_prepared, read_manifest
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
    from ..data.token_shards import tokenizer_sha256
    try:
        return tokenizer_sha256(name)
    except DataError as e:
        raise ConfigError(f"--tokenizer: {e}") from None


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


def _prepared_config(args, manifest: dict) -> dict:
    """The run's entries for a prepare-data folder: the vocabulary of its tokens and what a checkpoint records
    of them; ConfigError when --model or --tokenizer cannot read those tokens."""
    from ..data import DataError
    from ..errors import ConfigError
    from ..data.token_shards import BYTES, data_sha256, tokenizer_sha256
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
