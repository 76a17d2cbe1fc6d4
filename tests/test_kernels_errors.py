"""Bad input to pipeoptim_kernels: a clear error naming the argument, raised before anything is written."""
import pytest
import torch

import pipeoptim_kernels as pk

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
