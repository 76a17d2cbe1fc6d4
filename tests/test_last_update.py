"""The optimizer-agnostic "last update" prediction (pipeoptim.prediction.last_update,
PipeOptimPolicy(delta="last_update")):
ŵ = w + s·(lr_now/lr_t)·(w_t − w_{t−1}), checked against weights recorded here around each step; equal to the
optimizer's own Δ where the module docstring says it is exact; works for optimizers without a rule (Muon, NAdam,
chained ones); survives a checkpoint."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.optim import ChainedOptimizer
from pipeoptim.policies import make_policy


def _model(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias)).double()


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 6, generator=g, dtype=torch.float64)


def _train(policy, model, steps, record=None):
    """`steps` micro-batches, a step after each; `record` gets (w before, w after, lr) of every step."""
    for i in range(steps):
        with policy.forward(i, s=0):
            loss = model(_batch(i)).pow(2).mean()
        with policy.backward(i):
            loss.backward()
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        lr = policy.optimizer.param_groups[0]["lr"]
        policy.step()
        after = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        if record is not None:
            record.append((before, after, lr))


def _predicted(policy, s):
    return torch.cat([b.clone() for b in policy.predictor.predict(s)])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
], ids=["sgd-momentum", "adam"])
def test_equals_the_optimizers_own_delta_where_exact(make):
    preds = []
    for delta in ("optimizer", "last_update"):
        model = _model()
        pol = make_policy("pipeoptim", model, make(model.parameters()), delta=delta, mechanism="pointer",
                          backend="eager")
        _train(pol, model, 4)
        preds.append(_predicted(pol, 3.0))
    torch.testing.assert_close(preds[1], preds[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    lambda ps: torch.optim.NAdam(ps, lr=0.01, betas=(0.99, 0.999), decoupled_weight_decay=True, weight_decay=0.1),
    lambda ps: torch.optim.Muon(ps, lr=0.02),
], ids=["adamw", "nadam", "muon"])
def test_prediction_is_the_last_applied_update(make):
    model = _model(bias=False)  # Muon takes 2-D weights only
    pol = make_policy("pipeoptim", model, make(model.parameters()), delta="last_update", mechanism="pointer",
                      backend="eager")
    record = []
    _train(pol, model, 3, record)
    before, after, _ = record[-1]
    torch.testing.assert_close(_predicted(pol, 2.0), after + 2.0 * (after - before), rtol=1e-12, atol=1e-12)
    # a changed lr rescales the extrapolated update to the lr the next step will use
    pol.optimizer.param_groups[0]["lr"] *= 0.25
    torch.testing.assert_close(_predicted(pol, 2.0), after + 0.5 * (after - before), rtol=1e-12, atol=1e-12)
    assert pol.memory_report()["last_update"] == after.numel() * 8


@pytest.mark.parametrize("options,gamma", [({}, 1.0), ({"extrapolate": 2.0}, 2.0)], ids=["default", "extrapolate-2"])
def test_the_forward_reads_the_prediction_and_the_backward_the_real_weights(options, gamma):
    """The forward of s = 1 reads w + γ·u (u the last update; γ = `extrapolate`, 1 by default), the backward the
    real weights."""
    model = _model(bias=False)
    pol = make_policy("pipeoptim", model, torch.optim.Muon(model.parameters(), lr=0.02), delta="last_update",
                      mechanism="pointer", backend="eager", **options)
    record = []
    _train(pol, model, 2, record)
    before, after, _ = record[-1]
    seen = []
    handle = model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone().reshape(-1)))
    with pol.forward("x", s=1):
        model(_batch(9)).sum()
    handle.remove()
    n = model[0].weight.numel()
    torch.testing.assert_close(seen[0], (after + gamma * (after - before))[:n], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[0].weight.detach().reshape(-1), after[:n], rtol=0, atol=0)
    pol.discard("x")


def test_an_optimizer_without_a_rule_needs_delta_last_update():
    model = _model(bias=False)
    with pytest.raises(ValueError, match="no prediction rule for optimizer Muon"):
        make_policy("pipeoptim", model, torch.optim.Muon(model.parameters(), lr=0.02))
    model = _model(bias=False)
    for name in ("none", "stash", "spectrain"):    # policies that do not read the optimizer's Δ bind it
        m = _model(bias=False)
        make_policy(name, m, torch.optim.Muon(m.parameters(), lr=0.02))
    with pytest.raises(ValueError, match="one or the other"):
        make_policy("pipeoptim", model, torch.optim.SGD(model.parameters(), lr=0.1), delta="last_update", mode="paper")
    with pytest.raises(ValueError, match="delta must be one of"):
        make_policy("pipeoptim", model, torch.optim.SGD(model.parameters(), lr=0.1), delta="ema")


def test_state_dict_carries_the_last_update():
    runs = []
    for split in (False, True):
        model = _model(bias=False)
        pol = make_policy("pipeoptim", model, torch.optim.Muon(model.parameters(), lr=0.02), delta="last_update",
                          mechanism="pointer", backend="eager")
        _train(pol, model, 3)
        if split:
            saved = pol.state_dict()
            assert "last_update" in next(iter(saved["params"].values()))
            model2 = _model(seed=5, bias=False)
            opt2 = torch.optim.Muon(model2.parameters(), lr=0.02)
            with torch.no_grad():
                for p, q in zip(model2.parameters(), model.parameters()):
                    p.copy_(q)
            opt2.load_state_dict(pol.optimizer.state_dict())
            pol = make_policy("pipeoptim", model2, opt2, delta="last_update", mechanism="pointer", backend="eager")
            pol.load_state_dict(saved)
        runs.append(_predicted(pol, 2.0))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def test_chained_muon_and_adamw_predict_from_their_last_update():
    model = _model()
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    opt = ChainedOptimizer([torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=0.01)])
    pol = make_policy("pipeoptim", model, opt, delta="last_update", mechanism="pointer", backend="eager")
    record = []
    _train(pol, model, 3, record)
    before, after, _ = record[-1]
    # the binding's flat order is per param group (Muon's matrices, then AdamW's vectors)
    order = mats + rest
    index = {id(p): i for i, p in enumerate(model.parameters())}
    sizes = [p.numel() for p in model.parameters()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    want = torch.cat([(after + 2.0 * (after - before))[starts[index[id(p)]]:starts[index[id(p)]] + p.numel()]
                      for p in order])
    torch.testing.assert_close(_predicted(pol, 2.0), want, rtol=1e-12, atol=1e-12)


def test_bf16_working_weights_read_the_prediction_of_the_fp32_masters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False))
    pol = make_policy("pipeoptim", model, torch.optim.Muon(model.parameters(), lr=0.02), delta="last_update",
                      mechanism="pointer", backend="eager", working_dtype=torch.bfloat16)
    masters = [m for _, m in pol.binding.named_master_params()]
    for i in range(3):
        with pol.forward(i, s=0):
            loss = model(_batch(i).to(torch.bfloat16)).float().pow(2).mean()
        with pol.backward(i):
            loss.backward()
        before = torch.cat([m.detach().reshape(-1).clone() for m in masters])
        pol.step()
    after = torch.cat([m.detach().reshape(-1).clone() for m in masters])
    got = _predicted(pol, 2.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), after + 2.0 * (after - before), rtol=1e-2, atol=1e-3)
    assert pol.last_update.buffers[0].dtype == torch.float32


@pytest.mark.parametrize("fused", [False, True], ids=["step-then-predict", "fused-step-predict"])
def test_extrapolate_with_the_optimizers_own_rule_is_a_longer_prediction(fused):
    """With the optimizer's own Δ (Adam), γ = 1.5 at s = 2 predicts what γ = 1 predicts at s = 3, through the
    plain and the fused step+predict path alike."""
    weights = []
    for gamma, s in ((1.5, 2.0), (1.0, 3.0)):
        model = _model()
        pol = make_policy("pipeoptim", model, torch.optim.Adam(model.parameters(), lr=0.01), mechanism="pointer",
                          backend="eager", extrapolate=gamma, fused=fused)
        for i in range(3):
            with pol.forward(i, s=0):
                loss = model(_batch(i)).pow(2).mean()
            with pol.backward(i):
                loss.backward()
            pol.step(next_s=s)
        seen = []
        handle = model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
        with pol.forward("x", s=s):
            model(_batch(9)).sum()
        handle.remove()
        pol.discard("x")
        weights.append(seen[0])
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_extrapolate_refuses_what_is_not_a_positive_factor(bad):
    model = _model()
    with pytest.raises(ValueError, match="extrapolate is the factor"):
        make_policy("pipeoptim", model, torch.optim.Adam(model.parameters(), lr=0.01), extrapolate=bad)
