"""Export a single-copy schedule to torch.distributed.pipelining's per-rank action CSV, so torch's own runtime
(``_PipelineScheduleRuntime._load_csv``) can execute our order: a cross-check of the format against an
existing engine.

torch's compute-only CSV has one row per rank and one cell per action, ``<stage>F<mb>``, ``<stage>B<mb>`` (full
backward), ``<stage>I<mb>`` / ``<stage>W<mb>`` (a backward split into input and weight gradient), stages and
micro-batches numbered from 0 as here. torch derives the sends and receives and the
stage-to-rank mapping from the rows itself, and does the gradient scaling (1/N) at the last backward of each
stage; optimizer steps happen outside torch's schedule, so ``Step`` actions are dropped. The API is private and
changed names in torch 2.5, 2.6, 2.10 and 2.15: ``torch_runtime_available`` says whether this torch has what
the export targets, and why not.
"""
from __future__ import annotations

import csv
import io

from .actions import Step, Sync, format_action, is_compute
from .schedule import Schedule

__all__ = ["to_torch_rows", "to_torch_csv", "torch_runtime_available"]


def to_torch_rows(schedule: Schedule) -> list[list[str]]:
    """Per rank, torch action tokens of ``schedule``'s forwards and backwards, in order."""
    if schedule.num_replicas != 1:
        raise ValueError(f"{schedule.name} keeps two model replicas; torch.distributed.pipelining runs one copy "
                         "of each stage, so only the single-copy schedules (gpipe, 1f1b, interleaved, zb-h1, zbv, "
                         "dualpipev and the async orders) export")
    rows = []
    for acts in schedule.actions:
        row = []
        for a in acts:
            if is_compute(a):
                row.append(f"{a.stage}{format_action(a)[0]}{a.mb}")
            elif isinstance(a, Sync):
                raise ValueError(f"{schedule.format(a)}: torch's compute-only CSV has no gradient sync between "
                                 "pipeline ranks")
            elif not isinstance(a, Step):
                raise ValueError(f"{schedule.format(a)}: export the compute-only schedule (torch derives "
                                 "communication itself)")
        rows.append(row)
    return rows


def to_torch_csv(schedule: Schedule) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(to_torch_rows(schedule))
    return buf.getvalue()


def torch_runtime_available() -> tuple[bool, str]:
    """(True, "") if the installed torch can load our CSV into ``_PipelineScheduleRuntime``, else (False, why)."""
    try:
        import torch
        from torch.distributed.pipelining import schedules as ts
    except Exception as e:  # torch missing or built without distributed
        return False, f"torch.distributed.pipelining is not importable: {e}"
    runtime = getattr(ts, "_PipelineScheduleRuntime", None)
    action = getattr(ts, "_Action", None)
    if runtime is None or action is None or not hasattr(runtime, "_load_csv") or not hasattr(action, "from_str"):
        return False, (f"torch {torch.__version__} has no _PipelineScheduleRuntime._load_csv / _Action.from_str "
                       "(private API, renamed across versions)")
    return True, ""
