"""Pictures of a simulated schedule: the text grid, a PNG chart and a Chrome/Perfetto trace.

All three draw a ``sim.SimResult`` (a schedule timed with costs), so what is drawn is what was measured.
The PNG has one row per device, one box per forward/backward coloured by micro-batch (backward darker, the
weight-gradient half of a split backward darkest and dotted, up-replica boxes hatched), steps and syncs as thin
bars, and a grey background where the device is idle.
The trace opens in chrome://tracing or ui.perfetto.dev with one track per device.
"""
from __future__ import annotations

import json

from .schedules.actions import Backward, BackwardInput, BackwardWeight, Forward, Step, Sync, is_compute
from .schedules.grid import format_grid, label
from .sim import SimResult

__all__ = ["text_grid", "save_png", "chrome_trace", "save_trace", "save_comparison_png"]


def text_grid(result: SimResult, legend: bool = True) -> str:
    """Device x time grid of ``result`` (see ``schedules.grid``)."""
    return format_grid(result.timeline, legend=legend)


def _colours(n: int):
    import matplotlib
    cmap = matplotlib.colormaps["tab20"]
    return [cmap((2 * i) % 20 / 20 + (1 / 40 if (i // 10) % 2 else 0)) for i in range(n)]


def save_png(result: SimResult, path: str, title: str | None = None, time_unit: str = "time units") -> str:
    """Write a timeline chart of ``result`` to ``path`` (PNG, matplotlib Agg) and return the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    s = result.schedule
    D, T = s.num_devices, result.makespan
    colours = _colours(max(s.num_microbatches, 1))
    width = min(max(8.0, 0.09 * len(result.timeline.records[0]) + 4), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * D + 1.6), dpi=110)
    ax.set_xlim(0, T)
    ax.set_ylim(D - 0.5, -0.5)
    for d in range(D):
        ax.add_patch(plt.Rectangle((0, d - 0.4), T, 0.8, color="#e6e6e6", zorder=0, lw=0))
    points_per_unit = width * 72 * 0.85 / T   # the axes span about 85% of the figure width
    for d, recs in enumerate(result.timeline.records):
        for r in recs:
            a, dur = r.action, r.end - r.start
            if is_compute(a):
                base = to_rgb(colours[a.mb % len(colours)])
                if isinstance(a, Forward):
                    face = tuple(0.35 + 0.65 * c for c in base)
                elif isinstance(a, BackwardWeight):
                    face = tuple(0.55 * c for c in base)
                else:
                    face = tuple(0.8 * c for c in base)
                hatch = "///" if a.replica == 1 else (".." if isinstance(a, BackwardWeight) else None)
                ax.add_patch(plt.Rectangle((r.start, d - 0.4), dur, 0.8, facecolor=face, edgecolor="black",
                                           lw=0.4, hatch=hatch, zorder=2))
                text = label(s, a)
                size = min(8.0, dur * points_per_unit / (0.62 * len(text)))
                if size >= 4.0:
                    ax.text(r.start + dur / 2, d, text, ha="center", va="center", zorder=3, fontsize=size)
            elif isinstance(a, Step):
                ax.add_patch(plt.Rectangle((r.start, d - 0.45), max(dur, T / 600), 0.9, color="black", zorder=4))
            elif isinstance(a, Sync):
                ax.add_patch(plt.Rectangle((r.start, d + 0.3), max(dur, T / 600), 0.12, color="#7b2cbf",
                                           zorder=4))
    ax.set_yticks(range(D))
    ax.set_yticklabels([f"device {d}" for d in range(D)])
    ax.set_xlabel(time_unit)
    head = title or f"{s.name}  D={D}  N={s.num_microbatches}"
    ax.set_title(f"{head}   makespan {T:g}   bubble ratio {result.bubble_ratio:.3f}", fontsize=10)
    handles = [Patch(facecolor="#9ecae1", edgecolor="black", label="forward (light)"),
               Patch(facecolor="#2b6a99", edgecolor="black", label="backward (dark)"),
               Patch(facecolor="#e6e6e6", label="idle"),
               Patch(facecolor="black", label="optimizer step")]
    if s.split_backward:
        handles[1] = Patch(facecolor="#2b6a99", edgecolor="black", label="backward / input gradient I (dark)")
        handles.insert(2, Patch(facecolor="#1c4766", edgecolor="black", hatch="..", label="weight gradient W"))
    if s.num_replicas > 1:
        handles.insert(2, Patch(facecolor="white", edgecolor="black", hatch="///", label="up replica"))
    if any(isinstance(a, Sync) for acts in s.actions for a in acts):
        handles.append(Patch(facecolor="#7b2cbf", label="gradient sync"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.55 * D + 1.6) - 0.12),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def chrome_trace(result: SimResult, us_per_unit: float = 1000.0) -> dict:
    """Chrome/Perfetto trace events of ``result``; one time unit becomes ``us_per_unit`` microseconds."""
    s = result.schedule
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{s.name} D={s.num_devices} "
                                                                           f"N={s.num_microbatches}"}}]
    for d in range(s.num_devices):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d, "args": {"sort_index": d}})
    for d, recs in enumerate(result.timeline.records):
        for r in recs:
            a = r.action
            args: dict = {"action": s.format(a), "index": r.index}
            if is_compute(a):
                args.update(microbatch=a.mb, stage=a.stage, replica=a.replica)
                cat = {Forward: "forward", Backward: "backward", BackwardInput: "backward_input",
                       BackwardWeight: "backward_weight"}[type(a)]
            elif isinstance(a, Step):
                args.update(stage=a.stage, replica=a.replica)
                cat = "step"
            else:
                args.update(stages=list(a.stages), devices=list(a.devices))
                cat = "sync"
            events.append({"name": label(s, a), "cat": cat, "ph": "X", "pid": 0, "tid": d,
                           "ts": r.start * us_per_unit, "dur": (r.end - r.start) * us_per_unit, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"makespan": result.makespan, "bubble_ratio": result.bubble_ratio}}


def save_trace(result: SimResult, path: str, us_per_unit: float = 1000.0) -> str:
    with open(path, "w") as f:
        json.dump(chrome_trace(result, us_per_unit), f)
    return path


def save_comparison_png(rows_by_ratio: dict, path: str, title: str = "") -> str:
    """Bar charts of bubble ratio (steady: asynchronous schedules never flush), peak activations, weight versions
    and p2p traffic per schedule, one bar per backward/forward ratio (``rows_by_ratio``: ratio -> rows from
    ``sim.compare``; schedules excluded by their rules show no bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = list(rows_by_ratio)
    names = [r["schedule"] for r in rows_by_ratio[ratios[0]]]
    metrics = [("steady_bubble", "bubble ratio (per N micro-batches, long run)"),
               ("peak_activations", "peak activations (stage units)"),
               ("weight_versions", "weight versions (D-ths of model)"),
               ("p2p_bytes_per_device", "p2p traffic per device")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.4 * len(metrics), 4.0), dpi=110)
    width = 0.8 / len(ratios)
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    for ax, (key, name) in zip(axes, metrics):
        for j, ratio in enumerate(ratios):
            rows = {r["schedule"]: r for r in rows_by_ratio[ratio]}
            values = [rows[n].get(key, rows[n].get("bubble_ratio", 0.0)) if "error" not in rows[n] else 0.0
                      for n in names]
            xs = [i + (j - (len(ratios) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, values, width, color=colours[j % len(colours)], label=f"B/F = {ratio:g}")
            if key == "steady_bubble":
                for x, v in zip(xs, values):
                    ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.margins(y=0.15)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(ratios))
    fig.suptitle(title or "schedules compared", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_training(ax, history: list[dict], unit: str = "nats/byte", title: str = "") -> None:
    """Draw a training run's history (``pipeoptim train``'s history.json rows) on ``ax``: the training loss
    of every window and, as points joined by a line, the validation loss where it was measured."""
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1, label="training")
    val = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, lw=1.2, label="validation (held-out batch)")
    ax.set_xlabel("schedule window (train_step)")
    ax.set_ylabel(f"loss ({unit})")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
