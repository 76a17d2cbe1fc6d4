"""The two ways a schedule can be wrong, as exception types a caller can catch separately.

``ScheduleConfigError``: the request cannot be met (e.g. BitPipe on an odd number of devices); the message
states the rule and a valid alternative. ``ScheduleError``: a schedule (generated, parsed or hand-written)
breaks a rule of the format; the message names the rule, the device and position, and carries the text grid
with the offending step marked.
"""
from __future__ import annotations


class ScheduleConfigError(ValueError):
    """A schedule was asked for with parameters that its rules do not allow."""


class ScheduleError(ValueError):
    """A schedule breaks a rule: wrong device, missing or repeated work, dependency order, deadlock."""

    def __init__(self, rule: str, detail: str, device: int | None = None, index: int | None = None,
                 grid: str = ""):
        self.rule = rule
        self.detail = detail
        self.device = device
        self.index = index
        self.grid = grid
        where = "" if device is None else f" (device {device}" + ("" if index is None else f", action {index}") + ")"
        message = f"{rule}{where}: {detail}"
        if grid:
            message += "\n" + grid
        super().__init__(message)
