"""Equal time instead of equal updates: does an asynchronous method reach the target when it is given the
projected time the study's fastest method needed?

Why this exists: bench_time_to_target.py gives every method the same number of updates. An asynchronous update is
several times cheaper than a synchronous one (no flush), so within that budget an asynchronous run gets a fraction
of the projected time a synchronous run gets, and "not reached" may only mean "stopped early". This probe reruns
the named methods at one depth, each at its own best learning rate from the study's sweep, with as many updates as
fit in the time the fastest method at that depth took to reach the headline target (rounded up to whole windows
and evaluations), and reports whether and when each reaches the target, in updates and in projected seconds.

It reads the study's CSVs (runs and measured costs: run bench_time_to_target.py first) and writes
results/time_to_target_<workload>_equal_time.csv (one row per run, its curve included). Runs already in that CSV
are not run again.

    python benchmarks/probes/probe_equal_time.py --workload hfgpt2 --devices 16 --methods pipeoptim pipedream --jobs 2
    python benchmarks/probes/probe_equal_time.py --workload hfgpt2 --devices 16 --report
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
import bench_time_to_target as ttt  # noqa: E402  (spawned workers import it by this name)


def leader(wl: "ttt.Workload", rows: list[dict], costs: "ttt.MeasuredCosts", devices: int):
    """The method that reached the headline target first at `devices`, and its mean projected seconds."""
    ranked = [(t, r.method) for r in ttt.summarise(wl, rows, costs, wl.targets[0])
              if r.devices == devices and r.method in ttt.METHODS
              and (t := ttt._time_of(r)) is not None]
    if not ranked:
        raise SystemExit(f"no method reached {wl.targets[0]} at D = {devices} in the study; nothing to match")
    t, method = min(ranked)
    return method, t


def budget_for(wl: "ttt.Workload", schedule: str, devices: int, seconds: float, per_update_s: float) -> int:
    """Updates that fit in `seconds`, rounded up to whole windows (train_step calls) and evaluations."""
    per_call = wl.window // devices if schedule == "2bw" else wl.window
    step = math.lcm(per_call, wl.eval_every)
    return step * math.ceil(seconds / per_update_s / step)


def plan(wl, rows, costs, devices: int, methods: list[str], seeds: list[int]):
    lead, lead_s = leader(wl, rows, costs, devices)
    todo = []
    for name in dict.fromkeys(methods):
        run, schedule = ttt.METHODS[name]
        if run == "sync":
            raise SystemExit(f"{name} is synchronous: the study already gives it the time it needs")
        lr = ttt.best_lr(wl, rows, run, devices)
        if lr is None:
            print(f"  {name}: every sweep run diverged at D = {devices}; skipped", file=sys.stderr)
            continue
        per_update = costs.time_per_update(schedule, devices, ttt.POLICY_OF_RUN[run])["time_s"]
        updates = budget_for(wl, schedule, devices, lead_s, per_update)
        todo += [(name, run, lr, seed, updates, per_update) for seed in seeds]
    return lead, lead_s, todo


def _key(name, devices, lr, seed, updates):
    return (name, int(devices), float(lr), int(seed), int(updates))


def read_probe(path: str) -> list[dict]:
    return ttt._read_csv(path) if os.path.exists(path) else []


def run(wl, devices, todo, lead, lead_s, path, jobs) -> None:
    done = {_key(r["method"], r["devices"], r["lr"], r["seed"], r["updates"]) for r in read_probe(path)}
    todo = [t for t in todo if _key(t[0], devices, t[2], t[3], t[4]) not in done]
    if not todo:
        return
    print(f"{wl.name} D={devices}: {len(todo)} runs, {jobs} at a time (budgets: "
          + ", ".join(sorted({f'{t[0]} {t[4]} updates' for t in todo})) + ")", flush=True)

    budget = {(t[1], t[3]): t for t in todo}   # (run, seed) -> the plan's entry

    def record(call, row):
        name, run_name, lr, seed, updates, per_update = budget[(call[1], call[4])]
        curve = [(s, float("nan") if v is None else v) for s, v in json.loads(row["curve"])]
        hit = ttt.updates_to(curve, wl.targets[0], wl)
        ttt._append(path, {"workload": wl.name, "method": name, "run": run_name, "devices": devices, "lr": lr,
                           "seed": seed, "updates": updates, "time_per_update_s": per_update,
                           "target": wl.targets[0], "updates_to_target": "" if hit is None else round(hit, 1),
                           "time_to_target_s": "" if hit is None else round(hit * per_update, 3),
                           "leader": lead, "leader_time_s": round(lead_s, 3), "diverged": row["diverged"],
                           "final": row["final"], "curve": row["curve"], "wall_s": row["wall_s"]})
        print(f"  {name} lr={lr} seed={seed}: final {row['final']:.4f}, "
              + (f"target at {hit:.0f} updates = {hit * per_update:.2f} s" if hit is not None else "target not reached")
              + f" ({row['wall_s']} s)", flush=True)

    ttt.run_curves([(wl.name, t[1], devices, t[2], t[3], t[4]) for t in todo], jobs, 1, record)


def report(wl, devices: int, path: str) -> None:
    rows = [r for r in read_probe(path) if int(r["devices"]) == devices]
    if not rows:
        raise SystemExit(f"no probe runs for {wl.name} at D = {devices} in {path}")
    lead, lead_s = rows[0]["leader"], float(rows[0]["leader_time_s"])
    print(f"\n{wl.name}, D = {devices}: each method given the {lead_s:.2f} s that {lead} took to reach "
          f"{wl.targets[0]} (mean of the study's seeds)\n")
    print("| method | lr | updates given | reached | updates to target | time to target, s | final |")
    print("|---|---|---|---|---|---|---|")
    by = {}
    for r in rows:
        by.setdefault((r["method"], r["lr"], r["updates"]), []).append(r)
    for (name, lr, updates), rs in by.items():
        hits = [float(r["updates_to_target"]) for r in rs if r["updates_to_target"]]
        times = [float(r["time_to_target_s"]) for r in rs if r["time_to_target_s"]]
        finals = [float(r["final"]) for r in rs if math.isfinite(float(r["final"]))]
        print(f"| {name} | {lr} | {updates} | {len(hits)}/{len(rs)} | {ttt._ms(hits)} | {ttt._ms(times, '{:.2f}')} | "
              f"{ttt._ms(finals, '{:.4f}')}{'' if len(finals) == len(rs) else f' ({len(rs) - len(finals)} diverged)'} |")
    if any(r["updates_to_target"] for r in rows):
        print(f"\nmean over the seeds that reached it; {lead}: {lead_s:.2f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="hfgpt2", choices=sorted(ttt.WORKLOADS))
    ap.add_argument("--devices", type=int, help="pipeline depth (default: the workload's deepest)")
    ap.add_argument("--methods", nargs="+", default=["pipeoptim", "pipedream"],
                    choices=[m for m, (run, _) in ttt.METHODS.items() if run != "sync"])
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=ttt.RESULTS)
    ap.add_argument("--report", action="store_true", help="only print the table from the CSV")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    wl = ttt.WORKLOADS[args.workload]
    D = args.devices or max(wl.depths)
    if D not in wl.depths:
        ap.error(f"--devices {D}: {wl.name} was studied at D = {', '.join(map(str, wl.depths))}")
    path = os.path.join(args.out, f"time_to_target_{wl.name}_equal_time.csv")
    if not args.report:
        import torch
        torch.set_num_threads(1)
        runs_csv = os.path.join(args.out, f"time_to_target_{wl.name}_runs.csv")
        rows = ttt.read_runs(runs_csv)
        if not rows:
            raise SystemExit(f"no study runs in {runs_csv}: run bench_time_to_target.py --workload {wl.name} first")
        costs = ttt.load_or_measure_costs(wl, args.out, measure=False)
        lead, lead_s, todo = plan(wl, rows, costs, D, args.methods, args.seeds or list(wl.seeds))
        run(wl, D, todo, lead, lead_s, path, args.jobs)
    report(wl, D, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
