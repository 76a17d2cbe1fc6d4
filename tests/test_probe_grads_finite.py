"""benchmarks/probes/probe_grads_finite.py:
both stage sizes, every check timed with a positive time; the checks agree with
a float64 reference on finite, overflowing and non-finite buffers."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probes"))
import probe_grads_finite as probe  # noqa: E402


def test_each_stage_size_reports_every_check(capsys):
    assert probe.main(["--repeats", "2", "--warmup", "0", "--width", "64"]) == 0
    out = capsys.readouterr().out
    assert "tiny stage, 0.0083M parameters:" in out  # 2 x Linear(64, 64)
    assert "gpt stage, 0.1000M parameters:" in out    # 2 blocks of width 64
    names = list(probe.CHECKS) + ["plain float32 sum (floor)", "AdamW step (scale)"]
    for name in names:
        rows = [line for line in out.splitlines() if line.strip().startswith(name)]
        assert len(rows) == 2, name
        assert all(float(r.split()[-2]) > 0 for r in rows)


@pytest.mark.parametrize("values", [[1.0, 2.0], [3e38, 3e38], [1.0, float("inf")], [float("nan"), 1.0],
                                    [float("inf"), float("-inf")]])
def test_the_checks_agree_with_a_float64_reference(values):
    g = torch.tensor(values, dtype=torch.float32)
    expected = all(torch.isfinite(torch.tensor(values, dtype=torch.float64)).tolist())
    for name, check in probe.CHECKS.items():
        assert check(g) is expected, name


def test_bad_arguments_are_refused():
    for bad in (["--repeats", "0"], ["--width", "60"]):
        with pytest.raises(SystemExit):
            probe.main(bad)
