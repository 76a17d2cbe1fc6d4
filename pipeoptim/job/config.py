"""``TrainConfig``: one run of ``pipeoptim train``, as the command line, a torchrun job and Python all give it.

A dataclass with a field per flag of ``pipeoptim train`` (the flag's name with ``_`` for ``-``, the same default:
``tests/test_job_config.py`` keeps the two equal) and the fields ``job.checks.check`` fills in (the model's sizes,
the learning rate a run without ``lr`` gets, what a prepared folder or a tokenizer records). Torch-free and cheap,
so that every check can run before torch is imported, and picklable, so that the local launcher hands it to every
rank. The defaults the flags stand for (the model sizes, the measured learning rates) and the recipes they apply
live here too: the command line's parser and the checks both read them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["TrainConfig", "SIZES", "OPTIMIZERS", "DEFAULT_LR", "ASYNC_1F1B_ADAMW_LR", "ASYNC_1F1B_MUON_LR",
           "default_lr", "RECIPE_FLAGS", "apply_recipe", "checkpoint_stages_spec"]


SIZES = {  # name -> (d_model, n_heads, n_layers, seq_len)
    "tiny": (32, 2, 2, 32),
    "small": (64, 4, 4, 64),
    "medium": (128, 4, 6, 128),
    "hf-gpt2": (64, 4, 4, 64),   # transformers.GPT2LMHeadModel, meta-built
    "hf-llama": (64, 4, 4, 64),  # transformers.LlamaForCausalLM, meta-built
}
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "nadam", "muon")  # muon: Muon on the matrices + AdamW
# The lr when none is given. On the default run (the small GPT, 4 stages, 8 micro-batches, AdamW; 3 seeds, each lr
# bracketed on both sides) asynchronous 1F1B learned best at a quarter of the lr that suited the synchronous weights
# (2BW with one update per window, GPipe's weights): 7.5e-4 against 3e-3, validation 2.051 against 2.223 at 3e-3.
DEFAULT_LR, ASYNC_1F1B_ADAMW_LR = 3e-3, 7.5e-4
# The main job's default pair, asynchronous 1F1B + PipeOptim's prediction from the last update + Muon at AdamW's
# scale: the best lr of the same 3-seed sweep, bracketed on both sides (docs/getting-started.md, "The main job").
ASYNC_1F1B_MUON_LR = 8e-3


def default_lr(schedule: str, optimizer: str) -> float:
    """The peak lr a run gets without ``lr`` (``DEFAULT_LR`` but for the measured asynchronous pairs)."""
    measured = {("async-1f1b", "adamw"): ASYNC_1F1B_ADAMW_LR, ("async-1f1b", "muon"): ASYNC_1F1B_MUON_LR}
    return measured.get((schedule, optimizer), DEFAULT_LR)


def checkpoint_stages_spec(text: str):
    """``checkpoint_stages`` as the flag writes it: 'all' -> True; '0,1:0-2,1:5' -> {0: 'all', 1: [0, 1, 2, 5]}
    (the ``Pipeline``'s forms); a ValueError saying what it takes otherwise."""
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
        raise ValueError(f"{text!r}: give 'all', stage indices '0,1', or layers within a stage '1:0-2' (stage 1, its "
                         "layers 0 to 2)") from None
    return out


@dataclass(frozen=True)
class TrainConfig:
    """A run of ``pipeoptim train``: each field is the flag of that name (``pipeoptim train --help`` says what it
    does). ``pipeoptim.job.run(TrainConfig(...))`` runs it as the command would; ``pipeoptim.job.check`` returns
    it checked, with the fields below ``# filled in`` set. Frozen: ``replace`` makes a changed copy."""

    # the model and its data
    model: str = "small"
    hf_config: str | None = None
    hf_set: list[str] | None = None
    data: str | None = None
    tokenizer: str | None = None
    # the pipeline
    stages: int = 4
    dp: int = 1
    schedule: str = "async-1f1b"
    policy: str | None = None
    update_every: int | None = None
    stream: bool = False
    checkpoint_stages: bool | dict | None = None
    # the optimizer
    recipe: str | None = None
    optimizer: str = "muon"
    muon_scale: str | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    dc: float = 0.0
    predict_from: str | None = None
    delay_lr: str = "none"
    delay_momentum: str = "none"
    delay_warmup: int = 0
    lr: float | None = None
    clip: float = 1.0
    # the run
    microbatches: int = 8
    microbatch_size: int = 4
    steps: int = 200
    device: str = "cpu"
    precision: str = "fp32"
    seed: int = 0
    run_dir: str = "runs/train"
    resume: bool | str = False
    overwrite: bool = False
    allow_dp_change: bool = False
    save_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 20
    on_nonfinite: str = "stop"
    watchdog_s: float | None = None
    port: int | None = None
    emulate: bool = False
    link: str | None = None
    straggler: str | None = None
    no_progress: bool = False
    # filled in by job.checks.check (and by the launcher: resume_from, local_ranks)
    d_model: int | None = None
    n_heads: int | None = None
    n_layers: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    cores: int | None = None
    lr_given: bool | None = None
    recipe_lr: float | None = None
    emulation: str = ""
    prepared: dict | None = None
    tokenizer_sha256: str | None = None
    hf_spec: dict | None = None
    hf_model: str | None = None
    resume_from: str | None = None
    local_ranks: int | None = None
    # the recipe flags given on the command line (a recipe compares those even at their default); None: compare
    # with the defaults, as for a TrainConfig made in Python
    given: frozenset[str] | None = field(default=None, repr=False, compare=False)
    # set by job.checks.check: the flags above are resolved (lr, policy, model...), so it is not checked again
    checked: bool = field(default=False, repr=False)

    @classmethod
    def flag_names(cls) -> list[str]:
        """The fields that are flags of ``pipeoptim train``, in order."""
        return [f.name for f in dataclasses.fields(cls)][:dataclasses.fields(cls).index(_FIRST_FILLED)]

    @classmethod
    def from_args(cls, args) -> TrainConfig:
        """The configuration of a parsed ``pipeoptim train`` command line (an ``argparse.Namespace``)."""
        given = getattr(args, "_given", None)  # None: not made by pipeoptim train's parser
        return cls(**{name: getattr(args, name) for name in cls.flag_names()},
                   given=None if given is None else frozenset(given))

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes`` (a field not of this class is a TypeError naming it). A checked configuration's
        flags are resolved (its ``lr`` is the default it got, its ``model`` the one ``hf_config`` built): change
        those on the configuration you checked, then check that again."""
        flags = sorted(set(changes) & set(self.flag_names()))
        if self.checked and flags:
            raise ValueError(f"{', '.join(flags)}: this TrainConfig was checked (its flags resolved); change the "
                             "TrainConfig you gave check() and check it again")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field as a plain dict (what ``history.json`` records, less its non-plain values)."""
        own = ("given", "checked")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in own}


_FIRST_FILLED = next(f for f in dataclasses.fields(TrainConfig) if f.name == "d_model")

# the flags a recipe may set, as they are spelled on the command line
RECIPE_FLAGS = {"schedule": "--schedule", "policy": "--policy", "optimizer": "--optimizer", "momentum": "--momentum",
                "weight_decay": "--weight-decay", "delay_lr": "--delay-lr", "delay_momentum": "--delay-momentum",
                "delay_warmup": "--delay-warmup", "predict_from": "--predict-from", "muon_scale": "--muon-scale"}


def apply_recipe(config: TrainConfig) -> TrainConfig:
    """``config`` with the flags its ``recipe`` names set; a flag given with another value is an error, never
    overridden (on the command line even when the value given is the flag's default; in Python, a value other than
    the default). Without ``lr``, the lr the recipe was measured at on ``stages`` devices, or a ConfigError naming
    the depths it was measured on."""
    if not config.recipe:
        return config
    from ..errors import ConfigError
    from ..recipes import get
    recipe = get(config.recipe)
    defaults = TrainConfig()
    changes = {}
    for name, value in recipe.cli_flags().items():
        current = getattr(config, name)
        given = name in config.given if config.given is not None else current != getattr(defaults, name)
        if given and current != value:
            raise ConfigError(f"--recipe {recipe.name} sets {RECIPE_FLAGS[name]} {value} but you gave "
                              f"{RECIPE_FLAGS[name]} {current}; drop one of the two (pipeoptim.recipes says what the "
                              "recipe was measured with)")
        changes[name] = value
    if config.lr is None:
        try:
            changes["recipe_lr"] = recipe.lr_for(config.stages)
        except ValueError as e:
            raise ConfigError(f"--recipe {recipe.name} without --lr: {e} with --lr") from None
    return config.replace(**changes)
