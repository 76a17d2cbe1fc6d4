"""benchmarks/bench_regime_map.py: rows the study never measured say so (D = 32, deeper in-flight depths), a
method's time to target is its measured updates times the projected time per update, and the crossing latency
is read from the sweep."""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

pytest.importorskip("sklearn")

_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rm = _load("bench_regime_map")
btt, npj = rm.btt, rm.npj


def test_rows_measured_and_not_measured():
    wl = btt.WORKLOADS[rm.WORKLOAD]
    runs = btt.read_runs(os.path.join(btt.RESULTS, f"time_to_target_{wl.name}_runs.csv"))
    costs = btt.load_or_measure_costs(wl, btt.RESULTS, measure=False)
    memory = npj.measure_layer_memory(btt.GPT16)
    methods = {m: rm.METHODS[m] for m in ("zbv-muon", "2bw-muon", "2bw-muon-inflight4")}
    rows = rm.regime_rows(wl, runs, costs, memory, (4, 32), ("free",), methods)
    by = {(r["devices"], r["uneven"], r["method"]): r for r in rows}
    assert len(rows) == 2 * 2 * 3
    for uneven in (False, True):
        for m in methods:
            assert by[(32, uneven, m)]["time_to_target_s"] == "not measured"
    assert by[(4, False, "2bw-muon-inflight4")]["time_to_target_s"] == "not measured"
    zbv = by[(4, False, "zbv-muon")]
    assert (zbv["seeds"], zbv["seeds_reached"]) == (3, 3)
    # RESULTS.md 6.6: synchronous Muon, 77 updates; ZBV 2.07 s at D = 4 with communication free
    assert zbv["time_to_target_s"] == pytest.approx(zbv["updates_mean"] * zbv["time_per_update_s"], rel=1e-3)
    assert zbv["time_to_target_s"] == pytest.approx(2.07, abs=0.01)
    assert by[(4, True, "zbv-muon")]["time_to_target_s"] > zbv["time_to_target_s"]
    assert all(isinstance(r["peak_activation_bytes"], int) for r in rows if r["devices"] == 4)


def _run(method, lr, seed, curve, devices=16):
    return {"method": method, "devices": devices, "lr": lr, "seed": seed, "diverged": False, "final": curve[-1][1],
            "curve": curve}


def test_one_machine_rows_read_each_methods_own_workload_and_time_the_measured_in_flight_depth():
    """ONE_MACHINE: each method's updates come from its own workload's runs (here made up: 2.5 crossed at 60, 90
    and 120 updates), and a run trained at 2x in flight is timed at 2x, not marked "not measured"."""
    wl = btt.WORKLOADS[rm.WORKLOAD]
    costs = btt.load_or_measure_costs(wl, btt.RESULTS, measure=False)
    memory = npj.measure_layer_memory(btt.GPT16)
    crossing = lambda u: [[0, 5.5], [u - 10, 2.6], [u + 10, 2.4]]   # noqa: E731 - linear: 2.5 at u
    look = btt.WORKLOADS["gpt16-lookahead"]
    runs_of = {"gpt16-lookahead": [_run("sync-muon", look.lrs[0], s, crossing(60), devices=0) for s in look.seeds],
               "gpt16-inflight-long": [_run("pipeoptim-muon-inflight2", 8e-3, s, crossing(120)) for s in look.seeds],
               "gpt16-inflight": [_run("pipeoptim-muon", 4e-3, s, crossing(90)) for s in look.seeds]}
    methods = {m: rm.ONE_MACHINE[m] for m in ("zbv-muon", "pipeoptim-muon", "pipeoptim-muon-inflight2", "2bw-muon")}
    rows = rm.regime_rows(wl, [], costs, memory, (16,), ("internet",), methods, runs_of)
    by = {r["method"]: r for r in rows if not r["uneven"]}
    assert by["zbv-muon"]["updates_mean"] == pytest.approx(60)
    assert by["pipeoptim-muon"]["updates_mean"] == pytest.approx(90)
    deep = by["pipeoptim-muon-inflight2"]
    assert deep["updates_mean"] == pytest.approx(120) and deep["in_flight"] == 2
    assert deep["time_to_target_s"] == pytest.approx(120 * deep["time_per_update_s"], rel=1e-6)
    # its time per update is the 2x schedule's: under the internet's latency, less than at 1x
    assert deep["time_per_update_s"] < by["pipeoptim-muon"]["time_per_update_s"]
    assert by["2bw-muon"]["time_to_target_s"] == "not measured"                  # no runs given for it
    assert rm.is_async("lookahead-2bw-muon") and not rm.is_async("zbv-muon")


def test_crossing_latency_is_interpolated_in_log_latency():
    lat = rm.SWEEP_LATENCIES
    sweep = []
    for bw in rm.SWEEP_BANDWIDTHS:
        for latency in lat:
            sweep.append({"bandwidth": bw, "latency_s": latency, "asynchronous": False, "time_to_target_s": 1.0})
            # async: 4x slower at the smallest latency, a factor 2 better per decade
            a = 4.0 * (latency / lat[0]) ** -math.log10(2) if bw == "10Gbit/s" else 2.0
            sweep.append({"bandwidth": bw, "latency_s": latency, "asynchronous": True, "time_to_target_s": a})
    got = rm.crossings(sweep)
    assert got["100Mbit/s"] == {"above": None, "async_first_at": []}                  # never first
    assert got["10Gbit/s"]["above"] == pytest.approx(lat[0] * 100, rel=0.01)          # where the two are equal
    first = got["10Gbit/s"]["async_first_at"]          # (at 1e-4 the two are equal up to rounding)
    assert [x for x in first if x != lat[2]] == [x for x in lat if x > lat[2]]


def test_the_crossing_is_where_asynchronous_stays_first():
    lat = rm.SWEEP_LATENCIES
    sign = [1, 1, -1, -1, -1, 1, 1, 1, 1]            # first at the smallest latencies, then behind, then first again
    sweep = [row for bw in rm.SWEEP_BANDWIDTHS for latency, s in zip(lat, sign) for row in (
        {"bandwidth": bw, "latency_s": latency, "asynchronous": False, "time_to_target_s": 1.0},
        {"bandwidth": bw, "latency_s": latency, "asynchronous": True, "time_to_target_s": 2.0 ** -s})]
    got = rm.crossings(sweep)["10Gbit/s"]
    assert lat[4] < got["above"] < lat[5] and got["async_first_at"] == [lat[i] for i in (0, 1, 5, 6, 7, 8)]


def test_the_committed_map_reads_back_to_its_winners():
    import csv
    rows, sweep = rm.read_back(btt.RESULTS)
    with open(os.path.join(btt.RESULTS, "regime_winners.csv"), newline="") as fh:
        committed = list(csv.DictReader(fh))
    again = rm.winners(rows)
    assert [w["first"] for w in again] == [c["first"] for c in committed]
    for w, c in zip(again, committed):
        if w["first"] != "not measured":
            assert w["best_async_s"] == pytest.approx(float(c["best_async_s"]))
    # D = 32 is never projected; the internet's winner is asynchronous, an NVLink node's synchronous
    assert {w["first"] for w in again if w["devices"] == 32} == {"not measured"}
    assert all(rm.is_async(w["first"]) for w in again if w["profile"] == "internet" and w["devices"] != 32)
    assert not any(rm.is_async(w["first"]) for w in again if w["profile"] == "nvlink" and w["devices"] != 32)
    assert rm.crossings(sweep)["10Gbit/s"]["above"] < rm.crossings(sweep)["100Mbit/s"]["above"]


def test_quick_runs_end_to_end_and_its_report_reads_it_back(tmp_path, capsys):
    """main(--quick): D = 4 under free and internet from the committed runs, written and read back by --report
    (a regression test: the default mode once failed to unpack its settings after --one-machine was added)."""
    assert rm.main(["--quick", "--out", str(tmp_path)]) == 0
    rows, sweep = rm.read_back(str(tmp_path))
    assert {(r["profile"], r["devices"]) for r in rows} == {("free", 4), ("internet", 4)} and sweep == []
    first = capsys.readouterr().out
    assert rm.main(["--quick", "--out", str(tmp_path), "--report"]) == 0
    assert "| internet | False | 4 |" in first and "| internet | False | 4 |" in capsys.readouterr().out
