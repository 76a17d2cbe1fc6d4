"""The rule table: which optimizer state each rule reads and how it turns into one prediction formula.

Every supported optimizer's next update direction Δ fits one per-element form

    Δ  = (cm·m + cg·g + cw·w) / D  +  lam·w          ŵ = w − scale·Δ
    D  = 1                         (den = NONE)
       = dscale·√(v − vc²) + eps   (den = SQRT; vc only for centered RMSprop)
       = v                         (den = LINEAR; Adamax's infinity norm)

where m, v, vc, g are flat state buffers picked by the rule and every scalar (bias corrections, the
learning rate, NAdam's momentum schedule, RAdam's rectification) is worked out here, on the host, once
per call. The backends (eager, Triton, C++ CPU, CUDA) only evaluate the form above, so each rule's
maths lives in exactly one place: this module.

Fused step+predict has its own small plans (`adam_step_plan`, `sgd_step_plan`) because the step must
reproduce torch.optim's arithmetic, not just its direction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

DEN_NONE, DEN_SQRT, DEN_LINEAR = 0, 1, 2

# rule -> the state entries the exact mode may read (named as torch.optim names them; "grad" is the
# last gradient, which torch.optim does not keep but the flat binding does).
STATE_ENTRIES: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum_buffer", "grad"),
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "rmsprop": ("square_avg", "grad_avg", "momentum_buffer", "grad"),
    "adagrad": ("sum", "grad"),
    "adamax": ("exp_avg", "exp_inf"),
    "nadam": ("exp_avg", "exp_avg_sq", "mu_product", "grad"),
    "radam": ("exp_avg", "exp_avg_sq"),
}
BUILTIN_RULES = tuple(STATE_ENTRIES)
PAPER_RULES = ("sgd", "adam", "adamw")
REFERENCE_RULES = ("sgd", "adam", "adamw")
STEP_PREDICT_RULES = ("sgd", "adam", "adamw")
MODES = ("exact", "paper", "reference")
REFERENCE_EPS = 1e-8   # the public PipeOptim code's Adam/AdamW prediction ignores the group's eps

# torch.optim class name -> rule name, for callers that hold an optimizer object.
OPTIMIZER_CLASSES = {
    "SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "RMSprop": "rmsprop", "Adagrad": "adagrad",
    "Adamax": "adamax", "NAdam": "nadam", "RAdam": "radam",
}


@dataclass
class PredictPlan:
    """One call's worth of the form in the module docstring: which buffers, which scalars."""
    scale: float
    den: int = DEN_NONE
    m: torch.Tensor | None = None
    v: torch.Tensor | None = None
    vc: torch.Tensor | None = None
    g: torch.Tensor | None = None
    cm: float = 0.0
    cg: float = 0.0
    cw: float = 0.0
    dscale: float = 1.0
    eps: float = 0.0
    lam: float = 0.0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: t for k, t in (("m", self.m), ("v", self.v), ("vc", self.vc), ("g", self.g)) if t is not None}

    def coeffs(self) -> list[float]:
        """The scalars in the order of csrc/rules.h's PredictCoeffs (the compiled and Triton launches)."""
        return [self.scale, self.cm, self.cg, self.cw, self.dscale, self.eps, self.lam]


# ---- custom rules (run by the eager backend) --------------------------------------------------------

CustomRule = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping, int], torch.Tensor]
_CUSTOM_RULES: dict[str, CustomRule] = {}


def register_rule(name: str, direction: CustomRule, *, overwrite: bool = False) -> None:
    """Register a Python rule `direction(w, state, group, step) -> Δ` for an optimizer we do not know.

    Δ is the update direction such that the optimizer's next step is roughly `w − lr·Δ`; the
    prediction is then `ŵ = w − s·lr·Δ`. Custom rules run on the eager backend only.
    """
    if not callable(direction):
        raise TypeError(f"register_rule({name!r}, ...): direction must be callable as f(w, state, group, step) -> Δ")
    if name in BUILTIN_RULES:
        raise ValueError(f"register_rule: {name!r} is a built-in rule; pick another name for your rule")
    if name in _CUSTOM_RULES and not overwrite:
        raise ValueError(f"register_rule: {name!r} is already registered; pass overwrite=True to replace it")
    _CUSTOM_RULES[name] = direction


def custom_rule(name: str) -> CustomRule | None:
    return _CUSTOM_RULES.get(name)


def known_rules() -> list[str]:
    return list(BUILTIN_RULES) + sorted(_CUSTOM_RULES)


def unknown_rule_error(rule: object) -> ValueError:
    return ValueError(
        f"unknown rule {rule!r}: supported rules are {', '.join(known_rules())}. For another optimizer, "
        "register a Python rule with pipeoptim_kernels.register_rule(name, lambda w, state, group, step: delta)."
    )


# ---- helpers -------------------------------------------------------------------------------------------

def scalar(x) -> float:
    """A group hyperparameter or state scalar as a Python float (torch.optim allows 0-d tensors)."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _need(state: Mapping, name: str, rule: str, why: str) -> torch.Tensor:
    t = state.get(name)
    if t is None:
        raise ValueError(
            f"rule {rule!r} needs state[{name!r}] ({why}); pass the flat buffer that torch.optim keeps "
            f"under that name (or the last gradient under 'grad')"
        )
    return t


def _grad_terms(plan: PredictPlan, state: Mapping, group: Mapping, rule: str, factor: float = 1.0) -> None:
    """Numerator terms for d = ±g + wd·w (torch.optim's gradient after maximize and coupled decay)."""
    sign = -1.0 if group.get("maximize", False) else 1.0
    plan.g = _need(state, "grad", rule, "the last gradient")
    plan.cg = factor * sign
    plan.cw = factor * scalar(group.get("weight_decay", 0.0))


def _decoupled(rule: str, group: Mapping) -> bool:
    return rule == "adamw" or bool(group.get("decoupled_weight_decay", False))


# ---- predict plans ---------------------------------------------------------------------------------------

def predict_plan(rule: str, state: Mapping, group: Mapping, step: int, s: float, mode: str) -> PredictPlan:
    """The per-element form for `rule` after `step` completed steps, predicting `s` steps ahead.

    Callers handle s == 0 and step == 0 (no prediction) before asking for a plan.
    """
    lr = scalar(group["lr"])
    wd = scalar(group.get("weight_decay", 0.0))
    plan = PredictPlan(scale=s * lr)

    if mode == "paper":
        if rule == "sgd":
            if scalar(group.get("momentum", 0.0)) == 0.0:
                raise ValueError("mode='paper' reproduces the paper's SGD-momentum rule (Δ = m_t) and needs "
                                 "momentum > 0; use mode='exact' for plain SGD")
            plan.m, plan.cm = _need(state, "momentum_buffer", rule, "Δ = m_t"), 1.0
            return plan
        if rule in ("adam", "adamw"):
            b1, b2 = (scalar(b) for b in group["betas"])
            plan.m, plan.v = _need(state, "exp_avg", rule, "m_t"), _need(state, "exp_avg_sq", rule, "v_t")
            plan.cm, plan.den = 1.0 / (1.0 - b1 ** step), DEN_SQRT
            plan.dscale, plan.eps = 1.0 / math.sqrt(1.0 - b2 ** step), scalar(group["eps"])
            return plan
        raise ValueError(f"mode='paper' covers only {', '.join(PAPER_RULES)} (the paper's table); "
                         f"use mode='exact' for {rule!r}")

    if mode == "reference":
        return _reference_plan(plan, rule, state, group, step)

    if rule == "sgd":
        mu = scalar(group.get("momentum", 0.0))
        if mu != 0.0:
            plan.m = _need(state, "momentum_buffer", rule, "momentum > 0")
            if not group.get("nesterov", False):
                plan.cm = 1.0
                return plan
            plan.cm = mu
        _grad_terms(plan, state, group, rule)
        return plan

    if rule in ("adam", "adamw"):
        b1, b2 = (scalar(b) for b in group["betas"])
        plan.m = _need(state, "exp_avg", rule, "first moment")
        plan.v = (_need(state, "max_exp_avg_sq", rule, "amsgrad=True") if group.get("amsgrad", False)
                  else _need(state, "exp_avg_sq", rule, "second moment"))
        plan.cm, plan.den = 1.0 / (1.0 - b1 ** step), DEN_SQRT
        plan.dscale, plan.eps = 1.0 / math.sqrt(1.0 - b2 ** step), scalar(group["eps"])
        plan.lam = wd if _decoupled(rule, group) else 0.0
        return plan

    if rule == "rmsprop":
        if scalar(group.get("momentum", 0.0)) > 0.0:
            plan.m, plan.cm = _need(state, "momentum_buffer", rule, "momentum > 0"), 1.0
            return plan
        _grad_terms(plan, state, group, rule)
        plan.v, plan.den, plan.eps = _need(state, "square_avg", rule, "v"), DEN_SQRT, scalar(group["eps"])
        if group.get("centered", False):
            plan.vc = _need(state, "grad_avg", rule, "centered=True")
        return plan

    if rule == "adagrad":
        plan.scale = s * lr / (1.0 + (step - 1) * scalar(group.get("lr_decay", 0.0)))
        _grad_terms(plan, state, group, rule)
        plan.v, plan.den, plan.eps = _need(state, "sum", rule, "sum of squares"), DEN_SQRT, scalar(group["eps"])
        return plan

    if rule == "adamax":
        b1 = scalar(group["betas"][0])
        plan.m, plan.v = _need(state, "exp_avg", rule, "first moment"), _need(state, "exp_inf", rule, "infinity norm")
        plan.cm, plan.den = 1.0 / (1.0 - b1 ** step), DEN_LINEAR
        return plan

    if rule == "nadam":
        b1, b2 = (scalar(b) for b in group["betas"])
        psi = scalar(group.get("momentum_decay", 4e-3))
        mu = b1 * (1.0 - 0.5 * 0.96 ** (step * psi))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * psi))
        mu_product = scalar(_need(state, "mu_product", rule, "the product of the momentum schedule"))
        decoupled = _decoupled(rule, group)
        sign = -1.0 if group.get("maximize", False) else 1.0
        g_factor = (1.0 - mu) / (1.0 - mu_product)
        plan.g, plan.cg = _need(state, "grad", rule, "the last gradient"), sign * g_factor
        plan.cw = 0.0 if decoupled else g_factor * wd
        plan.m, plan.cm = _need(state, "exp_avg", rule, "first moment"), mu_next / (1.0 - mu_product * mu_next)
        plan.v, plan.den = _need(state, "exp_avg_sq", rule, "second moment"), DEN_SQRT
        plan.dscale, plan.eps = 1.0 / math.sqrt(1.0 - b2 ** step), scalar(group["eps"])
        plan.lam = wd if decoupled else 0.0
        return plan

    if rule == "radam":
        b1, b2 = (scalar(b) for b in group["betas"])
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * step * b2 ** step / bc2
        plan.m = _need(state, "exp_avg", rule, "first moment")
        plan.lam = wd if _decoupled(rule, group) else 0.0
        if rho_t > 5.0:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            plan.v, plan.den = _need(state, "exp_avg_sq", rule, "second moment"), DEN_SQRT
            plan.cm, plan.eps = rect * math.sqrt(bc2) / bc1, scalar(group["eps"])
        else:
            plan.cm = 1.0 / bc1
        return plan

    raise unknown_rule_error(rule)


def _reference_plan(plan: PredictPlan, rule: str, state: Mapping, group: Mapping, step: int) -> PredictPlan:
    """The public PipeOptim code's prediction, reproduced (mode "reference").

    Adam, AdamW: m̂/(√v̂ + 1e-8), whatever the group's eps, amsgrad and weight decay.
    SGD: Δ = μ·buf + (1−τ)·p.grad for momentum μ > 0 (nesterov ignored), Δ = p.grad for μ = 0, where p.grad
    is what the old torch it ran on left there after the step: g + λ·w_b, the weight decay added in place
    with the weights w_b from before that step. The gradient is counted twice (buf already holds it), and
    w_b is recovered from the current weights and the step just taken (w_b = w + lr·update), with the
    group's current lr: exact unless the lr changed between that step and this prediction.
    """
    if rule in ("adam", "adamw"):
        b1, b2 = (scalar(b) for b in group["betas"])
        plan.m, plan.v = _need(state, "exp_avg", rule, "m_t"), _need(state, "exp_avg_sq", rule, "v_t")
        plan.cm, plan.den = 1.0 / (1.0 - b1 ** step), DEN_SQRT
        plan.dscale, plan.eps = 1.0 / math.sqrt(1.0 - b2 ** step), REFERENCE_EPS
        return plan
    if rule != "sgd":
        raise ValueError(f"mode='reference' reproduces the public PipeOptim code, which predicts only for "
                         f"{', '.join(REFERENCE_RULES)}; use mode='exact' for {rule!r}")
    if group.get("maximize", False):
        raise ValueError("mode='reference' reproduces code written before SGD had maximize=True; use "
                         "mode='exact' to maximize")
    lr, wd = scalar(group["lr"]), scalar(group.get("weight_decay", 0.0))
    mu, tau = scalar(group.get("momentum", 0.0)), scalar(group.get("dampening", 0.0))
    if wd * lr >= 1.0:
        raise ValueError(f"mode='reference' recovers the weights before the last step from lr·weight_decay < 1 "
                         f"(got lr={lr}, weight_decay={wd}); use mode='exact'")
    plan.g = _need(state, "grad", rule, "the last gradient, which the public code reads from p.grad")
    # p.grad = d = g + λ·w_b and w_b = w + lr·u, u the update just applied: u = buf (momentum), u = d + μ·buf
    # (nesterov), u = d (no momentum). Solved for d: d = (g + λ·w + λ·lr·k·buf) / (1 − c·λ·lr) with k the
    # weight of buf in u and c = 1 when u contains d.
    if mu == 0.0:
        k, c = 0.0, 1.0
    elif group.get("nesterov", False):
        k, c = mu, 1.0
    else:
        k, c = 1.0, 0.0
    d = 1.0 / (1.0 - c * wd * lr)
    weight = (1.0 - tau) if mu != 0.0 else 1.0      # of d in Δ
    plan.cg, plan.cw = weight * d, weight * d * wd
    if mu != 0.0:
        plan.m = _need(state, "momentum_buffer", rule, "momentum > 0")
        plan.cm = mu + weight * d * wd * lr * k
    return plan


# ---- fused step+predict plans ------------------------------------------------------------------------------

@dataclass
class AdamStepPlan:
    """Scalars for one Adam/AdamW step (step number t+1) followed by the prediction for s steps."""
    lr: float
    beta1: float
    beta2: float
    one_minus_beta1: float  # formed in double here, as torch.optim does (see csrc/rules.h)
    one_minus_beta2: float
    eps: float
    sign: float            # -1 for maximize
    wd_coupled: float      # Adam: g += wd·w
    decay: float           # AdamW: w *= 1 − lr·wd (1.0 when not decoupled)
    step_size: float       # lr / bc1
    bc2_sqrt: float
    pred_scale: float      # s·lr/bc1: multiplies m/denom in the prediction
    pred_lam: float        # s·lr·wd for AdamW exact, else 0
    amsgrad: bool
    tensors: dict = field(default_factory=dict)

    def coeffs(self) -> list[float]:
        """The scalars in the order of csrc/rules.h's AdamStepCoeffs."""
        return [self.beta2, self.one_minus_beta1, self.one_minus_beta2, self.eps, self.sign,
                self.wd_coupled, self.decay, self.step_size, self.bc2_sqrt, self.pred_scale, self.pred_lam]


@dataclass
class SgdStepPlan:
    """Scalars for one SGD step followed by the prediction for s steps."""
    lr: float
    momentum: float
    dampening: float
    wd: float
    sign: float
    nesterov: bool
    first: bool            # no momentum buffer yet: torch.optim initialises it to d
    pred_scale: float      # s·lr
    tensors: dict = field(default_factory=dict)

    def coeffs(self) -> list[float]:
        """The scalars in the order of csrc/rules.h's SgdStepCoeffs (1 − dampening formed in double)."""
        return [self.lr, self.momentum, 1.0 - self.dampening, self.wd, self.sign, self.pred_scale]


def adam_step_plan(rule: str, state: Mapping, group: Mapping, step: int, s: float) -> AdamStepPlan:
    lr, wd = scalar(group["lr"]), scalar(group.get("weight_decay", 0.0))
    b1, b2 = (scalar(b) for b in group["betas"])
    t = step + 1
    decoupled = _decoupled(rule, group)
    amsgrad = bool(group.get("amsgrad", False))
    tensors = {"m": _need(state, "exp_avg", rule, "first moment"), "v": _need(state, "exp_avg_sq", rule, "second moment")}
    if amsgrad:
        tensors["vmax"] = _need(state, "max_exp_avg_sq", rule, "amsgrad=True")
    bc1 = 1.0 - b1 ** t
    return AdamStepPlan(
        lr=lr, beta1=b1, beta2=b2, one_minus_beta1=1.0 - b1, one_minus_beta2=1.0 - b2, eps=scalar(group["eps"]),
        sign=-1.0 if group.get("maximize", False) else 1.0,
        wd_coupled=0.0 if decoupled else wd, decay=1.0 - lr * wd if decoupled else 1.0,
        step_size=lr / bc1, bc2_sqrt=math.sqrt(1.0 - b2 ** t),
        pred_scale=s * lr / bc1, pred_lam=s * lr * wd if decoupled else 0.0,
        amsgrad=amsgrad, tensors=tensors,
    )


def sgd_step_plan(state: Mapping, group: Mapping, step: int, s: float) -> SgdStepPlan:
    mu = scalar(group.get("momentum", 0.0))
    tensors = {}
    if mu != 0.0:
        tensors["buf"] = _need(state, "momentum_buffer", "sgd", "momentum > 0 (allocate it, zeros are fine on step 0)")
    lr = scalar(group["lr"])
    return SgdStepPlan(
        lr=lr, momentum=mu, dampening=scalar(group.get("dampening", 0.0)),
        wd=scalar(group.get("weight_decay", 0.0)), sign=-1.0 if group.get("maximize", False) else 1.0,
        nesterov=bool(group.get("nesterov", False)), first=step == 0, pred_scale=s * lr, tensors=tensors,
    )
