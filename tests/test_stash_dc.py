"""DC-ASGD's delay compensation on weight stashing (StashPolicy(dc=λ)): the gradient a step applies is the stale
gradient g plus λ·g⊙g⊙(w_now − w_stash), with g computed here on a copy of the stashed weights."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.policies import make_policy
from pipeoptim.train import Pipeline


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _x(i):
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(i), dtype=torch.float64)


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("lam", [0.0, 0.7])
def test_stale_gradient_is_corrected_to_todays_weights(lam):
    model = _model()
    start = copy.deepcopy(model)
    pol = make_policy("stash", model, torch.optim.SGD(model.parameters(), lr=0.3), dc=lam)
    with pol.forward(0):
        y0 = model(_x(0)).pow(2).sum()
    with pol.forward(1):                      # forwarded at version 0, backward after one step
        y1 = model(_x(1)).pow(2).sum()
    with pol.backward(0):
        y0.backward()
    pol.step()
    w_now = _flat(p.detach() for p in model.parameters()).clone()
    with pol.backward(1):
        y1.backward()
    got = _flat(pol.binding.grad_buffers())
    start(_x(1)).pow(2).sum().backward()      # the stale gradient, on the version-0 weights
    g = _flat(p.grad for p in start.parameters())
    w_stash = _flat(p.detach() for p in start.parameters())
    want = g + lam * g * g * (w_now - w_stash)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert lam == 0.0 or not torch.allclose(got, g)


def test_a_fresh_gradient_is_left_alone():
    model = _model()
    pol = make_policy("stash", model, torch.optim.SGD(model.parameters(), lr=0.3), dc=5.0)
    with pol.forward(0):
        y = model(_x(0)).pow(2).sum()
    with pol.backward(0):
        y.backward()
    ref = _model()
    ref(_x(0)).pow(2).sum().backward()
    torch.testing.assert_close(_flat(pol.binding.grad_buffers()), _flat(p.grad for p in ref.parameters()),
                               rtol=0, atol=0)


def test_bad_dc_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="finite number >= 0"):
        make_policy("stash", model, torch.optim.SGD(model.parameters(), lr=0.1), dc=-1.0)
    model = _model()
    with pytest.raises(ValueError, match="one micro-batch per update"):
        make_policy("2bw", model, torch.optim.SGD(model.parameters(), lr=0.1), update_every=4, dc=0.5)


@pytest.mark.parametrize("schedule", ["async-1f1b", "async-zb"])
def test_pipeline_with_dc_trains_and_differs_from_plain_stash(schedule, one_thread):
    def run(dc):
        pipe = Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.adamw, devices=4,
                        schedule=schedule, policy="stash", microbatches=4, emulate=True, policy_options={"dc": dc})
        return [pipe.train_step(rc.batch(i % 2)) for i in range(3)]
    plain, dc = run(0.0), run(50.0)
    assert plain[-1] != dc[-1] and dc[-1] < dc[0]
