"""Eager backend: the plans of `rules.py` evaluated with plain torch ops.

It is the readable statement of what every compiled backend computes, the fallback on any device and
dtype, and the only backend that runs custom (registered) rules. It makes temporaries, so it moves
several times the minimal bytes; the compiled backends do the same maths in one pass.
"""
from __future__ import annotations

import torch

from .rules import DEN_LINEAR, DEN_SQRT, AdamStepPlan, PredictPlan, SgdStepPlan


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def predict(plan: PredictPlan, w: torch.Tensor, out: torch.Tensor) -> None:
    ct = _compute_dtype(w)
    wf = w.to(ct)
    num = torch.zeros_like(wf)
    if plan.m is not None:
        num += plan.cm * plan.m.to(ct)
    if plan.g is not None:
        num += plan.cg * plan.g.to(ct)
    if plan.cw:
        num += plan.cw * wf
    if plan.den == DEN_SQRT:
        v = plan.v.to(ct)
        if plan.vc is not None:
            v = v - plan.vc.to(ct) ** 2
        num /= plan.dscale * v.sqrt() + plan.eps
    elif plan.den == DEN_LINEAR:
        num /= plan.v.to(ct)
    if plan.lam:
        num += plan.lam * wf
    out.copy_(wf - plan.scale * num)


def predict_direction(direction: torch.Tensor, w: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """ŵ = w − scale·Δ for a Δ that a custom rule computed."""
    ct = _compute_dtype(w)
    out.copy_(w.to(ct) - scale * direction.to(ct))


def adam_step_predict(p: AdamStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    m, v, vmax = p.tensors["m"], p.tensors["v"], p.tensors.get("vmax")
    g = grad if p.sign > 0 else -grad
    if p.wd_coupled:
        g = g.add(w, alpha=p.wd_coupled)
    if p.decay != 1.0:
        w.mul_(p.decay)
    m.lerp_(g, p.one_minus_beta1)
    v.mul_(p.beta2).addcmul_(g, g, value=p.one_minus_beta2)
    if vmax is not None:
        torch.maximum(vmax, v, out=vmax)
    denom = ((vmax if vmax is not None else v).sqrt() / p.bc2_sqrt).add_(p.eps)
    w.addcdiv_(m, denom, value=-p.step_size)
    pred = w - p.pred_scale * (m / denom)
    if p.pred_lam:
        pred -= p.pred_lam * w
    out.copy_(pred)


def sgd_step_predict(p: SgdStepPlan, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    d = grad if p.sign > 0 else -grad
    if p.wd:
        d = d.add(w, alpha=p.wd)
    if p.momentum == 0.0:
        w.add_(d, alpha=-p.lr)
        direction = grad * p.sign + p.wd * w if p.wd else d
    else:
        buf = p.tensors["buf"]
        if p.first:
            buf.copy_(d)
        else:
            buf.mul_(p.momentum).add_(d, alpha=1.0 - p.dampening)
        w.add_(d.add(buf, alpha=p.momentum) if p.nesterov else buf, alpha=-p.lr)
        if p.nesterov:
            direction = grad * p.sign + p.wd * w + p.momentum * buf
        else:
            direction = buf
    out.copy_(w - p.pred_scale * direction)
