"""Triton backend: the plans of `rules.py` as Triton kernels, one pass over the flat buffers.

Runs on CUDA tensors; with TRITON_INTERPRET=1 set before this module is imported it also runs on CPU
tensors through Triton's interpreter, which is how the tests exercise it without a GPU. The interpreter
costs about a millisecond per program, hence the large block there. Its fp32→bf16 stores truncate
where the GPU rounds: tests allow one bf16 ulp on this path.

Three things the GPU code needs that the interpreter cannot show (tests/test_triton_targets.py compiles
every launch for sm_80 and sm_90 and checks them in the PTX):
- Whole blocks load and store without a mask, so 16-byte-aligned buffers get 128-bit accesses whatever
  the length; only the last, partial block is masked. (A mask over the whole launch vectorises only
  when Triton has specialised the length as a multiple of 16, which flat buffers seldom are.)
- Square roots and divisions round correctly (`sqrt_rn`, `div_rn`), as in torch.optim and the CUDA
  kernels; Triton's `sqrt` and `/` compile to approximations.
- Launches run on `w`'s device, whichever device is current (the CUDA ops do the same).
- Views misaligned alike (e.g. into one flat buffer at an odd offset) launch their first few elements
  on their own, so that the rest is aligned and vectorised (as the CUDA ops peel a head).
"""
from __future__ import annotations

import contextlib
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


def block_size() -> int:
    """Elements per program: 1024 on a GPU (8 per thread at 4 warps, two 128-bit accesses per buffer)."""
    return 65536 if interpreting() else 1024


if triton is not None:

    @triton.jit
    def _ld(ptr, offs, n, other, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(ptr + offs, mask=offs < n, other=other)
        else:
            return tl.load(ptr + offs)

    @triton.jit
    def _st(ptr, offs, n, value, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=offs < n)
        else:
            tl.store(ptr + offs, value.to(ptr.dtype.element_ty))

    @triton.jit
    def _predict_block(w_ptr, m_ptr, g_ptr, v_ptr, vc_ptr, out_ptr, offs, n,
                       scale, cm, cg, cw, dscale, eps, lam,
                       HAS_M: tl.constexpr, HAS_G: tl.constexpr, DEN: tl.constexpr, HAS_VC: tl.constexpr,
                       MASKED: tl.constexpr):
        w = _ld(w_ptr, offs, n, 0.0, MASKED)
        num = cw * w
        if HAS_M:
            num += cm * _ld(m_ptr, offs, n, 0.0, MASKED)
        if HAS_G:
            num += cg * _ld(g_ptr, offs, n, 0.0, MASKED)
        if DEN == 1:
            var = _ld(v_ptr, offs, n, 1.0, MASKED)
            if HAS_VC:
                vc = _ld(vc_ptr, offs, n, 0.0, MASKED)
                var = var - vc * vc
            num = tl.div_rn(num, dscale * tl.sqrt_rn(var) + eps)
        elif DEN == 2:
            num = tl.div_rn(num, _ld(v_ptr, offs, n, 1.0, MASKED))
        _st(out_ptr, offs, n, w - scale * (num + lam * w), MASKED)

    @triton.jit
    def _predict_kernel(w_ptr, m_ptr, g_ptr, v_ptr, vc_ptr, out_ptr, n,
                        scale, cm, cg, cw, dscale, eps, lam,
                        HAS_M: tl.constexpr, HAS_G: tl.constexpr, DEN: tl.constexpr, HAS_VC: tl.constexpr,
                        BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _predict_block(w_ptr, m_ptr, g_ptr, v_ptr, vc_ptr, out_ptr, offs, n, scale, cm, cg, cw, dscale, eps, lam,
                           HAS_M, HAS_G, DEN, HAS_VC, False)
        else:
            _predict_block(w_ptr, m_ptr, g_ptr, v_ptr, vc_ptr, out_ptr, offs, n, scale, cm, cg, cw, dscale, eps, lam,
                           HAS_M, HAS_G, DEN, HAS_VC, True)

    @triton.jit
    def _adam_block(w_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, offs, n,
                    beta2, one_minus_beta1, one_minus_beta2, eps, sign, wd_coupled, decay, step_size,
                    bc2_sqrt, pred_scale, pred_lam, AMSGRAD: tl.constexpr, MASKED: tl.constexpr):
        w = _ld(w_ptr, offs, n, 0.0, MASKED)
        grad = _ld(g_ptr, offs, n, 0.0, MASKED)
        m = _ld(m_ptr, offs, n, 0.0, MASKED)
        v = _ld(v_ptr, offs, n, 0.0, MASKED)
        g = sign * grad + wd_coupled * w
        w = w * decay
        if one_minus_beta1 < 0.5:  # torch's lerp, exact at both ends
            m = m + one_minus_beta1 * (g - m)
        else:
            m = g - (g - m) * (1.0 - one_minus_beta1)
        v = v * beta2 + one_minus_beta2 * (g * g)
        vhat = v
        if AMSGRAD:
            vmax = tl.maximum(_ld(vmax_ptr, offs, n, 0.0, MASKED), v)
            _st(vmax_ptr, offs, n, vmax, MASKED)
            vhat = vmax
        denom = tl.div_rn(tl.sqrt_rn(vhat), bc2_sqrt) + eps
        direction = tl.div_rn(m, denom)
        w = w - step_size * direction
        _st(w_ptr, offs, n, w, MASKED)
        _st(m_ptr, offs, n, m, MASKED)
        _st(v_ptr, offs, n, v, MASKED)
        _st(out_ptr, offs, n, w - pred_scale * direction - pred_lam * w, MASKED)

    @triton.jit
    def _adam_kernel(w_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, n,
                     beta2, one_minus_beta1, one_minus_beta2, eps, sign, wd_coupled, decay, step_size,
                     bc2_sqrt, pred_scale, pred_lam, AMSGRAD: tl.constexpr, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _adam_block(w_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, offs, n, beta2, one_minus_beta1,
                        one_minus_beta2, eps, sign, wd_coupled, decay, step_size, bc2_sqrt, pred_scale, pred_lam,
                        AMSGRAD, False)
        else:
            _adam_block(w_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, out_ptr, offs, n, beta2, one_minus_beta1,
                        one_minus_beta2, eps, sign, wd_coupled, decay, step_size, bc2_sqrt, pred_scale, pred_lam,
                        AMSGRAD, True)

    @triton.jit
    def _sgd_block(w_ptr, g_ptr, buf_ptr, out_ptr, offs, n, lr, momentum, one_minus_dampening, wd, sign,
                   pred_scale, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr,
                   MASKED: tl.constexpr):
        w = _ld(w_ptr, offs, n, 0.0, MASKED)
        grad = _ld(g_ptr, offs, n, 0.0, MASKED)
        d = sign * grad + wd * w
        update = d
        if HAS_MOMENTUM:
            if FIRST:
                buf = d
            else:
                buf = _ld(buf_ptr, offs, n, 0.0, MASKED) * momentum + one_minus_dampening * d
            _st(buf_ptr, offs, n, buf, MASKED)
            if NESTEROV:
                update = d + momentum * buf
            else:
                update = buf
        w = w - lr * update
        _st(w_ptr, offs, n, w, MASKED)
        if HAS_MOMENTUM and not NESTEROV:
            direction = buf
        else:
            direction = sign * grad + wd * w
            if HAS_MOMENTUM:
                direction += momentum * buf
        _st(out_ptr, offs, n, w - pred_scale * direction, MASKED)

    @triton.jit
    def _sgd_kernel(w_ptr, g_ptr, buf_ptr, out_ptr, n, lr, momentum, one_minus_dampening, wd, sign, pred_scale,
                    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _sgd_block(w_ptr, g_ptr, buf_ptr, out_ptr, offs, n, lr, momentum, one_minus_dampening, wd, sign,
                       pred_scale, HAS_MOMENTUM, NESTEROV, FIRST, False)
        else:
            _sgd_block(w_ptr, g_ptr, buf_ptr, out_ptr, offs, n, lr, momentum, one_minus_dampening, wd, sign,
                       pred_scale, HAS_MOMENTUM, NESTEROV, FIRST, True)


def on_device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's for the launch."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def aligned_head(buffers: list[torch.Tensor]) -> int:
    """How many leading elements to launch on their own so that every buffer is 16-byte aligned after them:
    0 when they already are, -1 when no offset aligns them all (then everything runs unvectorised)."""
    for head in range(16):
        if all((b.data_ptr() + head * b.element_size()) % 16 == 0 for b in buffers):
            return head
    return -1


def launch(kernel, buffers: list[torch.Tensor], coeffs: list[float], constexprs: dict) -> None:
    """Every launch of this backend: `kernel(*buffers, n, *coeffs)` over the buffers' n elements, on their
    device, split in two when a few leading elements misalign every buffer alike (views into flat
    buffers at one offset), so that the rest runs on 16-byte-aligned, vectorised accesses."""
    n = buffers[0].numel()
    head = aligned_head(buffers)
    with on_device_of(buffers[0]):
        if 0 < head < n:
            run_kernel(kernel, [b[:head] for b in buffers], head, coeffs, constexprs)
            run_kernel(kernel, [b[head:] for b in buffers], n - head, coeffs, constexprs)
        else:
            run_kernel(kernel, buffers, n, coeffs, constexprs)


def run_kernel(kernel, buffers: list[torch.Tensor], n: int, coeffs: list[float], constexprs: dict) -> None:
    block = block_size()
    kernel[(triton.cdiv(n, block),)](*buffers, n, *coeffs, **constexprs, BLOCK=block)


# The launches are torch.library custom ops (with fake implementations) so that torch.compile can
# trace through them; the argument lists mirror the compiled extension's ops. An absent optional
# buffer is passed as w, which the kernel never reads for it.

def _or(t: Optional[torch.Tensor], default: torch.Tensor) -> torch.Tensor:
    return t if t is not None else default


@torch.library.custom_op("pipeoptim::triton_predict_", mutates_args=("out",))
def _predict_op(w: torch.Tensor, m: Optional[torch.Tensor], g: Optional[torch.Tensor], v: Optional[torch.Tensor],
                vc: Optional[torch.Tensor], out: torch.Tensor, den: int, coeffs: list[float]) -> None:
    launch(_predict_kernel, [w, _or(m, w), _or(g, w), _or(v, w), _or(vc, w), out], coeffs,
           dict(HAS_M=m is not None, HAS_G=g is not None, DEN=den, HAS_VC=vc is not None and den == DEN_SQRT))


@torch.library.custom_op("pipeoptim::triton_adam_step_predict_", mutates_args=("w", "m", "v", "vmax", "out"))
def _adam_op(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, vmax: Optional[torch.Tensor],
             out: torch.Tensor, coeffs: list[float]) -> None:
    launch(_adam_kernel, [w, grad, m, v, _or(vmax, w), out], coeffs, dict(AMSGRAD=vmax is not None))


@torch.library.custom_op("pipeoptim::triton_sgd_step_predict_", mutates_args=("w", "buf", "out"))
def _sgd_op(w: torch.Tensor, grad: torch.Tensor, buf: Optional[torch.Tensor], out: torch.Tensor, nesterov: bool,
            first: bool, coeffs: list[float]) -> None:
    launch(_sgd_kernel, [w, grad, _or(buf, w), out], coeffs,
           dict(HAS_MOMENTUM=buf is not None, NESTEROV=nesterov, FIRST=first))


# The same launches writing ŵ over the gradient (each program reads its block of grad before storing
# over it), declared as mutating grad.
@torch.library.custom_op("pipeoptim::triton_adam_step_predict_into_grad_", mutates_args=("w", "grad", "m", "v", "vmax"))
def _adam_into_grad_op(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                       vmax: Optional[torch.Tensor], coeffs: list[float]) -> None:
    launch(_adam_kernel, [w, grad, m, v, _or(vmax, w), grad], coeffs, dict(AMSGRAD=vmax is not None))


@torch.library.custom_op("pipeoptim::triton_sgd_step_predict_into_grad_", mutates_args=("w", "grad", "buf"))
def _sgd_into_grad_op(w: torch.Tensor, grad: torch.Tensor, buf: Optional[torch.Tensor], nesterov: bool, first: bool,
                      coeffs: list[float]) -> None:
    launch(_sgd_kernel, [w, grad, _or(buf, w), grad], coeffs,
           dict(HAS_MOMENTUM=buf is not None, NESTEROV=nesterov, FIRST=first))


for _op in (_predict_op, _adam_op, _sgd_op, _adam_into_grad_op, _sgd_into_grad_op):
    _op.register_fake(lambda *args, **kwargs: None)


def predict(plan: PredictPlan, w: torch.Tensor, out: torch.Tensor) -> None:
    den = plan.den if plan.den in (DEN_SQRT, DEN_LINEAR) else 0
    _predict_op(w, plan.m, plan.g, plan.v, plan.vc, out, den, plan.coeffs())


def adam_step_predict(p: AdamStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    if same_buffer(out, grad):
        _adam_into_grad_op(w, grad, p.tensors["m"], p.tensors["v"], p.tensors.get("vmax"), p.coeffs())
    else:
        _adam_op(w, grad, p.tensors["m"], p.tensors["v"], p.tensors.get("vmax"), out, p.coeffs())


def sgd_step_predict(p: SgdStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    if same_buffer(out, grad):
        _sgd_into_grad_op(w, grad, p.tensors.get("buf"), p.nesterov, p.first, p.coeffs())
    else:
        _sgd_op(w, grad, p.tensors.get("buf"), out, p.nesterov, p.first, p.coeffs())
