"""benchmarks/bench_kernels.py in its --quick form: every row the GPU run makes, tried on the CPU, and a
CSV that keeps what was measured when a later rule fails (a GPU step's timeout must not lose it)."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_kernels.py"
_spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_quick_run_makes_every_gpu_row(tmp_path, capsys):
    out = tmp_path / "kernels.csv"
    assert bench.main(["--device", "cpu", "--quick", "--out", str(out), "--no-plot"]) == 0
    rows = _rows(out)
    assert {r["rule"] for r in rows} == {"adam", "sgd"}
    adam = {r["variant"] for r in rows if r["rule"] == "adam"}
    assert {"copy", "per-tensor torch loop", "cpu", "cpu bf16 out", "torch fused Adam step",
            "torch fused Adam step, parameter list", "torch foreach Adam step, parameter list",
            "cpu step+predict", "torch fused Adam step + predict"} <= adam
    if "triton" in bench.pk.available_backends():
        assert {"triton", "triton step+predict"} <= adam
    assert all(float(r["ms"]) > 0 and float(r["speedup_vs_torch_loop"]) >= 0 for r in rows)
    printed = capsys.readouterr().out
    assert "target >= 0.90" in printed and "faster than torch's fused step then predict" in printed


def test_rows_already_measured_survive_a_later_failure(tmp_path, monkeypatch):
    out = tmp_path / "kernels.csv"
    real = bench.bench_rule

    def second_rule_fails(rule, *args, **kwargs):
        if rule == "sgd":
            raise RuntimeError("killed mid-run")
        return real(rule, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_rule", second_rule_fails)
    with pytest.raises(RuntimeError, match="killed"):
        bench.main(["--device", "cpu", "--quick", "--rules", "adam,sgd", "--out", str(out), "--no-plot"])
    assert {r["rule"] for r in _rows(out)} == {"adam"}
