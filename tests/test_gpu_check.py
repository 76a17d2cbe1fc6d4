"""benchmarks/gpu_check.sh, the lent GPU's one script, proven on the CPU: its step runner's bookkeeping,
and the whole script's dry run (every step in its --device cpu --quick form)."""
from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _steps(out: Path) -> dict[str, dict]:
    with open(out / "steps.csv") as f:
        return {row["step"]: row for row in csv.DictReader(f)}


def test_step_runner_keeps_going_and_says_what_happened(tmp_path):
    script = tmp_path / "steps.sh"
    script.write_text(f"""
source {ROOT / 'benchmarks' / 'step_runner.sh'}
steps_begin "{tmp_path / 'out'}" 14
run_step good 10 'echo measured > "{tmp_path / 'out' / 'good.csv'}"; echo all fine'
run_step bad 10 'echo about to fail; exit 3'
run_step slow 2 'sleep 30'
run_step skipped 10 'echo never'
run_step greedy 100 'sleep 30'
run_step late 10 'echo never either'
steps_end
""")
    env = {**os.environ, "STEP_SKIP": "skipped:not wanted today;other:x"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    out = tmp_path / "out"
    assert r.returncode == 1, r.stdout + r.stderr
    steps = _steps(out)
    assert list(steps) == ["good", "bad", "slow", "skipped", "greedy", "late"]
    assert steps["good"]["status"] == "ok" and (out / "good.csv").read_text() == "measured\n"
    assert steps["bad"]["status"] == "failed" and steps["bad"]["exit_code"] == "3"
    assert steps["slow"]["status"] == "timed out" and int(steps["slow"]["seconds"]) <= 4
    assert steps["skipped"]["status"] == "skipped: not wanted today"
    # The total is 14 s: greedy's 100-s limit was cut to what was left, and nothing was left for late.
    assert steps["greedy"]["status"] == "timed out" and int(steps["greedy"]["limit_s"]) < 14
    assert steps["late"]["status"] == "not run: no time left"
    summary = (out / "summary.txt").read_text()
    assert "ran: good bad slow greedy" in summary and "failed: bad" in summary
    assert "timed out: slow greedy" in summary and "skipped (skipped: not wanted today)" in summary
    assert "about to fail" in summary and "===== good" in (out / "log.txt").read_text()
    assert "all fine" in (out / "log.txt").read_text()


def test_dry_run_runs_every_step_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    steps = _steps(tmp_path)
    assert list(steps) == ["env", "build", "tests_gpu", "kernels", "runtime", "runtime_peer"]
    for name, row in steps.items():
        assert row["status"] == "ok", (name, row, (tmp_path / "log.txt").read_text()[-3000:])
    with open(tmp_path / "env.csv") as f:
        env_rows = dict(csv.reader(f))
    assert env_rows["dry_run"] == "1" and env_rows["torch"] and env_rows["build_rebuilt"] == "no"
    # The device tool brings back at most 8 files from $OUT.
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8
    with open(tmp_path / "tests_gpu.csv") as f:
        outcomes = [row["outcome"] for row in csv.DictReader(f)]
    assert outcomes.count("passed") >= 100 and "failed" not in outcomes
    with open(tmp_path / "kernels_cpu.csv") as f:
        kernel_rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert {r["rule"] for r in kernel_rows} == {"adam", "sgd"}
    with open(tmp_path / "large.csv") as f:
        large_rows = list(csv.DictReader(f))
    assert {r["policy"] for r in large_rows} >= {"pipeoptim", "none"}, large_rows
    with open(tmp_path / "runtime_peer.csv") as f:
        peer_rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert {(r["model"], r["peer"]) for r in peer_rows} == {("tiny", "plain"), ("tiny", "staged")}, peer_rows
    assert all(float(r["ratio"]) > 0 for r in peer_rows)
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("gpu_check dry run on the CPU") and "failed: none" in summary


def test_step_limits_fit_one_device_command():
    """The steps' own limits must add to less than one device command's 600 s (they added to 780)."""
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    limits = [int(line.split()[2]) for line in text.splitlines() if line.startswith("run_step ")]
    total = int(next(line.split()[2] for line in text.splitlines() if line.startswith("steps_begin ")))
    assert len(limits) == 6 and sum(limits) <= total <= 570


@pytest.mark.parametrize("arg", ["--dryrun", "extra"])
def test_unknown_arguments_are_refused(arg):
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", arg], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
