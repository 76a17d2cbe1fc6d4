"""pipeoptim_kernels.step_predict: the step equals torch.optim's own step (single-tensor and foreach)
to fp32 rounding, and the prediction written in the same pass equals the float64 reference."""
import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import CPU_BACKEND_IDS, assert_close_to_reference, assert_second_moment_close, reference_predict


STEP_CONFIGS = [
    ("sgd", "SGD", dict(lr=0.05)),
    ("sgd", "SGD", dict(lr=0.05, weight_decay=0.01, maximize=True)),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1)),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adam", "Adam", dict(lr=1e-2)),
    ("adam", "Adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("adam", "Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-3, maximize=True)),
    ("adam", "Adam", dict(lr=1e-3, betas=(0.95, 0.9999))),
    ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05)),
    ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True)),
]
# Weights and gradients are O(1): a result that cancels (momentum·buf + d ≈ 0) keeps the absolute
# rounding error of its O(1) operands, a couple of fp32 ulps at 1.0, whichever order of operations
# (fused multiply-add or not) a backend uses. Any real mistake is orders of magnitude larger.
ATOL = 2.5e-7
STATE_NAMES = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
               "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}


def _ids(cfg):
    return cfg[0] + "-" + "-".join(f"{k}={v}" for k, v in cfg[2].items() if k != "lr")


def _flat_state(opt, p, rule, n):
    st = opt.state[p]
    out = {}
    for name in STATE_NAMES[rule]:
        if name in st:
            out[name] = st[name].detach().clone()
        elif name == "momentum_buffer" and opt.param_groups[0]["momentum"] != 0:
            out[name] = torch.zeros(n)  # not created until the first step; the kernel initialises it
        elif name == "max_exp_avg_sq" and opt.param_groups[0].get("amsgrad"):
            out[name] = torch.zeros(n)
        elif name in ("exp_avg", "exp_avg_sq"):
            out[name] = torch.zeros(n)
    return out


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("cfg", STEP_CONFIGS, ids=_ids)
def test_step_matches_torch_optim(cfg, backend, foreach, gen):
    rule, cls, hp = cfg
    n = 4097
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = getattr(torch.optim, cls)([p], **hp, foreach=foreach)
    w = p.detach().clone()
    state = _flat_state(opt, p, rule, n)
    for step in range(4):  # the first step included: buffers are initialised there
        g = torch.randn(n, generator=gen)
        p.grad = g.clone()
        opt.step()
        s = step % 3
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((n,), float("nan"), dtype=dtype)
            w_try, st_try = w.clone(), {k: v.clone() for k, v in state.items()}
            pk.step_predict(rule, w_try, g, st_try, opt.param_groups[0], step=step, s=s, out=out, backend=backend)
            msg = f"{backend} {rule} {hp} step {step + 1} seed={gen.initial_seed()}"
            torch.testing.assert_close(w_try, p.detach(), rtol=4e-6, atol=ATOL, msg=lambda m: f"{msg}: w {m}")
            for name, t in st_try.items():
                if name in ("exp_avg_sq", "max_exp_avg_sq"):
                    assert_second_moment_close(t, opt.state[p][name], state["exp_avg_sq"], g, w, hp, rule,
                                               msg=f"{msg}: {name}")
                else:
                    torch.testing.assert_close(t, opt.state[p][name], rtol=4e-6, atol=ATOL,
                                               msg=lambda m: f"{msg}: {name} {m}")
            ref_state = {**st_try, "grad": g}
            ref, term = reference_predict(rule, w_try, ref_state, opt.param_groups[0], step + 1, s)
            assert_close_to_reference(out, ref, term, msg=f"{msg} prediction {dtype}")
        # Start the next step from torch's own numbers, so each comparison covers one step's rounding.
        w, state = p.detach().clone(), {k: opt.state[p][k].detach().clone() for k in state}


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_step_predict_large_odd_size(backend, gen):
    n = (1 << 20) + 3
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    state = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    w = p.detach().clone()
    g = torch.randn(n, generator=gen)
    p.grad = g.clone()
    opt.step()
    out = torch.full((n,), float("nan"))
    pk.step_predict("adamw", w, g, state, opt.param_groups[0], step=0, s=3, out=out, backend=backend)
    torch.testing.assert_close(w, p.detach(), rtol=4e-6, atol=ATOL)
    ref, term = reference_predict("adamw", w, {**state, "grad": g}, opt.param_groups[0], 1, 3)
    assert_close_to_reference(out, ref, term, msg=f"{backend} large seed={gen.initial_seed()}")


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("cfg", STEP_CONFIGS, ids=_ids)
def test_prediction_written_over_the_gradient(cfg, backend, gen):
    """out=grad: the step has finished reading the gradient, so ŵ may take its place. The step and the
    prediction are the same, to the bit, as with a separate output, and the prediction matches the reference."""
    rule, cls, hp = cfg
    n = 4097
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = getattr(torch.optim, cls)([p], **hp)
    p.grad = torch.randn(n, generator=gen)
    opt.step()  # real optimizer state to start from
    state = _flat_state(opt, p, rule, n)
    w, g = p.detach().clone(), torch.randn(n, generator=gen)
    results = []
    for into_grad in (False, True):
        w_try, g_try, st_try = w.clone(), g.clone(), {k: v.clone() for k, v in state.items()}
        out = g_try if into_grad else torch.full((n,), float("nan"))
        got = pk.step_predict(rule, w_try, g_try, st_try, opt.param_groups[0], step=1, s=2, out=out, backend=backend)
        assert got is out
        results.append([out, w_try, *st_try.values()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    stepped_state = dict(zip(state, results[1][2:]))
    ref, term = reference_predict(rule, results[1][1], {**stepped_state, "grad": g}, opt.param_groups[0], 2, 2)
    assert_close_to_reference(results[1][0], ref, term, msg=f"{backend} {rule} {hp} seed={gen.initial_seed()}")


def test_out_overlapping_part_of_the_gradient_is_refused(gen):
    n = 1000
    base = torch.randn(n + 1, generator=gen)
    grad, out = base[:n], base[1:]
    w = torch.randn(n, generator=gen)
    state = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    before = base.clone()
    with pytest.raises(ValueError, match="out overlaps grad"):
        pk.step_predict("adam", w, grad, state, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                                     amsgrad=False, maximize=False), step=1, s=2, out=out)
    assert torch.equal(base, before)


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_adam_second_moment_forms_one_minus_beta_in_double(beta2, backend, gen):
    """v = β2·v + (1−β2)·g² with 1−β2 formed in double, as torch.optim forms it.

    1 − float32(0.999) is 1.3e-5 (at 0.9999: 1.7e-4) relatively off 1 − 0.999, an error the absolute
    bound of the test above hides (v ≈ 1e-3·g²). Every term of v is positive, so a correct fp32 step is
    within a few ulps of the float64 value relatively."""
    n = 4097
    group = dict(lr=1e-3, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0, amsgrad=True, maximize=False)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    state = {"exp_avg": torch.randn(n, generator=gen) * 1e-2, "exp_avg_sq": torch.rand(n, generator=gen) * 1e-4,
             "max_exp_avg_sq": torch.rand(n, generator=gen) * 1e-4}
    want = state["exp_avg_sq"].double() * beta2 + (1.0 - beta2) * g.double() ** 2
    want_max = torch.maximum(state["max_exp_avg_sq"].double(), want)
    out = torch.full((n,), float("nan"))
    pk.step_predict("adam", w, g, state, group, step=4, s=2, out=out, backend=backend)
    for name, ref in (("exp_avg_sq", want), ("max_exp_avg_sq", want_max)):
        rel = ((state[name].double() - ref).abs() / ref).max().item()
        assert rel <= 4 * torch.finfo(torch.float32).eps, \
            f"{backend} β2={beta2}: {name} is {rel:.2e} relatively off (seed={gen.initial_seed()})"
