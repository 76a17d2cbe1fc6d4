"""Single-copy synchronous schedules: GPipe, 1F1B (DAPPLE / PipeDream-Flush) and interleaved 1F1B.

All three keep one copy of each stage, run one iteration of N micro-batches and end with a flush: every
device steps each of its chunks once, after its last backward. Their orders are closed formulas (below), so
they need no search; they are the orders torch.distributed.pipelining runs too (see ``torch_export.py``).
"""
from __future__ import annotations

from .actions import Action, Backward, Chunk, Forward, Step
from .schedule import Schedule

__all__ = ["gpipe", "one_f_one_b", "interleaved", "one_f_one_b_order"]


def _flush(chunks) -> list[Action]:
    return [Step(c.stage, c.replica) for c in chunks]


def gpipe(devices: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order), then one step per stage."""
    chunks = [[Chunk(0, d)] for d in range(devices)]
    actions = []
    for d in range(devices):
        acts: list[Action] = [Forward(m, d) for m in range(microbatches)]
        acts += [Backward(m, d) for m in range(microbatches)]
        actions.append(acts + _flush(chunks[d]))
    return Schedule("gpipe", devices, microbatches, devices, chunks, actions, True)


def one_f_one_b_order(devices: int, microbatches: int, device: int, warmup: int | None = None) -> list[Action]:
    """Device ``device``'s 1F1B compute order: D-d-1 warm-up forwards (or ``warmup``), then forward/backward
    pairs, then the remaining backwards. Stage 0 thus holds at most D micro-batches' activations."""
    warmup = min(devices - device - 1 if warmup is None else warmup, microbatches)
    acts: list[Action] = [Forward(m, device) for m in range(warmup)]
    for i in range(microbatches - warmup):
        acts += [Forward(warmup + i, device), Backward(i, device)]
    acts += [Backward(m, device) for m in range(microbatches - warmup, microbatches)]
    return acts


def one_f_one_b(devices: int, microbatches: int) -> Schedule:
    chunks = [[Chunk(0, d)] for d in range(devices)]
    actions = [one_f_one_b_order(devices, microbatches, d) + _flush(chunks[d]) for d in range(devices)]
    return Schedule("1f1b", devices, microbatches, devices, chunks, actions, True)


def interleaved(devices: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual pipeline) with ``chunks`` = v chunks per device, looping placement:
    device d holds stages d, d+D, ..., d+(v-1)D. Needs N to be a multiple of D (checked by the registry).

    Virtual micro-batch k (0 <= k < vN) is the forward of chunk (k // D) % v on micro-batch
    (k // (vD)) * D + k % D: devices run D micro-batches through one chunk before moving to the next. The
    k-th backward runs chunks in reverse. Device d warms up with 2(D-d-1) + (v-1)D forwards, then alternates
    one forward and one backward, then drains the remaining backwards.
    """
    v, D, N = chunks, devices, microbatches
    placement = [[Chunk(0, c * D + d) for c in range(v)] for d in range(D)]
    total = v * N

    def mb(k: int) -> int:
        return (k // (v * D)) * D + k % D

    actions = []
    for d in range(D):
        def fwd(k: int) -> Forward:
            return Forward(mb(k), ((k // D) % v) * D + d)

        def bwd(k: int) -> Backward:
            return Backward(mb(k), (v - 1 - (k // D) % v) * D + d)

        warmup = (D - d - 1) if v == 1 else (D - d - 1) * 2 + (v - 1) * D
        warmup = min(warmup, total)
        acts: list[Action] = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        actions.append(acts + _flush(reversed(placement[d])))
    return Schedule("interleaved", D, N, v * D, placement, actions, True, {"chunks": v})
