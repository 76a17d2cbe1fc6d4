"""benchmarks/bench_predictor.py runs on a torch without storage swaps (the GPU machine's 2.11), tiny sizes."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

import pipeoptim.prediction.predictor

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_predictor.py"
_spec = importlib.util.spec_from_file_location("bench_predictor", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = ["--mech-d", "64", "--mech-layers", "1", "--d", "32", "--layers", "1", "--heads", "2", "--seq", "8",
        "--batch", "2", "--rounds", "1", "--reps", "1", "--steps", "1", "--threads", "1"]


@pytest.mark.parametrize("can_swap", [False, True])
def test_every_row_runs_with_the_mechanisms_this_torch_has(can_swap, monkeypatch, tmp_path):
    if can_swap and not pipeoptim.prediction.predictor._can_swap():
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_ (torch >= 2.12)")
    monkeypatch.setattr(pipeoptim.prediction.predictor, "_can_swap", lambda: can_swap)
    bench.main(TINY + ["--out-dir", str(tmp_path)])
    with open(tmp_path / "predictor_mechanisms.csv") as f:
        mechanisms = [r["variant"] for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    with open(tmp_path / "predictor_policies.csv") as f:
        policies = [r["policy"] for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    default = "swap" if can_swap else "pointer"
    assert ("lend: swap, compiled" in mechanisms) == can_swap
    assert f"fused step_predict, compiled ({default})" in mechanisms and "lend: pointer, compiled" in mechanisms
    assert ("pipeoptim swap" in policies) == can_swap and f"pipeoptim {default}+fused" in policies
