"""Smoke test of benchmarks/bench_convergence.py's logic (tiny runs, well under 20 s on one thread)."""
from __future__ import annotations

import csv
import importlib.util
import os

import pytest

pytest.importorskip("sklearn")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_convergence.py")
_spec = importlib.util.spec_from_file_location("bench_convergence", _PATH)
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

TINY = dict(task="digits", devices=2, optimizer="sgd", lr=0.01, steps=8, mbs=8, eval_every=4, target=0.5)


@pytest.fixture(autouse=True)
def restore_policy_registry():
    """The ablation registers extra policies in the global registry; undo it so other tests see the built-ins."""
    from pipeoptim.policies import POLICIES
    before = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(before)


def test_s_rules():
    assert bc.s_of_rule("schedule", 1, stage=0, devices=4) == 1  # warm-up value passes through
    assert bc.s_of_rule("paper", 1, stage=0, devices=4) == 3
    assert bc.s_of_rule("code", 0, stage=3, devices=4) == 1    # the public code predicts on the last stage too
    with pytest.raises(ValueError, match="unknown s rule"):
        bc.s_of_rule("bogus", 0, 0, 4)


def test_method_config_matches_samples_per_update():
    kw, size = bc.method_config("2bw", 4, 32, 8)
    assert kw["schedule"] == "2bw" and size == 8  # 4 micro-batches of 8 = 32 samples per update
    kw, size = bc.method_config("sync", 4, 32, 8)
    assert kw["microbatches"] == 1 and size == 32
    with pytest.raises(ValueError, match="divisible"):
        bc.method_config("2bw", 4, 30, 8)
    with pytest.raises(ValueError, match="unknown method"):
        bc.method_config("pipedream-3", 4, 32, 8)


def test_schedule_rule_equals_plain_pipeoptim_and_paper_rule_differs(one_thread):
    rows = {}
    for m in ("pipeoptim-exact", "s-schedule", "s-paper", "s-code"):
        row, curve = bc.run_one("tiny", m, 0, TINY, window=4)
        rows[m] = row
        assert curve[-1]["step"] == row["steps"] == 8 and len(curve) == 2
    assert rows["s-schedule"]["final_loss"] == rows["pipeoptim-exact"]["final_loss"]
    assert rows["s-paper"]["final_loss"] != rows["s-schedule"]["final_loss"]  # warm-up s differs
    assert rows["s-code"]["final_loss"] != rows["s-paper"]["final_loss"]
    assert rows["pipeoptim-exact"]["extra_weight_frac_per_stage"].split()[0] == "1.00"


def test_runs_and_report(tmp_path, one_thread, capsys):
    for m, seeds in (("sync", (0, 1)), ("stash", (0, 1)), ("2bw", (0,))):
        for seed in seeds:
            row, curve = bc.run_one("digits4", m, seed, TINY, window=4)
            bc._append(str(tmp_path / "convergence_digits4.csv"), [row])
            bc._append(str(tmp_path / "convergence_digits4_curves.csv"), curve)
    bc.report(str(tmp_path))
    out = capsys.readouterr().out
    assert "| sync | 2 |" in out and "| 2bw | 1 |" in out
    with open(tmp_path / "convergence_summary.csv") as fh:
        summary = list(csv.DictReader(fh))
    assert {r["method"] for r in summary} == {"sync", "stash", "2bw"}
    stash = next(r for r in summary if r["method"] == "stash")
    assert stash["extra_weight_bytes_per_stage"].split()[1] == "0"  # last stage never stashes


def test_zero_bubble_methods_run_and_their_s_rules_differ(one_thread):
    """zb-pipeoptim predicts up to the W (the runtime's s), zb-pipeoptim-sI only up to the I; both predict, so
    both differ from zb-none, and from each other."""
    rows = {m: bc.run_one("tiny", m, 0, TINY, window=4)[0] for m in bc.ZB_METHODS}
    losses = {m: r["final_loss"] for m, r in rows.items()}
    assert len(set(losses.values())) == 3, losses
    assert rows["zb-pipeoptim"]["extra_weight_frac_per_stage"].split() == ["1.00", "1.00"]  # the last stage predicts too
