"""Delay-aware hyper-parameters (pipeoptim.delay): the per-stage lr and momentum that each stage's optimizer holds
after every update equal the published formulas, written out here independently of the module; the option
refuses what it cannot do; a resumed run equals the uninterrupted one."""
from __future__ import annotations

import math

import pytest
import torch

import runtime_cases as rc
from pipeoptim.delay import DelayAwareHParams, DelayRules, lr_factor, momentum_for, stage_delays
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.runtime.config import make_schedule
from pipeoptim.runtime.plan import ConfigError
from pipeoptim.train import Pipeline

D, N = 4, 4


def _pipe(delay, schedule="async-1f1b", policy="pipeoptim", optimizer=rc.adamw, **kw):
    return Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=optimizer, devices=D, schedule=schedule,
                    policy=policy, microbatches=N, emulate=True, delay_hparams=delay, **kw)


def _optimizers(pipe):
    return {c.stage: st.optimizer for w in pipe.workers for c, st in w.stages.items()}


# The formulas as the papers write them, for stage `stage` of P on async 1F1B (delay τ = P − stage − 1).
def _pipemare(lr, tau, k, K):
    return lr / max(tau, 1) ** (1 - min(k / K, 1))


def _graphcore_lr(lr, stage, P):
    return lr * (0.25 + 0.75 * stage / (P - 1))


def _graphcore_momentum(m, stage, P):
    return 1 - (1 - m) * (0.1 + 0.9 * stage / (P - 1))


def _nesterov_beta1(m, tau, P):
    return m + tau * (0.99 - m) / P


def test_stage_delays_are_the_schedules_staleness():
    assert stage_delays(make_schedule("async-1f1b", 4, 8)) == {0: 3, 1: 2, 2: 1, 3: 0}
    assert stage_delays(make_schedule("async-zb", 4, 8)) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert stage_delays(make_schedule("2bw", 4, 8)) == {0: 1, 1: 1, 2: 1, 3: 0}
    assert stage_delays(make_schedule("1f1b", 4, 8)) == {0: 0, 1: 0, 2: 0, 3: 0}


@pytest.mark.parametrize("tau,k,K", [(3, 0, 8), (3, 5, 8), (3, 8, 8), (3, 20, 8), (0, 0, 8), (1, 2, 4), (15, 3, 64)])
def test_pipemare_factor(tau, k, K):
    assert lr_factor("pipemare", tau, 15, k, K) == pytest.approx(_pipemare(1.0, tau, k, K), rel=1e-12)


def test_linear_warmup_and_graphcore_factors():
    assert lr_factor("none", 3, 3, 0, 4) == 0.25 and lr_factor("none", 3, 3, 3, 4) == 1.0
    assert lr_factor("none", 3, 3, 7, 0) == 1.0
    for stage in range(4):
        tau = 3 - stage
        assert lr_factor("graphcore", tau, 3, 100, 0) == pytest.approx(_graphcore_lr(1.0, stage, 4))
        assert lr_factor("graphcore", tau, 3, 1, 4) == pytest.approx(_graphcore_lr(1.0, stage, 4) * 0.5)
        assert momentum_for("graphcore", 0.9, tau, 3, 4) == pytest.approx(_graphcore_momentum(0.9, stage, 4))
        assert momentum_for("nesterov", 0.9, tau, 3, 4) == pytest.approx(_nesterov_beta1(0.9, tau, 4))
    assert momentum_for("nesterov", 0.9, 3, 3, 4) < 0.99  # never reaches the cap for τ < P


def test_the_optimizer_of_every_stage_holds_the_formulas_after_every_update(one_thread):
    """PipeMare lr with K = 6 updates under the user's own LR scheduler, Nesterov-paper β1, through a real
    asynchronous pipeline: checked after each window (N updates per stage)."""
    base, K = 1e-2, 6
    decay = lambda i: 0.9 ** i  # noqa: E731
    pipe = _pipe(dict(lr="pipemare", momentum="nesterov", warmup=K),
                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, decay))
    seen = set()
    for window in range(3):
        pipe.train_step(rc.batch(window))
        k = (window + 1) * N
        for stage, opt in _optimizers(pipe).items():
            tau = D - stage - 1
            for g in opt.param_groups:
                assert g["lr"] == pytest.approx(_pipemare(base * decay(k), tau, k, K), rel=1e-12), (stage, k)
                assert g["betas"][0] == pytest.approx(_nesterov_beta1(0.9, tau, D), rel=1e-12)
                assert g["betas"][1] == 0.999
                seen.add(round(g["lr"], 12))
    assert len(seen) > 4  # the lrs really differ by stage and update


def test_graphcore_rules_on_sgd_momentum(one_thread):
    pipe = _pipe(dict(lr="graphcore", momentum="graphcore"), policy="stash", optimizer=rc.sgd)
    pipe.train_step(rc.batch(0))
    for stage, opt in _optimizers(pipe).items():
        g = opt.param_groups[0]
        assert g["lr"] == pytest.approx(_graphcore_lr(0.5, stage, D))
        assert g["momentum"] == pytest.approx(_graphcore_momentum(0.9, stage, D))


def test_the_prediction_uses_the_delayed_lr(one_thread):
    """The PipeOptim forward of stage 0 reads w − s·lr·Δ with the stage's delayed lr: one predicted step of an
    SGD-momentum stage is w − s·lr_k·buf."""
    pipe = _pipe(dict(lr="graphcore"), optimizer=rc.sgd)
    pipe.train_step(rc.batch(0))
    st = pipe.workers[0].stages[next(iter(pipe.workers[0].stages))]
    pol, opt = st.policy, st.optimizer
    lr = opt.param_groups[0]["lr"]
    assert lr == pytest.approx(0.5 * 0.25)
    g = pol.binding.groups[0]
    want = g.w - 2.0 * lr * g.state["momentum_buffer"]
    torch.testing.assert_close(pol.predictor.predict(2.0)[0], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("delay,words", [
    (dict(lr="pipemare"), "warm-up K > 0"),
    (dict(lr="fast"), "delay lr rule"),
    (dict(momentum="high"), "delay momentum rule"),
    (dict(warmup=-1), "whole number"),
    (dict(lr="none", beta=0.9), "unknown keys"),
])
def test_bad_rules_fail_with_the_rule(delay, words):
    with pytest.raises(ConfigError, match=words):
        _pipe(delay)


def test_synchronous_schedules_are_refused():
    with pytest.raises(ConfigError, match="synchronous"):
        _pipe(dict(momentum="nesterov"), schedule="1f1b", policy=None)


def test_momentum_rule_needs_a_momentum():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="neither 'betas' nor 'momentum'"):
        DelayAwareHParams(opt, DelayRules(momentum="nesterov"), delay=1, max_delay=1, stages=2)


def test_resume_equals_uninterrupted(tmp_path, one_thread):
    """The checkpoint's param groups come from one stage; loading re-applies each stage's own lr and β1."""
    delay = dict(lr="pipemare", momentum="graphcore", warmup=12)
    straight = _pipe(delay)
    for i in range(4):
        straight.train_step(rc.batch(i))
    first = _pipe(delay)
    for i in range(2):
        first.train_step(rc.batch(i))
    first.save(str(tmp_path / "ck"))
    resumed = _pipe(delay)
    resumed.load(str(tmp_path / "ck"))
    for stage, opt in _optimizers(resumed).items():
        want = _pipemare(1e-2, D - stage - 1, 2 * N, 12)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), stage
    for i in range(2, 4):
        resumed.train_step(rc.batch(i))
    for k, v in straight.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[k], v), k


def test_without_rules_nothing_changes(one_thread):
    plain, none = _pipe(None), _pipe(dict(lr="none", momentum="none", warmup=0))
    assert plain.delay_rules is None and none.delay_rules is None
    assert math.isclose(plain.train_step(rc.batch(0)), none.train_step(rc.batch(0)), rel_tol=0, abs_tol=0)


def test_rules_reach_every_child_of_a_chained_optimizer():
    from pipeoptim.optim import ChainedOptimizer
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    opt = ChainedOptimizer([torch.optim.Muon(mats, lr=0.02, momentum=0.95), torch.optim.AdamW(rest, lr=1e-3)])
    sched = DelayAwareHParams(opt, DelayRules(lr="graphcore", momentum="nesterov"), delay=2, max_delay=3, stages=4)
    muon, adamw = opt.children[0].param_groups[0], opt.children[1].param_groups[0]
    assert muon["momentum"] == pytest.approx(_nesterov_beta1(0.95, 2, 4))
    assert adamw["betas"][0] == pytest.approx(_nesterov_beta1(0.9, 2, 4))
    assert muon["lr"] == pytest.approx(_graphcore_lr(0.02, 1, 4)) and adamw["lr"] == pytest.approx(_graphcore_lr(1e-3, 1, 4))
    sched.step()
    assert muon["lr"] == pytest.approx(_graphcore_lr(0.02, 1, 4))  # no compounding across updates


def test_resume_keeps_each_stages_own_lr(tmp_path, one_thread):
    """The checkpoint's scheduler state comes from one stage; stages built with other lrs keep theirs."""
    def factory(params):
        params = list(params)
        lr = 1e-2 if any(p.shape[0] == 256 for p in params) else 5e-3   # embedding and head stages: 1e-2
        return torch.optim.AdamW(params, lr=lr)

    def make():
        return _pipe(dict(lr="graphcore", momentum="nesterov", warmup=6), optimizer=factory)
    straight = make()
    for i in range(4):
        straight.train_step(rc.batch(i))
    first = make()
    for i in range(2):
        first.train_step(rc.batch(i))
    first.save(str(tmp_path / "ck"))
    resumed = make()
    resumed.load(str(tmp_path / "ck"))
    for i in range(2, 4):
        resumed.train_step(rc.batch(i))
    for k, v in straight.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[k], v), k
