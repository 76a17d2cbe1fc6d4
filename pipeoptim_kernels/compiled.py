"""The compiled backends (`cpu`, `cuda`): loading the extension and calling its torch.library ops.

The extension `pipeoptim_kernels._C` is normally built by `pip install`. When it is missing (a source
checkout that was never built) it is compiled just in time with ninja from `csrc/`; when that is not
possible either, the package works on its eager backend and says so once. PIPEOPTIM_KERNELS_BUILD names
another build's --build-lib folder to load it from first (CI's run under its oldest torch builds there).

The ops (`torch.ops.pipeoptim.*`) take the scalars of a plan from `rules.py` as a float list (each
plan's `coeffs()`, in the order of the structs in `csrc/rules.h`). Fake implementations make them
traceable by torch.compile.
"""
from __future__ import annotations

import importlib
import os
import threading
import warnings

import torch

from . import _build
from .rules import AdamStepPlan, PredictPlan, SgdStepPlan
from .validate import same_buffer

_lock = threading.Lock()
_state: dict = {"tried": False, "module": None, "error": None}


def _jit_build():
    cpp_extension = _build.cpp_extension()
    if not _build.CSRC.is_dir():
        raise RuntimeError(f"no C++ sources at {_build.CSRC} to build from")
    plan = _build.cuda_plan() if torch.cuda.is_available() else None
    with_cuda = plan is not None and plan.with_cuda
    if with_cuda:
        _build.use_toolkit(plan.home)
    cflags = list(_build.CXX_FLAGS) + (["-DPIPEOPTIM_WITH_CUDA"] if with_cuda else [])
    return cpp_extension.load(
        name="pipeoptim_kernels_C", sources=_build.sources(with_cuda), extra_cflags=cflags,
        extra_cuda_cflags=list(_build.NVCC_FLAGS), extra_ldflags=list(_build.LINK_FLAGS),
        with_cuda=with_cuda, verbose=False)


def load():
    """The compiled module, or None (after one warning) when it cannot be had."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        module = None
        other_build = _build.built_extension_dir()
        if other_build != _build.ROOT / "pipeoptim_kernels":
            package = importlib.import_module("pipeoptim_kernels")
            if str(other_build) not in package.__path__:
                package.__path__.insert(0, str(other_build))
        try:
            module = importlib.import_module("pipeoptim_kernels._C")
        except ImportError as import_error:
            if os.environ.get("PIPEOPTIM_NO_JIT", "0") == "1":
                _state["error"] = f"{import_error} (and PIPEOPTIM_NO_JIT=1)"
            else:
                try:
                    module = _jit_build()
                except Exception as build_error:  # a missing compiler, headers, ninja...
                    _state["error"] = f"{import_error}; just-in-time build failed: {build_error}"
        if module is None:
            warnings.warn(
                "pipeoptim_kernels: the compiled kernels are not available, using the eager backend "
                f"({_state['error']}). Build them with `pip install --no-build-isolation -e .` "
                "(set CUDA_HOME=/usr/local/cuda for the CUDA kernels).", RuntimeWarning, stacklevel=3)
        else:
            _register_fakes()
        _state["module"], _state["tried"] = module, True
        return module


def has_cpu() -> bool:
    return load() is not None


def has_cuda() -> bool:
    module = load()
    return module is not None and bool(module.with_cuda) and torch.cuda.is_available()


def cpu_isa() -> str | None:
    module = load()
    return module.cpu_isa() if module is not None else None


def _register_fakes() -> None:
    for op in ("predict_", "adam_step_predict_", "sgd_step_predict_", "adam_step_predict_into_grad_",
               "sgd_step_predict_into_grad_"):
        name = f"pipeoptim::{op}"
        try:
            torch.library.register_fake(name)(lambda *args, **kwargs: None)
        except RuntimeError:  # already registered (module reloaded)
            pass


# ---- calls --------------------------------------------------------------------------------------------------

def predict(plan: PredictPlan, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.ops.pipeoptim.predict_(w, plan.m, plan.g, plan.v, plan.vc, out, plan.den, plan.coeffs())


def adam_step_predict(p: AdamStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    coeffs = p.coeffs()
    if same_buffer(out, grad):
        torch.ops.pipeoptim.adam_step_predict_into_grad_(w, grad, p.tensors["m"], p.tensors["v"], p.tensors.get("vmax"),
                                                         coeffs)
    else:
        torch.ops.pipeoptim.adam_step_predict_(w, grad, p.tensors["m"], p.tensors["v"], p.tensors.get("vmax"), out,
                                               coeffs)


def sgd_step_predict(p: SgdStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    coeffs = p.coeffs()
    if same_buffer(out, grad):
        torch.ops.pipeoptim.sgd_step_predict_into_grad_(w, grad, p.tensors.get("buf"), p.nesterov, p.first, coeffs)
    else:
        torch.ops.pipeoptim.sgd_step_predict_(w, grad, p.tensors.get("buf"), out, p.nesterov, p.first, coeffs)
