"""Zero-bubble schedules: the backward split into an input-gradient ``I`` and a weight-gradient ``W``.

Only ``I`` lies on the critical path (the previous stage waits for its output); ``W`` depends on nothing but its
own ``I``, so a schedule can defer it into the idle slots that the fill and drain of a pipeline leave (Qi et al.,
"Zero Bubble Pipeline Parallelism"). All three schedules here are synchronous: one iteration, then every device
steps each chunk once (flush). Costs below: F forward, I input gradient, W weight gradient of one chunk.

``zb-h1`` (one stage per device): 1F1B with each ``B`` replaced by an ``I``, and on device d each ``W`` run d
micro-batches after its ``I`` (the warm-up of device d is D-1-d forwards, so every device holds about D
micro-batches, the memory of 1F1B's first device). The ``I`` chain travels faster than a full backward and the
deferred ``W`` fill the drain: each device idles (D-1)(F + I - W) per iteration instead of 1F1B's (D-1)(F + I + W)
(the paper's ZB-H1 bubble), so with F = I = W one third of 1F1B's.

``zbv`` (two chunks per device, V-shaped): device d holds stages d and 2D-1-d; a micro-batch runs devices 0..D-1,
turns on device D-1 (a local hand-off) and comes back D-1..0, where its loss is computed. The order is the
paper's ZB-V: a warm-up of 2(D-d)-1 first-chunk forwards, then second-chunk forwards paired with ``I``/``W``,
then a steady state of ``F I W`` on both chunks, and a drain that runs the ``I`` first and the ``W`` last. Peak
activation memory is that of 1F1B; with F = I = W the only idle time left is the unavoidable ramp of the
first forward (see ``tests/test_schedules_zero_bubble.py`` for the closed forms the simulator reproduces).

``dualpipev``: DeepSeek's DualPipe folded onto D devices with the same V placement (the order
torch.distributed.pipelining ships as ``ScheduleDualPipeV``): in its steady state each forward of one chunk is
paired with a full backward of the other (DualPipe overlaps the two pairs' computation and communication; the
simulator runs them one after the other), and the drain switches to split backwards whose ``W`` fill the tail.
Needs N >= 2D.

Orders are built per device from counters ("the next micro-batch of this kind on this chunk"), phase by phase,
so each phase reads as the papers describe it. The tests check them against the orders torch's own schedule
classes generate.
"""
from __future__ import annotations

from collections import Counter, deque

from .actions import Action, Backward, BackwardInput, BackwardWeight, Chunk, Compute, Forward, Step
from .schedule import Schedule

__all__ = ["zb_h1_order", "zb_h1", "zbv", "dualpipev", "v_chunks"]


def zb_h1_order(devices: int, microbatches: int, device: int) -> list[Compute]:
    """Device ``device``'s ZB-H1 compute order (module docstring): D-1-d warm-up forwards, then ``F I`` pairs,
    each ``W`` emitted once d more ``I`` have run, the remaining ``W`` at the end."""
    D, N, d = devices, microbatches, device
    warmup = min(D - d - 1, N)
    acts: list[Compute] = [Forward(m, d) for m in range(warmup)]
    pending: deque[int] = deque()
    for m in range(N):
        if warmup + m < N:
            acts.append(Forward(warmup + m, d))
        acts.append(BackwardInput(m, d))
        pending.append(m)
        if len(pending) > d:
            acts.append(BackwardWeight(pending.popleft(), d))
    acts += [BackwardWeight(m, d) for m in pending]
    return acts


def zb_h1(devices: int, microbatches: int) -> Schedule:
    chunks = [[Chunk(0, d)] for d in range(devices)]
    actions = [zb_h1_order(devices, microbatches, d) + [Step(d)] for d in range(devices)]
    return Schedule("zb-h1", devices, microbatches, devices, chunks, actions, True)


def v_chunks(devices: int) -> list[list[Chunk]]:
    """V placement: device d holds stage d (first chunk) and stage 2D-1-d (second chunk)."""
    return [[Chunk(0, d), Chunk(0, 2 * devices - 1 - d)] for d in range(devices)]


class _Emitter:
    """Appends "the next micro-batch" of an action kind on a stage, counting per (kind, stage)."""

    def __init__(self):
        self.acts: list[Compute] = []
        self.count: Counter = Counter()

    def __call__(self, kind: type, stage: int) -> int:
        key = (BackwardInput if kind is Backward else kind, stage)  # a full B counts as that stage's next I
        mb = self.count[key]
        self.count[key] += 1
        self.acts.append(kind(mb, stage))
        return mb

    def done(self, kind: type, stage: int) -> int:
        return self.count[(kind, stage)]


def _zbv_order(D: int, N: int, d: int) -> list[Compute]:
    n = max(N, 2 * D - 1)      # enough micro-batches to reach the steady state; the extra ones are dropped
    first, second = d, 2 * D - 1 - d
    e = _Emitter()
    for _ in range(2 * (D - d) - 1):               # warm-up: first-chunk forwards
        e(Forward, first)
    for _ in range(d):                             # both chunks' forwards
        e(Forward, second)
        e(Forward, first)
    for _ in range(D - d):                         # second chunk reaches its first backwards
        e(Forward, second)
        e(BackwardInput, second)
        e(BackwardWeight, second)
    while e.done(Forward, second) < e.done(Forward, first) or e.done(Forward, first) < n:   # steady state
        if e.done(Forward, first) < n:
            e(Forward, first)
        e(BackwardInput, first)
        e(BackwardWeight, first)
        e(Forward, second)
        e(BackwardInput, second)
        e(BackwardWeight, second)
    for _ in range(d):                             # drain: input gradients first
        e(BackwardInput, first)
        e(BackwardInput, second)
    for _ in range(D - d):
        e(BackwardInput, first)
        e(BackwardWeight, first)
    for stage in (second, first):                  # then the deferred weight gradients
        while e.done(BackwardWeight, stage) < e.done(BackwardInput, stage):
            e(BackwardWeight, stage)
    return [a for a in e.acts if a.mb < N]


def zbv(devices: int, microbatches: int) -> Schedule:
    chunks = v_chunks(devices)
    actions: list[list[Action]] = []
    for d in range(devices):
        actions.append(_zbv_order(devices, microbatches, d) + [Step(c.stage) for c in chunks[d]])
    return Schedule("zbv", devices, microbatches, 2 * devices, chunks, actions, True)


def _dualpipev_order(D: int, N: int, d: int) -> list[Compute]:
    first, second = d, 2 * D - 1 - d
    e = _Emitter()
    weights: deque[BackwardWeight] = deque()       # W of the split backwards still to run, oldest first

    def backward(stage: int, split: bool) -> None:
        if split:
            weights.append(BackwardWeight(e(BackwardInput, stage), stage))
        else:
            e(Backward, stage)

    def deferred_weight() -> None:
        if weights:
            e.acts.append(weights.popleft())

    for _ in range(2 * (D - d - 1)):               # 1: first-chunk forwards
        e(Forward, first)
    for _ in range(d + 1):                         # 2: forwards of both chunks
        e(Forward, first)
        e(Forward, second)
    for _ in range(D - d - 1):                     # 3: second chunk's first backwards, split, W right away
        backward(second, split=True)
        deferred_weight()
        e(Forward, second)
    for _ in range(N - 2 * D + d + 1):             # 4: steady state, each forward paired with a backward
        e(Forward, first)
        backward(second, split=False)
        e(Forward, second)
        backward(first, split=False)
    for _ in range(D - d - 1):                     # 5: the first chunk's forwards are done
        backward(second, split=False)
        e(Forward, second)
        backward(first, split=False)
    split = False
    for i in range(d + 1):                         # 6: backwards of both chunks; the second half split
        if i == (d + 1) // 2 and d % 2 == 1:
            split = True
        backward(second, split)
        if i == (d + 1) // 2 and d % 2 == 0:
            split = True
        backward(first, split)
    for _ in range(D - d - 1):                     # 7: deferred W between the last first-chunk backwards
        deferred_weight()
        backward(first, split)
    for _ in range(d + 1):                         # 8: the remaining W
        deferred_weight()
    return e.acts


def dualpipev(devices: int, microbatches: int) -> Schedule:
    """DualPipeV; needs microbatches >= 2 x devices (checked by the registry)."""
    chunks = v_chunks(devices)
    actions: list[list[Action]] = []
    for d in range(devices):
        actions.append(_dualpipev_order(devices, microbatches, d) + [Step(c.stage) for c in chunks[d]])
    return Schedule("dualpipev", devices, microbatches, 2 * devices, chunks, actions, True)
