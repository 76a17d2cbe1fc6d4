"""pipeoptim_kernels.predict(mode="reference"): the public PipeOptim code's prediction rule, every backend.

The expectation is a float64 re-statement of what that code computes, written here from its behaviour and
independent of pipeoptim_kernels.rules:
- SGD: before a forward it reads p.grad, which on the torch it ran on (1.x) holds the last step's gradient
  with the weight decay added in place, g + λ·w_b (w_b: the weights before that step); with momentum μ it
  predicts with μ·buf + (1−τ)·p.grad, without momentum with p.grad; ŵ = w − lr·s·that. The run that produces
  buf, w and p.grad is simulated here the way that torch's SGD stepped (in-place decay), and checked to give
  the same weights and buffer as today's torch.optim.SGD, whose state the kernel reads.
- Adam, AdamW: ŵ = w − s·(lr/bc1)·m/(√v/√bc2 + 1e-8), whatever the group's eps, amsgrad and weight decay.
"""
import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import CPU_BACKEND_IDS, OUT_DTYPES, assert_close_to_reference, optimizer_state

SIZES = (1, 7, 4097)


def _old_torch_sgd(w0, grads, lr, momentum, dampening, weight_decay, nesterov):
    """torch 1.x SGD over `grads`, float64: returns (w, momentum buffer, p.grad after the last step)."""
    w, buf, p_grad = w0.clone(), None, None
    for g in grads:
        p_grad = g.clone()
        if weight_decay:
            p_grad.add_(w, alpha=weight_decay)            # in place, into p.grad
        update = p_grad
        if momentum:
            buf = p_grad.clone() if buf is None else buf * momentum + (1 - dampening) * p_grad
            update = p_grad + momentum * buf if nesterov else buf
        w = w - lr * update
    return w, buf, p_grad


def _reference_code_sgd(w, buf, p_grad, lr, momentum, dampening, s):
    d_p = p_grad if not momentum else buf * momentum + (1 - dampening) * p_grad
    return w - lr * s * d_p, lr * s * ((momentum * buf.abs() if momentum else 0) + p_grad.abs())


SGD_CONFIGS = [
    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, weight_decay=0.02, nesterov=True),
    dict(lr=0.1, momentum=0.0, weight_decay=0.05),
    dict(lr=0.05, momentum=0.8),
]


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("hp", SGD_CONFIGS, ids=lambda hp: "-".join(f"{k}={v}" for k, v in hp.items()))
def test_sgd_matches_the_public_code(hp, backend, gen):
    steps = 5
    for n in SIZES:
        w0 = torch.randn(n, generator=gen, dtype=torch.float64)
        grads = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(steps)]
        p = torch.nn.Parameter(w0.clone())
        opt = torch.optim.SGD([p], **hp, foreach=False)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        mu, tau = hp.get("momentum", 0.0), hp.get("dampening", 0.0)
        w_old, buf_old, p_grad = _old_torch_sgd(w0, grads, hp["lr"], mu, tau, hp.get("weight_decay", 0.0),
                                                hp.get("nesterov", False))
        torch.testing.assert_close(p.detach(), w_old, rtol=1e-12, atol=1e-12)   # same run on both torches
        state = {"grad": grads[-1]}
        if mu:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf_old, rtol=1e-12, atol=1e-12)
            state["momentum_buffer"] = opt.state[p]["momentum_buffer"].detach()
        s = 1 + int(torch.randint(0, 6, (1,), generator=gen))
        ref, term = _reference_code_sgd(p.detach(), buf_old, p_grad, hp["lr"], mu, tau, s)
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        w32 = p.detach().float()
        state32 = {k: v.float() for k, v in state.items()}
        for dtype in OUT_DTYPES:
            out = torch.full((n,), float("nan"), dtype=dtype)
            pk.predict("sgd", w32, state32, group, step=steps, s=s, out=out, mode="reference", backend=backend)
            assert_close_to_reference(out, ref, term, msg=f"{backend} {hp} n={n} s={s} {dtype} "
                                                          f"seed={gen.initial_seed()}")
        if n == SIZES[-1]:
            exact = pk.predict("sgd", w32, state32, group, step=steps, s=s, mode="exact", backend="eager")
            assert (exact.double() - ref).abs().max() > 1e-4, "this configuration must tell the modes apart"


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("cls,hp,differs", [("Adam", dict(lr=1e-2, eps=0.1, amsgrad=True), True),
                                            ("AdamW", dict(lr=1e-2, weight_decay=0.5, eps=1e-2), True),
                                            ("Adam", dict(lr=1e-2, weight_decay=0.1), False)])
def test_adam_family_matches_the_public_code(cls, hp, differs, backend, gen):
    """(Adam with eps 1e-8, no amsgrad: the code's rule is the optimizer's own, coupled decay being inside
    the moments.)"""
    rule = cls.lower()
    step = 6
    for n in SIZES:
        _, w64, _, state64, group = optimizer_state(cls, hp, n, step, gen)
        b1, b2 = group["betas"]
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        s = 1 + int(torch.randint(0, 6, (1,), generator=gen))
        m, v = state64["exp_avg"], state64["exp_avg_sq"]
        denom = v.sqrt() / bc2 ** 0.5 + 1e-8
        ref = w64 - s * (group["lr"] / bc1) * m / denom
        term = s * (group["lr"] / bc1) * m.abs() / denom
        w32 = w64.float()
        state32 = {k: (t.float() if isinstance(t, torch.Tensor) else t) for k, t in state64.items()}
        for dtype in OUT_DTYPES:
            out = torch.full((n,), float("nan"), dtype=dtype)
            pk.predict(rule, w32, state32, group, step=step, s=s, out=out, mode="reference", backend=backend)
            assert_close_to_reference(out, ref, term, msg=f"{backend} {cls} {hp} n={n} {dtype} "
                                                          f"seed={gen.initial_seed()}")
        if n == SIZES[-1]:
            exact = pk.predict(rule, w32, state32, group, step=step, s=s, mode="exact", backend="eager")
            assert ((exact.double() - ref).abs().max() > 1e-4) == differs


@pytest.mark.parametrize("rule,cls,hp,words", [
    ("rmsprop", "RMSprop", dict(lr=1e-2), "predicts only for sgd, adam, adamw"),
    ("sgd", "SGD", dict(lr=0.1, momentum=0.9, maximize=True), "maximize"),
    ("sgd", "SGD", dict(lr=10.0, weight_decay=0.2), "lr·weight_decay < 1"),
])
def test_reference_mode_refuses_what_the_code_never_did(rule, cls, hp, words, gen):
    _, w64, _, state64, group = optimizer_state(cls, hp, 9, 2, gen)
    w, out = w64.float(), torch.full((9,), float("nan"))
    state = {k: (t.float() if isinstance(t, torch.Tensor) and t.dim() else t) for k, t in state64.items()}
    with pytest.raises(ValueError, match=words):
        pk.predict(rule, w, state, group, step=2, s=1, out=out, mode="reference")
    assert out.isnan().all(), "nothing may be written before the error"
