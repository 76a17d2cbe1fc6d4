"""PipeOptim on the other asynchronous schedules (issue 20): on 2BW (gradients accumulated over m >= D micro-batches,
one update per m) it predicts the one update that remains between a forward and its backward; on async-zb the
D - 1 updates up to the deferred weight gradient. Checked: every forward reads w - s·lr·Δ with s counted in the
schedule's updates, the last stage reads the real weights, and both train."""
from __future__ import annotations

import pytest
import torch

import pipeoptim_kernels as pk
import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.schedules.staleness import version_difference
from pipeoptim.train import Pipeline


def _record(pipe):
    """Wrap every stage's policy.forward: record (stage, mb, s) and the largest |param − predicted| seen."""
    seen, worst = [], [0.0]
    for w in pipe.workers:
        for c, st in w.stages.items():
            pol, module = st.policy, st.module
            original = pol.forward

            def forward(mb, s=0, lookahead=0, _orig=original, _pol=pol, _stage=c.stage):
                seen.append((_stage, mb, s))
                return _orig(mb, s=s, lookahead=lookahead)
            pol.forward = forward

            def hook(mod, args, _pol=pol, _stage=c.stage):
                s = seen[-1][2]
                b = _pol.binding
                for g in b.groups:
                    want = g.w.clone()
                    if s > 0 and b.step_count(g) > 0:
                        pk.predict(g.rule, g.w, b.state_for_kernel(g), b.group_hparams(g), step=b.step_count(g),
                                   s=s, out=want, backend="eager")
                    got = torch.cat([p.detach().reshape(-1) for p in g.params])
                    worst[0] = max(worst[0], float((got - want).abs().max()))
            module.register_forward_pre_hook(hook)
    return seen, worst


@pytest.mark.parametrize("schedule,N,expect_s", [("2bw", 8, {0, 1}), ("async-zb", 4, {0, 1, 2, 3})])
def test_forwards_read_the_prediction_for_the_schedules_updates(schedule, N, expect_s, one_thread):
    pipe = Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.adamw, devices=4, schedule=schedule,
                    policy="pipeoptim", microbatches=N, emulate=True, policy_options={"mechanism": "pointer"})
    if schedule == "2bw":
        assert all(st.policy.update_every == 4 for w in pipe.workers for st in w.stages.values())
    seen, worst = _record(pipe)
    losses = [pipe.train_step(rc.batch(i % 2)) for i in range(4)]
    s_of = version_difference(pipe.schedule)
    assert seen and all(s == s_of[(stage, mb)] for stage, mb, s in seen)
    assert {s for _, _, s in seen} == expect_s
    assert all(s == 0 for stage, _, s in seen if stage == 3 and schedule == "2bw")
    assert worst[0] < 1e-6                      # forwards read w − s·lr·Δ (real weights where s = 0)
    assert losses[-1] < losses[0]


def test_pipeoptim_on_2bw_predicts_where_2bw_stashes(one_thread):
    """Same schedule, same start: the 2BW policy's forward reads the real weights and its backward the stashed
    version; PipeOptim's forward reads the prediction and its backward the real weights, so the runs differ
    after the first update and PipeOptim holds one prediction buffer instead of a stash."""
    kw = dict(loss_fn=lm_loss, optimizer=rc.adamw, devices=4, schedule="2bw", microbatches=8, emulate=True)
    two = Pipeline(gpt_layers(rc.CFG, seed=1), policy="2bw", **kw)
    pred = Pipeline(gpt_layers(rc.CFG, seed=1), policy="pipeoptim", **kw)
    a = [two.train_step(rc.batch(i)) for i in range(2)]
    b = [pred.train_step(rc.batch(i)) for i in range(2)]
    assert a[0] == pytest.approx(b[0], rel=1e-6) and a[1] != b[1]
    first = pred.workers[0].stages[next(iter(pred.workers[0].stages))].policy
    assert first.memory_report()["prediction"] > 0


def test_twice_the_micro_batches_in_flight_predict_twice_as_far(one_thread):
    """async 1F1B with in_flight=2 (schedule_options): every forward reads w − s·lr·Δ with the deeper schedule's
    s, which reaches 2·(D−1) on the first stage, and the pipeline trains."""
    pipe = Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.adamw, devices=4,
                    schedule="async-1f1b", schedule_options={"in_flight": 2}, policy="pipeoptim", microbatches=8,
                    emulate=True, policy_options={"mechanism": "pointer"})
    seen, worst = _record(pipe)
    losses = [pipe.train_step(rc.batch(i % 2)) for i in range(4)]
    s_of = version_difference(pipe.schedule)
    assert seen and all(s == s_of[(stage, mb)] for stage, mb, s in seen)
    assert max(s for stage, _, s in seen if stage == 0) == 6
    assert worst[0] < 1e-6
    assert losses[-1] < losses[0]
