"""The one interface between a pipeline executor and the way a stage treats its weights.

An asynchronous pipeline runs, on each stage, forwards and backwards of several micro-batches whose
optimizer steps interleave. What weights a forward reads, what weights its backward reads and when the
optimizer steps is the *weight policy*: naive async, PipeDream's stashing, 2BW's double buffering,
SpecTrain's and PipeOptim's predictions. The executor codes against `WeightPolicy` only:

    policy = make_policy("pipeoptim", stage, optimizer)           # or "none", "stash", "2bw", "spectrain"
    ...
    with policy.forward(mb, s=s_fwd, lookahead=s_bwd):             # s: steps until mb's backward (schedule)
        y = stage(x)
    ...
    with policy.backward(mb, s=s_bwd):                             # s_bwd: SpecTrain's backward look-ahead
        torch.autograd.backward(y, dy)
    # the same per action, without a scope object where the policy enters nothing (what the runtime calls):
    # y = policy.call_forward(mb, s_fwd, s_bwd, stage, x); policy.call_backward(mb, s_bwd, fn, *args)
    # or split (zero-bubble schedules): the input gradient now, the weight gradient later
    with policy.backward(mb, s=s_bwd, part="input"):  ...          # torch.autograd.grad on the inputs
    with policy.backward(mb, s=s_bwd, part="weight"): ...          # the deferred parameter gradients
    if policy.should_step():                                       # every `update_every` backwards
        # executor's business here: all-reduce / clip / unscale policy.binding.grad_buffers() (one flat
        # buffer per param group), agree on overflow across stages
        policy.step(next_s=s_of_next_forward, skip=found_inf)      # zeroes the grads

Rules for the executor:
- `mb` is any hashable id, unique among micro-batches in flight on this stage; every forward under
  grad mode needs exactly one backward (`policy.discard(mb)` drops one that will never run backward).
- Forwards and backwards on one stage never overlap in time (they may interleave freely).
- A split backward runs its two parts inside `backward(mb, part="input")` and later `backward(mb,
  part="weight")`; each part reads the weights this policy's backward reads, at the time the part runs (stash
  and 2bw: the forward's version, kept until the weight part; none and pipeoptim: the real weights then;
  spectrain: its backward prediction then). The micro-batch's gradient counts towards `should_step` and its
  forward's version is released only after the weight part. For layers whose weight gradient does not read the
  weight (linear, embedding, layer norm, convolutions) the two parts then compute exactly an unsplit backward.
- s values are inputs; the schedule computes them (DESIGN.md §2). `s` may be fractional.
- Only `policy.step()` should step the optimizer while forwards are in flight (it knows about stashes
  and fused predictions); LR schedulers may change the lr at any time between calls.
- On CUDA, issue a stage's forwards, backwards and steps on one stream: the weight swaps are host-side
  pointer exchanges, and stream order is what keeps a later prediction from overwriting a buffer that
  earlier kernels still read.
- Save checkpoints (module, optimizer and `policy.state_dict()`) when no micro-batch is in flight:
  stashes and predictions are transient, but some policies keep state across steps that the optimizer
  does not (the last gradient for rules that read it, SpecTrain's own gradient average, the step count
  where torch keeps none); without it a resumed run's first predictions differ from the uninterrupted
  run's. `state_dict()` keys that state by the module's parameter names, so a runtime can re-key it by
  global names and load it into another stage balance.
- `extra_weight_bytes()` is the memory the policy holds beyond the model, its gradients and the
  optimizer's own state; `memory_report()` splits it by purpose. With `measure_activations = True`,
  `peak_activation_bytes` is the most bytes that forwards in flight had saved for their backwards (each
  forward's saved storages counted once; weights excluded), which is what the schedule costs in activations
  on this stage. Off by default: counting needs a Python call per saved tensor, and without it a policy that
  reads the real weights (`none`) runs a forward whose weights cannot change before its backward (s = 0: every
  synchronous schedule) with no saved-tensor hooks at all.
- Activation recomputation (checkpointing): the executor runs a checkpointed forward with
  `recompute_context(mb)` as torch.utils.checkpoint's recompute context (`pipeoptim.stages.recompute`); the
  recomputation then runs inside `backward(mb, ...)` (once per part of a split backward) and the module's
  parameters read `_recompute_buffers`: by default the buffers the backward's saved weights resolve to, so
  the recomputed region's backward is computed at the very weights the backward reads (stash/2bw: the
  forward's version, hence the forward bit for bit; none/pipeoptim: the real weights then; spectrain: its
  backward prediction). Inside a checkpointed region weights are saved by the recomputation, not by
  `SavedWeights`; `peak_activation_bytes` counts what the forward keeps (the region's inputs).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Hashable, Iterator

import torch
from torch import nn

from ..prediction.flat import FlatBinding, bind, rule_or_opaque
from ..prediction.predictor import SavedWeights
from .saved_state import gather, scatter
from .scopes import BACKWARD_PARTS, INF, BackwardScope, ForwardScope, check_s


class WeightPolicy:
    """Base class: naive asynchronous semantics (forward and backward read the weights real at their time).

    Subclasses override the three decisions: `_forward_weights` (what the forward reads),
    `_resolve` (what a saved weight reads at backward) and `_backward_weights` (set-up around a
    backward), plus `memory_report`.
    """

    name: ClassVar[str] = "base"
    # whether the policy reads the optimizer's own update rule (then an optimizer without one is refused at bind)
    needs_optimizer_rule: bool = False

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, update_every: int = 1,
                 working_dtype: torch.dtype | None = None, binding: FlatBinding | None = None):
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
            raise ValueError(f"update_every must be a positive int (micro-batches per optimizer step), "
                             f"got {update_every!r}")
        if binding is None:
            binding = getattr(optimizer, "_pipeoptim_binding", None)
        if binding is None:
            rule = None if self.needs_optimizer_rule else rule_or_opaque(optimizer)
            binding = bind(module, optimizer, working_dtype=working_dtype, rule=rule)
        elif binding.module is not module or binding.optimizer is not optimizer:
            raise ValueError("binding= belongs to another module or optimizer; pass the binding made for this one")
        elif working_dtype is not None and binding.working_dtype != working_dtype:
            raise ValueError(f"the optimizer is already bound with working_dtype={binding.working_dtype}; "
                             f"cannot use working_dtype={working_dtype}")
        self.module, self.optimizer, self.binding = module, optimizer, binding
        self.update_every = update_every
        self.saved = SavedWeights(binding)
        self._in_flight: dict[Hashable, Any] = {}
        self._input_done: set = set()  # micro-batches whose split backward ran its input part, not yet its weight part
        self._backwards = 0  # since the last step
        # bytes of the tensors forwards saved for their backwards (storages, counted once per forward), in
        # flight now and at most so far: the stage's activation memory under this schedule
        self._act: dict[Hashable, int] = {}
        self._act_now = 0
        self._peak_act = 0
        self.measure_activations = False
        # whether this stage's forwards are (partly) recomputed in their backward (set by the runtime): a policy
        # that keeps something per forward for the recomputation (pipeoptim's recompute_on="forward") asks it
        self.recompute = False

    # ---- the interface ----------------------------------------------------------------------------

    def forward(self, mb: Hashable, s: float = 0, lookahead: float = 0) -> "ForwardScope":
        """Run micro-batch `mb`'s forward inside (a context manager). `s`: optimizer steps this stage will take
        before mb's backward (used by predicting policies; others ignore it). `lookahead`: the steps after that
        backward that the same micro-batch's backward will predict (SpecTrain's backward s); a policy whose
        forward aims past the backward (SpecTrain: s + lookahead) adds it in `_forward_s`."""
        check_s(s)
        check_s(lookahead)
        if mb in self._in_flight:
            raise ValueError(f"micro-batch {mb!r} is already in flight on this stage; run its backward (or "
                             "policy.discard(mb)) before reusing the id")
        return ForwardScope(self, mb, self._forward_s(s, lookahead))

    def backward(self, mb: Hashable, s: float = 0, part: str = "full") -> "BackwardScope":
        """Run micro-batch `mb`'s backward inside (a context manager). `s`: SpecTrain's backward look-ahead;
        others ignore it. `part`: "full", or "input" then "weight" for a backward split in two (module
        docstring)."""
        check_s(s)
        if part not in BACKWARD_PARTS:
            raise ValueError(f"part must be one of {', '.join(BACKWARD_PARTS)}, got {part!r}")
        if mb not in self._in_flight:
            raise ValueError(f"micro-batch {mb!r} has no forward in flight on this stage (in flight: "
                             f"{list(self._in_flight)[:8]}); call backward once per forward")
        if part == "weight" and mb not in self._input_done:
            raise ValueError(f"micro-batch {mb!r}: the weight part of a split backward runs after its input part; "
                             "call backward(mb, part='input') first")
        if part != "weight" and mb in self._input_done:
            raise ValueError(f"micro-batch {mb!r} already ran the input part of its backward; finish it with "
                             "backward(mb, part='weight')")
        return BackwardScope(self, mb, s, part)

    def call_forward(self, mb: Hashable, s: float, lookahead: float, fn: Callable, *args) -> Any:
        """``fn(*args)`` run inside ``forward(mb, s, lookahead)``; returns its result. The same as the ``with``
        form, for a runtime that runs one forward per action: where the scope would enter nothing (a policy that
        reads the real weights and lets autograd save them, at s = 0, not counting activations), it checks, runs
        and records the forward without building a scope, whose objects and calls cost a few µs per action."""
        if self._plain_at_s0 and not self.measure_activations and \
                (s.__class__ is int or s.__class__ is float) and s == 0 and \
                (lookahead.__class__ is int or lookahead.__class__ is float) and lookahead == 0:
            if mb in self._in_flight:
                self.forward(mb, s=s, lookahead=lookahead)  # raises the error the with form raises
            out = fn(*args)
            if torch.is_grad_enabled():
                self._in_flight[mb] = None  # (_forward_done: no tag, no activations counted)
            return out
        with self.forward(mb, s=s, lookahead=lookahead):
            return fn(*args)

    def call_backward(self, mb: Hashable, s: float, fn: Callable, *args) -> Any:
        """``fn(*args)`` run inside ``backward(mb, s)``, a whole backward (not split); returns its result. The same
        as the ``with`` form without a scope object where the policy enters nothing around a backward."""
        if self._plain_backward and mb in self._in_flight and mb not in self._input_done and \
                (s.__class__ is int or s.__class__ is float) and 0 <= s < INF:
            out = fn(*args)
            self._backward_done(mb, "full")
            return out
        with self.backward(mb, s=s):
            return fn(*args)

    def _forward_done(self, mb: Hashable, tag: Any, acts: dict | None) -> None:
        """A forward under grad mode finished: mb is in flight until its backward."""
        self._in_flight[mb] = tag
        if acts is not None:
            self._act[mb] = sum(acts.values())
            self._act_now += self._act[mb]
            self._peak_act = max(self._peak_act, self._act_now)

    def _backward_done(self, mb: Hashable, part: str) -> None:
        """A backward (or one part of a split one) finished."""
        if part == "input":
            self._input_done.add(mb)
            return
        self._input_done.discard(mb)
        tag = self._in_flight.pop(mb)
        if self._tracks_gradients:
            self._gradient_done(mb, tag)
        if self._tracks_releases:
            self._release(mb, tag)
        self._act_now -= self._act.pop(mb, 0)
        self._backwards += 1
        self.binding.grads_changed()

    def should_step(self) -> bool:
        """True once `update_every` backwards have run since the last step."""
        return self._backwards >= self.update_every

    def step(self, *, next_s: float | None = None, skip: bool = False) -> bool:
        """Step the optimizer on the accumulated gradients, then zero them. Returns whether it stepped.

        `skip=True` (e.g. found inf/nan): no update, nothing of the weights, state or predictions changes;
        the gradients are dropped. `next_s`: the s of this stage's next forward, if known; a predicting
        policy may then produce that prediction in the same pass as the step."""
        if next_s is not None:
            check_s(next_s)
        stepped = False
        if not skip:
            self._apply_step(next_s)
            stepped = True
        self.binding.zero_grad()
        self._backwards = 0
        return stepped

    def discard(self, mb: Hashable) -> None:
        """Forget micro-batch `mb`'s forward (its backward will never run)."""
        if mb in self._in_flight:
            self._input_done.discard(mb)
            self._release(mb, self._in_flight.pop(mb))
            self._act_now -= self._act.pop(mb, 0)

    @contextmanager
    def recompute_context(self, mb: Hashable) -> Iterator[None]:
        """Inside, the module's parameters read the weights micro-batch `mb`'s recomputed forward reads
        (`_recompute_buffers`); outside, the real weights. Run by activation checkpointing around the
        recomputation, which happens inside `backward(mb, ...)`.

        The parameters are pointed at the buffers (`.data`), never swapped with them: the recomputation saves
        aliases of what the parameters hold, and those must keep reading the same values until the backward
        part that recomputed has used them, whatever a later prediction or step does to the real weights."""
        if mb not in self._in_flight:
            raise RuntimeError(f"{self.name}: recomputing the forward of micro-batch {mb!r}, which is not in flight "
                               "on this stage; the recomputation runs inside policy.backward(mb) (activation "
                               "checkpointing needs the policy's backward around torch.autograd's)")
        groups = self.binding.groups
        buffers = self._recompute_buffers(mb, self._in_flight[mb])
        lent = [(g, b) for g, b in zip(groups, buffers) if b is not g.work]
        for g, b in lent:
            for j, p in enumerate(g.params):
                p.data = g.view(b, j)
        try:
            yield
        finally:
            for g, _ in lent:
                for j, p in enumerate(g.params):
                    p.data = g.view(g.work, j)

    @property
    def in_flight(self) -> tuple:
        """Micro-batches forwarded and not yet backwarded, in forward order."""
        return tuple(self._in_flight)

    def memory_report(self) -> dict[str, int]:
        """Bytes held beyond the model, its gradients and the optimizer state, by purpose."""
        return {}

    def extra_weight_bytes(self) -> int:
        return sum(self.memory_report().values())

    def close(self) -> None:
        """Remove the policy's hooks (the binding stays)."""

    # ---- state across steps (checkpoints) ---------------------------------------------------------

    def state_dict(self) -> dict:
        """What this policy keeps across optimizer steps beyond the module and optimizer, per parameter.

        `{"policy": name, "params": {module param name: {key: value}}}`. Keys: `steps_taken` (completed steps
        as the binding counts them; torch keeps no 'step' for SGD), `last_grad` (the last step's gradient,
        where the prediction rule reads it), plus what a subclass adds (`_state_entries`). Call it with no
        micro-batch in flight."""
        if self._in_flight or self._backwards:
            raise RuntimeError(f"{self.name}: cannot save policy state with micro-batches in flight "
                               f"({list(self._in_flight)[:4]}) or gradients of {self._backwards} backward(s) not "
                               "yet stepped; save between iterations (after the last Step)")
        return {"policy": self.name, "params": gather(self.binding.groups, self._state_entries)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict()` saved (possibly re-keyed, from another stage layout or policy).

        A flat group none of whose parameters appear in `state` keeps its current state (a checkpoint
        saved without policy state, or by a model that lacked them). A group only partly covered is an
        error: its parameters would resume from different points. Entries this policy does not keep
        (e.g. another policy's) are ignored; a kept entry missing from `state` stays as it is."""
        if self._in_flight:
            raise RuntimeError(f"{self.name}: cannot load policy state with micro-batches in flight "
                               f"({list(self._in_flight)[:4]}); load between iterations")
        params = state.get("params", {}) if isinstance(state, dict) else None
        if not isinstance(params, dict):
            raise TypeError("load_state_dict expects the dict returned by state_dict() "
                            "({'policy': ..., 'params': {name: {...}}})")
        scatter(self.name, self.binding.groups, self._state_entries, params)
        self._after_load()

    def _state_entries(self, group: int) -> dict[str, torch.Tensor]:
        """Flat per-element buffers (laid out like group `group`'s weights) this policy keeps across steps,
        by the key they are saved under."""
        return {}

    def _after_load(self) -> None:
        """Drop anything derived from the state before a load (cached predictions)."""
        predictor = getattr(self, "predictor", None)
        if predictor is not None:
            predictor.invalidate()

    # ---- what subclasses decide --------------------------------------------------------------------

    # whether a forward with s = 0 may let autograd save the module's weights as they are: true when the forward
    # reads the real weights and the backward would resolve its saved weights to the same real weights
    saves_real_weights_at_s0: ClassVar[bool] = False

    def _forward_s(self, s: float, lookahead: float) -> float:
        """The version difference the forward predicts for (default: up to the backward on this stage)."""
        return s

    def _forward_tag(self, mb: Hashable, s: float) -> Any:
        """What a saved weight remembers of its forward, passed back to `_resolve` at backward."""
        return None

    @contextmanager
    def _forward_weights(self, mb: Hashable, s: float) -> Iterator[None]:
        yield

    @contextmanager
    def _backward_weights(self, mb: Hashable, s: float) -> Iterator[None]:
        yield

    def _resolve(self, group: int, tag: Any) -> torch.Tensor:
        """The flat buffer a weight saved in a forward reads at backward time (default: the real weights)."""
        return self.binding.groups[group].work

    def _recompute_buffers(self, mb: Hashable, tag: Any) -> list[torch.Tensor]:
        """The flat buffers (one per group, laid out like its working weights) that mb's recomputed forward
        reads; default: what its backward's saved weights read now (`_resolve`)."""
        return [self._resolve(i, tag) for i in range(len(self.binding.groups))]

    def _gradient_done(self, mb: Hashable, tag: Any) -> None:
        """mb's gradient is complete in the gradient buffers (not called for a discarded micro-batch)."""

    def _release(self, mb: Hashable, tag: Any) -> None:
        """mb's backward is done (or it was discarded)."""

    def _apply_step(self, next_s: float | None) -> None:
        self.optimizer.step()

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes forwards in flight had saved for their backwards (`measure_activations` must be on)."""
        if not self.measure_activations:
            raise RuntimeError(f"{self.name}: activation bytes are counted only with measure_activations=True "
                               "(Pipeline(measure_activations=True), or set policy.measure_activations before "
                               "the forwards to count)")
        return self._peak_act

    @peak_activation_bytes.setter
    def peak_activation_bytes(self, value: int) -> None:
        self._peak_act = value

    # whether the class overrides _forward_weights / _backward_weights, _gradient_done / _release (set per class:
    # the scopes ask per action), and whether its forward at s = 0 and its backward enter nothing (the shortcuts
    # of call_forward and call_backward)
    _reads_own_forward_weights: ClassVar[bool] = False
    _reads_own_backward_weights: ClassVar[bool] = False
    _tracks_gradients: ClassVar[bool] = False
    _tracks_releases: ClassVar[bool] = False
    _plain_at_s0: ClassVar[bool] = False
    _plain_backward: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._reads_own_forward_weights = cls._forward_weights is not WeightPolicy._forward_weights
        cls._reads_own_backward_weights = cls._backward_weights is not WeightPolicy._backward_weights
        cls._tracks_gradients = cls._gradient_done is not WeightPolicy._gradient_done
        cls._tracks_releases = cls._release is not WeightPolicy._release
        # what ForwardScope enters nothing for: s = 0 (after _forward_s) with the real weights saved by autograd,
        # no tag to remember, no weights of its own to lend; and a class that redefines forward, backward or what
        # they record keeps its own (the shortcuts would pass it by)
        cls._plain_at_s0 = (cls.saves_real_weights_at_s0 and not cls._reads_own_forward_weights
                            and cls._forward_tag is WeightPolicy._forward_tag
                            and cls._forward_s is WeightPolicy._forward_s
                            and cls.forward is WeightPolicy.forward
                            and cls._forward_done is WeightPolicy._forward_done)
        cls._plain_backward = not cls._reads_own_backward_weights and cls.backward is WeightPolicy.backward

    def __repr__(self) -> str:
        return f"{type(self).__name__}(update_every={self.update_every}, in_flight={len(self._in_flight)})"
