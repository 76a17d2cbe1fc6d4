"""Split backwards in the runtime: the zero-bubble schedules train exactly as plain single-process training, the
asynchronous one (async-zb) exactly as an unsplit backward run at each I with its gradient added at the W, for
every weight policy, and the distributed executor equals the emulator on them."""
from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.runtime import launch
from pipeoptim.runtime.config import make_schedule
from pipeoptim.runtime.plan import Plan
from pipeoptim.runtime.worker import DeviceWorker
from pipeoptim.schedules.actions import BackwardInput, Forward
from pipeoptim.schedules.staleness import version_difference

SPLIT_SYNC = [("zb-h1", None, 4, 4, 1, {}), ("zbv", None, 4, 4, 1, {}), ("dualpipev", None, 4, 8, 1, {}),
              ("zb-h1", None, 2, 2, 2, {})]
SPLIT_ASYNC = [("async-zb", p, 4, 8, 1, {}) for p in ("none", "stash", "spectrain", "pipeoptim")]


@pytest.mark.parametrize("case", SPLIT_SYNC[:3], ids=lambda c: c[0])
def test_split_schedules_match_single_process_training(case, one_thread):
    got = rc.train(rc.make_pipeline(case, emulate=True, optimizer=rc.sgd))
    ref, norms = rc.single_process_reference(gpt_layers(rc.CFG, seed=1), case[3])
    assert set(got["params"]) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)


class UnsplitAtInput(DeviceWorker):
    """The reference for a split backward: at its I, one unsplit backward (the gradients of inputs and parameters
    in one autograd call) inside the policy's input part; at its W, those parameter gradients added to the
    gradient buffer inside the policy's weight part."""

    def backward(self, op, grads):
        if not isinstance(op, BackwardInput):
            return super().backward(op, grads)
        st = self.stages[op.chunk]
        xs, outs = self.saved.pop((op.mb, op.chunk))
        tensors, grad_tensors = self._output_grads(op, self.plan.is_last(op.chunk), outs, grads)
        lookahead = self.plan.s_backward.get((op.mb, op.chunk), 0)
        want = [i for i, x in enumerate(xs) if isinstance(x, torch.Tensor) and x.requires_grad]
        params = [p for p in st.module.parameters() if p.requires_grad]
        with st.policy.backward(op.mb, s=lookahead, part="input"):
            g = torch.autograd.grad(tensors, [xs[i] for i in want] + params, grad_tensors, allow_unused=True)
        self.weight_work[(op.mb, op.chunk)] = (list(zip(params, g[len(want):])), lookahead)
        dxs = [None] * len(xs)
        for i, gi in zip(want, g):
            dxs[i] = gi
        return None if op.stage == 0 else tuple(dxs)

    def backward_weight(self, op):
        st = self.stages[op.chunk]
        pairs, lookahead = self.weight_work.pop((op.mb, op.chunk))
        with st.policy.backward(op.mb, s=lookahead, part="weight"), torch.no_grad():
            for p, g in pairs:
                if g is not None:
                    p.grad.add_(g)


@pytest.mark.parametrize("case", SPLIT_ASYNC, ids=lambda c: c[1])
def test_async_split_backward_equals_an_unsplit_backward_at_each_input_pass(case, one_thread):
    """Steps fall between a micro-batch's I and W here (device d runs each W d micro-batches late), so this is
    where a policy could read the wrong weights in W; the GPT's weight gradients read no weights, so both must
    agree exactly."""
    split = rc.make_pipeline(case, emulate=True)
    reference = rc.make_pipeline(case, emulate=True)
    for w in reference.workers:
        w.__class__ = UnsplitAtInput
    a, b = rc.train(split), rc.train(reference)
    assert a["losses"] == b["losses"]
    for name, value in b["params"].items():
        torch.testing.assert_close(a["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    # the control: async-zb differs from async-1f1b (the schedule changes when gradients land)
    other = rc.train(rc.make_pipeline(("async-1f1b",) + case[1:], emulate=True))
    assert not torch.equal(other["params"]["3.fc.weight"], a["params"]["3.fc.weight"])


def test_plan_gives_async_zb_the_steps_up_to_the_weight_gradient():
    sched = make_schedule("async-zb", 4, 16)
    plan = Plan(sched)
    ref = version_difference(sched)
    for (stage, mb), s in ref.items():
        assert plan.s_forward(Forward(mb, stage)) == s
    assert [plan.s_forward(Forward(10, k)) for k in range(4)] == [3, 3, 3, 3]   # D-1 on every stage
    assert plan.update_every(sched.chunks[0][0]) == 1 and plan.loss_scale == 1.0


@pytest.mark.slow
def test_distributed_executor_equals_emulator_on_split_schedules(one_thread):
    """zbv (V turn, split everywhere), dualpipev (full and split backwards mixed), zb-h1 with data parallelism,
    async-zb with PipeOptim: processes over gloo give the emulator's weights bit for bit."""
    cases = SPLIT_SYNC[1:] + [SPLIT_ASYNC[3]]
    results = launch(rc.run_cases, 4, cases, timeout_s=200)
    for i, case in enumerate(cases):
        dist_params = {}
        for r in results:
            dist_params.update(r[i]["params"])
        emu = rc.train(rc.make_pipeline(case, emulate=True))
        assert set(dist_params) == set(emu["params"]), case
        for name, value in emu["params"].items():
            assert torch.equal(dist_params[name], value), (case, name)
        for r in results:
            assert r[i]["losses"] == pytest.approx(emu["losses"], rel=1e-5), case
