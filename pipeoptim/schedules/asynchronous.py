"""Asynchronous schedules: PipeDream's async 1F1B and PipeDream-2BW. No flush: the 1F1B order runs on across
batches and each stage updates its weights on its own, so a micro-batch's forward and backward on a stage can
see different weight versions (``staleness.version_difference`` counts how many updates apart).

- ``async-1f1b``: a step after every backward (each micro-batch is a mini-batch). Stage k keeps D-k weight
  versions if it stashes (PipeDream); PipeOptim instead predicts the weights the backward will see.
- ``2bw``: gradients accumulated over m >= D micro-batches, one step per m backwards; two weight versions.
- ``async-zb``: async 1F1B with the backward split (``zero_bubble.py``): the ZB-H1 order, where device d runs
  each weight gradient ``W`` d micro-batches after its input gradient ``I``, and a step after every ``W`` (the
  gradient exists only then). The deferred ``W`` fill the window's fill and drain; the price is staleness: a
  micro-batch's gradient reaches the weights d steps later than in async-1f1b, so its forward is D-1 steps
  ahead of the update that applies it on every stage (``staleness.version_difference``).

``in_flight`` = k (async-1f1b and 2bw): device d warms up with k·(D-d-1) forwards instead of D-d-1, so k times
as many micro-batches are in flight. A slow link's latency is then hidden behind more work, at the price of k
times the staleness (and of the activations of k times the micro-batches on the first devices).

The window covers ``microbatches`` micro-batches: the warm-up, the steady state and the drain of a stream
that a training run would continue indefinitely. ``Pipeline(stream=True)`` runs async-1f1b and 2bw as that
stream: one fill, then every ``train_step`` a steady segment, a drain only when asked (``runtime.stream``).
"""
from __future__ import annotations

from .actions import Action, Backward, BackwardWeight, Chunk, Step
from .schedule import Schedule
from .synchronous import one_f_one_b_order
from .zero_bubble import zb_h1_order

__all__ = ["async_1f1b", "two_bw", "async_zb"]


def _with_steps(devices: int, microbatches: int, every: int, in_flight: int = 1) -> list[list[Action]]:
    actions = []
    for d in range(devices):
        acts: list[Action] = []
        backwards = 0
        for a in one_f_one_b_order(devices, microbatches, d, warmup=in_flight * (devices - d - 1)):
            acts.append(a)
            if isinstance(a, Backward):
                backwards += 1
                if backwards % every == 0:
                    acts.append(Step(d))
        actions.append(acts)
    return actions


def _in_flight_params(in_flight: int) -> dict:
    return {} if in_flight == 1 else {"in_flight": in_flight}


def async_1f1b(devices: int, microbatches: int, in_flight: int = 1) -> Schedule:
    chunks = [[Chunk(0, d)] for d in range(devices)]
    return Schedule("async-1f1b", devices, microbatches, devices, chunks,
                    _with_steps(devices, microbatches, 1, in_flight), False, _in_flight_params(in_flight))


def two_bw(devices: int, microbatches: int, update_every: int | None = None, in_flight: int = 1) -> Schedule:
    """PipeDream-2BW with one update every ``update_every`` = m micro-batches (default D)."""
    m = devices if update_every is None else update_every
    chunks = [[Chunk(0, d)] for d in range(devices)]
    return Schedule("2bw", devices, microbatches, devices, chunks, _with_steps(devices, microbatches, m, in_flight),
                    False, {"update_every": m, **_in_flight_params(in_flight)})


def async_zb(devices: int, microbatches: int) -> Schedule:
    """Async 1F1B with split backwards in the ZB-H1 order and a step after every ``W`` (module docstring)."""
    chunks = [[Chunk(0, d)] for d in range(devices)]
    actions = []
    for d in range(devices):
        acts: list[Action] = []
        for a in zb_h1_order(devices, microbatches, d):
            acts.append(a)
            if isinstance(a, BackwardWeight):
                acts.append(Step(d))
        actions.append(acts)
    return Schedule("async-zb", devices, microbatches, devices, chunks, actions, False)
