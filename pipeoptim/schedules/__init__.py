"""Pipeline schedules as data: the action format, generators, the validator and derived communication.

A ``Schedule`` is, per device, an ordered list of small frozen actions (``actions.py`` documents what each one
needs and produces). Everything else reads that data: ``validate`` checks the rules, ``lower`` derives sends,
receives and hand-offs, ``version_difference`` counts staleness for weight prediction, ``pipeoptim.sim`` times
it, ``pipeoptim.viz`` draws it, and the runtime executor runs it.

    >>> from pipeoptim.schedules import get_schedule, validate
    >>> s = get_schedule("1f1b", devices=4, microbatches=8)
    >>> print(s.to_text())            # prints, and Schedule.from_text reads it back
    >>> lowered = validate(s)         # raises ScheduleError naming the broken rule
"""
from .actions import (Action, Backward, BackwardInput, BackwardWeight, Chunk, Compute, Forward, Handoff, Recv, Send,
                      Step, Sync, format_action, input_grad_action, is_compute, parse_action, weight_grad_action)
from .dataflow import consumer, input_transfer, output_transfer, producer, requirements
from .errors import ScheduleConfigError, ScheduleError
from .grid import format_grid, format_order_grid
from .lower import lower
from .registry import INFO, SCHEDULES, ScheduleInfo, get_schedule, with_data_parallel
from .schedule import Schedule
from .staleness import input_version_difference, max_version_difference, version_difference
from .timeline import Timeline, run_timeline, unit_durations
from .validate import check_rendezvous, validate

__all__ = [
    "Action", "Backward", "BackwardInput", "BackwardWeight", "Chunk", "Compute", "Forward", "Handoff", "Recv",
    "Send", "Step", "Sync", "format_action", "parse_action", "is_compute", "input_grad_action", "weight_grad_action",
    "consumer", "producer", "requirements", "input_transfer", "output_transfer",
    "ScheduleConfigError", "ScheduleError", "format_grid", "format_order_grid", "lower",
    "INFO", "SCHEDULES", "ScheduleInfo", "get_schedule", "with_data_parallel", "Schedule",
    "version_difference", "input_version_difference", "max_version_difference", "Timeline", "run_timeline",
    "unit_durations", "validate", "check_rendezvous",
]
