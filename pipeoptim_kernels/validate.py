"""Argument checks for the public API, run before any buffer is touched.

Each message names the argument, what was wrong, and how to fix it, because these are the errors a
user sees first when wiring the kernels into their own runtime.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EAGER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_flat(name: str, t: object, *, ref: torch.Tensor | None = None, dtypes=EAGER_DTYPES,
               same_dtype: bool = True) -> torch.Tensor:
    """A flat buffer: a contiguous 1-D floating tensor, matching `ref` in length, device and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (a flat 1-D buffer), got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be a flat 1-D buffer, got shape {tuple(t.shape)}; "
                         f"pass {name}.view(-1) of a contiguous tensor, or use pipeoptim.flat to build flat buffers")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got stride {t.stride()}); pass {name}.contiguous() "
                         "or a slice of a flat buffer with stride 1")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if ref is not None:
        if t.numel() != ref.numel():
            raise ValueError(f"{name} has {t.numel()} elements but w has {ref.numel()}; "
                             "every state buffer must cover exactly the same parameters as w")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but w is on {ref.device}; move it with {name}.to(w.device)")
        if same_dtype and t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but w has {ref.dtype}; optimizer state must have "
                            "w's dtype (keep fp32 master weights and state, write low precision through out=)")
    return t


def check_out(out: object, w: torch.Tensor) -> torch.Tensor:
    out = check_flat("out", out, ref=w, dtypes=OUT_DTYPES + (torch.float64,), same_dtype=False)
    if out.dtype == torch.float64 and w.dtype != torch.float64:
        raise TypeError("out is float64 but w is not; out may be w's dtype or a lower precision "
                        "(float32, bfloat16, float16)")
    return out


def check_step_s(step: object, s: object) -> tuple[int, float]:
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step) or step < 0:
        raise ValueError(f"step must be a non-negative integer (completed optimizer steps), got {step!r}")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise ValueError(f"s must be a finite number of steps ahead (the version difference), got {s!r}")
    if s < 0:
        raise ValueError(f"s must be >= 0 (how many optimizer steps ahead to predict), got {s}; "
                         "use s=0 for no prediction")
    return int(step), float(s)


def check_group(group: object) -> Mapping:
    if not isinstance(group, Mapping):
        raise TypeError(f"group must be a dict of hyperparameters such as optimizer.param_groups[i], "
                        f"got {type(group).__name__}")
    if "lr" not in group:
        raise ValueError("group has no 'lr'; pass optimizer.param_groups[i] or a dict with at least 'lr' "
                         "and the rule's hyperparameters (betas, eps, momentum, ...)")
    return group


def same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same flat buffer: same device, start, length and dtype."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
            and a.dtype == b.dtype)


def check_not_overlapping(out: torch.Tensor, others: dict[str, torch.Tensor]) -> None:
    """out may be w itself (in place) but must not overlap any other buffer it would corrupt."""
    o0, o1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    for name, t in others.items():
        t0, t1 = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if t.device == out.device and o0 < t1 and t0 < o1:
            raise ValueError(f"out overlaps {name}; write the prediction to its own buffer (or to w itself for "
                             "an in-place predict)")
