"""The regime map: which method reaches gpt16's validation loss 2.5 first, per link, depth and device evenness.

Why this script exists: issue 43 asks when an asynchronous pipeline is the right choice. The time-to-target study
(``bench_time_to_target.py``, workload ``gpt16-async``, RESULTS.md 6.6) measured each method's updates to 2.5 (3
seeds at its best lr) but priced communication as free between identical devices. This script keeps those
measured updates and re-prices the time per update with ``network_projection`` under the named links of
``pipeoptim.links`` (nvlink, infiniband, ethernet-10g, internet, and "free", the study's model), with and without
uneven devices (one device 1.5x slower, per-operation jitter of +-20 %, seeded), at D = 4, 8, 16, 32.

It trains nothing. What it cannot know it says: D = 32 was never trained (gpt16 has 16 blocks, so it cannot even
be cut into 32 stages) and is written as "not measured", as is every deeper in-flight variant of an asynchronous
schedule (its time per update is projected, but the extra staleness's cost in updates was never measured).
Methods are the Muon family of the study (the fastest of each kind: synchronous Muon timed as GPipe, 1F1B,
interleaved, BitPipe and ZBV; PipeDream-2BW, PipeOptim and stashing on async 1F1B with Muon).

    python benchmarks/bench_regime_map.py              # regime_map.csv, regime_latency_sweep.csv, the pictures
    python benchmarks/bench_regime_map.py --quick      # D = 4 only, free and internet: the test's form
    python benchmarks/bench_regime_map.py --report     # tables and pictures from the CSVs (no simulation)

Writes into --out (default benchmarks/results): regime_map.csv (one row per profile, devices, uneven, method),
regime_latency_sweep.csv (D = 16, even devices, latency swept at two bandwidths), regime_map.png (heat map:
best asynchronous over best synchronous time, first method named) and regime_latency_sweep.png; prints the
winners and the crossing latencies.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_time_to_target as btt  # noqa: E402
import network_projection as npj  # noqa: E402

from pipeoptim.links import PROFILES, Link  # noqa: E402

WORKLOAD = "gpt16-async"
TARGET = 2.5
DEPTHS = (4, 8, 16, 32)
PROFILE_ORDER = ("free", "nvlink", "infiniband", "ethernet-10g", "internet")
# method -> (convergence run giving its updates, schedule giving its time, in-flight multiple)
METHODS = {
    "gpipe-muon": ("sync-muon", "gpipe", 1),
    "1f1b-muon": ("sync-muon", "1f1b", 1),
    "interleaved-muon": ("sync-muon", "interleaved", 1),
    "bitpipe-muon": ("sync-muon", "bitpipe", 1),
    "zbv-muon": ("sync-muon", "zbv", 1),
    "2bw-muon": ("2bw-muon", "2bw", 1),
    "pipeoptim-muon": ("pipeoptim-muon", "async-1f1b", 1),
    "stash-muon": ("stash-muon", "async-1f1b", 1),
    "2bw-muon-inflight4": ("2bw-muon", "2bw", 4),
    "pipeoptim-muon-inflight2": ("pipeoptim-muon", "async-1f1b", 2),
}
# the D = 16 map from runs all trained on one machine with the same Muon (``--one-machine``): the update-gap
# candidates (gpt16-lookahead), PipeOptim + Muon at 1x and 2x the micro-batches in flight (gpt16-inflight; 2x from
# gpt16-inflight-long, the budget in which it reaches the target) and 2BW +
# Muon at 4x (gpt16-inflight-2bw), each beside its own synchronous or 1x baseline;
# method -> (workload, run, schedule, in-flight multiple)
ONE_MACHINE = {
    **{f"{s}-muon": ("gpt16-lookahead", "sync-muon", s, 1) for s in ("gpipe", "1f1b", "interleaved", "bitpipe", "zbv")},
    "2bw-muon": ("gpt16-lookahead", "2bw-muon", "2bw", 1),
    "pipeoptim-2bw-muon": ("gpt16-lookahead", "pipeoptim-2bw-muon", "2bw", 1),
    "lookahead-2bw-muon": ("gpt16-lookahead", "lookahead-2bw-muon", "2bw", 1),
    "pipeoptim-muon": ("gpt16-inflight", "pipeoptim-muon", "async-1f1b", 1),
    "pipeoptim-muon-inflight2": ("gpt16-inflight-long", "pipeoptim-muon-inflight2", "async-1f1b", 2),
    "2bw-muon-inflight4": ("gpt16-inflight-2bw", "stash-2bw-muon-inflight4", "2bw", 4),
}
SWEEP_LATENCIES = (1e-6, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
SWEEP_BANDWIDTHS = {"10Gbit/s": 1.25e9, "100Mbit/s": 12.5e6}
COLUMNS = ["profile", "devices", "uneven", "method", "time_to_target_s", "updates_mean", "seeds_reached", "seeds",
           "peak_activation_bytes", "time_per_update_s", "schedule", "microbatches", "microbatch_size", "in_flight",
           "lr", "link", "note"]


def is_async(method: str) -> bool:
    return (METHODS.get(method) or ONE_MACHINE[method])[-2] in ("async-1f1b", "2bw")


def trained_in_flight(run: str) -> int:
    """The in-flight multiple a convergence run trained with (a candidate's schedule_options; else 1)."""
    return btt.bc.CANDIDATES.get(run, {}).get("schedule_options", {}).get("in_flight", 1)


def resolve(spec: tuple, wl, rows: list[dict], runs_of: dict | None) -> tuple:
    """(workload, runs, run, schedule, in_flight) of a METHODS or ONE_MACHINE entry."""
    if len(spec) == 3:
        return (wl, rows) + tuple(spec)
    name, run, schedule, in_flight = spec
    return btt.WORKLOADS[name], runs_of[name], run, schedule, in_flight


def measured_updates(wl, rows: list[dict], run: str, devices: int) -> dict:
    """Updates to the target per seed at the run's best lr (None: not reached), and the lr; {} if never run."""
    rd = 0 if run in btt.SYNC_RUNS else devices
    if not any(r["method"] == run and r["devices"] == rd for r in rows):
        return {}
    lr = btt.best_lr(wl, rows, run, rd)
    at = [r for r in rows if r["method"] == run and r["devices"] == rd and r["lr"] == lr and r["seed"] in wl.seeds]
    per_seed = {r["seed"]: None if r["diverged"] else btt.updates_to(r["curve"], TARGET, wl) for r in at}
    return {"lr": lr, "per_seed": per_seed}


def settings(profiles) -> list[npj.Setting]:
    out = []
    for name in profiles:
        link = None if name == "free" else PROFILES[name]
        out += [npj.Setting(name, link, uneven=False), npj.Setting(name, link, uneven=True)]
    return out


def regime_rows(wl, rows, costs, memory, depths, profiles, methods=METHODS, runs_of: dict | None = None) -> list[dict]:
    """One row per (setting, depth, method). ``methods``: METHODS (updates from ``wl``'s ``rows``) or ONE_MACHINE
    (each from its own workload's runs in ``runs_of``, by workload name)."""
    out = []
    own_wl, own_rows = wl, rows
    for setting in settings(profiles):
        for D in depths:
            for method, spec in methods.items():
                wl, rows, run, schedule, in_flight = resolve(spec, own_wl, own_rows, runs_of)
                row = {"profile": setting.profile, "devices": D, "uneven": setting.uneven, "method": method,
                       "schedule": schedule, "in_flight": in_flight,
                       "link": "" if setting.link is None else setting.link.describe()}
                ups = measured_updates(wl, rows, run, D) if D in wl.depths else {}
                if D not in wl.depths:
                    out.append({**row, "time_to_target_s": "not measured", "note": f"D = {D} never trained (gpt16 "
                                f"has 16 blocks; no costs or updates at this depth)"})
                    continue
                timing = npj.project(costs, schedule, D, btt.POLICY_OF_RUN[run], setting, memory, in_flight)
                row.update(time_per_update_s=timing["time_s"], microbatches=timing["microbatches"],
                           microbatch_size=timing["microbatch_size"],
                           peak_activation_bytes=int(timing["peak_activation_bytes"]))
                if not ups:
                    out.append({**row, "time_to_target_s": "not measured", "note": f"{run} not trained at D = {D}"})
                    continue
                reached = [u for u in ups["per_seed"].values() if u is not None]
                row.update(lr=ups["lr"], seeds=len(ups["per_seed"]), seeds_reached=len(reached),
                           updates_mean=round(statistics.mean(reached), 1) if reached else "")
                if in_flight != trained_in_flight(run):
                    row.update(time_to_target_s="not measured", note=f"{in_flight}x the schedule's micro-batches in "
                               "flight: more staleness, whose updates to 2.5 were never measured (the updates "
                               f"shown are at {trained_in_flight(run)}x)")
                elif len(reached) < row["seeds"] or row["seeds"] < 3:
                    row.update(time_to_target_s="not reached",
                               note=f"reached 2.5 in {len(reached)} of {row['seeds']} seeds")
                else:
                    row["time_to_target_s"] = round(statistics.mean(reached) * timing["time_s"], 4)
                out.append(row)
            print(f"  {setting.profile:12s} uneven={setting.uneven!s:5s} D={D}: done", flush=True)
    return out


def winners(rows: list[dict]) -> list[dict]:
    """Per (profile, devices, uneven): the first method, the best synchronous and asynchronous ones, the ratio."""
    out = []
    keys = sorted({(r["profile"], r["devices"], r["uneven"]) for r in rows},
                  key=lambda k: (PROFILE_ORDER.index(k[0]), k[2], k[1]))
    for key in keys:
        timed = [r for r in rows if (r["profile"], r["devices"], r["uneven"]) == key
                 and isinstance(r["time_to_target_s"], float)]
        if not timed:
            out.append({"profile": key[0], "devices": key[1], "uneven": key[2], "first": "not measured"})
            continue
        sync = min((r for r in timed if not is_async(r["method"])), key=lambda r: r["time_to_target_s"])
        asyn = min((r for r in timed if is_async(r["method"])), key=lambda r: r["time_to_target_s"])
        first = min(timed, key=lambda r: r["time_to_target_s"])
        gpipe = next(r for r in timed if r["method"] == "gpipe-muon")
        out.append({"profile": key[0], "devices": key[1], "uneven": key[2], "first": first["method"],
                    "best_sync": sync["method"], "best_sync_s": sync["time_to_target_s"],
                    "best_async": asyn["method"], "best_async_s": asyn["time_to_target_s"],
                    "sync_over_async": sync["time_to_target_s"] / asyn["time_to_target_s"],
                    "async_memory_over_gpipe": asyn["peak_activation_bytes"] / gpipe["peak_activation_bytes"]})
    return out


def latency_sweep(wl, rows, costs, memory, devices: int = 16, methods=METHODS, runs_of: dict | None = None
                  ) -> list[dict]:
    """Time to 2.5 of every measured method at one depth, even devices, latency swept at two bandwidths."""
    out = []
    own_wl, own_rows = wl, rows
    for bw_name, bw in SWEEP_BANDWIDTHS.items():
        for latency in SWEEP_LATENCIES:
            setting = npj.Setting("sweep", Link(latency, bw))
            for method, spec in methods.items():
                wl, rows, run, schedule, in_flight = resolve(spec, own_wl, own_rows, runs_of)
                if in_flight != trained_in_flight(run):
                    continue
                ups = measured_updates(wl, rows, run, devices)
                reached = [u for u in ups.get("per_seed", {}).values() if u is not None]
                if len(reached) < 3 or len(reached) < len(ups["per_seed"]):
                    continue
                timing = npj.project(costs, schedule, devices, btt.POLICY_OF_RUN[run], setting, memory, in_flight)
                out.append({"bandwidth": bw_name, "latency_s": latency, "devices": devices, "method": method,
                            "asynchronous": is_async(method), "time_per_update_s": timing["time_s"],
                            "time_to_target_s": statistics.mean(reached) * timing["time_s"],
                            "peak_activation_bytes": int(timing["peak_activation_bytes"])})
            print(f"  sweep {bw_name} latency {latency:g} s: done", flush=True)
    return out


def crossings(sweep: list[dict]) -> dict:
    """Per bandwidth: the latency (log-interpolated between swept points) above which the best asynchronous
    method reaches 2.5 sooner than the best synchronous one at every larger swept latency (0.0: at every swept
    latency; None: not at the largest), and the swept latencies where asynchronous is first."""
    out = {}
    for bw in SWEEP_BANDWIDTHS:
        ratio = []
        for latency in SWEEP_LATENCIES:
            at = [r for r in sweep if r["bandwidth"] == bw and r["latency_s"] == latency]
            s = min(r["time_to_target_s"] for r in at if not r["asynchronous"])
            a = min(r["time_to_target_s"] for r in at if r["asynchronous"])
            ratio.append((latency, math.log(s / a)))    # > 0: asynchronous first
        first = [latency for latency, r in ratio if r > 0]
        above = None
        if ratio and ratio[-1][1] > 0:
            above = 0.0
            for (l0, r0), (l1, r1) in reversed(list(zip(ratio, ratio[1:]))):
                if r0 <= 0:
                    f = -r0 / (r1 - r0)
                    above = math.exp(math.log(l0) + f * (math.log(l1) - math.log(l0)))
                    break
        out[bw] = {"above": above, "async_first_at": first}
    return out


def write_csv(path: str, rows: list[dict], columns: list[str] | None = None) -> None:
    columns = columns or list(rows[0])
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})


def plot(win: list[dict], sweep: list[dict], out: str, suffix: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lines = [(p, u) for p in PROFILE_ORDER for u in (False, True) if any(w["profile"] == p for w in win)]
    depths = sorted({w["devices"] for w in win})
    grid = np.full((len(lines), len(depths)), np.nan)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.9 * len(depths) + 3), 0.55 * len(lines) + 1.6))
    for i, (p, u) in enumerate(lines):
        for j, D in enumerate(depths):
            w = next(w for w in win if (w["profile"], w["uneven"], w["devices"]) == (p, u, D))
            if w["first"] == "not measured":
                ax.text(j, i, "not measured", ha="center", va="center", fontsize=7, color="0.4")
                continue
            grid[i, j] = math.log2(w["sync_over_async"])
            ax.text(j, i, f"{w['first']}\nsync/async {w['sync_over_async']:.2f}x\n"
                    f"async memory {w['async_memory_over_gpipe']:.1f}x GPipe's", ha="center", va="center", fontsize=6)
    lim = max(1.0, float(np.nanmax(np.abs(grid)))) if np.isfinite(grid).any() else 1.0
    im = ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(depths)), [f"D = {d}" for d in depths])
    ax.set_yticks(range(len(lines)), [f"{p}{' + uneven' if u else ''}" for p, u in lines])
    fig.colorbar(im, ax=ax, label="log2(best sync time / best async time): blue = async first")
    ax.set_title("gpt16, time to validation loss 2.5 (measured updates x projected time per update)"
                 + ("\nall runs on one machine" if suffix else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"regime_map{suffix}.png"), dpi=110)
    plt.close(fig)
    if not sweep:
        return
    fig, axes = plt.subplots(1, len(SWEEP_BANDWIDTHS), figsize=(11, 4), sharey=True)
    for ax, bw in zip(np.atleast_1d(axes), SWEEP_BANDWIDTHS):
        for method in sorted({r["method"] for r in sweep}):
            pts = [r for r in sweep if r["bandwidth"] == bw and r["method"] == method]
            ax.plot([r["latency_s"] for r in pts], [r["time_to_target_s"] for r in pts], marker="o", ms=3,
                    ls="--" if pts[0]["asynchronous"] else "-", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("per-hop latency (s)")
        ax.set_title(f"D = 16, even devices, {bw}", fontsize=9)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("projected seconds to loss 2.5")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"regime_latency_sweep{suffix}.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=btt.RESULTS, help="where to write (default benchmarks/results)")
    p.add_argument("--results", default=btt.RESULTS, help="where the study's CSVs are (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="D = 4, free and internet only, no sweep (seconds)")
    p.add_argument("--report", action="store_true",
                   help="tables and pictures from the CSVs already in --out (no simulation)")
    p.add_argument("--one-machine", action="store_true",
                   help="the D = 16 map from the runs of gpt16-lookahead and gpt16-inflight (all trained on one "
                        "machine with the same Muon): the update-gap candidates and 2x the micro-batches in flight "
                        "beside their own baselines; files end in _one_machine")
    args = p.parse_args(argv)
    suffix = "_one_machine" if args.one_machine else ""
    if args.report:
        rows, sweep = read_back(args.out, suffix)
        win = winners(rows)
        plot(win, sweep, args.out, suffix)
        print_report(win, sweep)
        return 0
    wl = btt.WORKLOADS[WORKLOAD]
    sources = sorted({spec[0] for spec in ONE_MACHINE.values()}) if args.one_machine else [wl.name]
    runs_of = {name: btt.read_runs(os.path.join(args.results, f"time_to_target_{name}_runs.csv")) for name in sources}
    for name, runs in runs_of.items():
        if not runs:
            raise SystemExit(f"no runs of {name} in {args.results}; run bench_time_to_target.py --workload {name}")
    costs = btt.load_or_measure_costs(wl, args.results, measure=False)   # every source's costs are gpt16-async's
    memory = npj.measure_layer_memory(btt.GPT16)
    if args.one_machine:
        depths, profiles, methods = (16,), (("free", "internet") if args.quick else PROFILE_ORDER), ONE_MACHINE
    else:
        (depths, profiles), methods = ((4,), ("free", "internet")) if args.quick else (DEPTHS, PROFILE_ORDER), METHODS
    os.makedirs(args.out, exist_ok=True)
    runs = runs_of.get(wl.name, [])
    rows = regime_rows(wl, runs, costs, memory, depths, profiles, methods, runs_of)
    write_csv(os.path.join(args.out, f"regime_map{suffix}.csv"), rows, COLUMNS)
    win = winners(rows)
    write_csv(os.path.join(args.out, f"regime_winners{suffix}.csv"), win,
              ["profile", "devices", "uneven", "first", "best_sync", "best_sync_s", "best_async", "best_async_s",
               "sync_over_async", "async_memory_over_gpipe"])
    sweep = [] if args.quick else latency_sweep(wl, runs, costs, memory, methods=methods, runs_of=runs_of)
    if sweep:
        write_csv(os.path.join(args.out, f"regime_latency_sweep{suffix}.csv"), sweep)
    plot(win, sweep, args.out, suffix)
    print_report(win, sweep)
    return 0


def read_back(out: str, suffix: str = "") -> tuple[list[dict], list[dict]]:
    """regime_map.csv and regime_latency_sweep.csv (names + ``suffix``) as ``regime_rows`` and ``latency_sweep``
    return them."""
    def number(v: str):
        try:
            return float(v)
        except ValueError:
            return v
    with open(os.path.join(out, f"regime_map{suffix}.csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["devices"], r["uneven"] = int(r["devices"]), r["uneven"] == "True"
        r["time_to_target_s"] = number(r["time_to_target_s"])
        if r["peak_activation_bytes"]:
            r["peak_activation_bytes"] = int(r["peak_activation_bytes"])
    sweep = []
    path = os.path.join(out, f"regime_latency_sweep{suffix}.csv")
    if os.path.exists(path):
        with open(path, newline="") as fh:
            sweep = list(csv.DictReader(fh))
        for r in sweep:
            r["latency_s"], r["time_to_target_s"] = float(r["latency_s"]), float(r["time_to_target_s"])
            r["asynchronous"] = r["asynchronous"] == "True"
    return rows, sweep


def print_report(win: list[dict], sweep: list[dict]) -> None:
    print("\n| link | uneven | D | first | best sync (s) | best async (s) | sync/async | async memory / GPipe's |")
    print("|---|---|---|---|---|---|---|---|")
    for w in win:
        if w["first"] == "not measured":
            print(f"| {w['profile']} | {w['uneven']} | {w['devices']} | not measured | | | | |")
            continue
        print(f"| {w['profile']} | {w['uneven']} | {w['devices']} | {w['first']} | {w['best_sync']} "
              f"{w['best_sync_s']:.2f} | {w['best_async']} {w['best_async_s']:.2f} | {w['sync_over_async']:.2f}x | "
              f"{w['async_memory_over_gpipe']:.1f}x |")
    for bw, c in crossings(sweep).items() if sweep else ():
        where = ("not at the largest swept latency" if c["above"] is None else "at every swept latency"
                 if c["above"] == 0.0 else f"at every latency above {c['above'] * 1e3:.3g} ms")
        print(f"D = 16, even devices, {bw}: asynchronous first {where}; first at "
              f"{', '.join(f'{x * 1e3:g} ms' for x in c['async_first_at']) or 'no swept latency'}")


if __name__ == "__main__":
    sys.exit(main())
