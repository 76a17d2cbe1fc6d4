"""The runtime executes schedules correctly: the plan's derived facts, the emulator against plain
single-process training, and the distributed executor (gloo, spawned processes) against the emulator."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.runtime import launch
from pipeoptim.runtime.config import make_schedule
from pipeoptim.runtime.plan import Plan
from pipeoptim.schedules.actions import Chunk, Forward
from pipeoptim.schedules.staleness import version_difference


# ---- plan -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,D,N", [("async-1f1b", 4, 8), ("2bw", 4, 8), ("1f1b", 4, 4), ("bitpipe", 4, 8)])
def test_plan_s_matches_schedules_staleness(name, D, N):
    sched = make_schedule(name, D, N)
    plan = Plan(sched)
    ref = version_difference(sched)
    replica = sched.microbatch_replica
    for (stage, mb), s in ref.items():
        assert plan.s_forward(Forward(mb, stage, replica[mb])) == s


@pytest.mark.parametrize("name,D,N", [("1f1b", 4, 4), ("zbv", 4, 8), ("bitpipe", 4, 8), ("async-1f1b", 4, 8)])
def test_plan_program_says_of_each_action_what_the_plan_does(name, D, N):
    """The loops of the executor and the emulator read Plan.program instead of asking the plan per action."""
    from pipeoptim.runtime.plan import COMPUTE, STEP, SYNC, WEIGHT
    from pipeoptim.schedules.actions import BackwardWeight, Step, Sync, is_compute
    plan = Plan(make_schedule(name, D, N))
    assert [[a for _, a, _, _ in row] for row in plan.program] == plan.actions
    kinds = set()
    for row in plan.program:
        for kind, a, src, out_to in row:
            kinds.add(kind)
            if isinstance(a, BackwardWeight):
                assert (kind, src, out_to) == (WEIGHT, None, None)
            elif is_compute(a):
                assert (kind, src, out_to) == (COMPUTE, plan.input_source(a), plan.output_of(a))
            else:
                assert kind == (SYNC if isinstance(a, Sync) else STEP) and isinstance(a, (Sync, Step))
    assert {COMPUTE, STEP} <= kinds and (WEIGHT in kinds) == (name == "zbv")


def test_plan_async_1f1b_warmup_and_steady_state():
    plan = Plan(make_schedule("async-1f1b", 4, 8))
    for k in range(4):
        for j in range(8):
            assert plan.s_forward(Forward(j, k)) == min(j, 4 - k - 1)


def test_plan_loss_scale_and_update_every():
    assert Plan(make_schedule("1f1b", 4, 8)).loss_scale == 1 / 8
    p = Plan(make_schedule("bitpipe", 4, 8))
    assert p.loss_scale == 1 / 8 and p.update_every(Chunk(0, 0)) == 4
    assert Plan(make_schedule("async-1f1b", 4, 8)).loss_scale == 1.0
    assert Plan(make_schedule("2bw", 4, 8)).update_every(Chunk(0, 1)) == 4


def test_plan_spectrain_backward_lookahead_is_half_the_depth():
    plan = Plan(make_schedule("async-1f1b", 4, 12))
    # steady state, forward = backward: stage k steps floor(k/2) times before the micro-batch reaches stage 0
    assert [plan.s_backward[(6, Chunk(0, k))] for k in range(4)] == [0, 0, 1, 1]


# ---- emulator against plain training --------------------------------------------------------------------
@pytest.mark.parametrize("case", rc.SYNC_CASES[:5], ids=lambda c: c[0])
def test_emulated_synchronous_schedules_match_single_process_training(case, one_thread):
    # SGD: Adam's m/sqrt(v) would amplify rounding noise in gradients that are exactly zero in theory (the
    # attention key bias), so parity is checked where rounding stays rounding
    got = rc.train(rc.make_pipeline(case, emulate=True, optimizer=rc.sgd))
    ref, norms = rc.single_process_reference(gpt_layers(rc.CFG, seed=1), case[3])
    assert set(got["params"]) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)


def test_async_policies_differ_from_each_other(one_thread):
    finals = {c[1]: rc.train(rc.make_pipeline(c, emulate=True))["params"]["3.fc.weight"] for c in rc.ASYNC_CASES[:4]}
    names = list(finals)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert not torch.equal(finals[names[i]], finals[names[j]]), (names[i], names[j])


# ---- distributed executor against the emulator -------------------------------------------------------------
def test_distributed_executor_equals_emulator_for_every_schedule_and_policy(one_thread):
    cases = rc.SYNC_CASES + rc.ASYNC_CASES
    results = launch(rc.run_cases, 4, cases, timeout_s=200)
    for i, case in enumerate(cases):
        dist_params = {}
        for r in results:
            dist_params.update(r[i]["params"])
        emu = rc.train(rc.make_pipeline(case, emulate=True))
        assert set(dist_params) == set(emu["params"]), case
        exact = (case[4] == 1 and case[0] not in ("chimera", "bitpipe")) or case[2] == 2
        for name, value in emu["params"].items():
            if exact:
                assert torch.equal(dist_params[name], value), (case, name)
            else:  # sums over mirror ranks: gloo may add in another order (last-bit differences)
                torch.testing.assert_close(dist_params[name], value, rtol=1e-6, atol=1e-7, msg=str(case))
        for r in results:  # the loss is returned on every rank
            assert r[i]["losses"] == pytest.approx(emu["losses"], rel=1e-5), case


def test_an_iteration_reduces_its_scalars_once_and_every_rank_reports_the_same(one_thread):
    """Loss, global norm, times, skipped updates and stop requests travel in one reduction per iteration (issue 23),
    synchronous (at the first Step) and asynchronous (at the end), with data parallelism too; on gloo that reduction
    is no all-reduce (``scalars``); the loss and norm are the emulator's."""
    cases = [("1f1b", None, 4, 4, 1, {}), ("async-1f1b", "pipeoptim", 4, 4, 1, {"clip_norm": 1.0}),
             ("1f1b", None, 2, 2, 2, {})]  # (asynchronous stages measure their norms where they clip)
    results = launch(rc.count_reductions, 4, cases, timeout_s=200)
    for i, case in enumerate(cases):
        emu = rc.train(rc.make_pipeline(case, emulate=True))
        for r in results:
            # [squared norm, loss sum, losses, busy, wall, skipped, stop], and asynchronously one entry per rank:
            # each rank's largest per-stage gradient norm (issue 45.7: asynchronous rows had no norm)
            n = 7 if case[0] == "1f1b" else 7 + 4
            for step, (sizes, sums) in enumerate(zip(r[i]["sizes"], r[i]["scalar_sums"])):
                assert sums == [n], (case, step, sums)
                assert n not in sizes, (case, step, sizes)
                if case[4] == 1:  # without data parallelism nothing is all-reduced in these schedules
                    assert sizes == [], (case, step, sizes)
            got = r[i]["stats"]
            same = lambda stats: [{k: repr(v) for k, v in s.items()} for s in stats]  # noqa: E731  (nan == nan)
            assert same(got) == same(results[0][i]["stats"]), case
            assert [s["loss"] for s in got] == pytest.approx(emu["losses"], rel=1e-6), case
            assert [s["grad_norm"] for s in got] == pytest.approx(emu["norms"], rel=1e-6), case
            assert all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in got), case
            if case[0] == "1f1b":
                assert all(0.0 <= s["bubble"] < 1.0 and s["nonfinite"] == 0 for s in got), case


def test_on_gloo_every_receive_is_posted_when_an_iteration_starts_once_shapes_are_known(one_thread):
    """After the first iteration (and an evaluation in between, whose plan keeps its own shapes) every receive
    of a training iteration is posted before its first action and no header travels (``comm``: a receive
    posted late left the message to gloo's I/O thread, which doubled GPipe's step on 4 processes)."""
    cases = [("gpipe", None, 4, 4, 1, {}), ("1f1b", None, 4, 4, 1, {}), ("async-1f1b", "pipeoptim", 4, 4, 1, {}),
             ("1f1b", None, 2, 2, 2, {})]
    results = launch(rc.count_messages, 4, cases, timeout_s=200)
    for i, case in enumerate(cases):
        assert any(r[i][0]["headers_sent"] for r in results), case   # the first iteration agrees on shapes
        for r in results:
            for step, c in enumerate(r[i][1:], start=1):
                assert c["headers_sent"] == 0 and c["posted_later"] == 0, (case, step, c)
                assert c["posted_at_start"] == c["received"], (case, step, c)
        assert sum(c["received"] for r in results for c in r[i]) > 0, case

# ---- what the policies make the forward read, inside the runtime ---------------------------------------
@pytest.mark.parametrize("policy", ["pipeoptim", "stash", "none"])
def test_forward_reads_prediction_only_under_pipeoptim(policy):
    p = rc.make_pipeline(("async-1f1b", policy, 4, 4, 1, {}), emulate=True)
    p.train_step(rc.batch(0))  # optimizer state exists now, so predictions are not trivial
    st = p.workers[0].stages[Chunk(0, 0)]
    seen, real = [], []
    st.module.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.tok.weight.detach().clone()))
    inner = st.policy.call_forward  # what the runtime runs each forward through

    def call_forward(mb, s, lookahead, fn, *args):
        out = inner(mb, s, lookahead, fn, *args)
        real.append(st.module.layers[0].tok.weight.detach().clone())  # the real weights, once restored
        return out
    st.policy.call_forward = call_forward
    p.train_step(rc.batch(1))
    s = [p.plan.s_forward(Forward(j, 0)) for j in range(4)]
    assert s == [0, 1, 2, 3]
    expect = [x > 0 for x in s] if policy == "pipeoptim" else [False] * 4
    assert [not torch.equal(a, b) for a, b in zip(seen, real)] == expect


class _Scale(torch.autograd.Function):
    """y = x * w, recording at backward whether the saved w is the w its forward read, and whether the real
    weights still are (if not, the backward ran at another version than its forward)."""

    @staticmethod
    def forward(ctx, x, w, log):
        ctx.save_for_backward(x, w)  # goes through the policy's saved-tensor hooks, as any weight autograd saves
        ctx.seen, ctx.param, ctx.log = w.detach().clone(), w, log
        return x * w

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        ctx.log.append((torch.equal(w, ctx.seen), torch.equal(ctx.param.detach(), ctx.seen)))
        return gy * w, (gy * x).sum(dim=tuple(range(gy.dim() - 1))), None


_PROBE_LOG: list = []  # module-level: the Pipeline deep-copies its layers (and any list they hold)


class _Probe(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return _Scale.apply(x, self.w, _PROBE_LOG)


@pytest.mark.parametrize("policy", ["stash", "none"])
def test_stash_backward_reads_the_version_its_forward_read(policy):
    """Through the emulator (the executor's worker code): under 'stash' every backward on stage 0 reads the
    weights its forward read although the real weights moved on in between; under 'none' (the control that
    shows the probe can tell) the stale backwards read the moved weights."""
    from pipeoptim.train import Pipeline
    log = _PROBE_LOG
    log.clear()
    layers = gpt_layers(rc.CFG, seed=1)
    layers.insert(1, _Probe(rc.CFG.d_model))  # stage 0 = embedding + probe: s = 0, 1, 2, 3
    p = Pipeline(layers, loss_fn=lm_loss, optimizer=rc.sgd, devices=4, schedule="async-1f1b", policy=policy,
                 microbatches=4, balance=[2, 2, 2, 3], emulate=True)
    for i in range(2):
        p.train_step(rc.batch(i))
    assert len(log) == 8
    saved_is_forwards = [a for a, _ in log]
    real_is_forwards = [b for _, b in log]
    assert real_is_forwards.count(False) >= 3  # the weights did move between forward and backward
    if policy == "stash":
        assert all(saved_is_forwards)
    else:
        assert saved_is_forwards == real_is_forwards


def _spectrain_sgd(params):
    return torch.optim.SGD(params, lr=0.5)  # no smoothed gradient: SpecTrain keeps its own average (policy state)


_RESUME_CASE = ("async-1f1b", "spectrain", 2, 4, 1, {})


def resume_job(directory: str):
    """Rank side: two steps, save, a fresh pipeline loads, two more steps."""
    first = rc.make_pipeline(_RESUME_CASE, emulate=False, optimizer=_spectrain_sgd)
    for i in range(2):
        first.train_step(rc.batch(i))
    first.save(directory)
    resumed = rc.make_pipeline(_RESUME_CASE, emulate=False, optimizer=_spectrain_sgd)
    resumed.load(directory)
    for i in range(2, 4):
        resumed.train_step(rc.batch(i))
    return {k: v.detach().clone() for k, v in resumed.named_parameters().items()}


def test_distributed_resume_with_policy_state_equals_uninterrupted(tmp_path, one_thread):
    results = launch(resume_job, 2, str(tmp_path / "ck"), timeout_s=90)
    got = {}
    for r in results:
        got.update(r)
    straight = rc.make_pipeline(_RESUME_CASE, emulate=True, optimizer=_spectrain_sgd)
    for i in range(4):
        straight.train_step(rc.batch(i))
    for k, v in straight.named_parameters().items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("case", [rc.SYNC_CASES[1], rc.ASYNC_CASES[3]], ids=["1f1b", "async-1f1b+pipeoptim"])
def test_a_stop_asked_on_one_rank_reaches_every_rank_at_the_same_step(case):
    """``request_stop`` (what ``pipeoptim train`` calls on SIGTERM) travels in the iteration's scalars: every
    rank's ``last_stats["stop"]`` turns True at the very step after the request, whichever rank asked."""
    per_rank = launch(rc.stop_flags, 4, case, (0, 3), timeout_s=200)
    # per rank, per asker (rank 0, then the last rank, each on a fresh pipeline): the flags after each step
    assert per_rank == [[[False, True, True]] * 2] * 4, per_rank
    pipe = rc.make_pipeline(case, emulate=True)
    pipe.train_step(rc.batch(0))
    assert pipe.last_stats["stop"] is False
    pipe.request_stop()
    pipe.train_step(rc.batch(1))
    assert pipe.last_stats["stop"] is True
