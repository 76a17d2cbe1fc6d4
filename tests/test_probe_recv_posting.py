"""benchmarks/probes/probe_recv_posting.py: the three ways run the same steps and every measure is reported."""
from __future__ import annotations

import csv
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probes"))
import probe_recv_posting as probe  # noqa: E402


def test_every_way_reports_positive_times_and_ratios_against_torch(tmp_path):
    out = tmp_path / "posting.csv"
    assert probe.main(["--schedules", "gpipe", "--microbatches", "4", "--rounds", "3", "--warmup", "1",
                       "--csv", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# python") and "torch" in lines[1]
    rows = list(csv.DictReader(lines[2:]))
    assert [r["way"] for r in rows] == list(probe.WAYS)
    for r in rows:
        assert float(r["wall_ms"]) > 0 and float(r["cpu_ms"]) > 0
        io = float(r["gloo_io_cpu_ms"])
        assert math.isnan(io) or io >= 0
        if r["way"] != "torch":
            assert float(r["wall_vs_torch"]) > 0 and "-" in r["wall_vs_torch_90ci"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        probe.main(["--rounds", "0"])
