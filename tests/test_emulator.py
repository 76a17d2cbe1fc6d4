"""The emulator's run order (``emulator.run_order``): derived once per plan from the data flow, it must run every
device's actions in that device's own order, each exactly once, every compute after the action that feeds it,
and a synchronous schedule's global norm before any device's first step. The numbers the emulator computes in
that order are checked against plain training and the distributed executor in tests/test_runtime*.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.runtime.config import make_schedule
from pipeoptim.runtime.emulator import NORM, run_order
from pipeoptim.runtime.plan import COMPUTE, STEP, SYNC, Plan
from pipeoptim.schedules.actions import Step, Sync

CASES = [("1f1b", 4, 8), ("gpipe", 4, 4), ("interleaved", 2, 4), ("zbv", 4, 8), ("bitpipe", 4, 8),
         ("async-1f1b", 4, 8), ("2bw", 4, 8), ("async-zb", 3, 6)]


@pytest.mark.parametrize("name,D,N", CASES)
def test_run_order_runs_each_device_in_its_own_order_and_every_input_first(name, D, N):
    plan = Plan(make_schedule(name, D, N))
    order = run_order(plan)
    ran = [[] for _ in range(D)]
    produced = set()
    norms = []
    for kind, d, a, src, out_to, index in order:
        if kind == NORM:
            norms.append(sum(len(r) for r in ran))
            continue
        members = src if kind == SYNC else [d]
        for e in members:
            assert plan.actions[e][len(ran[e])] == a, f"device {e} ran {a} out of its order"
            ran[e].append(a)
        assert index == len(ran[d]) - 1
        if kind == COMPUTE:
            if src is not None:
                assert a in produced, f"{a} ran before the action that feeds it"
                produced.remove(a)
            if out_to is not None:
                produced.add(out_to.to_op)
        if kind == SYNC:
            assert isinstance(a, Sync) and members == sorted(set(a.devices) | {d})
        if kind == STEP:
            assert isinstance(a, Step)
            assert not plan.schedule.synchronous or norms, "a synchronous step ran before the global norm"
    assert ran == plan.actions, "some action never ran, or ran twice"
    assert any(k == SYNC for k, *_ in order) == (name == "bitpipe")  # bitpipe's replicas sum their gradients
    assert not produced, "an input was produced that nothing consumed"
    if plan.schedule.synchronous:
        assert len(norms) == 1
        first_steps = [next(i for i, a in enumerate(row) if isinstance(a, Step)) for row in plan.actions]
        assert norms[0] == sum(first_steps), "the norm must come when every device stands at its first step"
    else:
        assert norms == []


def test_run_order_is_derived_once_per_plan_and_the_eval_plan_has_its_own():
    from pipeoptim.train import Pipeline
    torch.manual_seed(0)
    pipe = Pipeline([nn.Linear(8, 8) for _ in range(4)], balance=[2, 2], devices=2, emulate=True,
                    loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    schedule="1f1b", microbatches=4)
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    pipe.train_step(batch)
    emulator = pipe._runner
    first = emulator._order(pipe.plan)
    pipe.train_step(batch)
    pipe.eval_step(batch)
    assert emulator._order(pipe.plan) is first
    assert len(emulator._orders) == 2 and emulator._order(pipe.eval_plan) is not first
