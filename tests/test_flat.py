"""Tests of pipeoptim.prediction.flat: parameters, gradients and optimizer state live in flat buffers, and the
unmodified optimizer trains exactly as it does unbound, through state_dict round trips and zero_grad."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import pipeoptim_kernels as pk
from pipeoptim.prediction.flat import bind, register_optimizer, rule_for
from pipeoptim.prediction.predictor import Predictor, SavedWeights

O = torch.optim
CONFIGS = {
    "sgd": lambda p: O.SGD(p, lr=0.1),
    "sgdm_damp_foreach": lambda p: O.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, foreach=True),
    "sgdm_damp_single": lambda p: O.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, foreach=False),
    "sgd_nesterov_fused": lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, fused=True),
    "adam_single": lambda p: O.Adam(p, lr=1e-2, foreach=False),
    "adam_foreach_ams": lambda p: O.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "adam_fused": lambda p: O.Adam(p, lr=1e-2, fused=True),
    "adamw_foreach": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "rmsprop_centered_mom": lambda p: O.RMSprop(p, lr=1e-2, momentum=0.5, centered=True, foreach=True),
    "rmsprop_single": lambda p: O.RMSprop(p, lr=1e-2, foreach=False),
    "adagrad_foreach": lambda p: O.Adagrad(p, lr=1e-2, initial_accumulator_value=0.1, foreach=True),
    "adagrad_fused": lambda p: O.Adagrad(p, lr=1e-2, fused=True),
    "adamax_single": lambda p: O.Adamax(p, lr=1e-2, foreach=False),
    "nadam_foreach": lambda p: O.NAdam(p, lr=1e-2, foreach=True),
    "nadam_single": lambda p: O.NAdam(p, lr=1e-2, foreach=False),
    "radam_foreach": lambda p: O.RAdam(p, lr=1e-2, foreach=True),
}


def model():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 2))


def batch(gen):
    return torch.randn(4, 2, 4, 4, generator=gen)


def run(m, optimizer, steps, seed, zero=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(batch(gen)).pow(2).mean().backward()
        optimizer.step()
        (zero or optimizer.zero_grad)()


def pair(config, seed=0):
    torch.manual_seed(seed)
    bound = model()
    plain = copy.deepcopy(bound)
    opt_b, opt_p = CONFIGS[config](bound.parameters()), CONFIGS[config](plain.parameters())
    return bound, opt_b, bind(bound, opt_b), plain, opt_p


def assert_bound(m, optimizer, binding):
    """Every parameter, gradient and per-element state tensor is a view into the binding's flat buffers."""
    for g in binding.groups:
        for j, p in enumerate(g.params):
            assert p.data_ptr() == g.view(g.work, j).data_ptr()
            assert p.grad is None or p.grad.data_ptr() == g.view(g.grad, j).data_ptr()
            for key, value in optimizer.state[p].items():
                if value.dim():
                    assert value.data_ptr() == g.view(g.state[key], j).data_ptr(), key
                else:
                    assert value.data_ptr() == g.scalars[key][j].data_ptr(), key


def assert_same_training(a, opt_a, b, opt_b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), (n, key)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_bound_optimizer_trains_exactly_like_unbound(config):
    bound, opt_b, binding, plain, opt_p = pair(config)
    run(bound, opt_b, 3, seed=1, zero=binding.zero_grad)
    run(plain, opt_p, 3, seed=1)
    assert_same_training(bound, opt_b, plain, opt_p)
    assert_bound(bound, opt_b, binding)
    assert binding.version == 3


def test_state_is_flat_before_the_first_step():
    m = model()
    optimizer = O.Adam(m.parameters(), lr=1e-2, amsgrad=True)
    binding = bind(m, optimizer)
    g = binding.groups[0]
    assert set(g.state) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} and set(g.scalars) == {"step"}
    assert_bound(m, optimizer, binding)
    assert binding.step_count(g) == 0


def test_sgd_momentum_created_lazily_by_torch_is_rehomed():
    """Regression: torch's SGD clones the gradient into a new momentum_buffer on its first step, which
    would leave the state outside the flat buffer."""
    bound, opt_b, binding, plain, opt_p = pair("sgdm_damp_single")
    assert "momentum_buffer" not in binding.groups[0].state
    run(bound, opt_b, 1, seed=2, zero=binding.zero_grad)
    assert_bound(bound, opt_b, binding)
    run(bound, opt_b, 2, seed=3, zero=binding.zero_grad)
    run(plain, opt_p, 1, seed=2)
    run(plain, opt_p, 2, seed=3)
    assert_same_training(bound, opt_b, plain, opt_p)


@pytest.mark.parametrize("config", ["sgdm_damp_foreach", "adam_foreach_ams", "nadam_single", "adagrad_foreach"])
def test_state_dict_round_trip_keeps_the_binding(config):
    bound, opt_b, binding, plain, opt_p = pair(config)
    run(bound, opt_b, 2, seed=1, zero=binding.zero_grad)
    run(plain, opt_p, 2, seed=1)
    saved = io.BytesIO()
    torch.save(opt_b.state_dict(), saved)
    run(bound, opt_b, 2, seed=5, zero=binding.zero_grad)  # move on, then go back
    saved.seek(0)
    opt_b.load_state_dict(torch.load(saved))
    assert_bound(bound, opt_b, binding)
    with torch.no_grad():
        for p, q in zip(bound.parameters(), plain.parameters()):
            p.copy_(q)
    run(bound, opt_b, 2, seed=3, zero=binding.zero_grad)
    run(plain, opt_p, 2, seed=3)
    assert_same_training(bound, opt_b, plain, opt_p)
    assert_bound(bound, opt_b, binding)
    steps = binding.step_count(binding.groups[0])
    assert steps > 0 if config.startswith("sgd") else steps == 4  # SGD keeps no step count, only "has stepped"


def test_in_memory_state_dict_from_another_optimizer_is_copied_in_not_aliased():
    bound, opt_b, binding, plain, opt_p = pair("adam_single")
    run(plain, opt_p, 2, seed=1)
    opt_b.load_state_dict(opt_p.state_dict())
    assert_bound(bound, opt_b, binding)
    first = next(plain.parameters())
    before = opt_p.state[first]["exp_avg"].clone()
    run(bound, opt_b, 1, seed=2, zero=binding.zero_grad)
    assert torch.equal(opt_p.state[first]["exp_avg"], before)


def test_zero_grad_set_to_none_is_survived():
    bound, opt_b, binding, plain, opt_p = pair("adamw_foreach")
    run(bound, opt_b, 3, seed=1, zero=lambda: opt_b.zero_grad(set_to_none=True))
    run(plain, opt_p, 3, seed=1)
    assert_same_training(bound, opt_b, plain, opt_p)
    bound(batch(torch.Generator().manual_seed(0))).sum().backward()
    opt_b.step()
    assert_bound(bound, opt_b, binding)
    flat = binding.grad_buffers()[0]
    assert flat.abs().sum() > 0
    assert torch.equal(flat, torch.cat([p.grad.reshape(-1) for p in bound.parameters()]))


def test_several_groups_dtypes_and_frozen_parameters():
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).double(), nn.Linear(2, 2))
    m[2].weight.requires_grad_(False)
    optimizer = O.SGD([{"params": list(m[0].parameters()) + list(m[1].parameters())},
                       {"params": list(m[2].parameters()), "lr": 0.5}], lr=0.1, momentum=0.9)
    frozen_ptr = m[2].weight.data_ptr()
    binding = bind(m, optimizer)
    assert [(g.index, g.w.dtype, len(g.params)) for g in binding.groups] == [
        (0, torch.float32, 2), (0, torch.float64, 2), (1, torch.float32, 1)]
    assert m[2].weight.data_ptr() == frozen_ptr
    x = torch.randn(5, 3)
    for _ in range(2):
        m[2](m[1](m[0](x).double()).float()).sum().backward()
        optimizer.step()
        binding.zero_grad()
    assert_bound(m, optimizer, binding)


def test_unsupported_optimizer_error_lists_supported_and_how_to_register():
    m = model()
    before = [p.data_ptr() for p in m.parameters()]
    for optimizer in (O.LBFGS(m.parameters()), _SignSGD(m.parameters(), lr=0.1)):
        with pytest.raises(ValueError) as info:
            bind(m, optimizer)
        message = str(info.value)
        assert type(optimizer).__name__ in message and "torch.optim.Adam" in message
        assert "register_rule" in message and "register_optimizer" in message
    assert [p.data_ptr() for p in m.parameters()] == before  # nothing was modified


class _SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["last_sign"] = p.grad.sign()
                    p.add_(self.state[p]["last_sign"], alpha=-group["lr"])


def test_registered_custom_optimizer_predicts_with_its_rule():
    name = "test_flat_signsgd"
    if pk.rules.custom_rule(name) is None:
        pk.register_rule(name, lambda w, state, group, step: state["last_sign"])
    register_optimizer(_SignSGD, name)
    m = model()
    optimizer = _SignSGD(m.parameters(), lr=0.1)
    assert rule_for(optimizer) == name
    binding = bind(m, optimizer)
    predictor = Predictor(binding, SavedWeights(binding))
    run(m, optimizer, 2, seed=1, zero=binding.zero_grad)
    assert_bound(m, optimizer, binding)
    buf = predictor.predict(3.0)[0]
    g = binding.groups[0]
    for j, p in enumerate(g.params):
        expected = p.detach() - 3.0 * 0.1 * optimizer.state[p]["last_sign"]
        assert torch.allclose(g.view(buf, j), expected)


def test_mixed_precision_keeps_fp32_masters_in_the_optimizer():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(m)
    optimizer = O.Adam(m.parameters(), lr=1e-2)
    binding = bind(m, optimizer, working_dtype=torch.bfloat16)
    masters = [t for t in optimizer.param_groups[0]["params"]]
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert all(t.dtype == torch.float32 for t in masters)
    ref_masters = [p.detach().clone() for p in reference.parameters()]
    ref_opt = O.Adam(ref_masters, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 6, generator=gen).bfloat16()
        m(x).float().pow(2).mean().backward()
        grads = [p.grad.float() for p in m.parameters()]
        optimizer.step()
        binding.zero_grad()
        for t, gr in zip(ref_masters, grads):
            t.grad = gr
        ref_opt.step()
    for t, r, p in zip(masters, ref_masters, m.parameters()):
        assert torch.equal(t, r)
        assert torch.equal(p.detach(), r.to(torch.bfloat16))
    assert_bound_mixed(binding, optimizer)


def assert_bound_mixed(binding, optimizer):
    for g in binding.groups:
        assert g.mixed and g.work.dtype == torch.bfloat16 and g.w.dtype == torch.float32
        for j, (p, t) in enumerate(zip(g.params, g.masters)):
            assert p.data_ptr() == g.view(g.work, j).data_ptr()
            assert t.data_ptr() == g.view(g.w, j).data_ptr()
            assert optimizer.state[t]["exp_avg"].data_ptr() == g.view(g.state["exp_avg"], j).data_ptr()


def test_bind_refuses_bad_inputs_before_modifying_anything():
    m = model()
    other = nn.Linear(2, 2)
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ValueError, match="not in the module"):
        bind(m, O.SGD(list(m.parameters()) + list(other.parameters()), lr=0.1))
    with pytest.raises(ValueError, match="working_dtype"):
        bind(m, O.SGD(m.parameters(), lr=0.1), working_dtype=torch.float64)
    half = nn.Linear(2, 2).half()
    with pytest.raises(TypeError, match="float32"):
        bind(half, O.SGD(half.parameters(), lr=0.1), working_dtype=torch.bfloat16)
    assert [p.data_ptr() for p in m.parameters()] == before
    optimizer = O.SGD(m.parameters(), lr=0.1)
    bind(m, optimizer)
    with pytest.raises(ValueError, match="already bound"):
        bind(m, optimizer)


def test_uneven_step_counts_are_reported_by_name():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    optimizer = O.Adam(m.parameters(), lr=1e-2)
    binding = bind(m, optimizer)
    m(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    optimizer.state[m[1].bias]["step"].sub_(1)  # as if it had missed a step
    binding._step_cache.clear()
    with pytest.raises(ValueError, match="1.bias"):
        binding.step_count(binding.groups[0])
