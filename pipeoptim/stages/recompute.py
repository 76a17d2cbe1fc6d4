"""Activation recomputation (checkpointing) of whole stages or of chosen layers of a stage, under any weight policy.

An asynchronous 1F1B stage k holds the activations of D − k micro-batches between their forwards and backwards,
so the first stages hold the most; recomputing a stage's forward inside its backward keeps only the stage's (or
each checkpointed layer's) inputs. ``Pipeline(checkpoint_stages=...)`` chooses where:

    checkpoint_stages=True                      every stage, each as one region (keeps only the stage's inputs)
    checkpoint_stages=[0, 1]                    stages 0 and 1, whole
    checkpoint_stages={0: "all", 1: [0, 2]}     stage 0 whole; layers 0 and 2 of stage 1 (indices within the stage)

A whole stage is one region: its backward recomputes the stage at once. Chosen layers are a region each: each
keeps its own input and is recomputed when the backward reaches it.

The recomputation is torch.utils.checkpoint's (non-reentrant: it works with ``torch.autograd.grad`` and so with
the split backward) with the weight policy's ``recompute_context(mb)`` as its recompute context: the module's
parameters then read the weights the policy names for the recomputation (``WeightPolicy._recompute_buffers``: by
default the weights the backward reads; see policies/base.py). A split backward recomputes once per part: each
part is its own autograd call, and the parts may read different weights (a step between them); the weight pass
recomputes once however many parameter groups it walks (runtime.split_backward).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Mapping, Sequence

from ..errors import ConfigError   # torch is imported where a stage runs: the CLI checks the form without it

__all__ = ["ALL", "CheckpointStagesError", "parse_checkpoint_stages", "run_stage"]

ALL = "all"

_HELP = ("checkpoint_stages is True (every stage), a list of stage indices, or a dict {stage: 'all' or a list of "
         "layer indices within that stage}")


class CheckpointStagesError(ConfigError):
    """A checkpoint_stages value that names no stage or layer, or has no known form; ``problem`` says which."""

    def __init__(self, problem: str):
        super().__init__(f"checkpoint_stages: {problem}; {_HELP}")
        self.problem = problem


def _index(value, limit: int, where: str, what: str) -> int:
    """``value`` as an index below ``limit``; else an error saying that ``where`` has no such ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointStagesError(f"{what} {value!r} is not an integer index")
    if not 0 <= value < limit:
        raise CheckpointStagesError(f"{where} has no {what} {value}: it has {limit} ({what}s 0 to {limit - 1})")
    return value


def parse_checkpoint_stages(value, layers_per_stage: Sequence[int | None]) -> dict[int, str | tuple[int, ...]]:
    """{stage: "all" or the sorted layer indices to checkpoint} from what ``Pipeline(checkpoint_stages=)`` got, or
    a ConfigError naming the stage or layer that does not exist. ``layers_per_stage``: the cut's layer counts (a
    stage given as a module is one layer); None for a stage whose layers are not known yet (the CLI checks the
    stages before the model exists; the Pipeline checks the layers)."""
    n = len(layers_per_stage)
    if value is None or value is False:
        return {}
    if value is True:
        return {k: ALL for k in range(n)}
    if isinstance(value, (str, bytes)) or not isinstance(value, (Mapping, Sequence, set, frozenset)):
        raise CheckpointStagesError(f"{value!r} has no known form")
    if not isinstance(value, Mapping):
        value = {stage: ALL for stage in value}
    out: dict[int, str | tuple[int, ...]] = {}
    for stage, layers in value.items():
        stage = _index(stage, n, "the pipeline", "stage")
        if layers == ALL or layers is True:
            out[stage] = ALL
            continue
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, set, frozenset)):
            raise CheckpointStagesError(f"stage {stage}: {layers!r} is neither 'all' nor a list of layer indices "
                                        "within the stage")
        count = layers_per_stage[stage]
        chosen = tuple(sorted({_index(j, 1 << 62 if count is None else count, f"stage {stage}", "layer")
                               for j in layers}))
        if chosen:
            out[stage] = ALL if len(chosen) == count == 1 else chosen
    return out


class _EachTime:
    """A context manager that enters a fresh ``make()`` each time: torch makes the recompute context once per
    checkpointed call, and a split backward recomputes (enters it) once per part."""

    def __init__(self, make: Callable[[], ContextManager]):
        self.make, self.open = make, []

    def __enter__(self):
        cm = self.make()
        value = cm.__enter__()
        self.open.append(cm)
        return value

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)


def _contexts(recompute_context: Callable[[], ContextManager]):
    return lambda: (nullcontext(), _EachTime(recompute_context))


def run_stage(module, xs: tuple, layers: str | tuple[int, ...],
              recompute_context: Callable[[], ContextManager]):
    """``module(*xs)`` with ``layers`` ("all", or indices of a StageModule's layers) recomputed in the backward,
    where ``recompute_context()`` is entered around each recomputation."""
    from torch.utils.checkpoint import checkpoint

    from .model_cut import StageModule, _boundary
    ctx = _contexts(recompute_context)
    if layers == ALL or not isinstance(module, StageModule):
        if layers != ALL:
            raise ValueError(f"layer-wise recomputation needs a StageModule, got {type(module).__name__}")
        return checkpoint(module, *xs, use_reentrant=False, context_fn=ctx)
    chosen = set(layers)
    out = xs
    for j, (name, layer) in enumerate(zip(module.layer_names, module.layers)):
        args = out if isinstance(out, tuple) else (out,)
        y = checkpoint(layer, *args, use_reentrant=False, context_fn=ctx) if j in chosen else layer(*args)
        out = _boundary(y, name, layer)
    return out
