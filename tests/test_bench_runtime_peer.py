"""benchmarks/bench_runtime_peer.py: both runtimes run the same stage on every rank and the table's ratio is
the ratio of the medians it prints."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_runtime_peer as bench  # noqa: E402

from pipeoptim.runtime import launch  # noqa: E402


def test_both_runtimes_time_the_same_number_of_rounds_on_every_rank():
    per_rank = launch(bench.rank_job, bench.STAGES, "tiny", "1f1b", 4, 2, 1, timeout_s=240)
    assert len(per_rank) == bench.STAGES
    for times in per_rank:
        assert set(times) == {"pipeoptim", "torch"}
        assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
    # the slowest rank's time is all-reduced: every rank reports the same numbers
    assert all(t == per_rank[0] for t in per_rank[1:])


def test_the_ratio_is_the_ratio_of_the_printed_medians():
    row = bench._row("tiny", "4 processes", "1f1b", 8, {"pipeoptim": [3.0, 1.0, 2.0], "torch": [4.0, 8.0, 5.0]},
                     "torch", "1f1b")
    assert row["pipeoptim_s"] == 2.0 and row["peer_s"] == 5.0 and row["ratio"] == pytest.approx(0.4)
    assert row["samples_per_s"] == 4.0 and row["pipeoptim_min_max"] == "1.00000-3.00000"


def test_same_initial_weights_in_both_runtimes():
    a, b = bench._stage("tiny", 2), bench._stage("tiny", 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(bench._stage("tiny", 1).parameters()), next(a.parameters()))
