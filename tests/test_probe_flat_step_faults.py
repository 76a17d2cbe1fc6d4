"""benchmarks/probes/probe_flat_step_faults.py:
three configurations, each a fresh process, each with a positive time; the
setting is applied only where asked for."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "probes"))
import probe_flat_step_faults as probe  # noqa: E402


def test_each_configuration_reports_its_step_time_and_faults(capsys):
    assert probe.main(["--steps", "2", "--warmup", "1", "--width", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("  ")[0].strip() for line in lines] == [name for name, _, _ in probe.CONFIGS]
    for line, (_, _, malloc) in zip(lines, probe.CONFIGS):
        assert "0.10M parameters" in line  # 2 blocks of width 64
        assert float(line.split(" ms per step")[0].split()[-1]) > 0
        if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION"):  # glibc's mallopt
            assert line.endswith(f"(setting applied: {malloc == 'reuse'})")


def test_bad_arguments_are_refused():
    for bad in (["--steps", "0"], ["--width", "60"]):
        with pytest.raises(SystemExit):
            probe.main(bad)
