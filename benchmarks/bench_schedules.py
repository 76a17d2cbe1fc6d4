"""How do the schedules compare as the pipeline deepens? Bubble ratio, makespan, memory and traffic of every
schedule (BitPipe's three orders, Chimera's two concatenations, the zero-bubble ones) at D = 4, 8, 16, 32 and
several N, with backward = forward and backward = 2 x forward, free communication. Simulated (pipeoptim.sim), so
it runs on any machine. Split backwards (zb-h1, zbv, dualpipev, async-zb) cost I = W = half the backward unless
``--weight-share`` says otherwise.

Writes benchmarks/results/schedules.csv, schedules_bubble.png (bubble vs N, one panel per D and ratio) and
schedules_bitpipe.png (BitPipe's reference, greedy and paced orders against interleaved 1F1B), prints the
BitPipe concatenation table (the README's) and the command that produced them. ``--tag T`` writes
schedules_T.csv and schedules_T_winners.md instead (no plots): per D, N, backward ratio and link, every
schedule's bubble (asynchronous ones: per N micro-batches of a long run) and which synchronous schedule wins;
``--p2p-latency`` adds a link on which each hop takes that many forward units (one D-th of the model's
forward = 1), so finer-cut schedules pay more per unit of work.

    python benchmarks/bench_schedules.py                 # the full sweep (19 minutes on the loaded 2-core VM)
    python benchmarks/bench_schedules.py --devices 4 8 --multiples 1 2 --out /tmp/r
    python benchmarks/bench_schedules.py --devices 8 16 32 --multiples 4 --p2p-latency 0 0.1 --tag zero_bubble \
        --schedules 1f1b interleaved chimera bitpipe zb-h1 zbv dualpipev async-1f1b async-zb
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pipeoptim.schedules import ScheduleConfigError, get_schedule  # noqa: E402
from pipeoptim.sim import Costs, compare, simulate  # noqa: E402

FIELDS = ["devices", "microbatches", "bwd_ratio", "weight_share", "p2p_latency", "schedule", "bubble_ratio",
          "steady_bubble", "makespan", "peak_activations", "weight_copies", "weight_versions", "p2p_bytes_per_device",
          "allreduce_bytes_total", "error"]
ASYNC = ("async-1f1b", "async-zb", "2bw")


def sweep(devices: list[int], multiples: list[int], ratios: list[float], weight_share: float = 0.5,
          latencies: list[float] = (0.0,), names: list[str] | None = None) -> list[dict]:
    rows = []
    for D in devices:
        for k in multiples:
            for ratio in ratios:
                for lat in latencies:
                    t0 = time.perf_counter()
                    costs = Costs(forward=1.0, backward=ratio, backward_input=ratio * (1 - weight_share),
                                  backward_weight=ratio * weight_share, p2p_latency=lat)
                    for r in compare(D, k * D, costs, names=names):
                        extra = {"bwd_ratio": ratio, "weight_share": weight_share, "p2p_latency": lat}
                        rows.append({**r, **extra})
                        if r["schedule"] == "bitpipe[reference]":
                            rows.append({**bitpipe_greedy(D, k * D, costs), **extra})
                    print(f"  D={D:2d} N={k * D:3d} B/F={ratio:g} latency={lat:g}: {time.perf_counter() - t0:.1f}s",
                          flush=True)
    return rows


def measured_weight_share(repeats: int = 9) -> float:
    """W / (I + W) of one GPT block (d_model 256, seq 128, micro-batch 4; bench_throughput's block), one thread,
    timed with the runtime's split passes."""
    import torch

    from pipeoptim.models import GPTConfig
    from pipeoptim.models.gpt import Block
    from pipeoptim.sim import profile_stages
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=128, d_model=256, n_heads=4, n_layers=1))
    r = profile_stages([block], torch.randn(4, 128, 256), repeats=repeats, warmup=2, split=True)
    f, b, i, w = (r[k][0] * 1e3 for k in ("forward", "backward", "backward_input", "backward_weight"))
    print(f"measured one GPT block (ms, medians of {repeats}): forward {f:.1f}, backward {b:.1f}, input pass {i:.1f}, "
          f"weight pass {w:.1f} (I + W = {(i + w) / b:.2f} x backward; W share {w / (i + w):.3f})", flush=True)
    return w / (i + w)


def winners(rows: list[dict], skip: tuple[str, ...] = ()) -> str:
    """Markdown: per (D, N, B/F, latency) each schedule's bubble (steady-state bubble for the asynchronous ones)
    and the synchronous schedule with the shortest iteration (the lowest bubble: every schedule does the same
    work per micro-batch)."""
    names = [n for n in dict.fromkeys(r["schedule"] for r in rows) if n not in skip]
    head = ("| D | N | B/F | link | " + " | ".join(names) + " | fastest synchronous (vs 1f1b) |\n|" +
            "---|" * (len(names) + 5))
    lines = [head]
    keys = list(dict.fromkeys((r["devices"], r["microbatches"], r["bwd_ratio"], r["p2p_latency"]) for r in rows))
    for key in keys:
        group = {r["schedule"]: r for r in rows
                 if (r["devices"], r["microbatches"], r["bwd_ratio"], r["p2p_latency"]) == key}
        cells = []
        for n in names:
            r = group.get(n)
            if r is None or r.get("error"):
                cells.append("–")
            else:
                value = r["steady_bubble"] if n in ASYNC else r["bubble_ratio"]
                cells.append(f"{max(value, 0.0):.3f}")   # a steady state can come out as -1e-16
        sync = [r for n, r in group.items() if n not in ASYNC and n not in skip and not r.get("error")]
        best = min(sync, key=lambda r: r["makespan"])
        speed = group["1f1b"]["makespan"] / best["makespan"] if "1f1b" in group else float("nan")
        link = "free" if key[3] == 0 else f"{key[3]:g} F/hop"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {link} | " + " | ".join(cells) +
                     f" | **{best['schedule']}** ({speed:.2f}x) |")
    return "\n".join(lines)


def bitpipe_greedy(D: int, N: int, costs: Costs) -> dict:
    """The row compare() would give BitPipe's greedy order (it gives the reference and paced ones)."""
    try:
        schedule = get_schedule("bitpipe", D, N, concat="greedy")
    except ScheduleConfigError as e:
        return {"schedule": "bitpipe[greedy]", "devices": D, "microbatches": N, "error": str(e)}
    row = simulate(schedule, costs).summary()
    return {**row, "steady_bubble": row["bubble_ratio"]}


def concat_table(rows: list[dict], ratio: float) -> str:
    """Markdown: BitPipe's bubble per order next to interleaved 1F1B (v = 2), and peak activations (largest
    device peak, and the end devices', in D-ths of the model), at backward = ratio x forward."""
    names = ["bitpipe[reference]", "bitpipe[greedy]", "bitpipe[paced]", "interleaved"]
    out = ["| D | N | reference | greedy | paced | interleaved, v=2 | peak activations: reference / greedy / paced "
           "(end devices) |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["devices"], r["microbatches"]) for r in rows if r["bwd_ratio"] == ratio and
                   r["schedule"] == "bitpipe[reference]" and not r.get("error")})
    for D, N in keys:
        by = {r["schedule"]: r for r in rows if (r["devices"], r["microbatches"]) == (D, N)
              and r["bwd_ratio"] == ratio}
        peaks = []
        for concat in ("reference", "greedy", "paced"):   # per device (the rows keep only the largest)
            p = simulate(get_schedule("bitpipe", D, N, concat=concat, bwd_ratio=ratio),
                         Costs(forward=1.0, backward=ratio)).peak_activations
            peaks.append(f"{max(p):g} ({p[0]:g})")
        out.append(f"| {D} | {N} | " + " | ".join(f"{by[n]['bubble_ratio']:.4f}" for n in names) + " | "
                   + " / ".join(peaks) + " |")
    return "\n".join(out)


def plot_bubbles(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = sorted({r["devices"] for r in rows})
    ratios = sorted({r["bwd_ratio"] for r in rows})
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = plt.subplots(len(ratios), len(devices), figsize=(4.2 * len(devices), 3.6 * len(ratios)),
                             dpi=110, squeeze=False, sharey=True)
    styles = {n: (c, m) for n, c, m in zip(names, itertools.cycle(plt.get_cmap("tab10").colors),
                                             itertools.cycle("os^vD<>ph*"))}
    for i, ratio in enumerate(ratios):
        for j, D in enumerate(devices):
            ax = axes[i][j]
            for name in names:
                pts = sorted((r["microbatches"], r["steady_bubble"]) for r in rows
                             if r["schedule"] == name and r["devices"] == D and r["bwd_ratio"] == ratio
                             and not r.get("error"))
                if pts:
                    colour, marker = styles[name]
                    ax.plot(*zip(*pts), marker=marker, color=colour, label=name,
                            ls="--" if name in ASYNC else (":" if name in ("zb-h1", "zbv", "dualpipev") else "-"))
            ax.set_xscale("log", base=2)
            ax.set_title(f"D={D}, backward = {ratio:g} x forward", fontsize=9)
            ax.set_xlabel("micro-batches N")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("bubble ratio (per N micro-batches)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("bubble = idle / (D x time); async schedules (dashed): steady state, they never flush",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bitpipe(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = sorted({r["devices"] for r in rows})
    ratio = max(r["bwd_ratio"] for r in rows)
    fig, axes = plt.subplots(1, len(devices), figsize=(4.2 * len(devices), 3.6), dpi=110, squeeze=False)
    for ax, D in zip(axes[0], devices):
        for name, colour in (("interleaved", "#55a868"), ("bitpipe[reference]", "#c44e52"),
                             ("bitpipe[greedy]", "#dd8452"), ("bitpipe[paced]", "#4c72b0"), ("1f1b", "#999999")):
            pts = sorted((r["microbatches"], r["bubble_ratio"]) for r in rows if r["schedule"] == name
                         and r["devices"] == D and r["bwd_ratio"] == ratio and not r.get("error"))
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colour, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={D}, backward = {ratio:g} x forward", fontsize=9)
        ax.set_xlabel("micro-batches N")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bubble ratio")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("BitPipe: the published order (reference), greedy and paced concatenation of groups of D "
                 "micro-batches", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="N = multiple x D (default 1 2 4 8)")
    p.add_argument("--bwd-ratio", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--weight-share", default="0.5",
                   help="share of a split backward that is the weight gradient W (default 0.5: I = W), or "
                        "'measured': time the input and weight passes of one GPT block here and use their ratio")
    p.add_argument("--p2p-latency", type=float, nargs="+", default=[0.0],
                   help="time of one hop in forward units of one D-th of the model (default 0: free)")
    p.add_argument("--schedules", nargs="+", default=None, help="subset of schedules (default: all)")
    p.add_argument("--tag", default=None, help="write schedules_TAG.csv and schedules_TAG_winners.md, no plots")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    command = "python benchmarks/bench_schedules.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(f"command: {command.strip()}")
    os.makedirs(args.out, exist_ok=True)
    share = measured_weight_share() if args.weight_share == "measured" else float(args.weight_share)
    rows = sweep(args.devices, args.multiples, args.bwd_ratio, share, args.p2p_latency, args.schedules)
    if args.tag:
        csv_path = os.path.join(args.out, f"schedules_{args.tag}.csv")
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        # one column per BitPipe/Chimera order would crowd the table: it shows the paced ones (the fastest)
        table = winners(rows, skip=("bitpipe[reference]", "bitpipe[greedy]", "chimera[reference]"))
        md_path = os.path.join(args.out, f"schedules_{args.tag}_winners.md")
        with open(md_path, "w") as f:
            f.write(f"<!-- {command.strip()} -->\n{table}\n")
        print(table)
        print(f"wrote {csv_path} and {md_path}")
        print(f"command: {command.strip()}")
        return 0
    csv_path = os.path.join(args.out, "schedules.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot_bubbles(rows, os.path.join(args.out, "schedules_bubble.png"))
    plot_bitpipe(rows, os.path.join(args.out, "schedules_bitpipe.png"))
    ratio = max(args.bwd_ratio)
    print(f"\nBitPipe's orders, backward = {ratio:g} x forward, free communication (bubble ratio):\n")
    print(concat_table(rows, ratio))
    print(f"\nwrote {csv_path}, schedules_bubble.png, schedules_bitpipe.png in {args.out}")
    print(f"command: {command.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
