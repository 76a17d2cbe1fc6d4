"""benchmarks/probes/probe_equal_time.py:
the budget each asynchronous method gets (the leader's time, in whole windows and
evaluations), the rows it records, resuming, and run_curve's own budget."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import pytest

pytest.importorskip("sklearn")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probes"))
import probe_equal_time as probe  # noqa: E402

ttt = probe.ttt
QUICK = dataclasses.replace(ttt.WORKLOADS["quick"], depths=(2,), batch=8, window=8, eval_every=4, updates=16,
                            targets=(0.5,))


def _costs(wl, unit=1e-3):
    """forward = backward = `unit` s per sample per layer (8 layers); PipeOptim's step costs 2 units more."""
    layer_rows = [{"layer": j, "microbatch_size": b, "forward_s": unit * b, "backward_s": unit * b}
                  for j in range(8) for b in ttt.microbatch_sizes(wl)]
    stage_rows = [{"devices": D, "stage": k, "variant": v, "forward_overhead_s": 0.0, "backward_overhead_s": 0.0,
                   "step_s": 2 * unit if v == "pipeoptim" else 0.0}
                  for D in wl.depths for k in range(D)
                  for v in ("none", "stash", "2bw", "spectrain", "pipeoptim", "pipeoptim-code")]
    return ttt.MeasuredCosts(wl, layer_rows, stage_rows)


def _run(method, lr, seed, curve, diverged=False):
    return {"method": method, "devices": 0 if method == "sync" else 2, "lr": lr, "seed": seed, "diverged": diverged,
            "final": curve[-1][1], "curve": curve}


def _study(wl):
    """Seed-0 sweep plus seeds: sync reaches 0.5 at update 8; stash and PipeOptim never (PipeOptim best at 0.02)."""
    rows = []
    for lr in wl.lrs:
        rows.append(_run("sync", lr, 0, [(0, 0.1), (4, 0.3), (8, 0.5 if lr == 0.02 else 0.4), (16, 0.6)]))
        for m in ttt.ASYNC_RUNS:
            rows.append(_run(m, lr, 0, [(0, 0.1), (8, 0.2), (16, 0.35 if lr == 0.02 else 0.3)]))
    rows += [_run("sync", 0.02, s, [(0, 0.1), (4, 0.3), (8, 0.5), (16, 0.6)]) for s in wl.seeds[1:]]
    return rows


def test_budget_is_the_leaders_time_in_whole_windows_and_evaluations():
    wl = dataclasses.replace(QUICK, window=8, eval_every=4)
    assert probe.budget_for(wl, "async-1f1b", 2, seconds=1.0, per_update_s=0.03) == 40    # 33.3 -> 5 windows of 8
    assert probe.budget_for(wl, "2bw", 2, seconds=1.0, per_update_s=0.03) == 36           # windows of 8/2 updates
    assert probe.budget_for(wl, "async-1f1b", 2, seconds=0.24, per_update_s=0.03) == 8    # exactly one window


def test_plan_gives_each_method_the_leaders_time_at_its_own_best_lr():
    wl, rows = QUICK, _study(QUICK)
    costs = _costs(wl)
    lead, lead_s, todo = probe.plan(wl, rows, costs, 2, ["pipeoptim", "pipedream"], [0, 1])
    sync = {m: costs.time_per_update(m, 2, "none")["time_s"] for m in ("gpipe", "1f1b", "interleaved", "bitpipe")}
    assert lead == min(sync, key=sync.get) and lead_s == pytest.approx(8 * min(sync.values()))
    assert {(t[0], t[2], t[3]) for t in todo} == {(m, 0.02, s) for m in ("pipeoptim", "pipedream") for s in (0, 1)}
    for name, run, lr, seed, updates, per_update in todo:
        assert per_update == costs.time_per_update("async-1f1b", 2, ttt.POLICY_OF_RUN[run])["time_s"]
        assert updates % wl.window == 0 and updates >= lead_s / per_update > updates - wl.window
    with pytest.raises(SystemExit, match="synchronous"):
        probe.plan(wl, rows, costs, 2, ["bitpipe"], [0])


def test_rows_record_the_crossing_in_updates_and_seconds_and_are_not_run_again(tmp_path, monkeypatch):
    wl = QUICK
    path = str(tmp_path / "probe.csv")
    calls = []

    def fake_run_curve(workload, run, devices, lr, seed, updates):
        calls.append((run, seed, updates))
        curve = [[0, 0.1], [updates // 2, 0.4], [updates, 0.6]]   # crosses 0.5 at 3/4 of the budget
        return {"curve": json.dumps(curve), "final": 0.6, "diverged": False, "wall_s": 0.0}

    monkeypatch.setattr(ttt, "run_curve", fake_run_curve)
    todo = [("pipeoptim", "pipeoptim-exact", 0.02, 0, 32, 0.01), ("pipeoptim", "pipeoptim-exact", 0.02, 1, 32, 0.01)]
    probe.run(wl, 2, todo, "bitpipe", 0.3, path, jobs=1)
    rows = probe.read_probe(path)
    assert [(r["seed"], r["updates"]) for r in rows] == [("0", "32"), ("1", "32")]
    assert all(float(r["updates_to_target"]) == 24.0 and float(r["time_to_target_s"]) == pytest.approx(0.24)
               for r in rows)
    probe.run(wl, 2, todo, "bitpipe", 0.3, path, jobs=1)      # resumes: nothing run twice
    assert len(calls) == 2


def test_run_curve_trains_for_the_budget_it_is_given(one_thread):
    row = ttt.run_curve("quick", "pipeoptim-exact", 2, 0.02, 0, updates=24)
    curve = json.loads(row["curve"])
    assert row["updates"] == 24 and curve[-1][0] == 24 and math.isfinite(curve[-1][1])
