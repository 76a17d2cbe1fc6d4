"""Flat parameter, gradient and optimizer-state buffers bound to an unmodified torch.optim optimizer.

The prediction kernels work on flat 1-D buffers: one launch per buffer covers a whole parameter group.
This module re-homes a stage module's parameters into one contiguous buffer per (param group, dtype,
device), every parameter a view into it, and does the same for gradients and for the optimizer's
per-element state (exp_avg, momentum_buffer, ...), so the optimizer's own `step()` keeps updating the
flat buffers in place. Scalar state kept per parameter ('step', NAdam's 'mu_product') lives in a small
flat buffer of one element per parameter.

The binding survives what would otherwise break it, by re-homing (copying into the flat views) from
optimizer hooks:
- torch's SGD creates `momentum_buffer` lazily as a clone of the gradient on its first step;
- `optimizer.load_state_dict` installs new state tensors;
- `optimizer.zero_grad()` (set_to_none=True by default) drops the gradient views.

Mixed precision (`working_dtype=torch.bfloat16`): the optimizer keeps fp32 master weights and state;
the module's parameters become bf16 working copies in their own flat buffer (gradients too). The
master copies replace the module's parameters in `optimizer.param_groups`; after every optimizer step
the working copy is refreshed from the masters (the cast a mixed-precision loop needs anyway).

Module parameters that are not in the optimizer, or do not require grad, are left alone. Bind after the
module is on its device and dtype (`.to()` afterwards replaces the parameters' storage). In mixed
precision the optimizer holds only the masters, so its `zero_grad()` does not see the working gradients:
use `binding.zero_grad()` (the policies do).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

import pipeoptim_kernels as pk

__all__ = ["FlatBinding", "FlatGroup", "bind", "register_optimizer", "rule_for", "rule_or_opaque", "OPAQUE_RULE",
           "supported_optimizers"]

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
        f"    pipeoptim.flat.register_optimizer({cls.__name__}, 'myopt')\n"
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
_ELEMENT_STATE: dict[str, list[tuple[str, Callable[[dict], bool]]]] = {
    "adam": [("exp_avg", lambda g: True), ("exp_avg_sq", lambda g: True),
             ("max_exp_avg_sq", lambda g: bool(g.get("amsgrad", False)))],
    "rmsprop": [("square_avg", lambda g: True), ("momentum_buffer", lambda g: g.get("momentum", 0) > 0),
                ("grad_avg", lambda g: bool(g.get("centered", False)))],
    "adamax": [("exp_avg", lambda g: True), ("exp_inf", lambda g: True)],
    "nadam": [("exp_avg", lambda g: True), ("exp_avg_sq", lambda g: True)],
    "radam": [("exp_avg", lambda g: True), ("exp_avg_sq", lambda g: True)],
}
_ELEMENT_STATE["adamw"] = _ELEMENT_STATE["adam"]
_SCALAR_STATE = {"step": 0.0, "mu_product": 1.0}  # mu_product: NAdam only


def _scalar_placement(group: dict, param: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """Where torch.optim keeps a parameter's 'step' tensor: on the param's device only when fused/capturable."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused = bool(group.get("fused", False))
    on_device = fused or bool(group.get("capturable", False))
    return (param.device if on_device else torch.device("cpu")), _get_scalar_dtype(is_fused=fused)


@dataclass(eq=False)
class FlatGroup:
    """The flat buffers of one (param group, dtype, device) slice of a bound optimizer.

    `w` is what the optimizer steps (the fp32 masters in mixed precision), `work` what the module's forward
    reads (`work is w` unless mixed). `grad` receives the module's gradients; `master_grad` is what the
    optimizer reads (`master_grad is grad` unless mixed). `state` holds per-element optimizer state by
    torch.optim's names, `scalars` the per-parameter scalars ('step', 'mu_product'), one element per param.
    """
    index: int
    rule: str
    names: list[str]
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    offsets: list[int]
    shapes: list[torch.Size]
    w: torch.Tensor
    work: torch.Tensor
    grad: torch.Tensor
    master_grad: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    last_grad: torch.Tensor | None = None
    steps_taken: int = 0  # completed steps observed by the binding (used where torch keeps no 'step')
    grad_views: list[torch.Tensor] = field(default_factory=list)         # params' .grad, made once
    master_grad_views: list[torch.Tensor] = field(default_factory=list)  # masters' .grad (mixed precision)

    @property
    def numel(self) -> int:
        return self.w.numel()

    def __repr__(self) -> str:
        mixed = f", working {self.work.dtype}" if self.mixed else ""
        return (f"FlatGroup(param_group={self.index}, rule={self.rule!r}, {len(self.params)} params, {self.numel} "
                f"elements, {self.w.dtype} on {self.w.device}{mixed}, state={sorted(self.state)})")

    @property
    def mixed(self) -> bool:
        return self.work is not self.w

    def view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter j's slice of a buffer laid out like this group's."""
        shape = self.shapes[j]
        return flat[self.offsets[j]:self.offsets[j] + shape.numel()].view(shape)


class FlatBinding:
    """Binds a stage module's parameters, gradients and optimizer state to flat buffers (see module doc).

    Use `bind(module, optimizer)`. The optimizer stays the user's own object and keeps working as usual
    (`step`, `zero_grad`, `state_dict`, `load_state_dict`, LR schedulers); prefer `binding.zero_grad()`,
    which zeroes one buffer per group and keeps the gradient views.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *,
                 working_dtype: torch.dtype | None = None, rule: str | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"bind(module, optimizer): module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"bind(module, optimizer): optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if getattr(optimizer, "_pipeoptim_binding", None) is not None:
            raise ValueError("this optimizer is already bound to flat buffers; reuse that binding "
                             "(or call its unbind() first)")
        rule = rule if rule is not None else rule_for(optimizer)
        plan = _plan_groups(module, optimizer, working_dtype)
        self.module, self.optimizer, self.rule = module, optimizer, rule
        self.working_dtype = working_dtype
        self.version = 0  # optimizer steps completed since binding
        self.groups: list[FlatGroup] = [self._build(rule, index, items, working_dtype) for index, items in plan]
        self._by_param = {id(m): (g, j) for g in self.groups for j, m in enumerate(g.masters)}
        self._state_dirty = True
        self._grads_synced = False
        self._step_cache: dict[int, int] = {}  # group id -> torch's step count, valid until the next step/load
        self._before_step: list[Callable[[], None]] = []
        self._after_step: list[Callable[[], None]] = []
        self.rehome_state()
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._pre_step()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._post_step()),
            optimizer.register_load_state_dict_post_hook(lambda opt: self._after_load()),
        ]
        optimizer._pipeoptim_binding = self

    # ---- construction ---------------------------------------------------------------------------

    def _build(self, rule: str, index: int, items: list[tuple[str, nn.Parameter]],
               working_dtype: torch.dtype | None) -> FlatGroup:
        optimizer = self.optimizer
        params = [p for _, p in items]
        dtype, device = params[0].dtype, params[0].device
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        w = torch.empty(total, dtype=dtype, device=device)
        grad_dtype = working_dtype or dtype
        work = w if working_dtype is None else torch.empty(total, dtype=working_dtype, device=device)
        grad = torch.zeros(total, dtype=grad_dtype, device=device)
        master_grad = grad if working_dtype is None else torch.zeros(total, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, offsets):
                w[off:off + p.numel()].view(p.shape).copy_(p)
                if p.grad is not None:
                    grad[off:off + p.numel()].view(p.shape).copy_(p.grad)
            if working_dtype is not None:
                work.copy_(w)

        group = optimizer.param_groups[index]
        if working_dtype is None:
            masters = params
        else:
            masters = []
            for p in params:
                m = torch.empty(0, dtype=dtype, device=device).requires_grad_(True)
                masters.append(m)
            plist = group["params"]
            for p, m in zip(params, masters):
                plist[next(i for i, q in enumerate(plist) if q is p)] = m  # the master takes the param's place
                if p in optimizer.state:
                    optimizer.state[m] = optimizer.state.pop(p)
        g = FlatGroup(index=index, rule=rule, names=[n for n, _ in items], params=params, masters=masters,
                      offsets=offsets, shapes=[p.shape for p in params], w=w, work=work, grad=grad, master_grad=master_grad)
        g.grad_views = [g.view(grad, j) for j in range(len(params))]
        g.master_grad_views = g.grad_views if working_dtype is None else [
            g.view(master_grad, j) for j in range(len(params))]
        for j, (p, m) in enumerate(zip(params, masters)):
            m.data = g.view(w, j)
            m.grad = g.master_grad_views[j]
            if working_dtype is not None:
                p.data = g.view(work, j)
                p.grad = g.grad_views[j]
        self._create_state(g, group)
        return g

    def _create_state(self, g: FlatGroup, group: dict) -> None:
        """Pre-create torch's state as flat views, for params with no state yet (see _ELEMENT_STATE)."""
        cls = type(self.optimizer)
        if not (cls.__module__.startswith("torch.optim") and pk.OPTIMIZER_CLASSES.get(cls.__name__) == g.rule):
            return  # only torch's own classes are known to initialise their state this way
        entries = [name for name, cond in _ELEMENT_STATE.get(g.rule, []) if cond(group)]
        if not entries:
            return
        empty = [j for j, m in enumerate(g.masters) if len(self.optimizer.state.get(m, {})) == 0]
        if len(empty) != len(g.masters):
            return  # state exists (loaded, or stepped before binding): rehome_state copies it in
        for name in entries:
            g.state[name] = torch.zeros(g.numel, dtype=g.w.dtype, device=g.w.device)
        scalar_names = ["step"] + (["mu_product"] if g.rule == "nadam" else [])
        device, dtype = _scalar_placement(group, g.masters[0])
        for name in scalar_names:
            g.scalars[name] = torch.full((len(g.masters),), _SCALAR_STATE[name], dtype=dtype, device=device)
        for j, m in enumerate(g.masters):
            st = self.optimizer.state[m]
            st.update({name: g.scalars[name][j] for name in scalar_names})
            st.update({name: g.view(g.state[name], j) for name in entries})

    # ---- keeping the binding ----------------------------------------------------------------------

    def rehome_state(self) -> None:
        """Copy any optimizer state tensor that is not a view into our flat buffers into one, and use the view.

        Param-shaped tensors of the param's dtype go to `g.state[name]`, 0-d tensors to `g.scalars[name]`;
        anything else is left as it is. Cheap when nothing changed; run after load_state_dict and after the
        optimizer's first steps (torch's SGD creates momentum_buffer lazily).
        """
        if not self._state_dirty:
            return
        opt_state = self.optimizer.state
        for g in self.groups:
            for j, m in enumerate(g.masters):
                st = opt_state.get(m)
                if not st:
                    continue
                for name, value in list(st.items()):
                    if not isinstance(value, torch.Tensor):
                        continue
                    if value.dim() == 0:
                        flat = g.scalars.get(name)
                        if flat is None or flat.dtype != value.dtype or flat.device != value.device:
                            flat = g.scalars[name] = torch.full((len(g.masters),), _SCALAR_STATE.get(name, 0.0),
                                                                dtype=value.dtype, device=value.device)
                        slot = flat[j]
                    elif value.shape == m.shape and value.dtype == m.dtype and value.device == m.device:
                        flat = g.state.get(name)
                        if flat is None:
                            flat = g.state[name] = torch.zeros(g.numel, dtype=m.dtype, device=m.device)
                        slot = g.view(flat, j)
                    else:
                        continue
                    if value is not slot and not _same_view(value, slot):
                        with torch.no_grad():
                            slot.copy_(value)
                        st[name] = slot
        # Stay dirty while torch has yet to create some state (SGD's momentum_buffer before its first step).
        self._state_dirty = any(_keeps_state(g.rule, self.group_hparams(g)) and not opt_state.get(m)
                                for g in self.groups for m in g.masters)

    def rebind_grads(self) -> None:
        """Make every bound param's .grad the flat view again (after zero_grad(set_to_none=True) or a user
        assigning .grad). A parameter without a gradient gets a zero one, so that every parameter of a group
        steps together (as with zero_grad(set_to_none=False))."""
        for g in self.groups:
            for p, view in zip(g.params, g.grad_views):
                cur = p.grad
                if cur is view:
                    continue
                if cur is None or not _same_view(cur, view):
                    with torch.no_grad():
                        if cur is None:
                            view.zero_()
                        else:
                            view.copy_(cur)
                p.grad = view
            if g.mixed:
                for m, view in zip(g.masters, g.master_grad_views):
                    if m.grad is not view:
                        m.grad = view

    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffers the backward accumulates into, one per group: all-reduce, clip or unscale
        these (one op each) before the step. In mixed precision they are the working-dtype gradients."""
        return [g.grad for g in self.groups]

    def keep_last_grad(self, mode: str = "exact") -> None:
        """Keep a copy of each step's gradient where the group's rule reads it in prediction mode `mode`
        (`state['grad']` of the kernels): torch.optim does not keep it and the gradient buffer is zeroed after
        the step. Until the next step the copy is zero."""
        for g in self.groups:
            if g.last_grad is None and needs_last_grad(g.rule, self.group_hparams(g), mode):
                g.last_grad = torch.zeros_like(g.w)

    def zero_grad(self) -> None:
        """Zero the flat gradient buffers (one op per group), keeping the .grad views."""
        for g in self.groups:
            g.grad.zero_()
        self.rebind_grads()
        self._grads_synced = False

    def sync_grads(self) -> None:
        """Mixed precision: copy the working gradients into the fp32 master gradients (once per step)."""
        if self._grads_synced:
            return
        self.rebind_grads()
        for g in self.groups:
            if g.mixed:
                g.master_grad.copy_(g.grad)
        self._grads_synced = True

    def grads_changed(self) -> None:
        """Tell the binding that a backward added to the gradients after sync_grads."""
        self._grads_synced = False

    # ---- optimizer hooks ------------------------------------------------------------------------------

    def on_before_step(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn() before each optimizer step (real or fused); returns a function that removes it."""
        self._before_step.append(fn)
        return lambda: self._before_step.remove(fn)

    def on_after_step(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn() after each completed optimizer step (real or fused); returns a function that removes it."""
        self._after_step.append(fn)
        return lambda: self._after_step.remove(fn)

    def run_step(self, update: Callable[[], None]) -> None:
        """Apply an optimizer step made outside optimizer.step() (a fused kernel updating the flat buffers)
        with the same bookkeeping: before-step hooks, 'step' counters +1, after-step hooks."""
        self._pre_step()
        update()
        for g in self.groups:
            if "step" in g.scalars:
                g.scalars["step"].add_(1)
        self.optimizer._opt_called = True  # what an LR scheduler's wrapper of optimizer.step() records
        self._post_step()

    def _pre_step(self) -> None:
        self.sync_grads()
        for fn in list(self._before_step):
            fn()

    def _post_step(self) -> None:
        self._step_cache.clear()
        self.version += 1
        self._grads_synced = False
        for g in self.groups:
            g.steps_taken += 1
        if self.rule not in pk.BUILTIN_RULES:
            self._state_dirty = True  # an optimizer we do not know may replace its state tensors at any step
        self.rehome_state()
        with torch.no_grad():
            for g in self.groups:
                if g.last_grad is not None:
                    g.last_grad.copy_(g.master_grad)
                if g.mixed:
                    g.work.copy_(g.w)
        for fn in list(self._after_step):
            fn()

    def _after_load(self) -> None:
        self._step_cache.clear()
        self._state_dirty = True
        self.rehome_state()
        for g in self.groups:
            step = g.scalars.get("step")
            if step is not None:
                g.steps_taken = int(step.max().item())
            elif g.state:
                g.steps_taken = max(g.steps_taken, 1)
            else:
                g.steps_taken = 0

    # ---- what the predictor reads ----------------------------------------------------------------------

    def group_hparams(self, g: FlatGroup) -> dict:
        """The live param group (so the current lr, after any scheduler, is what a prediction uses)."""
        return self.optimizer.param_groups[g.index]

    def step_count(self, g: FlatGroup) -> int:
        """Completed optimizer steps of group g, as torch.optim counts them ('step' state when it keeps one)."""
        step = g.scalars.get("step")
        if step is None:
            return g.steps_taken
        key = id(g)
        if key in self._step_cache:
            return self._step_cache[key]
        lo, hi = step.aminmax()
        lo, hi = int(lo.item()), int(hi.item())
        if lo != hi:
            names = [n for n, v in zip(g.names, step.tolist()) if int(v) != hi]
            raise ValueError(f"parameters of one group have taken different numbers of optimizer steps ({lo} to "
                             f"{hi}; behind: {', '.join(names[:5])}). Prediction uses one step count per group: "
                             "give every parameter a gradient at every step (binding.zero_grad() does).")
        self._step_cache[key] = hi
        return hi

    def state_for_kernel(self, g: FlatGroup) -> dict:
        """The flat state by torch.optim's names, plus 'grad' (the last step's gradient) and 'mu_product'."""
        state: dict = dict(g.state)
        if g.last_grad is not None:
            state["grad"] = g.last_grad
        if "mu_product" in g.scalars:
            state["mu_product"] = g.scalars["mu_product"][0]
        return state

    def named_master_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 master) pairs; the module's own parameters in full precision mode."""
        for g in self.groups:
            yield from zip(g.names, g.masters)

    def extra_bytes(self) -> int:
        """Memory the binding holds beyond what torch would: the last-gradient copies (mixed mode's masters
        and working copy are the usual mixed-precision costs and not counted)."""
        return sum(g.last_grad.numel() * g.last_grad.element_size() for g in self.groups if g.last_grad is not None)

    def unbind(self) -> None:
        """Remove the optimizer hooks. The buffers stay as they are (parameters remain views)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.optimizer._pipeoptim_binding = None


def bind(module: nn.Module, optimizer: torch.optim.Optimizer, *, working_dtype: torch.dtype | None = None,
         rule: str | None = None) -> FlatBinding:
    """Re-home `module`'s optimized parameters, their gradients and `optimizer`'s state into flat buffers.

    `working_dtype` (e.g. torch.bfloat16): keep fp32 masters in the optimizer and give the module working
    copies of that dtype. `rule`: the kernel rule to predict with, if not the one for the optimizer's class.
    """
    return FlatBinding(module, optimizer, working_dtype=working_dtype, rule=rule)


def _keeps_state(rule: str, group: dict) -> bool:
    return not (rule == "sgd" and pk.rules.scalar(group.get("momentum", 0.0)) == 0.0)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _plan_groups(module: nn.Module, optimizer: torch.optim.Optimizer,
                 working_dtype: torch.dtype | None) -> list[tuple[int, list[tuple[str, nn.Parameter]]]]:
    """Check everything and split each param group by (dtype, device), before anything is modified."""
    names = {id(p): n for n, p in module.named_parameters()}
    if working_dtype is not None and working_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"working_dtype must be torch.bfloat16 or torch.float16 (got {working_dtype}); "
                         "leave it None to train in the parameters' own dtype")
    plan, seen = [], set()
    for index, group in enumerate(optimizer.param_groups):
        buckets: dict[tuple, list] = {}
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not in the module (shape "
                                 f"{tuple(p.shape)}); build the stage's optimizer from module.parameters() only")
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]} appears twice in the optimizer's param groups")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"parameter {names[id(p)]} is not a dense strided tensor; flat buffers need dense "
                                 "parameters")
            if not p.is_floating_point():
                raise TypeError(f"parameter {names[id(p)]} has dtype {p.dtype}; flat buffers hold floating-point "
                                "parameters only")
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"parameter {names[id(p)]} has a sparse gradient (e.g. nn.Embedding(sparse=True));"
                                 " flat gradient buffers need dense gradients")
            if working_dtype is not None and p.dtype != torch.float32:
                raise TypeError(f"mixed precision needs float32 parameters to serve as masters, but "
                                f"{names[id(p)]} is {p.dtype}; build the model in float32 and pass "
                                f"working_dtype={working_dtype}")
            buckets.setdefault((p.dtype, p.device), []).append((names[id(p)], p))
        plan.extend((index, items) for items in buckets.values())
    if not plan:
        raise ValueError("the optimizer holds no trainable parameter of this module; nothing to bind")
    return plan
