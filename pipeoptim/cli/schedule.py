"""``pipeoptim schedule`` and ``pipeoptim compare-schedules``: one schedule printed, drawn and timed; all of them
tabulated (bubble, memory, traffic) by the simulator. Neither loads torch.distributed.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .arg_types import non_negative_float as _non_negative_float
from .arg_types import positive_float as _positive_float
from .arg_types import positive_float_or_inf as _positive_float_or_inf
from .arg_types import positive_int as _positive_int

__all__ = ["schedule_arguments", "schedule_run", "compare_arguments", "compare_run", "format_table"]


def _schedule_names() -> tuple[str, ...]:
    from ..runtime.config import SCHEDULES  # the names only: no torch
    return SCHEDULES


# ---- pipeoptim schedule ---------------------------------------------------------------------------------
def schedule_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=_schedule_names(), metavar="NAME", help="the schedule: %(choices)s")
    p.add_argument("--devices", "-D", type=_positive_int, required=True, help="pipeline devices D")
    p.add_argument("--microbatches", "-N", type=_positive_int, required=True, help="micro-batches N")
    p.add_argument("--chunks", type=_positive_int, default=None,
                   help="interleaved: chunks per device v (default: 2)")
    p.add_argument("--bwd-ratio", type=_positive_float, default=2.0, help="backward cost / forward cost")
    _weight_share_argument(p)
    p.add_argument("--concat", choices=("reference", "greedy", "paced"), default="reference",
                   help="chimera/bitpipe: how groups of D micro-batches are joined (reference: the published "
                        "order; greedy: bitpipe only)")
    p.add_argument("--update-every", type=_positive_int, default=None,
                   help="2bw: micro-batches per update m (default: D)")
    p.add_argument("--data-parallel", action="store_true",
                   help="add gradient syncs across data-parallel copies of the pipeline")
    p.add_argument("--png", help="write a timeline chart here (default: none)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON) here (default: none)")
    p.add_argument("--text", help="write the schedule in text notation here (default: none)")
    p.add_argument("--csv", help="write the per-device action lists as CSV here (default: none)")
    p.add_argument("--no-grid", action="store_true", help="do not print the grid")


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def _weight_share_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight-share", type=_share, default=0.5,
                   help="share of the backward that is the weight gradient W of a split backward; the input "
                        "gradient I is the rest (0.5: I = W)")


def _costs(forward: float, bwd_ratio: float, weight_share: float, **others):
    from ..sim import Costs
    backward = forward * bwd_ratio
    return Costs(forward=forward, backward=backward, backward_input=backward * (1 - weight_share),
                 backward_weight=backward * weight_share, **others)


def schedule_run(args: argparse.Namespace) -> int:
    from ..schedules import ScheduleConfigError, get_schedule, validate
    from ..sim import simulate
    try:
        schedule = get_schedule(args.name, args.devices, args.microbatches, chunks=args.chunks,
                                concat=args.concat, bwd_ratio=args.bwd_ratio, update_every=args.update_every,
                                data_parallel=args.data_parallel)
    except ScheduleConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    validate(schedule)
    result = simulate(schedule, _costs(1.0, args.bwd_ratio, args.weight_share))
    if not args.no_grid:
        from ..viz import text_grid
        print(text_grid(result))
    if args.png:
        from ..viz import save_png
        print(f"wrote {save_png(result, args.png)}")
    if args.trace:
        from ..viz import save_trace
        print(f"wrote {save_trace(result, args.trace)}")
    if args.text:
        with open(args.text, "w") as f:
            f.write(schedule.to_text())
        print(f"wrote {args.text}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(schedule.to_csv())
        print(f"wrote {args.csv}")
    split = (f"; split: I = {args.bwd_ratio * (1 - args.weight_share):g}, W = "
             f"{args.bwd_ratio * args.weight_share:g}" if schedule.split_backward else "")
    print(f"makespan: {result.makespan:g} (forward of one D-th of the model = 1, backward = {args.bwd_ratio:g}"
          f"{split})")
    print(f"peak activations per device: {', '.join(f'{v:g}' for v in result.peak_activations)}")
    print(f"bubble ratio: {result.bubble_ratio:.6f}")
    return 0


# ---- pipeoptim compare-schedules ------------------------------------------------------------------------
_COLUMNS = [("schedule", "schedule", "{}"), ("bubble_ratio", "bubble", "{:.4f}"),
            ("steady_bubble", "steady", "{:.4f}"), ("makespan", "makespan", "{:g}"),
            ("peak_activations", "peak act", "{:g}"), ("weight_copies", "weights", "{:g}"),
            ("weight_versions", "versions", "{:g}"), ("p2p_bytes_per_device", "p2p/dev", "{:g}"),
            ("allreduce_bytes_total", "allreduce", "{:g}")]


def format_table(rows: Sequence[dict]) -> str:
    """Plain-text table of ``sim.compare`` rows; rows with ``error`` show the rule that excluded them."""
    cells = [[head for _, head, _ in _COLUMNS]]
    notes = []
    for r in rows:
        if "error" in r:
            cells.append([r["schedule"]] + ["-"] * (len(_COLUMNS) - 1))
            notes.append(f"  {r['schedule']}: {r['error']}")
        else:
            cells.append([fmt.format(r[key]) for key, _, fmt in _COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + notes)


def compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", "-D", type=_positive_int, default=8, help="pipeline devices D")
    p.add_argument("--microbatches", "-N", type=_positive_int, default=32, help="micro-batches N")
    p.add_argument("--bwd-ratio", type=_positive_float, nargs="+", default=[1.0, 2.0],
                   help="backward/forward cost ratios to compare (default: 1 2)")
    p.add_argument("--chunks", type=_positive_int, default=2, help="interleaved: chunks per device")
    _weight_share_argument(p)
    p.add_argument("--p2p-latency", type=_non_negative_float, default=0.0, help="per-hop latency (forward time units)")
    p.add_argument("--p2p-bandwidth", type=_positive_float_or_inf, default=float("inf"),
                   help="activation sizes per forward time unit (default: inf, free communication)")
    p.add_argument("--schedules", nargs="+", choices=_schedule_names(), default=None, metavar="NAME",
                   help="subset of schedules, from: %(choices)s (default: all)")
    p.add_argument("--png", help="write bar charts here (default: none)")
    p.add_argument("--csv", help="write the table as CSV here (default: none)")


def compare_run(args: argparse.Namespace) -> int:
    import csv

    from ..schedules import ScheduleConfigError
    from ..sim import compare
    by_ratio: dict[float, list[dict]] = {}
    for ratio in args.bwd_ratio:
        costs = _costs(1.0, ratio, args.weight_share, p2p_latency=args.p2p_latency,
                       p2p_bandwidth=args.p2p_bandwidth)
        try:
            rows = compare(args.devices, args.microbatches, costs, args.schedules, chunks=args.chunks)
        except ScheduleConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        by_ratio[ratio] = rows
        print(f"D={args.devices} N={args.microbatches} backward/forward={ratio:g} "
              f"(forward of one D-th of the model = 1; memory in stage activations; traffic in activations)")
        print(format_table(rows))
        print()
    print("bubble: idle / (devices x makespan) over one window of N micro-batches; steady: per N micro-batches "
          "of a long run (differs only for asynchronous schedules, which never flush)")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            keys = ["bwd_ratio"] + [k for k, _, _ in _COLUMNS] + ["error"]
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for ratio, rows in by_ratio.items():
                for r in rows:
                    w.writerow({"bwd_ratio": ratio, **r})
        print(f"wrote {args.csv}")
    if args.png:
        from ..viz import save_comparison_png
        save_comparison_png(by_ratio, args.png, title=f"D={args.devices} N={args.microbatches}")
        print(f"wrote {args.png}")
    return 0
