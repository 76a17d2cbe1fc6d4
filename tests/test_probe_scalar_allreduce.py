"""benchmarks/probes/probe_scalar_allreduce.py: every rank times both ways of summing and reports positive times."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probes"))
import probe_scalar_allreduce as probe  # noqa: E402


def test_each_rank_reports_its_median_and_mean(capsys):
    assert probe.main(["--procs", "2", "--rounds", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]
    for line in lines:
        ways = line.split(":", 1)[1].split(";")
        assert [way.split(" median")[0].strip() for way in ways] == ["all_reduce", "RankSum (star)"]
        for way in ways:
            median, mean = (float(part.split()[-2]) for part in way.split(","))
            assert median > 0 and mean > 0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        probe.main(["--procs", "1"])
