"""pipeoptim_kernels on CUDA: every rule × GPU backend × output dtype against the float64 reference,
step+predict against torch.optim's own CUDA step (foreach and fused), and large odd sizes."""
import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import CONFIGS, assert_close_to_reference, check_predict, config_id, reference_predict

GPU_BACKENDS = ["cuda", "triton", "eager"]


def test_gpu_backends_available():
    assert {"cuda", "triton"} <= set(pk.available_backends()), pk.available_backends()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_predict_matches_reference_cuda(cfg, backend, gen):
    check_predict(cfg, backend, "cuda", gen, sizes=(1, 7, 4097, (1 << 20) + 3))


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rule,cls,hp", [("adam", "Adam", dict(lr=1e-2, weight_decay=0.1)),
                                         ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
                                         ("sgd", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01))])
def test_step_predict_matches_torch_cuda(rule, cls, hp, backend, impl, gen):
    n = (1 << 20) + 3
    p = torch.nn.Parameter(torch.randn(n, generator=gen).cuda())
    opt = getattr(torch.optim, cls)([p], **hp, **{impl: True})
    names = ["momentum_buffer"] if rule == "sgd" else ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hp.get("amsgrad") else [])
    state = {k: torch.zeros(n, device="cuda") for k in names}
    w = p.detach().clone()
    for step in range(3):
        g = torch.randn(n, generator=gen).cuda()
        p.grad = g.clone()
        opt.step()
        out = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
        pk.step_predict(rule, w, g, state, opt.param_groups[0], step=step, s=2, out=out, backend=backend)
        torch.testing.assert_close(w, p.detach(), rtol=4e-6, atol=2.5e-7)
        for k in names:
            torch.testing.assert_close(state[k], opt.state[p][k], rtol=4e-6, atol=2.5e-7)
        ref, term = reference_predict(rule, w.cpu(), {**{k: v.cpu() for k, v in state.items()}, "grad": g.cpu()},
                                      opt.param_groups[0], step + 1, 2)
        assert_close_to_reference(out.cpu(), ref, term, msg=f"{backend} {rule} step {step + 1}")
        w, state = p.detach().clone(), {k: opt.state[p][k].detach().clone() for k in names}


def test_misaligned_views_take_the_scalar_path(gen):
    """Buffers offset by one element are not 16-byte aligned: the kernel must still be exact."""
    n = 4099
    base = torch.randn(n + 1, generator=gen).cuda()
    w = base[1:]
    m, v = torch.randn(n + 1, generator=gen).cuda()[1:], torch.rand(n + 1, generator=gen).cuda()[1:]
    group = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    out = torch.full((n,), float("nan"), device="cuda")
    pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, group, step=3, s=2, out=out, backend="cuda")
    ref, term = reference_predict("adam", w.cpu(), {"exp_avg": m.cpu(), "exp_avg_sq": v.cpu()}, group, 3, 2)
    assert_close_to_reference(out.cpu(), ref, term, msg="misaligned")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rule,hp", [("adam", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                                   amsgrad=True, maximize=False)),
                                     ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01,
                                                  nesterov=True, maximize=False))])
def test_step_predict_into_grad_cuda(rule, hp, backend, gen):
    """out=grad gives the same bits as a separate output (each thread reads its grad before writing over it)."""
    n = (1 << 20) + 3
    names = ["momentum_buffer"] if rule == "sgd" else ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    w, g = torch.randn(n, generator=gen).cuda(), torch.randn(n, generator=gen).cuda()
    state = {k: torch.rand(n, generator=gen).cuda() for k in names}
    results = []
    for into_grad in (False, True):
        w_try, g_try, st = w.clone(), g.clone(), {k: v.clone() for k, v in state.items()}
        out = g_try if into_grad else torch.empty(n, device="cuda")
        pk.step_predict(rule, w_try, g_try, st, hp, step=3, s=2, out=out, backend=backend)
        results.append([out, w_try, *st.values()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
