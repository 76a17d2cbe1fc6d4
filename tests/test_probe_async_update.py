"""benchmarks/probes/probe_async_update.py:
the window model's arithmetic (checked at its own break-even point), a run on
the tiny model reporting every stage with positive times, and bad arguments refused before anything runs."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probes"))
import probe_async_update as probe  # noqa: E402


def test_the_window_model():
    p = probe.windows(8, 2, fb=1.0, u=0.5)
    assert p["sync"] == pytest.approx(9 * 1.0 + 0.5)   # N + D - 1 slots and one update
    assert p["stream"] == pytest.approx(8 * 1.5)       # N slots and N updates
    assert p["ratio"] == pytest.approx(12 / 9.5)
    assert p["break_even"] == pytest.approx(7 * 0.5 / 1.0)
    # at the break-even factor the two windows are equal
    k = p["break_even"]
    q = probe.windows(8, 2, fb=k * 1.0, u=0.5)
    assert q["stream"] == pytest.approx(q["sync"])
    # deeper pipelines drain longer: the same update costs less against it
    assert probe.windows(8, 4, fb=1.0, u=0.5)["ratio"] < p["ratio"]


def test_a_run_on_the_tiny_model_reports_every_stage(tmp_path, capsys):
    out = tmp_path / "report.txt"
    assert probe.main(["--model", "tiny", "--microbatches", "4", "--rounds", "2", "--warmup", "0",
                       "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text().strip() == printed.strip()
    stages = [line for line in printed.splitlines() if line.startswith("stage ")]
    assert len(stages) == 2
    for line in stages:
        fb, u = _times(line)
        assert fb > 0 and u > 0
    assert "ratio" in printed and "breaks even" in printed


def _times(line: str) -> tuple[float, float]:
    """(forward + backward, update) in ms from a report line 'stage i: forward + backward X ms   update Y ms'."""
    words = line.split()
    return float(words[words.index("backward") + 1]), float(words[words.index("update") + 1])


@pytest.mark.parametrize("bad", [["--microbatches", "1"], ["--rounds", "0"], ["--rows-per-microbatch", "0"],
                                 ["--warmup", "-1"], ["--ranks", "3"]])
def test_bad_arguments_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        probe.main(bad)
    assert "error" in capsys.readouterr().err
