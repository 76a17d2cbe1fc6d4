"""Schedules by name, with their rules checked up front and errors that say which rule and what would work.

``get_schedule("bitpipe", devices=4, microbatches=8)`` is the one entry point the CLI, the benchmarks and the
runtime use; ``SCHEDULES`` lists the names. Each rule is checked here, before generation, so a user gets
"bitpipe needs an even number of devices (got 3); use --devices 4 or the 1f1b schedule" and not a failure deep
inside a generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .actions import Step, Sync, weight_grad_action
from .asynchronous import async_1f1b, async_zb, two_bw
from .bidirectional import CONCATS, bitpipe, chimera
from .errors import ScheduleConfigError
from .schedule import Schedule
from .synchronous import gpipe, interleaved, one_f_one_b
from .zero_bubble import dualpipev, zb_h1, zbv

__all__ = ["SCHEDULES", "ScheduleInfo", "INFO", "get_schedule", "with_data_parallel"]


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    synchronous: bool
    single_copy: bool          # one copy of each stage (exportable to torch.distributed.pipelining)
    summary: str


INFO: dict[str, ScheduleInfo] = {i.name: i for i in [
    ScheduleInfo("gpipe", True, True, "all forwards, then all backwards; flush"),
    ScheduleInfo("1f1b", True, True, "one forward one backward (DAPPLE / PipeDream-Flush); flush"),
    ScheduleInfo("interleaved", True, True, "1F1B over v chunks per device, looping placement; flush"),
    ScheduleInfo("chimera", True, False, "two replicas in opposite directions; flush"),
    ScheduleInfo("bitpipe", True, False, "two V-shaped replicas, 4 chunks per device, eager sync; flush"),
    ScheduleInfo("zb-h1", True, True, "1F1B with split backward, weight gradients deferred into the bubble; flush"),
    ScheduleInfo("zbv", True, True, "zero bubble, V-shaped: 2 chunks per device, split backward; flush"),
    ScheduleInfo("dualpipev", True, True, "DualPipe on V-shaped chunks: forward/backward pairs, split tail; flush"),
    ScheduleInfo("async-1f1b", False, True, "PipeDream: no flush, a step after every backward"),
    ScheduleInfo("async-zb", False, True, "async 1F1B, split backward in ZB-H1 order, a step after every W"),
    ScheduleInfo("2bw", False, True, "PipeDream-2BW: no flush, a step every m micro-batches"),
]}
SCHEDULES: list[str] = list(INFO)


def _multiples(n: int, d: int) -> str:
    low = (n // d) * d
    options = [m for m in (low, low + d) if m >= d]
    return " or ".join(str(m) for m in options)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ScheduleConfigError(message)


def _even_devices(name: str, devices: int) -> None:
    _need(devices % 2 == 0, f"{name} needs an even number of devices (got {devices}); use --devices "
          f"{devices + 1 if devices > 1 else 2} or the 1f1b schedule, which takes any number")


def _multiple_of_devices(name: str, devices: int, microbatches: int) -> None:
    _need(microbatches % devices == 0, f"{name} needs the number of micro-batches to be a multiple of the "
          f"number of devices (got {microbatches} micro-batches on {devices} devices); use --microbatches "
          f"{_multiples(microbatches, devices)}, or the 1f1b schedule, which takes any number")


def get_schedule(name: str, devices: int, microbatches: int, *, chunks: int | None = None,
                 concat: str = "reference", bwd_ratio: float = 2.0,
                 update_every: int | None = None, in_flight: int = 1, data_parallel: bool = False) -> Schedule:
    """Generate schedule ``name`` for ``devices`` pipeline ranks and ``microbatches`` micro-batches.

    chunks:        interleaved only: chunks per device v (default 2).
    concat:        chimera and bitpipe: "reference" or "paced" concatenation of groups; bitpipe also "greedy"
                   (bidirectional.py).
    bwd_ratio:     chimera and bitpipe "paced": backward/forward cost ratio the order is planned for.
    update_every:  2bw only: micro-batches per weight update m (default D; must be >= D).
    in_flight:     async-1f1b and 2bw: k times the warm-up forwards, so k times the micro-batches in flight
                   (default 1; asynchronous.py).
    data_parallel: the pipeline is one of several data-parallel copies: add their gradient syncs
                   (``with_data_parallel``).
    """
    if name not in INFO:
        close = [s for s in SCHEDULES if s.startswith(name[:2])] or SCHEDULES
        raise ScheduleConfigError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
                                  + (f" (did you mean {close[0]}?)" if close != SCHEDULES else ""))
    _need(isinstance(devices, int) and devices >= 1, f"the number of devices must be a positive integer "
          f"(got {devices!r}); use --devices 2 or more")
    _need(isinstance(microbatches, int) and microbatches >= 1, f"the number of micro-batches must be a "
          f"positive integer (got {microbatches!r}); use --microbatches {max(devices, 1)}")
    if chunks is not None and name != "interleaved":
        raise ScheduleConfigError(f"--chunks applies to the interleaved schedule only ({name} has a fixed "
                                  "placement); drop it or use the interleaved schedule")
    if update_every is not None and name != "2bw":
        raise ScheduleConfigError(f"--update-every applies to the 2bw schedule only; drop it for {name}")
    _need(isinstance(in_flight, int) and not isinstance(in_flight, bool) and in_flight >= 1,
          f"in_flight multiplies the warm-up forwards and must be a positive integer (got {in_flight!r}); use 1 "
          "(the schedule's own) or 2")
    _need(in_flight == 1 or name in ("async-1f1b", "2bw"), f"in_flight applies to the async-1f1b and 2bw "
          f"schedules only (the others' warm-up is fixed by their flush or split backward); drop it for {name}")
    if name in ("bitpipe", "chimera"):
        _need(concat in CONCATS, f"unknown concatenation {concat!r}; use one of {', '.join(CONCATS)}")
        _need(bwd_ratio > 0, f"the backward/forward cost ratio must be positive (got {bwd_ratio}); use "
              "--bwd-ratio 2")
    elif concat != "reference":
        raise ScheduleConfigError(f"--concat applies to the chimera and bitpipe schedules only; drop it for "
                                  f"{name}")
    build: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: gpipe(devices, microbatches),
        "1f1b": lambda: one_f_one_b(devices, microbatches),
        "interleaved": lambda: _interleaved(devices, microbatches, 2 if chunks is None else chunks),
        "chimera": lambda: _chimera(devices, microbatches, concat, bwd_ratio),
        "bitpipe": lambda: _bitpipe(devices, microbatches, concat, bwd_ratio),
        "zb-h1": lambda: zb_h1(devices, microbatches),
        "zbv": lambda: zbv(devices, microbatches),
        "dualpipev": lambda: _dualpipev(devices, microbatches),
        "async-1f1b": lambda: async_1f1b(devices, microbatches, in_flight),
        "async-zb": lambda: async_zb(devices, microbatches),
        "2bw": lambda: _two_bw(devices, microbatches, devices if update_every is None else update_every, in_flight),
    }
    schedule = build[name]()
    return with_data_parallel(schedule) if data_parallel else schedule


def with_data_parallel(schedule: Schedule) -> Schedule:
    """``schedule`` as one of several data-parallel copies: gradients are also averaged across the copies.

    Existing syncs (Chimera's and BitPipe's mirror syncs) widen to the data-parallel group (``dp=True``: one
    all-reduce over mirror and copies). Otherwise synchronous schedules sync each chunk eagerly, right after its
    last backward or W (overlapping the remaining backwards, as DDP does), and asynchronous ones sync before every
    step.
    """
    actions = []
    for d, acts in enumerate(schedule.actions):
        acts = list(acts)
        if any(isinstance(a, Sync) for a in acts):
            acts = [Sync(a.stages, a.devices, dp=True) if isinstance(a, Sync) else a for a in acts]
        elif schedule.synchronous:
            for chunk in schedule.chunks[d]:
                last = max(i for i, a in enumerate(acts) if weight_grad_action(a) and a.chunk == chunk)
                acts.insert(last + 1, Sync((chunk.stage,), (), dp=True))
        else:
            out = []
            for a in acts:
                if isinstance(a, Step):
                    out.append(Sync((a.stage,), (), dp=True))
                out.append(a)
            acts = out
        actions.append(acts)
    return schedule.replace(actions=actions, params={**schedule.params, "data_parallel": True})


def _interleaved(devices: int, microbatches: int, v: int) -> Schedule:
    _need(isinstance(v, int) and v >= 1, f"interleaved needs a positive number of chunks per device "
          f"(got {v!r}); use --chunks 2")
    _multiple_of_devices("interleaved", devices, microbatches)
    return interleaved(devices, microbatches, v)


def _chimera(devices: int, microbatches: int, concat: str, bwd_ratio: float) -> Schedule:
    _even_devices("chimera", devices)
    _need(microbatches % 2 == 0, f"chimera needs an even number of micro-batches, half for each direction "
          f"(got {microbatches}); use --microbatches {microbatches + 1}")
    return chimera(devices, microbatches, concat, bwd_ratio)


def _bitpipe(devices: int, microbatches: int, concat: str, bwd_ratio: float) -> Schedule:
    _even_devices("bitpipe", devices)
    _multiple_of_devices("bitpipe", devices, microbatches)
    return bitpipe(devices, microbatches, concat, bwd_ratio)


def _dualpipev(devices: int, microbatches: int) -> Schedule:
    _need(microbatches >= 2 * devices, f"dualpipev needs at least twice as many micro-batches as devices, one per "
          f"stage of its V (got {microbatches} micro-batches on {devices} devices); use --microbatches "
          f"{2 * devices}, or the zbv schedule, which takes any number")
    return dualpipev(devices, microbatches)


def _two_bw(devices: int, microbatches: int, m: int, in_flight: int = 1) -> Schedule:
    _need(isinstance(m, int) and m >= devices, f"2bw needs update_every >= devices (got {m} on {devices} "
          "devices): a stage may only update once its oldest in-flight micro-batch has finished, so that two "
          f"weight versions suffice; use --update-every {devices}")
    _need(microbatches % m == 0, f"2bw needs the number of micro-batches to be a multiple of update_every "
          f"(got {microbatches} micro-batches, update every {m}); use --microbatches {_multiples(microbatches, m)}")
    return two_bw(devices, microbatches, m, in_flight)
