"""Argument checks for the public API, run before any buffer is touched.

`predict` and `step_predict` call `check_predict_call` / `check_step_predict_call` first, whatever the
backend, so every backend refuses the same inputs with the same error, and none of them is handed a
call it would get wrong: buffers that share memory (the compiled loops read and write block by block,
so an output overlapping an input gives wrong values rather than an error), hyperparameters outside the
ranges torch.optim accepts (beta2 = 1 divides by zero), state that is not a flat tensor.

Each message names the argument, what was wrong, and how to fix it, because these are the errors a
user sees first when wiring the kernels into their own runtime.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from . import rules

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EAGER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MODES_HELP = ("mode must be 'exact' (the optimizer's full rule), 'paper' (the paper's table) or 'reference' (the "
              "public PipeOptim code's rule)")

# The hyperparameters torch.optim's constructors require to be >= 0, per rule (besides lr, checked for
# every rule, custom ones included). Betas must lie in [0, 1) for the rules that have them.
NON_NEGATIVE = {
    "sgd": ("momentum", "weight_decay"),
    "adam": ("eps", "weight_decay"),
    "adamw": ("eps", "weight_decay"),
    "rmsprop": ("eps", "momentum", "weight_decay", "alpha"),
    "adagrad": ("eps", "lr_decay", "weight_decay"),
    "adamax": ("eps", "weight_decay"),
    "nadam": ("eps", "weight_decay", "momentum_decay"),
    "radam": ("eps", "weight_decay"),
}
BETAS_RULES = ("adam", "adamw", "adamax", "nadam", "radam")
# Read by a rule without a range in torch.optim: any number but NaN.
OTHER_NUMBERS = {"sgd": ("dampening",)}
# The state a fused step writes (its "grad" entry, if any, is neither read nor written there).
STEP_STATE = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
              "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}


# ---- buffers -------------------------------------------------------------------------------------------

def check_flat(name: str, t: object, *, ref: torch.Tensor | None = None, dtypes=EAGER_DTYPES,
               same_dtype: bool = True) -> torch.Tensor:
    """A flat buffer: a contiguous 1-D floating tensor, matching `ref` in length, device and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (a flat 1-D buffer), got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be a flat 1-D buffer, got shape {tuple(t.shape)}; "
                         f"pass {name}.view(-1) of a contiguous tensor, or use pipeoptim.prediction.flat to build "
                         "flat buffers")
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


def check_state(rule: str, state: object, w: torch.Tensor, step: int) -> Mapping:
    """The state dict: every entry the rule may read is a flat buffer like w (NAdam's mu_product a number).

    Entries the rule does not know (torch.optim's 'step', another rule's names) are left alone.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of flat buffers named as torch.optim names them, got "
                        f"{type(state).__name__}")
    for name in rules.STATE_ENTRIES.get(rule, ()):
        t = state.get(name)
        if t is None:
            continue  # a missing entry is reported by the rule that needs it, with the reason
        if name == "mu_product":
            value = _number(f"state[{name!r}]", t)
            if step > 0 and not 0.0 <= value < 1.0:
                raise ValueError(f"state['mu_product'] is {value} after {step} steps; NAdam's product of momentum "
                                 "coefficients lies in [0, 1) once a step is taken: pass the optimizer's own state")
            continue
        check_flat(f"state[{name!r}]", t, ref=w)
    return state


def same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same flat buffer: same device, start, length and dtype."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
            and a.dtype == b.dtype)


def _spans(buffers: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """(device, first byte, end byte) of each buffer that holds memory (not empty, not on the meta device)."""
    spans = {}
    for name, t in buffers.items():
        if t.numel() and not t.is_meta:
            start = t.data_ptr()
            spans[name] = (t.device, start, start + t.numel() * t.element_size())
    return spans


def check_disjoint(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor],
                   same_allowed: tuple[tuple[str, str], ...] = (), advice: dict[tuple[str, str], str] | None = None
                   ) -> None:
    """No buffer that is written shares memory with any other buffer of the call (reads may share).

    A pair in `same_allowed` may be the very same buffer (in place), never a partial overlap: the
    compiled loops read and write in blocks, so a shifted overlap reads values already overwritten.
    `advice` gives the fix for a pair, where it is more specific than "a buffer of its own".
    """
    buffers = {**read, **written}
    names = list(written) + [k for k in read if k not in written]
    spans = _spans(buffers)
    for i, a in enumerate(names):
        if a not in spans:
            continue
        device_a, a0, a1 = spans[a]
        for b in names[i + 1:]:
            if b not in spans or (a not in written and b not in written):
                continue
            device_b, b0, b1 = spans[b]
            if a0 >= b1 or b0 >= a1 or device_a != device_b:
                continue
            allowed = (a, b) in same_allowed or (b, a) in same_allowed
            if allowed and same_buffer(buffers[a], buffers[b]):
                continue
            fix = (advice or {}).get((a, b)) or (advice or {}).get((b, a)) or "give each a buffer of its own"
            how = "without being the same buffer" if allowed else "(they share memory)"
            raise ValueError(f"{a} overlaps {b} {how}: writing one while reading the other would give wrong "
                             f"values; {fix}")


# ---- scalars -------------------------------------------------------------------------------------------

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


def _number(name: str, x: object) -> float:
    """A hyperparameter as a float: a real number or a one-element tensor (torch.optim allows a tensor lr)."""
    if type(x) is float or type(x) is int:  # the common case, ahead of the slower checks below
        return float(x)
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} is a tensor of {x.numel()} elements; a hyperparameter tensor must hold "
                             "one number, as torch.optim requires")
        return float(x.item())
    if isinstance(x, numbers.Real):
        return float(x)
    raise TypeError(f"{name} must be a number (or a one-element tensor), got {type(x).__name__}")


def check_group(rule: str, group: object) -> Mapping:
    """The param group: a mapping with lr, and every hyperparameter the rule reads within the range
    torch.optim's constructor enforces (NaN refused everywhere: torch.optim.SGD alone lets a NaN lr in)."""
    if not isinstance(group, Mapping):
        raise TypeError(f"group must be a dict of hyperparameters such as optimizer.param_groups[i], "
                        f"got {type(group).__name__}")
    if "lr" not in group:
        raise ValueError("group has no 'lr'; pass optimizer.param_groups[i] or a dict with at least 'lr' "
                         "and the rule's hyperparameters (betas, eps, momentum, ...)")
    for key in ("lr",) + NON_NEGATIVE.get(rule, ()):
        if key in group:
            value = _number(f"group[{key!r}]", group[key])
            if not value >= 0.0:
                raise ValueError(f"group[{key!r}] is {value}; it must be a number >= 0, as torch.optim requires "
                                 f"(fix the {'learning rate' if key == 'lr' else key} in the optimizer's param group)")
    for key in OTHER_NUMBERS.get(rule, ()):
        if key in group and math.isnan(_number(f"group[{key!r}]", group[key])):
            raise ValueError(f"group[{key!r}] is nan; it must be a number")
    if rule in BETAS_RULES and "betas" in group:
        betas = group["betas"]
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise TypeError(f"group['betas'] must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            value = _number(f"group['betas'][{i}]", b)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"group['betas'][{i}] is {value}; each beta must lie in [0, 1), as torch.optim "
                                 f"requires (a beta of 1 never updates the moment and divides the bias "
                                 f"correction by zero)")
    if rule == "sgd" and group.get("nesterov", False):
        if not (_number("group['momentum']", group.get("momentum", 0.0)) > 0.0
                and _number("group['dampening']", group.get("dampening", 0.0)) == 0.0):
            raise ValueError("group has nesterov=True, which needs momentum > 0 and dampening = 0, as torch.optim.SGD "
                             "requires")
    return group


# ---- whole calls ---------------------------------------------------------------------------------------

def check_rule(rule: object, mode: object) -> bool:
    """An existing rule and mode; returns whether the rule is built in (custom rules: exact mode only)."""
    if not isinstance(rule, str) or (rule not in rules.BUILTIN_RULES and rules.custom_rule(rule) is None):
        raise rules.unknown_rule_error(rule)
    if not isinstance(mode, str) or mode not in rules.MODES:
        raise ValueError(f"{MODES_HELP}, got {mode!r}")
    builtin = rule in rules.BUILTIN_RULES
    if not builtin and mode != "exact":
        raise ValueError(f"mode={mode!r} exists only for {', '.join(rules.PAPER_RULES)}; custom rule {rule!r} has "
                         "only mode='exact'")
    return builtin


def check_predict_call(rule, w, state, group, step, s, out, mode) -> tuple[int, float]:
    """Every check of `predict` that needs no backend: returns (step, s) as int and float."""
    builtin = check_rule(rule, mode)
    check_flat("w", w)
    step, s = check_step_s(step, s)
    check_group(rule, group)
    if out is not None:
        check_out(out, w)
    if builtin:
        check_state(rule, state, w, step)
        read = {f"state[{k!r}]": state[k] for k in rules.STATE_ENTRIES[rule]
                if isinstance(state.get(k), torch.Tensor) and state[k].dim() == 1}
    else:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict of flat buffers, got {type(state).__name__}")
        read = {f"state[{k!r}]": v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1}
    if out is not None:
        check_disjoint({"out": out}, {"w": w, **read}, same_allowed=(("out", "w"),),
                       advice={("out", "w"): "pass out=w itself to predict in place, or a buffer of its own"})
    return step, s


def check_step_predict_call(rule, w, grad, state, group, step, s, out) -> tuple[int, float]:
    """Every check of `step_predict` that needs no backend: returns (step, s) as int and float."""
    if rule not in rules.STEP_PREDICT_RULES:
        raise ValueError(f"step_predict supports {', '.join(rules.STEP_PREDICT_RULES)}, got {rule!r}; for other "
                         "optimizers call optimizer.step() and then pipeoptim_kernels.predict(...)")
    check_flat("w", w)
    check_flat("grad", grad, ref=w)
    step, s = check_step_s(step, s)
    check_group(rule, group)
    if out is None:
        raise ValueError("step_predict needs out=, a buffer for the next forward's weights (not w itself)")
    check_out(out, w)
    if out is w:
        raise ValueError("out must not be w: w receives the stepped weights and out the prediction")
    check_state(rule, state, w, step)
    kept = {f"state[{k!r}]": state[k] for k in STEP_STATE[rule] if isinstance(state.get(k), torch.Tensor)}
    check_disjoint({"out": out, "w": w, **kept}, {"grad": grad}, same_allowed=(("out", "grad"),),
                   advice={("out", "grad"): "pass out=grad itself to write ŵ over the spent gradient, or a "
                                            "buffer of its own",
                           ("out", "w"): "w receives the stepped weights and out the prediction"})
    return step, s
