"""pipeoptim_kernels.predict: every rule × backend × output dtype against the float64 reference."""
import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import (CONFIGS, CPU_BACKEND_IDS, OUT_DTYPES, STEPS, assert_close_to_reference, check_predict,
                              config_id, optimizer_state, reference_predict)


def _state32(state):
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in state.items()}


def _poisoned(n, dtype):
    return torch.full((n,), float("nan"), dtype=dtype)


def test_expected_backends_are_available():
    # CI builds the extension and runs Triton through its interpreter: both must be here.
    assert pk.available_backends()[0] == "eager"
    assert {"cpu", "triton"} <= set(pk.available_backends())


def test_reference_reproduces_torch_optim_step(gen):
    """Δ re-evaluated at the weights before the last step, with s = 1, is exactly that step."""
    for rule, cls, hp in CONFIGS:
        for step in STEPS.get(rule, (4,)):
            w_prev, w_now, _, state, group = optimizer_state(cls, hp, 257, step, gen)
            ref, _ = reference_predict(rule, w_prev, state, group, step, 1)
            torch.testing.assert_close(ref, w_now, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{rule} {hp} step {step}: {m}")


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_predict_matches_reference(cfg, backend, gen):
    check_predict(cfg, backend, "cpu", gen)


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("rule", pk.BUILTIN_RULES)
def test_predict_in_place_large(rule, backend, gen):
    """About a million elements (odd size, so vector tails run), written in place into w."""
    cfg = next(c for c in CONFIGS if c[0] == rule and len(c[2]) > 2) if rule != "radam" else CONFIGS[-1]
    _, cls, hp = cfg
    n = (1 << 20) + 3
    step = STEPS.get(rule, (0, 3))[1]
    _, w64, _, state64, group = optimizer_state(cls, hp, n, step, gen)
    w, state = w64.float(), _state32(state64)
    ref, term = reference_predict(rule, w, state, group, step, 2)
    got = pk.predict(rule, w, state, group, step=step, s=2, out=w, backend=backend)
    assert got is w
    assert_close_to_reference(w, ref, term, msg=f"{backend} {rule} in place seed={gen.initial_seed()}")


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("rule", ["sgd", "adam", "adamw"])
def test_paper_mode(rule, backend, gen):
    hp = {"sgd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
          "adam": dict(lr=1e-2, amsgrad=True), "adamw": dict(lr=1e-2, weight_decay=0.1)}[rule]
    cls = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[rule]
    _, w64, _, state64, group = optimizer_state(cls, hp, 4097, 6, gen)
    w, state = w64.float(), _state32(state64)
    ref, term = reference_predict(rule, w, state, group, 6, 3, mode="paper")
    exact, _ = reference_predict(rule, w, state, group, 6, 3, mode="exact")
    assert (ref - exact).abs().max() > 1e-6, "this configuration must tell paper from exact"
    out = _poisoned(4097, torch.float32)
    pk.predict(rule, w, state, group, step=6, s=3, out=out, mode="paper", backend=backend)
    assert_close_to_reference(out, ref, term, msg=f"paper {backend} {rule} seed={gen.initial_seed()}")


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_no_prediction_when_s_or_step_is_zero(backend, gen):
    _, w64, _, state64, group = optimizer_state("Adam", dict(lr=1e-2), 1000, 3, gen)
    w, state = w64.float(), _state32(state64)
    assert pk.predict("adam", w, state, group, step=3, s=0, backend=backend) is w
    assert pk.predict("adam", w, state, group, step=0, s=4, backend=backend) is w
    before = w.clone()
    assert pk.predict("adam", w, state, group, step=3, s=0, out=w, backend=backend) is w
    assert torch.equal(w, before)
    for dtype in OUT_DTYPES:
        out = _poisoned(1000, dtype)
        pk.predict("adam", w, state, group, step=0, s=3, out=out, backend=backend)
        assert torch.equal(out, w.to(dtype)), "no prediction into a separate buffer copies w"


def test_predict_out_none_allocates(gen):
    _, w64, _, state64, group = optimizer_state("SGD", dict(lr=0.1, momentum=0.9), 33, 2, gen)
    w, state = w64.float(), _state32(state64)
    got = pk.predict("sgd", w, state, group, step=2, s=1)
    assert got is not w and got.dtype == w.dtype
    ref, term = reference_predict("sgd", w, state, group, 2, 1)
    assert_close_to_reference(got, ref, term, msg="out=None")


def test_sgd_without_momentum_s1_is_torch_sgd_step(gen):
    """Cross-check named in the issue: plain SGD, s = 1, equals torch.optim.SGD's step with that gradient."""
    n = 4097
    w = torch.nn.Parameter(torch.randn(n, generator=gen))
    g = torch.randn(n, generator=gen)
    opt = torch.optim.SGD([w], lr=0.1, weight_decay=0.01)
    predicted = pk.predict("sgd", w.detach(), {"grad": g}, opt.param_groups[0], step=1, s=1)
    w.grad = g.clone()
    opt.step()
    torch.testing.assert_close(predicted, w.detach(), rtol=0, atol=1e-6)


def test_lr_as_tensor_and_group_from_real_optimizer(gen):
    w = torch.nn.Parameter(torch.randn(100, generator=gen))
    opt = torch.optim.Adam([w], lr=torch.tensor(0.01))
    w.grad = torch.randn(100, generator=gen)
    opt.step()
    st = opt.state[w]
    state = {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
    out = pk.predict("adam", w.detach(), state, opt.param_groups[0], step=int(st["step"]), s=2)
    ref, term = reference_predict("adam", w.detach(), state, {**opt.param_groups[0], "lr": 0.01}, 1, 2)
    assert_close_to_reference(out, ref, term, msg="tensor lr")


def test_custom_rule_runs_on_eager(gen):
    name = f"signsgd_{gen.initial_seed()}"
    pk.register_rule(name, lambda w, state, group, step: state["grad"].sign())
    w = torch.randn(50, generator=gen)
    g = torch.randn(50, generator=gen)
    out = pk.predict(name, w, {"grad": g}, {"lr": 0.1}, step=1, s=2)
    torch.testing.assert_close(out.double(), w.double() - 0.2 * g.sign().double(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="eager"):
        pk.predict(name, w, {"grad": g}, {"lr": 0.1}, step=1, s=2, backend="cpu")
    with pytest.raises(ValueError, match="already registered"):
        pk.register_rule(name, lambda *a: None)


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_prediction_past_the_output_dtypes_range_is_inf(out_dtype, backend, gen):
    """A prediction past the output dtype's range rounds to inf of its sign, and the reference check accepts
    that (found on the H200: a float16 prediction of 1.3e7 from a second moment near 0 was reported as off).
    A finite largest value in its place is still an error."""
    n = 37
    big = 1e6 if out_dtype == torch.float16 else 1e39   # float16 ends at 65504, bfloat16 at 3.39e38
    w = torch.randn(n, generator=gen)
    m = torch.full((n,), big / 10.0 if out_dtype == torch.float16 else 3e38)
    m[::2] *= -1
    v = torch.full((n,), 1e-30)
    group = dict(lr=1.0, betas=(0.0, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    out = torch.full((n,), float("nan"), dtype=out_dtype)
    pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, group, step=3, s=2, out=out, backend=backend)
    ref, term = reference_predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, group, 3, 2)
    assert (ref.abs() > big / 10).all(), "the case must overflow the output dtype"
    assert torch.isinf(out).all() and torch.equal(out.sign(), ref.sign().to(out_dtype)), out
    assert_close_to_reference(out, ref, term, msg=f"{backend} {out_dtype} seed={gen.initial_seed()}")
    clipped = torch.where(ref > 0, torch.finfo(out_dtype).max, torch.finfo(out_dtype).min).to(out_dtype)
    with pytest.raises(AssertionError, match="elements off"):
        assert_close_to_reference(clipped, ref, term, msg="the largest finite value instead of inf")
