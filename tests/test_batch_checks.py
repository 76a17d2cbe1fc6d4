"""A batch the pipeline cannot train on is refused before anything runs: an empty one (0 rows, which used to
run the schedule, decay the weights and the optimizer's moments, then blame a NaN) and one whose targets or
inputs differ in row count (which used to end as a bare IndexError at some action). The error names the
sizes; weights, optimizer and policy state are bit for bit what they were, in one process and on real ones."""
from __future__ import annotations

import re

import pytest
import torch

import fault_jobs as fj
from pipeoptim.runtime import launch


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.5)  # a step on nothing would still shrink weights


def _flat(prefix: str, value, out: dict) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()
    elif isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}/{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flat(f"{prefix}/{i}", v, out)
    elif isinstance(value, (int, float, bool)) or value is None:
        out[prefix] = torch.tensor(float("nan") if value is None else float(value), dtype=torch.float64)


def snapshot(pipe) -> dict[str, torch.Tensor]:
    """Every parameter, every optimizer's and policy's state and LR scheduler, and the step count."""
    out = {"step_count": torch.tensor(pipe.step_count)}
    _flat("params", dict(pipe.named_parameters()), out)
    for w in pipe.workers:
        for c, st in w.stages.items():
            _flat(f"{c}/optimizer", st.optimizer.state_dict(), out)
            _flat(f"{c}/policy", st.policy.state_dict(), out)
            if st.scheduler is not None:
                _flat(f"{c}/scheduler", st.scheduler.state_dict(), out)
    return out


def _x(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))


BAD_BATCHES = {
    "empty": ((_x(0), _x(0)), r"the batch is empty \(the inputs have 0 rows\): refused before anything ran"),
    "fewer targets": ((_x(8), _x(6)),
                      r"the targets have 6 rows but the inputs have 8: .*targets of shape \(8, \.\.\.\)"),
    "more targets": ((_x(4), _x(8)), r"the targets have 8 rows but the inputs have 4"),
    "empty targets": ((_x(8), _x(0)), r"the targets have 0 rows but the inputs have 8"),
    "inputs differ": (((_x(8), _x(4)), _x(8)), r"input 1 of the batch has 4 rows but input 0 has 8"),
}


def refusals(pipe) -> dict[str, str]:
    """Train a step (so that there are moments to decay), then offer every bad batch to train_step and
    eval_step; returns each refusal's message, checking that nothing changed."""
    pipe.train_step(fj.batch(0))
    before = snapshot(pipe)
    seen = {}
    for name, (batch, _) in BAD_BATCHES.items():
        for call in (pipe.train_step, pipe.eval_step):
            try:
                call(batch)
            except ValueError as e:
                seen[f"{name}/{call.__name__}"] = str(e)
            else:
                seen[f"{name}/{call.__name__}"] = "accepted"
    after = snapshot(pipe)
    assert set(after) == set(before)
    changed = [k for k in before if not torch.equal(before[k], after[k]) and not
               (before[k].isnan().all() and after[k].isnan().all())]
    seen["changed"] = ", ".join(changed)
    return seen


def _check(seen: dict[str, str]) -> None:
    assert seen.pop("changed") == "", "state changed by a refused batch"
    for name, (_, words) in BAD_BATCHES.items():
        for call in ("train_step", "eval_step"):
            assert re.search(words, seen[f"{name}/{call}"]), (name, call, seen[f"{name}/{call}"])


@pytest.mark.parametrize("schedule,policy", [("1f1b", None), ("async-1f1b", "pipeoptim")])
def test_bad_batches_are_refused_before_anything_runs_emulated(schedule, policy):
    pipe = fj.small_pipeline(2, emulate=True, devices=2, optimizer=_adamw, schedule=schedule, policy=policy)
    _check(refusals(pipe))
    assert pipe.train_step(fj.batch(1)) > 0  # and a good batch still trains


def _rank_job() -> dict[str, str]:
    return refusals(fj.small_pipeline(2, optimizer=_adamw, schedule="async-1f1b", policy="pipeoptim"))


def test_bad_batches_are_refused_on_real_processes():
    for seen in launch(_rank_job, 2, timeout_s=120):
        _check(seen)
