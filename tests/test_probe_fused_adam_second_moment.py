"""The fused-Adam second-moment probe on the CPU: torch's fused and foreach Adam and our cpu backend all within a
few float32 ulps of the float64 rule there (on the H200 torch's fused CUDA Adam is not: see the probe)."""
import importlib.util
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "probe_fused_adam_second_moment",
    os.path.join(HERE, "..", "benchmarks", "probes", "probe_fused_adam_second_moment.py"))
probe_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe_mod)


def test_on_the_cpu_every_implementation_is_within_a_few_ulps(capsys):
    rows = probe_mod.probe("cpu", 4099, seed=7)
    eps = torch.finfo(torch.float32).eps
    who = {r["who"] for r in rows}
    assert {"torch fused", "torch foreach"} <= who
    assert len(rows) == len(probe_mod.CASES) * len(who)
    for r in rows:
        assert r["worst"] <= 8 * eps, r


def test_relative_error_counts_nan_as_infinitely_off():
    v_ref = torch.ones(3, dtype=torch.float64)
    rel = probe_mod.relative_error(torch.tensor([1.0, float("nan"), 1.0]), v_ref, v_ref)
    assert rel[1].item() == float("inf") and rel[0].item() == 0.0


def test_main_prints_one_line_per_row(capsys):
    assert probe_mod.main(["--device", "cpu", "--n", "257"]) == 0
    out = capsys.readouterr().out
    assert "torch fused" in out and "relative error against the float64 rule" in out
