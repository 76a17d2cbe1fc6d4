"""The contexts a weight policy's ``forward(mb, s)`` and ``backward(mb, s)`` return (``base.WeightPolicy``), and the
checks and sizes every policy shares. Written as classes, not generator-based contexts: a pipeline enters two per
micro-batch and stage, and a generator costs several microseconds each time."""
from __future__ import annotations

from typing import Hashable

import torch

__all__ = ["BACKWARD_PARTS", "ForwardScope", "BackwardScope", "check_s", "nbytes"]

BACKWARD_PARTS = ("full", "input", "weight")
INF = float("inf")


class _Scope:
    """A policy's forward or backward context (``policy``: the ``base.WeightPolicy`` it belongs to). ``_inner``
    are the contexts the policy needs around the body (entered in order, exited in reverse, an exception passed through them)."""
    __slots__ = ("policy", "mb", "s", "_inner")

    def _enter(self, contexts) -> None:
        if not contexts:  # (most scopes: nothing to enter, nothing to exit)
            self._inner = ()
            return
        self._inner = []
        for c in contexts:
            try:
                c.__enter__()
            except BaseException as e:
                self._exit(type(e), e, e.__traceback__)
                raise
            self._inner.append(c)

    def _exit(self, exc_type, exc, tb) -> bool:
        """Exit the entered contexts in reverse order, as nested ``with`` statements would; True when they
        handled the exception ``exc``."""
        if not self._inner:
            return False
        pending = exc
        while self._inner:
            c = self._inner.pop()
            try:
                if c.__exit__(type(pending) if pending is not None else None, pending,
                              pending.__traceback__ if pending is not None else None):
                    pending = None
            except BaseException as e:  # an exit raised: that exception replaces the one in flight
                pending = e
        if pending is not None and pending is not exc:
            raise pending
        return exc is not None and pending is None


class ForwardScope(_Scope):
    __slots__ = ("tag", "acts")

    def __init__(self, policy, mb: Hashable, s: float):
        self.policy, self.mb, self.s = policy, mb, s

    def __enter__(self) -> None:
        p, mb, s = self.policy, self.mb, self.s
        self.tag = tag = p._forward_tag(mb, s)
        self.acts = acts = {} if p.measure_activations else None
        contexts = []
        # (with s = 0 and real weights, autograd saves the weights itself: no step comes before the backward)
        if not (s == 0 and acts is None and p.saves_real_weights_at_s0):
            contexts.append(p.saved.hooks(tag, p._resolve, acts))
        if p._reads_own_forward_weights:
            contexts.append(p._forward_weights(mb, s))
        self._enter(contexts)

    def __exit__(self, exc_type, exc, tb) -> bool:
        handled = self._exit(exc_type, exc, tb)
        if (exc_type is None or handled) and torch.is_grad_enabled():
            self.policy._forward_done(self.mb, self.tag, self.acts)
        return handled


class BackwardScope(_Scope):
    __slots__ = ("part",)

    def __init__(self, policy, mb: Hashable, s: float, part: str):
        self.policy, self.mb, self.s, self.part = policy, mb, s, part

    def __enter__(self) -> None:
        p = self.policy
        self._enter((p._backward_weights(self.mb, self.s),) if p._reads_own_backward_weights else ())

    def __exit__(self, exc_type, exc, tb) -> bool:
        handled = self._exit(exc_type, exc, tb)
        if exc_type is None or handled:
            self.policy._backward_done(self.mb, self.part)
        return handled


def check_s(s: object) -> None:
    if (s.__class__ is int or s.__class__ is float) and 0 <= s < INF:  # (the common case, in one test per action)
        return
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0 or s == INF:
        raise ValueError(f"s must be a finite number >= 0 (optimizer steps between a forward and its backward), "
                         f"got {s!r}")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
