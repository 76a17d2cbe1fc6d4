"""Device x time text grid of a timed schedule, able to mark the step where a schedule is invalid.

Each row is a device; each column is one time quantum (the greatest common divisor of the durations, so with
forward 1 and backward 2 a backward spans two columns). Labels: ``F3`` / ``B3`` (micro-batch 3), ``I3`` / ``W3``
for a backward split into input and weight gradient, with the direction (``>`` down, ``<`` up) on two-replica
schedules and the stage (``s5``) when a device holds several chunks; ``-``/``=``/``+`` continue a forward/
backward (or ``I``)/``W``, ``.`` is idle, ``|`` marks an optimizer step and ``*`` a
gradient sync when they take no time (otherwise they get cells ``U``/``AR``). A marked action is printed as
``!label`` and explained under the grid.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable, Sequence

from .actions import Action, Backward, BackwardInput, BackwardWeight, Step, Sync, format_action, is_compute
from .schedule import Schedule
from .timeline import Timeline

__all__ = ["label", "format_grid", "format_order_grid", "LEGEND"]

LEGEND = ("F/B/I/W<mb>[>|<][s<stage>]: forward/backward/input gradient/weight gradient; -/=/+: continues; "
          ".: idle; |: optimizer step; *: gradient sync; !: invalid step")


def label(schedule: Schedule, action: Action) -> str:
    """Short cell label of ``action`` (see module docstring)."""
    multi_chunk = any(len(c) > 1 for c in schedule.chunks)
    if is_compute(action):
        kind = format_action(action)[0]
        direction = {0: ">", 1: "<"}[action.replica] if schedule.directed else ""
        stage = f"s{action.stage}" if multi_chunk else ""
        return f"{kind}{action.mb}{direction}{stage}"
    if isinstance(action, Step):
        return "U" + (f"s{action.stage}" if multi_chunk else "")
    if isinstance(action, Sync):
        return "AR"
    return schedule.format(action)


def _quantum(durations: Iterable[float]) -> float:
    positive = [d for d in durations if d > 1e-12 and math.isfinite(d)]
    if not positive:
        return 1.0
    fracs = [Fraction(d).limit_denominator(64) for d in positive]
    exact = all(abs(float(f) - d) <= 1e-9 * max(1.0, d) for f, d in zip(fracs, positive))
    if exact:
        g = fracs[0]
        for f in fracs[1:]:
            g = Fraction(math.gcd(g.numerator * f.denominator, f.numerator * g.denominator),
                         g.denominator * f.denominator)
        q = float(g)
        if max(positive) / q <= 64:
            return q
    return min(positive)


def _render(rows: Sequence[Sequence[tuple[float, float, str, Action, bool]]], quantum: float,
            device_labels: Sequence[str], notes: Sequence[str]) -> str:
    cells = [[(round(s / quantum), max(1, round((e - s) / quantum)) if e - s > 1e-12 else 0, text, a, m)
              for s, e, text, a, m in row] for row in rows]
    width = 1 + max([len(t) + (1 if m else 0) for row in cells for _, _, t, _, m in row] + [2])
    ncols = max([c + w for row in cells for c, w, *_ in row if w] + [1])
    head = max(len(x) for x in device_labels)
    step = max(1, math.ceil(6 / width))
    axis = [" "] * (ncols * width)
    for col in range(0, ncols, step):
        text = str(col)
        if col * width + len(text) <= len(axis):
            axis[col * width: col * width + len(text)] = list(text)
    out = [" " * (head + 2) + "".join(axis).rstrip() + f"   (1 column = {quantum:g} time units)"]
    for name, row in zip(device_labels, cells):
        line = [" "] * (ncols * width + 1)
        for col in range(ncols):
            line[col * width] = "."
        cursor = 0
        for col, w, text, action, mark in row:
            col = max(col, cursor) if w else col
            if w == 0:
                pos = min(max(col * width - 1, 0), len(line) - 1)
                line[pos] = "*" if isinstance(action, Sync) else "|"
                continue
            text = ("!" if mark else "") + text
            fill = ("=" if isinstance(action, (Backward, BackwardInput)) else
                    "+" if isinstance(action, BackwardWeight) else "-")
            span = w * width - 1
            cell = (text + fill * span)[:max(span, len(text))]
            line[col * width: col * width + len(cell)] = list(cell)
            cursor = col + w
        out.append(f"{name:>{head}} |" + "".join(line).rstrip())
    out.extend(notes)
    return "\n".join(out)


def format_grid(timeline: Timeline, marks: Iterable[tuple[int, int]] = (), notes: Sequence[str] = (),
                legend: bool = True) -> str:
    """Grid of ``timeline``; ``marks`` are (device, index) of actions to flag; blocked devices (an incomplete
    timeline) get their stuck action drawn, flagged, after their last completed action."""
    schedule = timeline.schedule
    marks = set(marks)
    rows: list[list[tuple[float, float, str, Action, bool]]] = []
    durations = []
    for d, recs in enumerate(timeline.records):
        row = []
        for r in recs:
            if math.isfinite(r.end):
                row.append((r.start, r.end, label(schedule, r.action), r.action, (d, r.index) in marks))
                durations.append(r.end - r.start)
        rows.append(row)
    quantum = _quantum(durations)
    notes = list(notes)
    for b in timeline.blocked:
        at = max((r.end for r in timeline.records[b.device] if math.isfinite(r.end)), default=0.0)
        rows[b.device].append((at, at + quantum, label(schedule, b.action), b.action, True))
        notes.append(f"! device {b.device}, action {b.index} ({schedule.format(b.action)}) waits for "
                     f"{b.waits_for}")
    if legend:
        notes.append(LEGEND)
    return _render(rows, quantum, [f"d{d}" for d in range(schedule.num_devices)], notes)


def format_order_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = (),
                      notes: Sequence[str] = ()) -> str:
    """Grid by list position (column = index in the device's list), for schedules that cannot be timed."""
    marks = set(marks)
    rows = [[(float(i), float(i + 1), label(schedule, a), a, (d, i) in marks) for i, a in enumerate(acts)]
            for d, acts in enumerate(schedule.actions)]
    return _render(rows, 1.0, [f"d{d}" for d in range(schedule.num_devices)],
                   list(notes) + ["columns are positions in each device's list, not time"])
