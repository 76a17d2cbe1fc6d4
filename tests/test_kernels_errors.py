"""Bad input to pipeoptim_kernels: a clear error naming the argument, raised before anything is written, the same
on every backend; and the valid edge cases (zero length, in place through another view, a Parameter as w) alike too."""
import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import (CONFIGS, CPU_BACKEND_IDS, assert_close_to_reference, config_id, optimizer_state,
                              reference_predict)

N = 64
GROUP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)


def _inputs():
    w = torch.randn(N)
    state = {"exp_avg": torch.randn(N), "exp_avg_sq": torch.rand(N)}
    return w, state


def _predict_case(**change):
    w, state = _inputs()
    args = dict(rule="adam", w=w, state=state, group=GROUP, step=3, s=2, out=torch.full((N,), 7.0))
    args.update(change)
    return args


def _bad_state(**entries):
    _, state = _inputs()
    state.update(entries)
    return state


PREDICT_CASES = [
    ("unknown rule", dict(rule="lbfgs"), ValueError, "unknown rule 'lbfgs'.*register_rule"),
    ("w not a tensor", dict(w=[1.0, 2.0]), TypeError, "w must be a torch.Tensor"),
    ("w 2-D", dict(w=torch.randn(8, 8)), ValueError, "w must be a flat 1-D buffer"),
    ("w strided", dict(w=torch.randn(2 * N)[::2]), ValueError, "w must be contiguous"),
    ("w int", dict(w=torch.ones(N, dtype=torch.int32)), TypeError, "w has dtype torch.int32"),
    ("state short", dict(state=_bad_state(exp_avg=torch.randn(N - 1))), ValueError, r"state\['exp_avg'\] has 63 elements"),
    ("state dtype", dict(state=_bad_state(exp_avg_sq=torch.rand(N, dtype=torch.float64))), TypeError, "exp_avg_sq.*dtype"),
    ("state missing", dict(state={"exp_avg": torch.randn(N)}), ValueError, r"needs state\['exp_avg_sq'\]"),
    ("amsgrad state missing", dict(group={**GROUP, "amsgrad": True}), ValueError, "max_exp_avg_sq.*amsgrad"),
    ("out short", dict(out=torch.full((N + 1,), 7.0)), ValueError, "out has 65 elements"),
    ("out int", dict(out=torch.zeros(N, dtype=torch.int64)), TypeError, "out has dtype"),
    ("out overlaps state", "overlap", ValueError, "out overlaps"),
    ("negative s", dict(s=-1), ValueError, "s must be >= 0"),
    ("nan s", dict(s=float("nan")), ValueError, "s must be a finite"),
    ("negative step", dict(step=-2), ValueError, "step must be a non-negative integer"),
    ("fractional step", dict(step=1.5), ValueError, "step must be a non-negative integer"),
    ("group without lr", dict(group={"betas": (0.9, 0.99)}), ValueError, "group has no 'lr'"),
    ("group not a dict", dict(group=0.1), TypeError, "group must be a dict"),
    ("group without betas", dict(group={"lr": 0.1, "eps": 1e-8}), ValueError, "group has no 'betas'"),
    ("state not a dict", dict(state=[1, 2]), TypeError, "state must be a dict"),
    ("bad mode", dict(mode="fast"), ValueError, "mode must be 'exact'"),
    ("paper rmsprop", dict(rule="rmsprop", mode="paper"), ValueError, "mode='paper' covers only"),
    ("bad backend", dict(backend="opencl"), ValueError, "unknown backend 'opencl'"),
    ("cpu backend float64", dict(w=torch.randn(N, dtype=torch.float64), backend="cpu",
                                 state={"exp_avg": torch.randn(N, dtype=torch.float64),
                                        "exp_avg_sq": torch.rand(N, dtype=torch.float64)},
                                 out=torch.full((N,), 7.0, dtype=torch.float64)), TypeError, "use backend='eager'"),
]


@pytest.mark.parametrize("case", PREDICT_CASES, ids=[c[0] for c in PREDICT_CASES])
def test_predict_rejects_bad_input_before_writing(case):
    _, change, exc, pattern = case
    if change == "overlap":
        args = _predict_case()
        args["out"] = args["state"]["exp_avg"]
    else:
        args = _predict_case(**change)
    w, out, state = args["w"], args["out"], args["state"]
    w_before = w.clone() if isinstance(w, torch.Tensor) else None
    out_before = out.clone()
    state_before = {k: v.clone() for k, v in state.items()} if isinstance(state, dict) else {}
    rule = args.pop("rule")
    with pytest.raises(exc, match=pattern):
        pk.predict(rule, args.pop("w"), args.pop("state"), args.pop("group"), **args)
    if w_before is not None:
        assert torch.equal(w, w_before), "w was written before the error"
    assert torch.equal(out, out_before), "out was written before the error"
    for k, v in state_before.items():
        assert torch.equal(state[k], v), f"state[{k!r}] was written before the error"


def test_step_predict_rejects_bad_input_before_writing():
    w, state = _inputs()
    g = torch.randn(N)
    cases = [
        (dict(rule="rmsprop"), ValueError, "step_predict supports sgd, adam, adamw"),
        (dict(out=None), ValueError, "needs out="),
        (dict(out="w"), ValueError, "out must not be w"),
        (dict(grad=torch.randn(N + 2)), ValueError, "grad has 66 elements"),
        (dict(out="exp_avg"), ValueError, "out overlaps"),
        (dict(s=-0.5), ValueError, "s must be >= 0"),
        (dict(state={"exp_avg": torch.randn(N)}), ValueError, r"needs state\['exp_avg_sq'\]"),
    ]
    for change, exc, pattern in cases:
        snapshot = [w.clone(), g.clone()] + [v.clone() for v in state.values()]
        out = torch.full((N,), 7.0)
        args = dict(rule="adam", w=w, grad=g, state=state, group=GROUP, step=1, s=1, out=out)
        args.update(change)
        if isinstance(args["out"], str):  # name of an input the out buffer should alias
            args["out"] = w if args["out"] == "w" else state[args["out"]]
        with pytest.raises(exc, match=pattern):
            pk.step_predict(args.pop("rule"), args.pop("w"), args.pop("grad"), args.pop("state"), args.pop("group"),
                            **args)
        after = [w, g] + list(state.values())
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after)), f"{change}: an input was written"
        assert torch.equal(out, torch.full((N,), 7.0)), f"{change}: out was written"


def test_unavailable_backend_names_how_to_get_it(monkeypatch):
    from pipeoptim_kernels import compiled
    monkeypatch.setattr(compiled, "has_cuda", lambda: False)
    w, state = _inputs()
    with pytest.raises(RuntimeError, match="CUDA_HOME=/usr/local/cuda pip install"):
        pk.predict("adam", w, state, GROUP, step=1, s=1, out=torch.empty(N), backend="cuda")


def test_custom_rule_on_a_compiled_backend_is_refused():
    w, _ = _inputs()
    pk.register_rule("errors_test_rule", lambda w, st, g, t: st["grad"], overwrite=True)
    with pytest.raises(ValueError, match="custom rules run on the eager backend"):
        pk.predict("errors_test_rule", w, {"grad": torch.randn(N)}, {"lr": 0.1}, step=1, s=1, backend="triton")


# ---- every backend alike: the same error, nothing written ---------------------------------------------------
# Each case runs on every backend present (the checks run before a backend is picked, so a backend that
# would mishandle the call never sees it). Buffers are poisoned with random bits first and compared bit
# for bit afterwards (NaN payloads included), so "nothing written" cannot pass by accident.

def _poisoned(n: int, dtype=torch.float32) -> torch.Tensor:
    """A buffer of random bits (some of them NaNs and infinities)."""
    bits = torch.randint(-2**15, 2**15, (n * torch.finfo(dtype).bits // 16,), dtype=torch.int16)
    return bits.view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _snapshot(*buffers) -> list[torch.Tensor]:
    return [_bits(b) for b in buffers]


def _assert_untouched(before: list[torch.Tensor], buffers, what: str) -> None:
    for i, (b, t) in enumerate(zip(before, buffers)):
        assert torch.equal(b, _bits(t)), f"{what}: buffer {i} was written before the error"


def _adam_state(n: int) -> dict:
    return {"exp_avg": _poisoned(n).nan_to_num_(0.0, 1.0, -1.0), "exp_avg_sq": torch.rand(n)}


def _predict_gap(case: str):
    """(args for pk.predict, the buffers that must stay untouched, error, message) for one audited case."""
    n = N
    w, state, out = torch.randn(n), _adam_state(n), _poisoned(n)
    group, step, s = dict(GROUP), 3, 2.0
    keep = [w, out, *state.values()]
    if case in ("out shifted after w", "out shifted before w"):
        buf = _poisoned(n + 1)
        buf[:] = torch.randn(n + 1)
        w, out = (buf[:-1], buf[1:]) if case == "out shifted after w" else (buf[1:], buf[:-1])
        keep = [buf, *state.values()]
        return dict(w=w, state=state, group=group, step=step, s=s, out=out), keep, ValueError, \
            "out overlaps w without being the same buffer"
    if case == "bf16 out over w's first half":
        out = w.view(torch.bfloat16)[:n]
        return dict(w=w, state=state, group=group, step=step, s=s, out=out), keep, ValueError, "out overlaps w"
    if case == "no prediction (s=0) into the state":
        return dict(w=w, state=state, group=group, step=step, s=0, out=state["exp_avg"]), keep, ValueError, \
            r"out overlaps state\['exp_avg'\]"
    bad = {
        "beta2 = 1": (dict(group={**group, "betas": (0.9, 1.0)}), ValueError,
                      r"group\['betas'\]\[1\] is 1.0; each beta must lie in \[0, 1\)"),
        "beta1 = 1": (dict(group={**group, "betas": (1.0, 0.999)}), ValueError, r"group\['betas'\]\[0\] is 1.0"),
        "beta2 nan": (dict(group={**group, "betas": (0.9, float("nan"))}), ValueError, r"group\['betas'\]\[1\] is nan"),
        "beta1 negative": (dict(group={**group, "betas": (-0.1, 0.999)}), ValueError, r"group\['betas'\]\[0\] is -0.1"),
        "betas not a pair": (dict(group={**group, "betas": 0.9}), TypeError, r"group\['betas'\] must be a pair"),
        "lr negative": (dict(group={**group, "lr": -1e-3}), ValueError,
                        r"group\['lr'\] is -0.001; it must be a number >= 0"),
        "lr nan": (dict(group={**group, "lr": float("nan")}), ValueError, r"group\['lr'\] is nan"),
        "lr nan tensor": (dict(group={**group, "lr": torch.tensor(float("nan"))}), ValueError, r"group\['lr'\] is nan"),
        "lr two-element tensor": (dict(group={**group, "lr": torch.tensor([1e-3, 1e-3])}), ValueError,
                                  r"group\['lr'\] is a tensor of 2 elements"),
        "lr a string": (dict(group={**group, "lr": "1e-3"}), TypeError, r"group\['lr'\] must be a number"),
        "eps negative": (dict(group={**group, "eps": -1e-8}), ValueError, r"group\['eps'\] is -1e-08"),
        "weight_decay negative": (dict(group={**group, "weight_decay": -0.1}), ValueError,
                                  r"group\['weight_decay'\] is -0.1"),
        "state entry a list": (dict(state={**state, "exp_avg": [0.0] * n}), TypeError,
                               r"state\['exp_avg'\] must be a torch.Tensor"),
        "state entry a float": (dict(state={**state, "exp_avg_sq": 0.5}), TypeError,
                                r"state\['exp_avg_sq'\] must be a torch.Tensor"),
        "state entry on another device": (dict(state={**state, "exp_avg": torch.empty(n, device="meta")}), ValueError,
                                          r"state\['exp_avg'\] is on meta but w is on cpu"),
        "unknown backend with nothing to predict": (dict(s=0, out=None, backend="opencl"), ValueError,
                                                    "unknown backend 'opencl'"),
    }
    change, exc, pattern = bad[case]
    args = dict(w=w, state=state, group=group, step=step, s=s, out=out)
    args.update(change)
    return args, keep, exc, pattern


PREDICT_GAPS = ["out shifted after w", "out shifted before w", "bf16 out over w's first half",
                "no prediction (s=0) into the state", "beta2 = 1", "beta1 = 1", "beta2 nan", "beta1 negative",
                "betas not a pair", "lr negative", "lr nan", "lr nan tensor", "lr two-element tensor", "lr a string",
                "eps negative", "weight_decay negative", "state entry a list", "state entry a float",
                "state entry on another device", "unknown backend with nothing to predict"]


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("case", PREDICT_GAPS)
def test_predict_gap_is_refused_alike_on_every_backend(case, backend):
    args, keep, exc, pattern = _predict_gap(case)
    args.setdefault("backend", backend)
    before = _snapshot(*keep)
    with pytest.raises(exc, match=pattern):
        pk.predict("adam", args.pop("w"), args.pop("state"), args.pop("group"), **args)
    _assert_untouched(before, keep, f"{case} on {backend}")


# Other rules' hyperparameters, each outside the range torch.optim's constructor accepts.
RULE_GAPS = [
    ("sgd", "SGD", {"momentum": -0.5}, {"momentum_buffer"}, r"group\['momentum'\] is -0.5"),
    ("sgd", "SGD", {"momentum": 0.9, "nesterov": True, "dampening": 0.1}, {"momentum_buffer"},
     "nesterov=True, which needs"),
    ("rmsprop", "RMSprop", {"alpha": -0.9}, {"square_avg", "grad"}, r"group\['alpha'\] is -0.9"),
    ("rmsprop", "RMSprop", {"eps": float("nan")}, {"square_avg", "grad"}, r"group\['eps'\] is nan"),
    ("adagrad", "Adagrad", {"lr_decay": -0.1}, {"sum", "grad"}, r"group\['lr_decay'\] is -0.1"),
    ("adamax", "Adamax", {"betas": (0.9, 1.0)}, {"exp_avg", "exp_inf"}, r"group\['betas'\]\[1\] is 1.0"),
    ("nadam", "NAdam", {"momentum_decay": -4e-3}, {"exp_avg", "exp_avg_sq", "grad"},
     r"group\['momentum_decay'\] is -0.004"),
    ("radam", "RAdam", {"betas": (0.9, 1.0)}, {"exp_avg", "exp_avg_sq"}, r"group\['betas'\]\[1\] is 1.0"),
]


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("case", RULE_GAPS, ids=lambda c: f"{c[0]}-{c[2]}")
def test_hyperparameters_torch_optim_refuses_are_refused(case, backend):
    rule, cls, bad, names, pattern = case
    with pytest.raises(ValueError):  # the range is torch.optim's own: its constructor refuses the value too
        getattr(torch.optim, cls)([torch.nn.Parameter(torch.zeros(1))], **bad)
    group = {**_defaults(cls), **bad}
    w, out = torch.randn(N), _poisoned(N)
    state = {k: torch.rand(N) + 0.5 for k in names}
    if rule == "nadam":
        state["mu_product"] = torch.tensor(0.5)
    keep = [w, out, *(v for v in state.values() if v.dim())]
    before = _snapshot(*keep)
    with pytest.raises(ValueError, match=pattern):
        pk.predict(rule, w, state, group, step=3, s=2, out=out, backend=backend)
    _assert_untouched(before, keep, f"{rule} {bad} on {backend}")


def _defaults(cls: str) -> dict:
    group = getattr(torch.optim, cls)([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def test_nan_lr_is_refused_for_every_rule_though_torch_sgd_accepts_it():
    """torch.optim.SGD's check (lr < 0) lets NaN through; the kernels refuse it for every rule alike."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float("nan"))
    w, buf = torch.randn(N), torch.randn(N)
    with pytest.raises(ValueError, match=r"group\['lr'\] is nan"):
        pk.predict("sgd", w, {"momentum_buffer": buf}, {"lr": float("nan"), "momentum": 0.9}, step=1, s=1)


def test_nadam_mu_product_of_one_is_refused_before_dividing_by_zero():
    w, out = torch.randn(N), _poisoned(N)
    state = {"exp_avg": torch.randn(N), "exp_avg_sq": torch.rand(N), "grad": torch.randn(N),
             "mu_product": torch.tensor(1.0)}
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"state\['mu_product'\] is 1.0 after 3 steps"):
        pk.predict("nadam", w, state, _defaults("NAdam"), step=3, s=1, out=out)
    _assert_untouched(before, [out], "nadam")


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_values_at_the_edge_of_torch_optims_ranges_are_accepted(backend, gen):
    """lr, eps, weight decay and beta1 of 0 are what torch.optim accepts: the checks must not refuse them."""
    n = 257
    for edge in (dict(lr=0.0), dict(eps=0.0, lr=1e-2), dict(betas=(0.0, 0.999), lr=1e-2)):
        _, w64, _, state64, group = optimizer_state("Adam", edge, n, 3, gen)
        w = w64.float()
        state = {k: v.float() for k, v in state64.items() if isinstance(v, torch.Tensor) and v.dim()}
        out = _poisoned(n)
        pk.predict("adam", w, state, group, step=3, s=2, out=out, backend=backend)
        ref, term = reference_predict("adam", w, state, group, 3, 2)
        assert_close_to_reference(out, ref, term, msg=f"{backend} {edge}")


def _step_gap(case: str):
    n = N
    w, grad, out = torch.randn(n), torch.randn(n), _poisoned(n)
    state = _adam_state(n)
    group = dict(GROUP)
    args = dict(w=w, grad=grad, state=state, group=group, out=out)
    keep = [w, grad, out, *state.values()]
    if case in ("grad shifted after w", "grad shifted before w", "out shifted over grad"):
        buf = torch.randn(n + 1)
        first, second = buf[:-1], buf[1:]
        if case == "out shifted over grad":
            args.update(grad=first, out=second)
            keep = [buf, w, *state.values()]
            return args, keep, "out overlaps grad without being the same buffer"
        args.update(w=first, grad=second) if case == "grad shifted after w" else args.update(w=second, grad=first)
        keep = [buf, out, *state.values()]
        return args, keep, "w overlaps grad"
    if case == "grad is w":
        args.update(grad=w)
        return args, keep, "w overlaps grad"
    if case == "exp_avg is exp_avg_sq":
        state["exp_avg_sq"] = state["exp_avg"]
        return args, keep, r"state\['exp_avg'\] overlaps state\['exp_avg_sq'\]"
    if case == "exp_avg is w":
        state["exp_avg"] = w
        return args, keep, r"w overlaps state\['exp_avg'\]"
    if case == "out is a view of w":
        args.update(out=w[:])
        return args, keep, "out overlaps w.*w receives the stepped weights"
    if case == "beta2 = 1":
        args.update(group={**group, "betas": (0.9, 1.0)})
        return args, keep, r"group\['betas'\]\[1\] is 1.0"
    if case == "lr nan":
        args.update(group={**group, "lr": float("nan")})
        return args, keep, r"group\['lr'\] is nan"
    if case == "state entry a list":
        state["exp_avg"] = [0.0] * n
        keep = [w, grad, out, state["exp_avg_sq"]]
        return args, keep, r"state\['exp_avg'\] must be a torch.Tensor"
    raise AssertionError(case)


STEP_GAPS = ["grad shifted after w", "grad shifted before w", "out shifted over grad", "grad is w",
             "exp_avg is exp_avg_sq", "exp_avg is w", "out is a view of w", "beta2 = 1", "lr nan", "state entry a list"]


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("case", STEP_GAPS)
def test_step_predict_gap_is_refused_alike_on_every_backend(case, backend):
    args, keep, pattern = _step_gap(case)
    exc = TypeError if "must be a torch.Tensor" in pattern else ValueError
    before = _snapshot(*keep)
    with pytest.raises(exc, match=pattern):
        pk.step_predict("adam", args.pop("w"), args.pop("grad"), args.pop("state"), args.pop("group"), step=3, s=1,
                        backend=backend, **args)
    _assert_untouched(before, keep, f"{case} on {backend}")


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_sgd_step_predict_refuses_a_momentum_buffer_over_the_gradient(backend):
    w, grad, out = torch.randn(N), torch.randn(N), _poisoned(N)
    keep = [w, grad, out]
    before = _snapshot(*keep)
    with pytest.raises(ValueError, match=r"state\['momentum_buffer'\] overlaps grad"):
        pk.step_predict("sgd", w, grad, {"momentum_buffer": grad}, dict(lr=0.1, momentum=0.9), step=2, s=1, out=out,
                        backend=backend)
    _assert_untouched(before, keep, backend)


# ---- what is valid behaves alike on every backend --------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_zero_length_buffers_predict_nothing_on_every_backend(cfg, backend, gen):
    """Zero parameters (an empty group) is valid: every backend returns the empty prediction, equal to the
    float64 reference's, without launching anything (the cpu backend used to fail inside its op)."""
    rule, cls, hp = cfg
    _, w64, _, state64, group = optimizer_state(cls, hp, 0, 3, gen)
    w = w64.float()
    state = {k: (v.float() if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in state64.items()}
    ref, term = reference_predict(rule, w, state, group, 3, 2)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(0, dtype=dtype)
        got = pk.predict(rule, w, state, group, step=3, s=2, out=out, backend=backend)
        assert got is out
        assert_close_to_reference(out, ref, term, msg=f"{backend} {rule} n=0")
    got = pk.predict(rule, w, state, group, step=3, s=2, backend=backend)
    assert got.shape == (0,) and got.dtype == torch.float32 and got is not w


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
@pytest.mark.parametrize("rule, cls, hp", [("adam", "Adam", dict(lr=1e-2, amsgrad=True)),
                                           ("adamw", "AdamW", dict(lr=1e-2)),
                                           ("sgd", "SGD", dict(lr=0.1, momentum=0.9))], ids=["adam", "adamw", "sgd"])
def test_zero_length_buffers_step_predict_nothing_on_every_backend(rule, cls, hp, backend):
    p = torch.nn.Parameter(torch.zeros(0))
    opt = getattr(torch.optim, cls)([p], **hp)
    p.grad = torch.zeros(0)
    opt.step()  # torch.optim takes the step on an empty parameter; so do the kernels
    names = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
             "sgd": ("momentum_buffer",)}[rule]
    state = {k: torch.zeros(0) for k in names}
    for out_is_grad in (False, True):
        w, grad = torch.zeros(0), torch.zeros(0)
        out = grad if out_is_grad else torch.empty(0, dtype=torch.bfloat16)
        assert pk.step_predict(rule, w, grad, state, opt.param_groups[0], step=1, s=2, out=out, backend=backend) is out
        assert w.shape == out.shape == p.shape == (0,)


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_empty_views_inside_other_buffers_do_not_count_as_overlap(backend):
    buf = torch.randn(3 * N)
    w, m, v = buf[:0], buf[N:N], buf[2 * N:2 * N]
    out = pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, GROUP, step=3, s=2, out=buf[5:5], backend=backend)
    assert out.numel() == 0


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_in_place_through_another_view_of_w_is_in_place(backend, gen):
    """out=w is allowed as the same buffer, whichever tensor object holds it (e.g. two slices of one flat buffer)."""
    _, w64, _, state64, group = optimizer_state("Adam", dict(lr=1e-2), 301, 3, gen)
    state = {k: v.float() for k, v in state64.items() if isinstance(v, torch.Tensor) and v.dim()}
    flat = torch.cat([torch.zeros(7), w64.float()])
    ref, term = reference_predict("adam", flat[7:], state, group, 3, 2)
    pk.predict("adam", flat[7:], state, group, step=3, s=2, out=flat[7:], backend=backend)
    assert_close_to_reference(flat[7:], ref, term, msg=f"{backend} in place through a second view")
    assert torch.equal(flat[:7], torch.zeros(7))


@pytest.mark.parametrize("backend", CPU_BACKEND_IDS, indirect=True)
def test_buffers_that_require_grad_are_written_outside_autograd(backend, gen):
    """A Parameter passed as w (not w.detach()) is stepped as optimizer.step() steps it, under no_grad, on every
    backend: eager used to write the moments and then fail on w (a leaf that requires grad), and its
    prediction joined the autograd graph while the compiled backends' did not."""
    n = 129
    w0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    state0 = {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen)}
    results = []
    for as_parameter in (True, False):
        w = torch.nn.Parameter(w0.clone()) if as_parameter else w0.clone()
        state = {k: v.clone() for k, v in state0.items()}
        out = torch.empty(n)
        pk.step_predict("adam", w, g, state, GROUP, step=3, s=2, out=out, backend=backend)
        assert out.grad_fn is None and not out.requires_grad
        predicted = pk.predict("adam", w, state, GROUP, step=4, s=1, backend=backend)
        assert predicted.grad_fn is None and not predicted.requires_grad
        results.append([_bits(t) for t in (w, out, predicted, *state.values())])
    assert all(torch.equal(a, b) for a, b in zip(*results)), f"{backend}: a Parameter w gave other bits"


def test_meta_buffers_are_not_taken_for_overlapping():
    """Meta tensors (shapes without memory, as while tracing) all report address 0: they share no memory, so
    the overlap checks pass them (they used to be refused as `out overlaps m`) and auto runs them eagerly."""
    def meta():
        return torch.empty(N, device="meta")
    out = meta()
    assert pk.predict("adam", meta(), {"exp_avg": meta(), "exp_avg_sq": meta()}, GROUP, step=3, s=2, out=out) is out
    out = meta()
    assert pk.step_predict("adam", meta(), meta(), {"exp_avg": meta(), "exp_avg_sq": meta()}, GROUP, step=3, s=2,
                           out=out) is out
