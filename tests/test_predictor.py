"""Tests of pipeoptim.prediction.predictor: predicted weights, the forward under prediction, backward semantics.

The references are independent of pipeoptim_kernels.rules: the float64 prediction ŵ = w − s·lr·Δ with Δ
from torch.optim's update rules as tests/kernel_reference.py writes them, and gradients computed by hand (the output
gradient from the ŵ forward, every backward op with the weights real at backward time). The helpers
at the top are shared with tests/test_policies.py.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_input, conv2d_weight
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernel_reference import reference_delta

import pipeoptim_kernels as pk
from pipeoptim.prediction.flat import bind
from pipeoptim.prediction.predictor import MECHANISMS, Predictor, SavedWeights, available_mechanisms, default_mechanism

NO_SWAP = pytest.mark.skipif("swap" not in available_mechanisms(),
                             reason=f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_ (torch >= 2.12): "
                                    "its default mechanism is 'pointer', tested here")
MECHANISM_PARAMS = [pytest.param(m, marks=NO_SWAP) if m == "swap" else m for m in MECHANISMS]

# ---- small real models, each with a hand-written backward -------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)

    @staticmethod
    def example(n=5):
        return torch.randn(n, 6)

    @staticmethod
    def manual(x, gy, wp, wr):
        """(input grad, param grads) with forward weights wp and backward weights wr (dicts by name)."""
        a1 = x @ wp["net.0.weight"].T + wp["net.0.bias"]
        h = torch.tanh(a1)
        ga1 = (gy @ wr["net.2.weight"]) * (1 - h * h)
        grads = {"net.2.weight": gy.T @ h, "net.2.bias": gy.sum(0), "net.0.weight": ga1.T @ x,
                 "net.0.bias": ga1.sum(0)}
        return ga1 @ wr["net.0.weight"], grads


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 3, 3)

    def forward(self, x):
        return self.c2(F.relu(self.c1(x)))

    @staticmethod
    def example(n=3):
        return torch.randn(n, 2, 6, 6)

    @staticmethod
    def manual(x, gy, wp, wr):
        a1 = F.conv2d(x, wp["c1.weight"], wp["c1.bias"], padding=1)
        h = F.relu(a1)
        gh = conv2d_input(h.shape, wr["c2.weight"], gy)
        ga1 = gh * (a1 > 0)
        grads = {"c2.weight": conv2d_weight(h, wr["c2.weight"].shape, gy), "c2.bias": gy.sum((0, 2, 3)),
                 "c1.weight": conv2d_weight(x, wr["c1.weight"].shape, ga1, padding=1),
                 "c1.bias": ga1.sum((0, 2, 3))}
        return conv2d_input(x.shape, wr["c1.weight"], ga1, padding=1), grads


class XWT(nn.Module):
    """Computes x @ W.T itself, so autograd saves the view W.T of the parameter."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 6) * 0.4)
        self.weight2 = nn.Parameter(torch.randn(4, 8) * 0.4)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T) @ self.weight2.T

    @staticmethod
    def example(n=5):
        return torch.randn(n, 6)

    @staticmethod
    def manual(x, gy, wp, wr):
        h = torch.tanh(x @ wp["weight"].T)
        ga = (gy @ wr["weight2"]) * (1 - h * h)
        return ga @ wr["weight"], {"weight2": gy.T @ h, "weight": ga.T @ x}


MODELS = {"mlp": MLP, "conv": ConvNet, "xwt": XWT}

# ---- optimizers and the float64 reference prediction ----------------------------------------------------

O = torch.optim
OPTIMIZERS = {
    "sgd": lambda p: O.SGD(p, lr=0.1),
    "sgd_wd_max": lambda p: O.SGD(p, lr=0.1, weight_decay=0.01, maximize=True),
    "sgdm_damp": lambda p: O.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, foreach=True),
    "nesterov": lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: O.Adam(p, lr=1e-2, foreach=True),
    "adam_ams_wd": lambda p: O.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1, maximize=True),
    "adamw": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.05),
    "rmsprop": lambda p: O.RMSprop(p, lr=1e-2, foreach=True),
    "rmsprop_centered": lambda p: O.RMSprop(p, lr=1e-2, centered=True, weight_decay=0.1),
    "rmsprop_mom": lambda p: O.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "adagrad": lambda p: O.Adagrad(p, lr=1e-2, lr_decay=0.01, weight_decay=0.01),
    "adamax": lambda p: O.Adamax(p, lr=1e-2, weight_decay=0.01, foreach=True),
    "nadam": lambda p: O.NAdam(p, lr=1e-2, weight_decay=0.01),
    "nadam_decoupled": lambda p: O.NAdam(p, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True, foreach=True),
    "radam": lambda p: O.RAdam(p, lr=1e-2, foreach=True),
    "radam_rectified": lambda p: O.RAdam(p, lr=1e-2, betas=(0.9, 0.9), weight_decay=0.01),
}


def _f(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


RULE_OF = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "RMSprop": "rmsprop", "Adagrad": "adagrad",
           "Adamax": "adamax", "NAdam": "nadam", "RAdam": "radam"}


def reference_direction(optimizer, p, last_grad):
    """Δ in float64 for parameter p from optimizer.state[p], by tests/kernel_reference.py's textbook rules,
    scaled so that ŵ = w − s·lr·Δ with the group's lr (Adagrad's lr decay folded in)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    state = {k: v for k, v in optimizer.state[p].items() if k != "step"}
    step = int(_f(optimizer.state[p]["step"])) if "step" in optimizer.state[p] else 0
    delta, lr = reference_delta(RULE_OF[type(optimizer).__name__], p.detach(), {**state, "grad": last_grad}, group,
                                step)
    return delta * (lr / _f(group["lr"]))


def reference_prediction(optimizer, p, last_grad, s):
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    return p.detach().double() - s * _f(group["lr"]) * reference_direction(optimizer, p, last_grad)


def train(model, optimizer, binding, steps, seed=0):
    """`steps` real optimizer steps; returns the last gradient of each parameter (by name)."""
    gen = torch.Generator().manual_seed(seed)
    last = {}
    for _ in range(steps):
        x = _example(model, gen)
        model(x).pow(2).mean().backward()
        last = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        binding.zero_grad()
    return last


def _example(model, gen):
    shape = type(model).example().shape
    return torch.randn(shape, generator=gen)


def predicted_params(model, optimizer, last, s):
    """name -> float64 ŵ for every parameter of the model."""
    return {n: reference_prediction(optimizer, p, last[n], s) for n, p in model.named_parameters()}


def loaded_copy(model, weights):
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in clone.named_parameters():
            p.copy_(weights[n])
    return clone


class AllocCounter(TorchDispatchMode):
    """Records every tensor storage an op creates (outputs not sharing a storage with any input)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def setup(model_name, opt_name, steps=3, mechanism=None, seed=0, **predictor_options):
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    binding = bind(model, optimizer)
    saved = SavedWeights(binding)
    predictor = Predictor(binding, saved, mechanism=mechanism, **predictor_options)
    last = train(model, optimizer, binding, steps, seed=seed)
    return model, optimizer, binding, saved, predictor, last


def real_hook(binding):
    return lambda group, tag: binding.groups[group].work


def params64(model):
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


# ---- predicted weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_predicted_weights_match_float64_reference(model_name, opt_name):
    steps = 7 if opt_name == "radam_rectified" else 3
    model, optimizer, binding, _, predictor, last = setup(model_name, opt_name, steps=steps)
    s = 2.5
    buffers = predictor.predict(s)
    expected = predicted_params(model, optimizer, last, s)
    for g, buf in zip(binding.groups, buffers):
        for j, name in enumerate(g.names):
            got = g.view(buf, j).double()
            assert torch.allclose(got, expected[name], rtol=1e-5, atol=1e-6), (name, (got - expected[name]).abs().max())
    # the prediction really moves the weights (the comparison above could not pass by ŵ == w)
    moved = max((expected[n] - p.detach().double()).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-4


@pytest.mark.parametrize("opt_name", ["sgdm_damp", "adam", "adamw"])
def test_paper_mode_follows_the_papers_table(opt_name):
    model, optimizer, binding, saved, _, last = setup("mlp", opt_name)
    predictor = Predictor(binding, saved, mode="paper")
    buf = predictor.predict(2.0)[0]
    g = binding.groups[0]
    for j, (name, p) in enumerate(model.named_parameters()):
        st = optimizer.state[p]
        lr = optimizer.param_groups[0]["lr"]
        if opt_name == "sgdm_damp":
            direction = st["momentum_buffer"].double()
        else:  # AdamW's table entry has no decoupled-decay term
            b1, b2 = optimizer.param_groups[0]["betas"]
            t = st["step"].item()
            direction = (st["exp_avg"].double() / (1 - b1 ** t)) / (
                (st["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt() + optimizer.param_groups[0]["eps"])
        assert torch.allclose(g.view(buf, j).double(), p.detach().double() - 2.0 * lr * direction, atol=1e-6)


def test_paper_mode_refuses_optimizers_outside_the_table():
    model = MLP()
    optimizer = O.RMSprop(model.parameters(), lr=1e-2)
    binding = bind(model, optimizer)
    with pytest.raises(ValueError, match="paper"):
        Predictor(binding, SavedWeights(binding), mode="paper")


def test_lr_scheduler_change_is_honoured():
    model, optimizer, binding, _, predictor, last = setup("mlp", "adam")
    before = predictor.predict(2.0)[0].clone()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.25)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25e-2)
    after = predictor.predict(2.0)[0]
    expected = predicted_params(model, optimizer, last, 2.0)
    g = binding.groups[0]
    for j, name in enumerate(g.names):
        assert torch.allclose(g.view(after, j).double(), expected[name], atol=1e-6)
    assert not torch.equal(before, after)
    del scheduler


# ---- the forward reads ŵ -------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISM_PARAMS)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", ["nesterov", "adamw", "nadam"])
def test_forward_output_equals_copy_loaded_with_prediction(mechanism, model_name, opt_name):
    model, optimizer, binding, saved, predictor, last = setup(model_name, opt_name, mechanism=mechanism)
    x = type(model).example()
    reference = loaded_copy(model, predicted_params(model, optimizer, last, 3.0))
    real_before = params64(model)
    with saved.hooks(None, real_hook(binding)), predictor.lend(3.0):
        y = model(x)
    assert torch.allclose(y, reference(x), atol=1e-5)
    assert not torch.allclose(y, model(x), atol=1e-4)  # the prediction made a difference
    for n, p in model.named_parameters():  # the real weights are back
        assert torch.equal(p.detach().double(), real_before[n])


@pytest.mark.parametrize("mechanism", MECHANISM_PARAMS)
def test_no_prediction_before_the_first_step_or_with_s_zero(mechanism):
    model, optimizer, binding, saved, predictor, _ = setup("mlp", "adam", steps=0, mechanism=mechanism)
    for buf in predictor.buffers:
        buf.fill_(float("nan"))
    x = MLP.example()
    with predictor.lend(2.0):
        y0 = model(x)
    train(model, optimizer, binding, 1)
    with predictor.lend(0):
        y1 = model(x)
    assert torch.isfinite(y0).all() and torch.isfinite(y1).all()
    assert all(torch.isnan(buf).all() for buf in predictor.buffers)  # nothing was predicted


# ---- backward: output gradient from the ŵ forward, backward ops with the real weights ---------------------


def _check_grads(model, x, gy, wp, wr, binding):
    gx_ref, grads_ref = type(model).manual(x.detach().double(), gy.double(), wp, wr)
    assert torch.allclose(x.grad.double(), gx_ref, atol=1e-5), (x.grad.double() - gx_ref).abs().max()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad.double(), grads_ref[n], atol=1e-5), (n, (p.grad.double() - grads_ref[n]).abs().max())


def _three_in_flight(model_name, opt_name, mechanism):
    """F0(s=3) F1(s=2) F2(s=1), then B0 step B1 step B2 step. Each forward's output is checked against a copy
    of the model loaded with its ŵ, each backward against the manual gradient with that ŵ and the real
    weights of its backward time."""
    model, optimizer, binding, saved, predictor, last = setup(model_name, opt_name, mechanism=mechanism)
    gen = torch.Generator().manual_seed(1)
    flights = []
    for s in (3.0, 2.0, 1.0):
        x = type(model).example().requires_grad_(True)
        wp = predicted_params(model, optimizer, last, s)
        with saved.hooks(None, real_hook(binding)), predictor.lend(s):
            y = model(x)
        assert torch.allclose(y, loaded_copy(model, wp)(x), atol=1e-5)
        flights.append((x, y, wp, torch.randn(y.shape, generator=gen)))
    first = next(iter(flights[0][2]))
    assert not torch.allclose(flights[0][2][first], flights[1][2][first])  # the three predictions differ
    assert not torch.allclose(flights[1][2][first], flights[2][2][first])
    for x, y, wp, gy in flights:
        wr = params64(model)
        y.backward(gy)
        _check_grads(model, x, gy, wp, wr, binding)
        optimizer.step()
        binding.zero_grad()


@pytest.mark.parametrize("mechanism", MECHANISM_PARAMS)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_three_microbatches_in_flight_by_mechanism(mechanism, model_name):
    _three_in_flight(model_name, "adamw", mechanism)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_three_microbatches_in_flight_by_optimizer(opt_name, model_name):
    mechanisms = available_mechanisms()
    mechanism = mechanisms[sorted(OPTIMIZERS).index(opt_name) % len(mechanisms)]  # each meets every model
    _three_in_flight(model_name, opt_name, mechanism)


def test_backward_without_hooks_would_see_the_version_error():
    """The control for the test above: without SavedWeights, stepping between forward and backward is
    exactly the autograd error the hooks exist to avoid."""
    model, optimizer, binding, _, predictor, _ = setup("xwt", "adam")
    y = model(XWT.example())
    y.sum().backward(retain_graph=True)
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class ZooModel(nn.Module):
    """Layers that save their weights in different ways: embedding, conv1d, attention, layer norm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, tokens):
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.norm(self.block(h))


@pytest.mark.parametrize("mechanism", MECHANISM_PARAMS)
def test_every_saved_weight_of_common_layers_is_redirected(mechanism):
    """With micro-batches in flight the optimizer steps the parameters in place; autograd would raise at
    backward for any saved alias of a parameter that the hooks had not redirected."""
    torch.manual_seed(0)
    model = ZooModel()
    optimizer = O.AdamW(model.parameters(), lr=1e-2)
    binding = bind(model, optimizer)
    saved = SavedWeights(binding)
    predictor = Predictor(binding, saved, mechanism=mechanism)
    tokens = torch.randint(0, 11, (2, 5))
    model(tokens).sum().backward()
    optimizer.step()
    binding.zero_grad()
    outs = []
    for s in (2.0, 1.0):
        with saved.hooks(None, real_hook(binding)), predictor.lend(s):
            outs.append(model(tokens))
    for y in outs:
        y.pow(2).sum().backward()
        optimizer.step()
        binding.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_later_prediction_does_not_leak_into_earlier_backward():
    """x @ W.T saves a view of W: with the pointer mechanism that view points at the prediction buffer,
    which the next forward overwrites; the hooks must send the backward to the real weights."""
    model, optimizer, binding, saved, predictor, last = setup("xwt", "adam", mechanism="pointer")
    x = XWT.example().requires_grad_(True)
    with saved.hooks(None, real_hook(binding)), predictor.lend(1.0):
        y = model(x)
    wp = predicted_params(model, optimizer, last, 1.0)
    with saved.hooks(None, real_hook(binding)), predictor.lend(5.0):  # overwrites the prediction buffer
        model(XWT.example())
    gy = torch.randn(y.shape)
    wr = params64(model)
    y.backward(gy)
    _check_grads(model, x, gy, wp, wr, binding)


# ---- cost: no copy of the weights per predict -----------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISM_PARAMS)
def test_no_weight_sized_allocation_per_predict(mechanism):
    model, optimizer, binding, saved, predictor, _ = setup("mlp", "adam", mechanism=mechanism)
    weight_bytes = sum(g.w.numel() * g.w.element_size() for g in binding.groups)
    with predictor.lend(1.0):  # the first prediction allocates the one prediction buffer (lazily)
        pass
    with AllocCounter() as counter:
        for s in (1.0, 2.0, 3.0):
            with predictor.lend(s):
                pass
    assert sum(counter.sizes) < weight_bytes / 4, counter.sizes


def test_alloc_counter_sees_the_eager_backends_temporaries():
    """Control: the counter does catch weight-sized allocations (the eager backend makes temporaries)."""
    model, optimizer, binding, saved, predictor, _ = setup("mlp", "adam", backend="eager")
    weight_bytes = sum(g.w.numel() * g.w.element_size() for g in binding.groups)
    with AllocCounter() as counter:
        with predictor.lend(1.0):
            pass
    assert max(counter.sizes) >= weight_bytes


@NO_SWAP
def test_swap_points_parameters_at_the_prediction_without_copying():
    model, optimizer, binding, saved, predictor, _ = setup("mlp", "adam", mechanism="swap")
    g = binding.groups[0]
    pred_ptr = predictor.predict(1.0)[0].data_ptr()
    real_ptr = g.work.data_ptr()
    first = next(model.parameters())
    with predictor.lend(1.0):
        assert first.data_ptr() == pred_ptr
    assert first.data_ptr() == real_ptr and predictor.buffers[0].data_ptr() == pred_ptr


# ---- fused step + predict -------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", ["sgd_wd_max", "sgdm_damp", "nesterov", "adam", "adam_ams_wd", "adamw"])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_fused_step_predict_equals_step_then_predict(opt_name, steps_before, monkeypatch):
    plain = setup("mlp", opt_name, steps=steps_before)
    fused = setup("mlp", opt_name, steps=steps_before)
    x = MLP.example()
    for model, *_ in (plain, fused):
        model(x).pow(2).mean().backward()
    model_p, opt_p, binding_p, _, pred_p, _ = plain
    model_f, opt_f, binding_f, _, pred_f, _ = fused
    opt_p.step()
    expected = pred_p.predict(2.0)[0].clone()
    assert pred_f.can_fuse()
    pred_f.step_predict(2.0)
    for (n, a), b in zip(model_p.named_parameters(), model_f.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
        for key, value in opt_p.state[a].items():
            assert torch.allclose(value, opt_f.state[b][key], atol=1e-6), (n, key)
            if value.dim():  # the fused step keeps (or creates) torch's state as flat views
                g, j = binding_f._by_param[id(b)]
                assert opt_f.state[b][key].data_ptr() == g.view(g.state[key], j).data_ptr()
    assert torch.allclose(pred_f.buffers[0], expected, atol=1e-6)
    assert binding_f.version == binding_p.version == steps_before + 1
    # the prediction is reused by the next forward, not recomputed
    calls = []
    original = pk.predict
    monkeypatch.setattr(pk, "predict", lambda *a, **k: calls.append(1) or original(*a, **k))
    with pred_f.lend(2.0):
        pass
    assert not calls
    with pred_f.lend(1.0):  # another s: predicted again
        pass
    assert calls


def test_fused_step_counts_as_an_optimizer_step_for_lr_schedulers():
    """Regression: a scheduler warned that lr_scheduler.step() came before optimizer.step() when every step
    was fused (the scheduler only sees calls of optimizer.step())."""
    model, optimizer, binding, _, predictor, _ = setup("mlp", "adam", steps=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(MLP.example()).sum().backward()
    predictor.step_predict(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)


# ---- mixed precision ----------------------------------------------------------------------------------------------


def test_mixed_precision_prediction_writes_the_bf16_working_copy():
    torch.manual_seed(0)
    model = MLP()
    optimizer = O.Adam(model.parameters(), lr=1e-2)
    binding = bind(model, optimizer, working_dtype=torch.bfloat16)
    saved = SavedWeights(binding)
    predictor = Predictor(binding, saved)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        model(MLP.example().bfloat16()).float().pow(2).mean().backward()
        optimizer.step()
        binding.zero_grad()
    masters = dict(binding.named_master_params())
    expected = {n: (m.detach().double() - 2.0 * 1e-2 * reference_direction(optimizer, m, torch.zeros_like(m))).to(torch.bfloat16)
                for n, m in masters.items()}
    for n, p in model.named_parameters():  # the working copy is the cast masters
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), masters[n].detach().to(torch.bfloat16))
    with predictor.lend(2.0):
        for n, p in model.named_parameters():
            ulp = p.detach().float().abs() * 2 ** -7 + 1e-30
            assert ((p.detach().float() - expected[n].float()).abs() <= ulp).all(), n
    del gen


def test_fused_step_in_mixed_precision_matches_unfused():
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = MLP()
        optimizer = O.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        binding = bind(model, optimizer, working_dtype=torch.bfloat16)
        predictor = Predictor(binding, SavedWeights(binding))
        for k in range(3):
            model(torch.ones(4, 6, dtype=torch.bfloat16) * (k + 1)).float().pow(2).mean().backward()
            binding.sync_grads()
            if fused:
                predictor.step_predict(1.5)
            else:
                optimizer.step()
            binding.zero_grad()
        runs.append((model, binding, predictor.predict(1.5)[0].clone()))
    (m0, b0, p0), (m1, b1, p1) = runs
    assert torch.allclose(b0.groups[0].w, b1.groups[0].w, atol=1e-6)
    assert torch.equal(b0.groups[0].work, b1.groups[0].work)
    assert (p0.float() - p1.float()).abs().max() <= p0.float().abs().max() * 2 ** -7


def test_lend_refuses_nesting():
    model, optimizer, binding, saved, predictor, _ = setup("mlp", "adam")
    with predictor.lend(1.0):
        with pytest.raises(RuntimeError, match="nest"):
            with predictor.lend(2.0):
                pass


def test_without_storage_swap_the_default_is_pointer_and_swap_says_which_torch(monkeypatch):
    """torch 2.11 (the GPU machine's) has no UntypedStorage._swap_data_ptr_: predictors there lend through
    parameter pointers, and asking for 'swap' names the torch release that has it."""
    import pipeoptim.prediction.predictor

    # a C type's method cannot be deleted
    monkeypatch.setattr(pipeoptim.prediction.predictor, "_can_swap", lambda: False)
    assert default_mechanism() == "pointer" and available_mechanisms() == ("pointer", "inplace")
    model, optimizer, binding, saved, predictor, last = setup("mlp", "adam")
    assert predictor.mechanism == "pointer"
    with predictor.lend(1.0):
        model(MLP.example())
    with pytest.raises(RuntimeError, match=r"torch 2\.12 added; this is torch .*mechanism='pointer'"):
        Predictor(binding, saved, mechanism="swap")


def test_unknown_mechanism_is_refused():
    model = MLP()
    binding = bind(model, O.Adam(model.parameters()))
    with pytest.raises(ValueError, match="mechanism"):
        Predictor(binding, SavedWeights(binding), mechanism="teleport")
