"""Triton backend: the plans of `rules.py` as Triton kernels, one pass over the flat buffers.

Runs on CUDA tensors; with TRITON_INTERPRET=1 set before this module is imported it also runs on CPU
tensors through Triton's interpreter, which is how the tests exercise it without a GPU. The interpreter
costs about a millisecond per program, hence the large block there. Its fp32→bf16 stores truncate
where the GPU rounds: tests allow one bf16 ulp on this path.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .rules import DEN_LINEAR, DEN_SQRT, AdamStepPlan, PredictPlan, SgdStepPlan
from .validate import same_buffer

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional
    triton = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    return triton is not None and (interpreting() or torch.cuda.is_available())


def _block() -> int:
    return 65536 if interpreting() else 1024


if triton is not None:

    @triton.jit
    def _predict_kernel(w_ptr, m_ptr, g_ptr, v_ptr, vc_ptr, out_ptr, n,
                        scale, cm, cg, cw, dscale, eps, lam,
                        HAS_M: tl.constexpr, HAS_G: tl.constexpr, DEN: tl.constexpr, HAS_VC: tl.constexpr,
                        BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        num = cw * w
        if HAS_M:
            num += cm * tl.load(m_ptr + offs, mask=mask, other=0.0)
        if HAS_G:
            num += cg * tl.load(g_ptr + offs, mask=mask, other=0.0)
        if DEN == 1:
            var = tl.load(v_ptr + offs, mask=mask, other=1.0)
            if HAS_VC:
                vc = tl.load(vc_ptr + offs, mask=mask, other=0.0)
                var = var - vc * vc
            num = num / (dscale * tl.sqrt(var) + eps)
        elif DEN == 2:
            num = num / tl.load(v_ptr + offs, mask=mask, other=1.0)
        res = w - scale * (num + lam * w)
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _adam_kernel(w_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, n,
                     beta1, beta2, eps, sign, wd_coupled, decay, step_size, bc2_sqrt, pred_scale, pred_lam,
                     AMSGRAD: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        grad = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        g = sign * grad + wd_coupled * w
        w = w * decay
        weight = 1.0 - beta1
        if weight < 0.5:  # torch's lerp, exact at both ends
            m = m + weight * (g - m)
        else:
            m = g - (g - m) * (1.0 - weight)
        v = v * beta2 + (1.0 - beta2) * (g * g)
        vhat = v
        if AMSGRAD:
            vmax = tl.maximum(tl.load(vmax_ptr + offs, mask=mask, other=0.0), v)
            tl.store(vmax_ptr + offs, vmax, mask=mask)
            vhat = vmax
        denom = tl.sqrt(vhat) / bc2_sqrt + eps
        direction = m / denom
        w = w - step_size * direction
        tl.store(w_ptr + offs, w, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        res = w - pred_scale * direction - pred_lam * w
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sgd_kernel(w_ptr, g_ptr, buf_ptr, out_ptr, n, lr, momentum, dampening, wd, sign, pred_scale,
                    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        grad = tl.load(g_ptr + offs, mask=mask, other=0.0)
        d = sign * grad + wd * w
        update = d
        if HAS_MOMENTUM:
            if FIRST:
                buf = d
            else:
                buf = tl.load(buf_ptr + offs, mask=mask, other=0.0) * momentum + (1.0 - dampening) * d
            tl.store(buf_ptr + offs, buf, mask=mask)
            if NESTEROV:
                update = d + momentum * buf
            else:
                update = buf
        w = w - lr * update
        tl.store(w_ptr + offs, w, mask=mask)
        if HAS_MOMENTUM and not NESTEROV:
            direction = buf
        else:
            direction = sign * grad + wd * w
            if HAS_MOMENTUM:
                direction += momentum * buf
        res = w - pred_scale * direction
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


def _grid(n: int, block: int):
    return (triton.cdiv(n, block),)


# The launches are torch.library custom ops (with fake implementations) so that torch.compile can
# trace through them; the argument lists mirror the compiled extension's ops.

@torch.library.custom_op("pipeoptim::triton_predict_", mutates_args=("out",))
def _predict_op(w: torch.Tensor, m: Optional[torch.Tensor], g: Optional[torch.Tensor], v: Optional[torch.Tensor],
                vc: Optional[torch.Tensor], out: torch.Tensor, den: int, coeffs: list[float]) -> None:
    n, block = w.numel(), _block()
    scale, cm, cg, cw, dscale, eps, lam = coeffs
    _predict_kernel[_grid(n, block)](
        w, m if m is not None else w, g if g is not None else w, v if v is not None else w,
        vc if vc is not None else w, out, n, scale, cm, cg, cw, dscale, eps, lam,
        HAS_M=m is not None, HAS_G=g is not None, DEN=den,
        HAS_VC=vc is not None and den == DEN_SQRT, BLOCK=block)


@torch.library.custom_op("pipeoptim::triton_adam_step_predict_", mutates_args=("w", "m", "v", "vmax", "out"))
def _adam_op(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, vmax: Optional[torch.Tensor],
             out: torch.Tensor, coeffs: list[float]) -> None:
    n, block = w.numel(), _block()
    _adam_kernel[_grid(n, block)](w, grad, m, v, vmax if vmax is not None else w, out, n, *coeffs,
                                  AMSGRAD=vmax is not None, BLOCK=block)


@torch.library.custom_op("pipeoptim::triton_sgd_step_predict_", mutates_args=("w", "buf", "out"))
def _sgd_op(w: torch.Tensor, grad: torch.Tensor, buf: Optional[torch.Tensor], out: torch.Tensor, nesterov: bool,
            first: bool, coeffs: list[float]) -> None:
    n, block = w.numel(), _block()
    _sgd_kernel[_grid(n, block)](w, grad, buf if buf is not None else w, out, n, *coeffs,
                                 HAS_MOMENTUM=buf is not None, NESTEROV=nesterov, FIRST=first, BLOCK=block)


# The same launches writing ŵ over the gradient (each program reads its block of grad before storing
# over it), declared as mutating grad.
@torch.library.custom_op("pipeoptim::triton_adam_step_predict_into_grad_", mutates_args=("w", "grad", "m", "v", "vmax"))
def _adam_into_grad_op(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                       vmax: Optional[torch.Tensor], coeffs: list[float]) -> None:
    n, block = w.numel(), _block()
    _adam_kernel[_grid(n, block)](w, grad, m, v, vmax if vmax is not None else w, grad, n, *coeffs,
                                  AMSGRAD=vmax is not None, BLOCK=block)


@torch.library.custom_op("pipeoptim::triton_sgd_step_predict_into_grad_", mutates_args=("w", "grad", "buf"))
def _sgd_into_grad_op(w: torch.Tensor, grad: torch.Tensor, buf: Optional[torch.Tensor], nesterov: bool, first: bool,
                      coeffs: list[float]) -> None:
    n, block = w.numel(), _block()
    _sgd_kernel[_grid(n, block)](w, grad, buf if buf is not None else w, grad, n, *coeffs,
                                 HAS_MOMENTUM=buf is not None, NESTEROV=nesterov, FIRST=first, BLOCK=block)


for _op in (_predict_op, _adam_op, _sgd_op, _adam_into_grad_op, _sgd_into_grad_op):
    _op.register_fake(lambda *args, **kwargs: None)


def predict(plan: PredictPlan, w: torch.Tensor, out: torch.Tensor) -> None:
    coeffs = [plan.scale, plan.cm, plan.cg, plan.cw, plan.dscale, plan.eps, plan.lam]
    den = plan.den if plan.den in (DEN_SQRT, DEN_LINEAR) else 0
    _predict_op(w, plan.m, plan.g, plan.v, plan.vc, out, den, coeffs)


def adam_step_predict(p: AdamStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    coeffs = [p.beta1, p.beta2, p.eps, p.sign, p.wd_coupled, p.decay, p.step_size, p.bc2_sqrt, p.pred_scale, p.pred_lam]
    if same_buffer(out, grad):
        _adam_into_grad_op(w, grad, p.tensors["m"], p.tensors["v"], p.tensors.get("vmax"), coeffs)
    else:
        _adam_op(w, grad, p.tensors["m"], p.tensors["v"], p.tensors.get("vmax"), out, coeffs)


def sgd_step_predict(p: SgdStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    coeffs = [p.lr, p.momentum, p.dampening, p.wd, p.sign, p.pred_scale]
    if same_buffer(out, grad):
        _sgd_into_grad_op(w, grad, p.tensors.get("buf"), p.nesterov, p.first, coeffs)
    else:
        _sgd_op(w, grad, p.tensors.get("buf"), out, p.nesterov, p.first, coeffs)
