"""A NaN injected into a loss or a gradient: found on every rank at the same step; no update with a non-finite
gradient is ever applied; on_nonfinite="stop" raises NonFiniteError with the weights of the last finite
state, "skip" drops the update and goes on. The references are runs that never saw the bad step."""
from __future__ import annotations

import math

import pytest
import torch

import fault_jobs as fj
from pipeoptim.runtime import launch
from pipeoptim.train import NonFiniteError


def _emulated(**kw):
    return fj.small_pipeline(2, emulate=True, devices=2, optimizer=fj.adam, **kw)


def _state(pipe):
    """Every optimizer state tensor, by (global parameter name, key)."""
    out = {}
    for w in pipe.workers:
        for st in w.stages.values():
            names = {id(p): st.names[n] for n, p in st.module.named_parameters()}
            for p, s in st.optimizer.state.items():
                out.update({(names[id(p)], k): v.clone() for k, v in s.items()})
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stop_keeps_the_state_before_the_bad_step():
    clean = _emulated(microbatches=2)
    for step in range(2):
        clean.train_step(fj.batch(step))
    pipe = _emulated(microbatches=2)
    with pytest.raises(NonFiniteError, match=r"step 3: the loss was nan; 2 optimizer update\(s\) with a "
                                             r"non-finite gradient were skipped"):
        for step in range(4):
            pipe.train_step(fj.nan_batch(step, poisoned=2))
    assert pipe.step_count == 3 and pipe.nonfinite_steps == 1
    assert _equal(pipe.named_parameters(), clean.named_parameters())
    assert _equal(_state(pipe), _state(clean))  # Adam's moments and step counts untouched too


def test_skip_goes_on_as_if_the_bad_step_had_not_been():
    clean = _emulated(microbatches=2)
    for step in (0, 1, 3):
        clean.train_step(fj.batch(step))
    pipe = _emulated(microbatches=2, on_nonfinite="skip")
    with pytest.warns(RuntimeWarning, match="step 3: the loss was nan"):
        losses = [pipe.train_step(fj.nan_batch(step, poisoned=2)) for step in range(4)]
    assert math.isnan(losses[2]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != 2)
    assert pipe.last_stats["nonfinite"] == 0 and pipe.nonfinite_steps == 1
    assert _equal(pipe.named_parameters(), clean.named_parameters())
    assert _equal(_state(pipe), _state(clean))


class _PoisonGrad(torch.nn.Module):
    """A linear layer whose weight gradient turns NaN at its ``at``-th backward (a gradient, not the loss: the
    gradient it passes to the stage before stays finite)."""

    def __init__(self, at: int):
        super().__init__()
        self.lin, self.at, self.backwards = torch.nn.Linear(8, 8), at, 0

    def _hook(self, g):
        self.backwards += 1
        return g * float("nan") if self.backwards == self.at else g

    def forward(self, x):
        w = self.lin.weight * 1.0  # a node of its own: its gradient feeds the weight's, not the input's
        w.register_hook(self._hook)
        return torch.nn.functional.linear(x, w, self.lin.bias)


def test_a_nan_gradient_in_an_asynchronous_pipeline_skips_only_that_update():
    from pipeoptim.train import Pipeline
    torch.manual_seed(0)
    pipe = Pipeline([torch.nn.Linear(8, 8), _PoisonGrad(at=6)], loss_fn=fj.mse, optimizer=fj.adam, devices=2,
                    schedule="async-1f1b", policy="pipeoptim", microbatches=4, emulate=True, on_nonfinite="skip")
    seen = []
    with pytest.warns(RuntimeWarning, match="step 2: a gradient held a NaN or inf"):
        for step in range(3):
            pipe.train_step(fj.batch(step))
            seen.append(pipe.last_stats["nonfinite"])
    assert seen == [0, 1, 0]  # the 6th backward of stage 1 is in the second window
    steps = {c.stage: max(int(s["step"]) for s in st.optimizer.state.values())
             for w in pipe.workers for c, st in w.stages.items()}
    assert steps == {0: 12, 1: 11}  # stage 0's gradient stayed finite: only stage 1 dropped one update
    assert all(torch.isfinite(p).all() for p in pipe.named_parameters().values())
    with pytest.raises(NonFiniteError, match="a gradient held a NaN or inf"):
        torch.manual_seed(0)
        strict = Pipeline([torch.nn.Linear(8, 8), _PoisonGrad(at=2)], loss_fn=fj.mse, optimizer=fj.adam,
                          devices=2, schedule="async-1f1b", microbatches=4, emulate=True)
        strict.train_step(fj.batch(0))


@pytest.mark.filterwarnings("ignore:step 3. the loss was nan")
def test_every_rank_stops_at_the_same_step_and_holds_what_the_emulator_holds(one_thread):
    """Distributed: the NaN appears only on the last stage's loss, yet both ranks stop at the same step."""
    ranks = launch(fj.nan_job, 2, 2, 5, timeout_s=240)
    stop_ref = fj.nan_run(_emulated(microbatches=2), 2, 5)
    skip_ref = fj.nan_run(_emulated(microbatches=4, schedule="async-1f1b", on_nonfinite="skip"), 2, 5)
    assert stop_ref["stopped"][0] == 3 and stop_ref["updates"] == {0: 2, 1: 2}
    assert skip_ref["stopped"] is None and skip_ref["updates"] == {0: 5 * 4 - 1, 1: 5 * 4 - 1}
    for rank, (stop, skip) in enumerate(ranks):
        assert stop["stopped"] == stop_ref["stopped"], rank
        assert skip["stopped"] is None and skip["nonfinite_steps"] == 1, rank
        assert skip["updates"][rank] == skip_ref["updates"][rank], rank
        for name, value in stop["params"].items():
            assert torch.equal(value, stop_ref["params"][name]), (rank, name)
        for name, value in skip["params"].items():
            assert torch.equal(value, skip_ref["params"][name]), (rank, name)
