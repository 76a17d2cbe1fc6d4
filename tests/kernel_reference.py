"""Float64 reference for the kernel tests, written from torch.optim's update rules.

Deliberately independent of pipeoptim_kernels.rules: the direction Δ of each optimizer is written out
here in its textbook form, and `optimizer_state` produces real state by running torch.optim itself, so
the kernels are compared with the optimizer's own numbers, not with our own reformulation.
"""
from __future__ import annotations

import math

import torch

import pipeoptim_kernels as pk

# Test ids of the CPU backends (conftest's `backend` fixture turns an id into a backend). "cpu-stream"
# is the cpu backend with streaming stores forced on: the path it takes by default only for buffers
# larger than the last-level cache, too large for most tests.
CPU_BACKEND_IDS = [b for b in ("eager", "triton", "cpu") if b in pk.available_backends()]
if "cpu" in CPU_BACKEND_IDS:
    CPU_BACKEND_IDS.append("cpu-stream")

# (rule, torch.optim class, hyperparameters) — the configurations every backend is tested on.
CONFIGS = [
    ("sgd", "SGD", dict(lr=0.1, momentum=0.0)),
    ("sgd", "SGD", dict(lr=0.1, momentum=0.0, weight_decay=0.01, maximize=True)),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1)),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.8, weight_decay=0.02, maximize=True)),
    ("adam", "Adam", dict(lr=1e-2)),
    ("adam", "Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("adam", "Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-3, maximize=True)),
    ("adam", "Adam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05)),
    ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True)),
    ("rmsprop", "RMSprop", dict(lr=1e-2)),
    ("rmsprop", "RMSprop", dict(lr=1e-2, centered=True, weight_decay=0.1)),
    ("rmsprop", "RMSprop", dict(lr=1e-2, momentum=0.9, centered=True)),
    ("rmsprop", "RMSprop", dict(lr=1e-2, alpha=0.9, eps=1e-4, maximize=True)),
    ("adagrad", "Adagrad", dict(lr=1e-2)),
    ("adagrad", "Adagrad", dict(lr=1e-2, lr_decay=0.05, weight_decay=0.1, maximize=True)),
    ("adamax", "Adamax", dict(lr=2e-3)),
    ("adamax", "Adamax", dict(lr=2e-3, weight_decay=0.1, maximize=True)),
    ("nadam", "NAdam", dict(lr=2e-3)),
    ("nadam", "NAdam", dict(lr=2e-3, weight_decay=0.1)),
    ("nadam", "NAdam", dict(lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    ("radam", "RAdam", dict(lr=1e-3)),
    ("radam", "RAdam", dict(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)),
]

# RAdam switches formula at rho_t > 5 (about step 6 with beta2 = 0.999): test both sides.
STEPS = {"radam": (3, 8)}


def config_id(cfg) -> str:
    rule, _, hp = cfg
    return rule + "-" + "-".join(f"{k}={v}" for k, v in hp.items() if k != "lr")


def optimizer_state(cls_name: str, hp: dict, n: int, steps: int, gen: torch.Generator, dtype=torch.float64):
    """Run torch.optim for `steps` steps on random gradients; returns (w_before_last, w, grad, state, group)."""
    w = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = getattr(torch.optim, cls_name)([w], **hp, foreach=False)
    w_prev = w.detach().clone()
    grad = None
    for _ in range(steps):
        grad = torch.randn(n, generator=gen, dtype=dtype)
        w.grad = grad.clone()
        w_prev = w.detach().clone()
        opt.step()
    state = {k: (v.detach().clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
             for k, v in opt.state[w].items() if k != "step"}
    state["grad"] = grad
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return w_prev, w.detach().clone(), grad, state, group


def _f(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def reference_delta(rule: str, w: torch.Tensor, st: dict, group: dict, step: int, mode: str = "exact"):
    """(Δ, effective lr) in float64: the direction torch.optim applied at step `step`, at weights w."""
    w = w.double()
    st = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    lr = _f(group["lr"])
    wd = group.get("weight_decay", 0.0)
    sign = -1.0 if group.get("maximize", False) else 1.0
    d = sign * st["grad"] + wd * w if "grad" in st else None
    decoupled = rule == "adamw" or group.get("decoupled_weight_decay", False)
    t = step

    if mode == "paper":
        if rule == "sgd":
            return st["momentum_buffer"], lr
        b1, b2 = group["betas"]
        mhat = st["exp_avg"] / (1 - b1 ** t)
        vhat = st["exp_avg_sq"] / (1 - b2 ** t)
        return mhat / (vhat.sqrt() + group["eps"]), lr

    if rule == "sgd":
        mu = group["momentum"]
        if mu == 0:
            return d, lr
        buf = st["momentum_buffer"]
        return (d + mu * buf if group["nesterov"] else buf), lr
    if rule in ("adam", "adamw"):
        b1, b2 = group["betas"]
        mhat = st["exp_avg"] / (1 - b1 ** t)
        vhat = (st["max_exp_avg_sq"] if group["amsgrad"] else st["exp_avg_sq"]) / (1 - b2 ** t)
        delta = mhat / (vhat.sqrt() + group["eps"])
        return (delta + wd * w if decoupled else delta), lr
    if rule == "rmsprop":
        if group["momentum"] > 0:
            return st["momentum_buffer"], lr
        v = st["square_avg"] - st["grad_avg"] ** 2 if group["centered"] else st["square_avg"]
        return d / (v.sqrt() + group["eps"]), lr
    if rule == "adagrad":
        return d / (st["sum"].sqrt() + group["eps"]), lr / (1 + (t - 1) * group["lr_decay"])
    if rule == "adamax":
        b1 = group["betas"][0]
        return st["exp_avg"] / ((1 - b1 ** t) * st["exp_inf"]), lr
    if rule == "nadam":
        b1, b2 = group["betas"]
        psi = group["momentum_decay"]
        mu_t = b1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod = _f(st["mu_product"])
        gd = sign * st["grad"] + (0.0 if decoupled else wd) * w
        denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + group["eps"]
        delta = (1 - mu_t) / (1 - prod) * gd / denom + mu_next / (1 - prod * mu_next) * st["exp_avg"] / denom
        return (delta + wd * w if decoupled else delta), lr
    if rule == "radam":
        b1, b2 = group["betas"]
        mhat = st["exp_avg"] / (1 - b1 ** t)
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
        if rho_t > 5:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            delta = mhat * rect * math.sqrt(1 - b2 ** t) / (st["exp_avg_sq"].sqrt() + group["eps"])
        else:
            delta = mhat
        return (delta + wd * w if decoupled else delta), lr
    raise AssertionError(rule)


def reference_predict(rule, w, st, group, step, s, mode="exact"):
    """(ŵ in float64, magnitude of s·lr·Δ's operands).

    The second bounds the fp32 rounding a kernel may add: Δ can cancel (g + μ·buf ≈ 0), so its error
    scales with its operands, which is Δ evaluated on their absolute values.
    """
    delta, lr = reference_delta(rule, w, st, group, step, mode)
    abs_state = {k: (v.abs() if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in st.items()}
    magnitude, _ = reference_delta(rule, w.abs(), abs_state, {**group, "maximize": False}, step, mode)
    return w.double() - s * lr * delta, s * lr * magnitude.abs()


def overflow_bound(dtype: torch.dtype) -> float:
    """The magnitude from which round-to-nearest gives inf in `dtype`: its largest finite value plus half an
    ulp there (float16: 65520)."""
    fi = torch.finfo(dtype)
    ulp_at_max = fi.max * fi.eps / (2 - fi.eps)
    return fi.max + ulp_at_max / 2


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, term: torch.Tensor, *, ulps: float = 1.0,
                              msg: str = "") -> None:
    """Within `ulps` ulp of the output dtype, plus fp32 rounding of the terms the kernel computed in fp32.

    fp32 maths: a few roundings of s·lr·Δ's operands (up to 16 fp32 eps of `term`, the magnitude from
    `reference_predict`), then one rounding into out's dtype
    (≤ 1 ulp, which also covers truncating stores). Where that rounding overflows (|ref| past the dtype's
    overflow bound by more than the fp32 error) the right value is inf of ref's sign; within the error of
    the bound, inf and the largest finite value are both right.
    """
    eps_out = torch.finfo(out.dtype).eps
    eps32 = torch.finfo(torch.float32).eps
    tiny = torch.finfo(out.dtype).tiny if out.dtype != torch.float32 else 1e-30
    tol = ulps * eps_out * ref.abs() + 16 * eps32 * term + 1e-6 * eps32 + tiny
    got = out.double()
    err = (got - ref).abs()
    may_overflow = ref.abs() + 16 * eps32 * term >= overflow_bound(out.dtype)
    overflowed = torch.isinf(got) & (got.sign() == ref.sign()) & may_overflow
    bad = ~((err <= tol) | overflowed)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{msg}: {int(bad.sum())} of {out.numel()} elements off; first at {i}: "
                             f"got {out[i].item()!r}, reference {ref[i].item()!r}, tolerance {tol[i].item():.3g}")


def coupled_weight_decay(hp: dict, rule: str) -> float:
    """The weight decay Adam adds to the gradient (0 when it is decoupled: AdamW, decoupled_weight_decay)."""
    return 0.0 if rule == "adamw" or hp.get("decoupled_weight_decay") else hp.get("weight_decay", 0.0)


def second_moment_scale(v_before, grad, w, hp, rule) -> torch.Tensor:
    """The magnitude of the terms of v = β2·v + (1−β2)·g² (|g| as |grad| + wd·|w|), float64 on the CPU: what a
    correct float32 step's error is relative to."""
    beta2 = hp.get("betas", (0.9, 0.999))[1]
    g_magnitude = grad.double().cpu().abs() + coupled_weight_decay(hp, rule) * w.double().cpu().abs()
    return beta2 * v_before.double().cpu() + (1.0 - beta2) * g_magnitude ** 2


def reference_second_moment(v_before, grad, w, hp, rule, max_before=None):
    """Adam's v = β2·v + (1−β2)·g² in float64 (g with coupled weight decay for Adam), and AMSGrad's running
    maximum of it when `max_before` is given."""
    beta2 = hp.get("betas", (0.9, 0.999))[1]
    g = grad.double().cpu() + coupled_weight_decay(hp, rule) * w.double().cpu()
    v = beta2 * v_before.double().cpu() + (1.0 - beta2) * g ** 2
    return v, (None if max_before is None else torch.maximum(max_before.double().cpu(), v))


def assert_second_moment_close(got, want, v_before, grad, w, hp, rule, msg):
    """v = β2·v + (1−β2)·g² is a sum of positive terms: a correct fp32 step is a few ulps off relatively to
    the magnitude of its terms, g's included (coupled weight decay can make g = grad + wd·w cancel). An
    absolute bound would hide a relative error in v ≈ 1e-3·g² (see test_kernels_step_predict's
    test_adam_second_moment_forms_one_minus_beta_in_double). A NaN in either is an error."""
    scale = second_moment_scale(v_before, grad, w, hp, rule)
    err = (got.double().cpu() - want.double().cpu()).abs()
    bad = ~(err <= 8 * torch.finfo(torch.float32).eps * scale)
    assert not bad.any(), (f"{msg}: {int(bad.sum())} elements off ({int(err.isnan().sum())} NaN), worst relative "
                           f"{(err / scale).nan_to_num(nan=float('inf')).max().item():.2e} of the terms' magnitude")


# ---- checks shared by the CPU tests and tests/gpu -------------------------------------------------------

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def to_device(state: dict, device, dtype=torch.float32) -> dict:
    return {k: (v.to(device, dtype) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in state.items()}


def check_predict(cfg, backend: str, device: str, gen: torch.Generator, sizes=(1, 7, 4097)) -> None:
    """predict into poisoned buffers of every output dtype matches the float64 reference; w untouched."""

    rule, cls, hp = cfg
    for n in sizes:
        for step in STEPS.get(rule, (5,)):
            _, w64, _, state64, group = optimizer_state(cls, hp, n, step, gen)
            w, state = w64.to(device, torch.float32), to_device(state64, device)
            s = 1 + int(torch.randint(0, 7, (1,), generator=gen))
            ref, term = reference_predict(rule, w.cpu(), to_device(state, "cpu"), group, step, s)
            for dtype in OUT_DTYPES:
                out = torch.full((n,), float("nan"), dtype=dtype, device=device)
                w_before = w.clone()
                got = pk.predict(rule, w, state, group, step=step, s=s, out=out, backend=backend)
                assert got is out
                assert torch.equal(w, w_before), "w must not change when out is a separate buffer"
                assert_close_to_reference(out.cpu(), ref, term,
                                          msg=f"{backend} {rule} {hp} n={n} step={step} s={s} {dtype} "
                                              f"seed={gen.initial_seed()}")
