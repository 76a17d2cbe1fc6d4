"""Which prediction rule of ``pipeoptim_kernels`` steps with which optimizer, and the state each rule keeps.

``torch.optim``'s optimizers map to the kernels' built-in rules (``pipeoptim_kernels.OPTIMIZER_CLASSES``); any other
optimizer class is added with ``register_optimizer``. An optimizer with no rule (``torch.optim.Muon``, a
``ChainedOptimizer``) is bound as ``OPAQUE_RULE``: flat buffers, and every policy that does not read the optimizer's
own update direction, still work. ``flat`` reads these tables when it lays out a stage's buffers.
"""
from __future__ import annotations

from typing import Callable

import torch

import pipeoptim_kernels as pk

__all__ = ["OPAQUE_RULE", "register_optimizer", "supported_optimizers", "rule_for", "rule_or_opaque",
           "needs_last_grad", "ELEMENT_STATE", "SCALAR_STATE", "scalar_placement"]

# The binding's rule for an optimizer with no prediction rule (torch.optim.Muon, a ChainedOptimizer): flat buffers
# and policies that do not read the optimizer's Δ (none, stash, 2bw, spectrain, pipeoptim's last update) work;
# a prediction from the optimizer's own rule is refused where it is asked for (rule_for's error).
OPAQUE_RULE = "opaque"

# Optimizer classes we know beyond torch.optim's, added by register_optimizer: class -> (rule, needs_grad).
_REGISTERED: dict[type, tuple[str, bool]] = {}


def register_optimizer(cls: type, rule: str, *, needs_grad: bool = False) -> None:
    """Let `bind` accept optimizer class `cls`, predicting with kernel rule `rule`.

    `rule` is a built-in rule name or one registered with `pipeoptim_kernels.register_rule`. Set
    `needs_grad=True` if the rule reads the last gradient (`state['grad']`): the binding then keeps a copy
    of the gradient of the last completed step.
    """
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise TypeError(f"register_optimizer: cls must be a torch.optim.Optimizer subclass, got {cls!r}")
    if rule not in pk.BUILTIN_RULES and pk.rules.custom_rule(rule) is None:
        raise ValueError(f"register_optimizer({cls.__name__}, {rule!r}): no kernel rule named {rule!r}; register "
                         f"it first with pipeoptim_kernels.register_rule({rule!r}, lambda w, state, group, step: delta)")
    _REGISTERED[cls] = (rule, needs_grad)


def supported_optimizers() -> list[str]:
    return [f"torch.optim.{name}" for name in pk.OPTIMIZER_CLASSES] + [c.__name__ for c in _REGISTERED]


def rule_for(optimizer: torch.optim.Optimizer) -> str:
    """The kernel rule that predicts for `optimizer`, or a ValueError that says how to add one."""
    cls = type(optimizer)
    if cls in _REGISTERED:
        return _REGISTERED[cls][0]
    if cls.__module__.startswith("torch.optim") and cls.__name__ in pk.OPTIMIZER_CLASSES:
        return pk.OPTIMIZER_CLASSES[cls.__name__]
    raise ValueError(
        f"no prediction rule for optimizer {cls.__name__}: weight prediction needs the optimizer's next update "
        f"direction. Supported: {', '.join(supported_optimizers())}. For another optimizer, register a rule and "
        "the class:\n"
        "    pipeoptim_kernels.register_rule('myopt', lambda w, state, group, step: delta)  # flat tensors -> Δ\n"
        f"    pipeoptim.prediction.flat.register_optimizer({cls.__name__}, 'myopt')\n"
        "so that ŵ = w − s·lr·Δ (custom rules run on the eager backend)."
    )


def rule_or_opaque(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's prediction rule, or OPAQUE_RULE when it has none."""
    try:
        return rule_for(optimizer)
    except ValueError:
        return OPAQUE_RULE


def needs_last_grad(rule: str, group: dict, mode: str = "exact") -> bool:
    """Whether `rule`'s prediction for this group reads the last gradient (mode "reference": SGD always, as
    the public PipeOptim code adds p.grad to the momentum buffer)."""
    if mode == "reference":
        return rule == "sgd"
    for cls, (name, needs) in _REGISTERED.items():
        if name == rule:
            return needs
    momentum = pk.rules.scalar(group.get("momentum", 0.0))
    if rule == "sgd":
        return momentum == 0.0 or bool(group.get("nesterov", False))
    if rule == "rmsprop":
        return momentum == 0.0
    return rule in ("adagrad", "nadam")


# Per-element state that torch creates on the first step; we create it up front as flat views so the first
# step already runs in place. name -> (condition on the group, initial value). SGD is absent on purpose: it
# initialises momentum_buffer to the first gradient (not to zeros), so it is re-homed after its first step.
ELEMENT_STATE: dict[str, list[tuple[str, Callable[[dict], bool]]]] = {
    "adam": [("exp_avg", lambda g: True), ("exp_avg_sq", lambda g: True),
             ("max_exp_avg_sq", lambda g: bool(g.get("amsgrad", False)))],
    "rmsprop": [("square_avg", lambda g: True), ("momentum_buffer", lambda g: g.get("momentum", 0) > 0),
                ("grad_avg", lambda g: bool(g.get("centered", False)))],
    "adamax": [("exp_avg", lambda g: True), ("exp_inf", lambda g: True)],
    "nadam": [("exp_avg", lambda g: True), ("exp_avg_sq", lambda g: True)],
    "radam": [("exp_avg", lambda g: True), ("exp_avg_sq", lambda g: True)],
}
ELEMENT_STATE["adamw"] = ELEMENT_STATE["adam"]
SCALAR_STATE = {"step": 0.0, "mu_product": 1.0}  # mu_product: NAdam only


def scalar_placement(group: dict, param: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """Where torch.optim keeps a parameter's 'step' tensor: on the param's device only when fused/capturable."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused = bool(group.get("fused", False))
    on_device = fused or bool(group.get("capturable", False))
    return (param.device if on_device else torch.device("cpu")), _get_scalar_dtype(is_fused=fused)
