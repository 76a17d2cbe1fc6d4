"""Weight policies: what a pipeline stage's forwards and backwards read, and when its optimizer steps.

`make_policy(name, stage_module, optimizer, **options)` builds one by name; every policy has the
interface of `WeightPolicy` (see base.py for the executor's side of the contract):

    none       naive async: forward and backward read the weights real at their time
    stash      PipeDream: a weight version per in-flight micro-batch, backward reads its forward's
               (dc=λ: DC-ASGD's correction of the stale gradient to the weights it is applied to)
    2bw        PipeDream-2BW: two versions, gradients accumulated over update_every=m micro-batches
    spectrain  SpecTrain: ŵ = w − s·lr·v (smoothed gradient) for forward and backward
    pipeoptim  PipeOptim: ŵ = w − s·lr·Δ, Δ from the optimizer's state (mode="exact", "paper" or "reference"),
               or delta="last_update": the last applied update, for any optimizer

Common options: update_every (micro-batches per step), working_dtype (bf16/fp16 working weights over
fp32 masters), binding (an existing FlatBinding). Predicting policies also take mechanism ("swap",
"pointer", "inplace") and backend (a pipeoptim_kernels backend).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import WeightPolicy
from .naive import NoPolicy
from .pipeoptim import PipeOptimPolicy
from .spectrain import SpecTrainPolicy
from .stash import StashPolicy, TwoBWPolicy

__all__ = ["WeightPolicy", "make_policy", "register_policy", "POLICIES", "NoPolicy", "StashPolicy",
           "TwoBWPolicy", "SpecTrainPolicy", "PipeOptimPolicy"]

POLICIES: dict[str, type[WeightPolicy]] = {
    cls.name: cls for cls in (NoPolicy, StashPolicy, TwoBWPolicy, SpecTrainPolicy, PipeOptimPolicy)
}


def register_policy(cls: type[WeightPolicy], *, overwrite: bool = False) -> type[WeightPolicy]:
    """Add a WeightPolicy subclass to the registry under `cls.name` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, WeightPolicy)):
        raise TypeError(f"register_policy needs a WeightPolicy subclass, got {cls!r}")
    if cls.name in POLICIES and not overwrite:
        raise ValueError(f"a policy named {cls.name!r} is already registered; pass overwrite=True to replace it")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, stage_module: nn.Module, optimizer: torch.optim.Optimizer, **options) -> WeightPolicy:
    """Build the weight policy `name` for one stage's module and optimizer (binding them to flat buffers)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown weight policy {name!r}; choose one of {', '.join(POLICIES)}")
    return cls(stage_module, optimizer, **options)
