"""A batch made into the micro-batches a schedule runs: checked first (every input and the targets one row per
sample, not empty, divisible by the micro-batch count), then split along the batch dimension on the stage's device.

Its own module because the ``Pipeline`` splits every training and evaluation batch this way, and an error here
must come before anything runs (an empty batch would still run the schedule and decay the weights).
"""
from __future__ import annotations

import torch

__all__ = ["split_batch"]


def split_batch(batch, num_microbatches: int, device) -> tuple[list[tuple], list]:
    """``(inputs, targets)`` as ``num_microbatches`` micro-batches of inputs (a tuple each) and of targets, on
    ``device``; a ValueError saying what is wrong with the batch otherwise. Targets that are not a tensor are
    given whole to every micro-batch."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("a batch is (inputs, targets); inputs a tensor or a tuple of tensors")
    inputs, targets = batch
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    N = num_microbatches
    B = _batch_rows(inputs, targets)
    if B % N:
        raise ValueError(f"batch size {B} is not divisible by {N} micro-batches; use a batch size that is a "
                         f"multiple of {N}")
    per_input = [x.to(device).chunk(N) for x in inputs]
    micro_inputs = [tuple(p[i] for p in per_input) for i in range(N)]
    tgt = targets.to(device) if isinstance(targets, torch.Tensor) else targets
    micro_targets = list(tgt.chunk(N)) if isinstance(tgt, torch.Tensor) else [tgt] * N
    return micro_inputs, micro_targets


def _batch_rows(inputs: tuple, targets) -> int:
    """The batch's row count, once every input and the targets agree on it and it is not 0: checked before
    anything runs, since an empty batch would still run the schedule, decay the weights and move the
    optimizer's moments, and targets of another length would fail at some later action."""
    if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in inputs):
        raise ValueError("a batch is (inputs, targets); inputs a tensor or a tuple of tensors, each with the batch "
                         "dimension first")
    rows = inputs[0].shape[0]
    for i, x in enumerate(inputs[1:], 1):
        if x.shape[0] != rows:
            raise ValueError(f"input {i} of the batch has {x.shape[0]} rows but input 0 has {rows}: every input "
                             "needs one row per sample")
    if isinstance(targets, torch.Tensor) and (targets.dim() == 0 or targets.shape[0] != rows):
        have = "no rows (a 0-dimensional tensor)" if targets.dim() == 0 else f"{targets.shape[0]} rows"
        raise ValueError(f"the targets have {have} but the inputs have {rows}: give one target row per input "
                         f"row (targets of shape ({rows}, ...))")
    if rows == 0:
        raise ValueError("the batch is empty (the inputs have 0 rows): refused before anything ran (a step on it "
                         "would still decay the weights and the optimizer's moments); skip empty batches")
    return rows
