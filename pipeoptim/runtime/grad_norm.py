"""The squared gradient norm that clipping and the non-finite check read: accurate in one pass per buffer, and
infinite or NaN exactly when some element is (``sum_of_squares``).

Its own module because it is a numerical method with its own accuracy argument and tests, apart from what the
device worker does with it (a stage's norm, a pipeline's less its copied weights'); ``runtime.worker`` re-exports
it.
"""
from __future__ import annotations

import math

import torch

__all__ = ["sum_of_squares"]


_ROW = 1 << 12  # elements per float32 partial sum of squares
_SMALL = 1 << 16  # up to this many elements a buffer is summed in float64 at once (one operation instead of six)


def sum_of_squares(tensors) -> torch.Tensor:
    """The sum of the squares of every element of ``tensors``, as a float64 CPU scalar.

    One pass over each buffer: the 2-norms of its rows of 4,096 elements accumulated in float32 (one
    vectorised reduction, as ``torch.nn.utils.clip_grad_norm_`` computes norms), then the rows' squares
    summed in float64. Short rows keep float32's rounding small: relative error ~1e-8 measured on 2e7 normal
    values and ~1e-5 in the worst case of one value repeated (rounding biased one way), where a single float32
    norm over a whole buffer is off by ~2e-3 on the former and a float64 copy of the buffer costs ~50x the
    time (tests/test_worker.py). A buffer of at most 65,536 elements is summed in float64 at once instead:
    there the row pass's five extra operations cost more than the copy (a small stage's step notices). A sum
    that is not finite is redone in float64 from the elements, so the result is infinite or NaN exactly when
    some element is, never because a finite gradient is large (float32 squares overflow above ~1.8e19).
    """
    flats = [t.detach().reshape(-1) for t in tensors]
    total = None  # summed where the buffers are: one copy back
    for flat in flats:
        if flat.numel() <= _SMALL:
            part = torch.linalg.vector_norm(flat, dtype=torch.float64).square()
        else:
            whole = flat.numel() // _ROW * _ROW
            rows = torch.linalg.vector_norm(flat[:whole].view(-1, _ROW), dim=1, dtype=torch.float32)
            rest = torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1)
            part = torch.cat([rows, rest]).double().pow(2).sum()
        total = part if total is None else total.add_(part)
    if total is None:
        return torch.zeros((), dtype=torch.float64)
    total = total.cpu()
    if not math.isfinite(float(total)):  # (a Python float: torch.isfinite costs ~3 µs, a small stage's step notices)
        total = sum((f.double().pow(2).sum().cpu() for f in flats), torch.zeros((), dtype=torch.float64))
    return total
