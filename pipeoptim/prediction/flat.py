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

from typing import Callable, Iterator

import torch
from torch import nn

import pipeoptim_kernels as pk

from .flat_groups import FlatGroup, keeps_state, plan_groups, same_view
from .optimizer_rules import (ELEMENT_STATE, OPAQUE_RULE, SCALAR_STATE, needs_last_grad, register_optimizer,
                              rule_for, rule_or_opaque, scalar_placement, supported_optimizers)

__all__ = ["FlatBinding", "FlatGroup", "bind", "register_optimizer", "rule_for", "rule_or_opaque", "OPAQUE_RULE",
           "supported_optimizers"]


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
        plan = plan_groups(module, optimizer, working_dtype)
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
        """Pre-create torch's state as flat views, for params with no state yet (see ELEMENT_STATE)."""
        cls = type(self.optimizer)
        if not (cls.__module__.startswith("torch.optim") and pk.OPTIMIZER_CLASSES.get(cls.__name__) == g.rule):
            return  # only torch's own classes are known to initialise their state this way
        entries = [name for name, cond in ELEMENT_STATE.get(g.rule, []) if cond(group)]
        if not entries:
            return
        empty = [j for j, m in enumerate(g.masters) if len(self.optimizer.state.get(m, {})) == 0]
        if len(empty) != len(g.masters):
            return  # state exists (loaded, or stepped before binding): rehome_state copies it in
        for name in entries:
            g.state[name] = torch.zeros(g.numel, dtype=g.w.dtype, device=g.w.device)
        scalar_names = ["step"] + (["mu_product"] if g.rule == "nadam" else [])
        device, dtype = scalar_placement(group, g.masters[0])
        for name in scalar_names:
            g.scalars[name] = torch.full((len(g.masters),), SCALAR_STATE[name], dtype=dtype, device=device)
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
                            flat = g.scalars[name] = torch.full((len(g.masters),), SCALAR_STATE.get(name, 0.0),
                                                                dtype=value.dtype, device=value.device)
                        slot = flat[j]
                    elif value.shape == m.shape and value.dtype == m.dtype and value.device == m.device:
                        flat = g.state.get(name)
                        if flat is None:
                            flat = g.state[name] = torch.zeros(g.numel, dtype=m.dtype, device=m.device)
                        slot = g.view(flat, j)
                    else:
                        continue
                    if value is not slot and not same_view(value, slot):
                        with torch.no_grad():
                            slot.copy_(value)
                        st[name] = slot
        # Stay dirty while torch has yet to create some state (SGD's momentum_buffer before its first step).
        self._state_dirty = any(keeps_state(g.rule, self.group_hparams(g)) and not opt_state.get(m)
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
                if cur is None or not same_view(cur, view):
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
