"""pipeoptim_kernels: fused weight prediction over flat parameter buffers.

    ŵ = w − s·lr·Δ          Δ: the update direction the optimizer's own rule gives from its state

`predict` writes ŵ in one pass over w and the optimizer state, in place or into a separate (possibly
bf16/fp16) buffer. `step_predict` takes the optimizer step and writes the next forward's prediction in
the same pass. Rules follow torch.optim's update rules and state names; `group` can be a real
optimizer's `param_groups[i]`. This package knows nothing of pipelines.

Backends: `eager` (plain torch, any device, the readable oracle), `triton` (GPU; CPU under
TRITON_INTERPRET=1, for tests), `cpu` and `cuda` (the compiled extension). `backend="auto"` picks the
fastest available for the tensors' device.
"""
from __future__ import annotations

from typing import Mapping

import torch

from . import compiled, eager, rules, triton_backend
from .rules import (BUILTIN_RULES, MODES, OPTIMIZER_CLASSES, PAPER_RULES, REFERENCE_RULES, STATE_ENTRIES,
                    STEP_PREDICT_RULES, register_rule)
from .validate import check_predict_call, check_step_predict_call

__all__ = ["predict", "step_predict", "available_backends", "register_rule", "BUILTIN_RULES", "MODES", "PAPER_RULES",
           "REFERENCE_RULES", "STEP_PREDICT_RULES", "STATE_ENTRIES", "OPTIMIZER_CLASSES", "BACKENDS"]

BACKENDS = ("auto", "eager", "triton", "cpu", "cuda")
_HOW_TO_GET = {
    "triton": "install triton (`pip install triton`) and use CUDA tensors, or set TRITON_INTERPRET=1 before "
              "importing to run it on CPU tensors",
    "cpu": "build the extension: `pip install --no-build-isolation -e .`",
    "cuda": "build the extension on a machine with torch+CUDA and nvcc "
            "(`CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e .`) and use CUDA tensors",
}


def available_backends() -> list[str]:
    """Backends that can run here, e.g. ["eager", "triton", "cpu", "cuda"]."""
    names = ["eager"]
    if triton_backend.available():
        names.append("triton")
    if compiled.has_cpu():
        names.append("cpu")
    if compiled.has_cuda():
        names.append("cuda")
    return names


def _resolve_backend(backend: str, w: torch.Tensor, out: torch.Tensor, builtin: bool) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    compiled_ok = builtin and w.dtype == torch.float32 and out.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if backend == "auto":
        if not compiled_ok:
            return "eager"
        if w.device.type == "cuda":
            if compiled.has_cuda():
                return "cuda"
            if triton_backend.available():
                return "triton"
        elif w.device.type == "cpu" and compiled.has_cpu():
            return "cpu"
        return "eager"
    if backend == "eager":
        return backend
    if not builtin:
        raise ValueError("custom rules run on the eager backend only; pass backend='eager' or 'auto'")
    if not compiled_ok:
        raise TypeError(f"backend {backend!r} needs float32 w and state with a float32/bfloat16/float16 out "
                        f"(got w {w.dtype}, out {out.dtype}); use backend='eager' for other dtypes")
    if backend == "triton":
        if not triton_backend.available() or (w.device.type != "cuda" and not triton_backend.interpreting()):
            raise RuntimeError(f"backend 'triton' is not available for {w.device} tensors here: {_HOW_TO_GET['triton']}")
    elif backend == "cpu":
        if not compiled.has_cpu():
            raise RuntimeError(f"backend 'cpu' is not available: {_HOW_TO_GET['cpu']}")
        if w.device.type != "cpu":
            raise ValueError(f"backend 'cpu' runs on CPU tensors, w is on {w.device}; use backend='cuda' or 'auto'")
    elif backend == "cuda":
        if not compiled.has_cuda():
            raise RuntimeError(f"backend 'cuda' is not available: {_HOW_TO_GET['cuda']}")
        if w.device.type != "cuda":
            raise ValueError(f"backend 'cuda' runs on CUDA tensors, w is on {w.device}; use backend='cpu' or 'auto'")
    return backend


def _plan(make, rule, *args):
    """A plan from the rule table, turning a missing hyperparameter into an error that says which."""
    try:
        return make(rule, *args)
    except KeyError as e:
        raise ValueError(f"group has no {e.args[0]!r}, which rule {rule!r} needs; pass the optimizer's "
                         "param_groups[i] as is, or a dict with every hyperparameter of that optimizer") from None


_PREDICT = {"eager": eager.predict, "cpu": compiled.predict, "cuda": compiled.predict,
            "triton": triton_backend.predict}


def predict(rule: str, w: torch.Tensor, state: Mapping[str, torch.Tensor], group: Mapping, *, step: int, s: float,
            out: torch.Tensor | None = None, mode: str = "exact", backend: str = "auto") -> torch.Tensor:
    """Predicted weights ŵ = w − s·lr·Δ for `rule`, after `step` completed optimizer steps.

    `state` maps torch.optim's state names (plus 'grad', the last gradient, where the rule uses it) to
    flat buffers aligned with `w`. `out=w` predicts in place; another buffer may be a lower precision
    and must not overlap w or the state. With `out=None` a new buffer is returned, except when nothing
    is to predict (s == 0 or step == 0): then `w` itself is returned. Zero-length buffers are valid
    (nothing is computed). Returns the tensor holding ŵ.
    """
    step, s = check_predict_call(rule, w, state, group, step, s, out, mode)
    builtin = rule in BUILTIN_RULES
    name = _resolve_backend(backend, w, w if out is None else out, builtin)
    if s == 0 or step == 0:  # nothing to predict
        if out is None or out is w:
            return w
        with torch.no_grad():
            out.copy_(w)
        return out
    plan = _plan(rules.predict_plan, rule, state, group, step, s, mode) if builtin else None
    if out is None:
        out = torch.empty_like(w)
    if w.numel() == 0:
        return out
    with torch.no_grad():  # like optimizer.step(): the kernels write outside autograd, on every backend alike
        if builtin:
            _PREDICT[name](plan, w, out)
        else:
            direction = rules.custom_rule(rule)(w, state, group, step)
            eager.predict_direction(direction, w, s * rules.scalar(group["lr"]), out)
    return out


def step_predict(rule: str, w: torch.Tensor, grad: torch.Tensor, state: Mapping[str, torch.Tensor], group: Mapping, *,
                 step: int, s: float, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """One optimizer step of `w` (and its state) from `grad`, then ŵ for the next forward into `out`.

    Takes step number `step + 1` exactly as torch.optim would (`step`: completed steps before this
    call; the caller keeps its own step count, e.g. torch.optim's state['step']). Rules: sgd, adam,
    adamw. `out` is a separate buffer (fp32, bf16 or fp16), or `grad` itself: the step has finished
    with the gradient, so ŵ can take its place, saving a buffer and (on the CPU) the traffic of a
    fourth written stream. No other two of w, grad, out and the state may share memory. With s == 0
    it receives the stepped weights. Zero-length buffers are valid (nothing is computed). Returns `out`.
    """
    step, s = check_step_predict_call(rule, w, grad, state, group, step, s, out)
    name = _resolve_backend(backend, w, out, True)
    if rule == "sgd":
        plan = _plan(lambda r, *a: rules.sgd_step_plan(*a), rule, state, group, step, s)
    else:
        plan = _plan(rules.adam_step_plan, rule, state, group, step, s)
    if w.numel() == 0:
        return out
    table = {"eager": eager, "cpu": compiled, "cuda": compiled, "triton": triton_backend}[name]
    with torch.no_grad():  # like optimizer.step(): the kernels write outside autograd, on every backend alike
        (table.sgd_step_predict if rule == "sgd" else table.adam_step_predict)(plan, w, grad, out)
    return out
