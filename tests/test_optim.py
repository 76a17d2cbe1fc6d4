"""Several optimizers as one (pipeoptim.optim): ChainedOptimizer steps, saves and loads as its children would,
an LR scheduler reaches every child, and a Pipeline whose optimizer factory returns [Muon, AdamW] trains as the
same optimizers stepping the unsplit model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.optim import ChainedOptimizer, as_optimizer, muon_and_adamw
from pipeoptim.train import Pipeline


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _split(model):
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)]


def _loss(model, i):
    g = torch.Generator().manual_seed(i)
    return model(torch.randn(4, 6, generator=g)).pow(2).mean()


def test_chained_steps_as_its_children():
    a, b = _model(), _model()
    chained, (muon, adamw) = ChainedOptimizer(_split(a)), _split(b)
    assert chained.param_groups[0] is chained.children[0].param_groups[0]
    for i in range(3):
        for model, opts in ((a, [chained]), (b, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            _loss(model, i).backward()
            for o in opts:
                o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert len(chained.state) == 4 and all(p in chained.state for p in a.parameters())
    assert "momentum_buffer" in chained.state[a[0].weight] and "exp_avg" in chained.state[a[0].bias]


def test_chained_state_dict_round_trip_and_scheduler():
    a = _model()
    opt = ChainedOptimizer(_split(a))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    for i in range(2):
        opt.zero_grad()
        _loss(a, i).backward()
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.children[0].param_groups] == [0.02 * 0.25]
    assert [g["lr"] for g in opt.children[1].param_groups] == [0.01 * 0.25]
    saved = copy.deepcopy(opt.state_dict())
    b = copy.deepcopy(a)
    opt_b = ChainedOptimizer([torch.optim.Muon([b[0].weight, b[2].weight], lr=1.0),
                              torch.optim.AdamW([b[0].bias, b[2].bias], lr=1.0)])
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0] is opt_b.children[0].param_groups[0]
    assert opt_b.children[0].param_groups[0]["lr"] == pytest.approx(0.005)
    assert torch.equal(opt_b.children[1].state[b[0].bias]["exp_avg"], opt.children[1].state[a[0].bias]["exp_avg"])
    for model, o in ((a, opt), (b, opt_b)):
        o.zero_grad()
        _loss(model, 7).backward()
        o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_bad_chains_are_refused():
    m = _model()
    with pytest.raises(ValueError, match="two of the chained optimizers"):
        ChainedOptimizer([torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD([m[0].weight], lr=0.1)])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        as_optimizer("adam")
    with pytest.raises(RuntimeError, match="chained optimizers"):
        ChainedOptimizer(_split(m)).add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def test_pipeline_with_muon_and_adamw_equals_the_unsplit_model(one_thread):
    """Synchronous 1F1B over 4 stages, each with [Muon (matrices), AdamW (the rest)], against one Muon and one
    AdamW over the unsplit model, 2 micro-batches of the same batches: bitwise equal on one thread (measured so;
    Muon's Newton–Schulz runs in bf16, so a last-bit difference of the gradient would show as a bf16 ulp)."""
    factory = muon_and_adamw(lr=0.02, adamw_lr=1e-2)
    pipe = Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=factory, devices=4, schedule="1f1b",
                    microbatches=2, emulate=True)
    assert all(isinstance(st.optimizer, ChainedOptimizer) for w in pipe.workers for st in w.stages.values())
    model = nn.Sequential(*gpt_layers(rc.CFG, seed=1))
    opts = factory(model.parameters())
    for i in range(3):
        x, y = rc.batch(i)
        loss = pipe.train_step((x, y))
        for o in opts:
            o.zero_grad()
        ref = sum(lm_loss(model(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
        ref.backward()
        for o in opts:
            o.step()
        assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    got = pipe.named_parameters()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=0, msg=name)


def test_async_pipeline_predicts_muon_from_its_last_update_and_resumes(tmp_path, one_thread):
    def make():
        return Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=muon_and_adamw(lr=0.02, adamw_lr=1e-2),
                        devices=4, schedule="async-1f1b", policy="pipeoptim", microbatches=4, emulate=True,
                        policy_options={"delta": "last_update"})
    straight = make()
    losses = [straight.train_step(rc.batch(i % 2)) for i in range(4)]
    assert losses[-1] < losses[0]
    first = make()
    for i in range(2):
        first.train_step(rc.batch(i % 2))
    first.save(str(tmp_path / "ck"))
    resumed = make()
    resumed.load(str(tmp_path / "ck"))
    for i in range(2, 4):
        resumed.train_step(rc.batch(i % 2))
    for k, v in straight.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[k], v), k


def test_a_checkpoint_of_one_chain_does_not_load_into_another(tmp_path, one_thread):
    from pipeoptim.runtime.checkpoint import CheckpointError

    def make(factory):
        return Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=factory, devices=2, schedule="1f1b",
                        microbatches=2, emulate=True)
    muon = make(muon_and_adamw(lr=0.02))
    muon.train_step(rc.batch(0))
    muon.save(str(tmp_path / "ck"))

    def sgd_and_adamw(params):
        params = list(params)
        return [torch.optim.SGD([p for p in params if p.ndim == 2], lr=0.1),
                torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-3)]
    with pytest.raises(CheckpointError, match=r"ChainedOptimizer\(Muon, AdamW\)"):
        make(sgd_and_adamw).load(str(tmp_path / "ck"))
    make(muon_and_adamw(lr=0.02)).load(str(tmp_path / "ck"))


def test_muon_at_adamw_scale_gives_both_optimizers_one_lr_and_weight_decay():
    from pipeoptim.optim import muon_at_adamw_scale
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(3))]
    muon, adamw = muon_at_adamw_scale(3e-3, momentum=0.9, weight_decay=0.05)(params)
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    m, a = muon.param_groups[0], adamw.param_groups[0]
    assert m["params"][0] is params[0] and a["params"][0] is params[1]
    assert m["adjust_lr_fn"] == "match_rms_adamw" and m["momentum"] == 0.9
    assert m["lr"] == a["lr"] == 3e-3 and m["weight_decay"] == a["weight_decay"] == 0.05
    assert a["betas"] == (0.9, 0.999)
