"""Tests of pipeoptim.policies: what each policy's forwards and backwards read, when it steps, and that
its memory report matches the buffers it holds.

Each backward is checked against a hand-written backward (tests/test_predictor.py's models) fed with
the weights the policy should have used: forward weights and backward weights are worked out here
from the policy's definition (DESIGN.md §3), from the optimizer's state, independently of the code.
"""
from __future__ import annotations

import contextlib
import gc
import types

import pytest
import torch
from torch import nn

from pipeoptim.policies import POLICIES, WeightPolicy, make_policy, register_policy
from test_predictor import MLP, XWT, params64, reference_prediction

O = torch.optim


def build(policy, model_cls=XWT, opt=lambda p: O.AdamW(p, lr=2e-2, weight_decay=0.05), seed=0, warm=1, **options):
    """A model, its optimizer and policy, after `warm` plain steps (so that predictions are active)."""
    torch.manual_seed(seed)
    model = model_cls()
    optimizer = opt(model.parameters())
    pol = make_policy(policy, model, optimizer, **options)
    gen = torch.Generator().manual_seed(seed + 100)
    last = {}
    for _ in range(warm):
        model(torch.randn(model_cls.example().shape, generator=gen)).pow(2).mean().backward()
        last = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        pol.step()
    return model, optimizer, pol, last


class Flight:
    """One micro-batch: its input, output, output gradient and the weights its forward read."""

    def __init__(self, model, pol, mb, s, forward_weights, gen):
        self.x = type(model).example().requires_grad_(True)
        with pol.forward(mb, s=s):
            self.y = model(self.x)
        self.mb, self.wf = mb, forward_weights
        self.gy = torch.randn(self.y.shape, generator=gen)

    def backward_and_check(self, model, pol, backward_weights, s=0):
        before = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        with pol.backward(self.mb, s=s):
            self.y.backward(self.gy)
        gx, grads = type(model).manual(self.x.detach().double(), self.gy.double(), self.wf, backward_weights)
        assert torch.allclose(self.x.grad.double(), gx, atol=1e-5), (self.x.grad.double() - gx).abs().max()
        for n, p in model.named_parameters():
            added = p.grad.double() - before[n]
            assert torch.allclose(added, grads[n], atol=1e-5), (n, (added - grads[n]).abs().max())


def smoothed(optimizer, model, s):
    """SpecTrain's ŵ = w − s·lr·v with v the Adam family's exp_avg."""
    lr = optimizer.param_groups[0]["lr"]
    return {n: p.detach().double() - s * lr * optimizer.state[p]["exp_avg"].double() for n, p in model.named_parameters()}


# ---- the executor's view -------------------------------------------------------------------------------


def test_registry_names_and_errors():
    assert set(POLICIES) == {"none", "stash", "2bw", "spectrain", "pipeoptim"}
    model = XWT()
    with pytest.raises(ValueError, match="none, stash, 2bw, spectrain, pipeoptim"):
        make_policy("gpipe", model, O.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already registered"):
        register_policy(POLICIES["none"])


def test_custom_policy_can_be_registered():
    class Frozen(WeightPolicy):
        name = "test_frozen"

        def _apply_step(self, next_s):
            pass

    try:
        register_policy(Frozen)
        model = XWT()
        pol = make_policy("test_frozen", model, O.SGD(model.parameters(), lr=0.1))
        assert isinstance(pol, Frozen)
    finally:
        POLICIES.pop("test_frozen", None)


def test_a_policys_own_weight_contexts_run_whether_defined_or_inherited():
    """Whether a class reads its own weights is worked out once per class (the scopes ask it per action): a
    class that defines _forward_weights / _backward_weights, and one that inherits them, both get them run."""
    seen = []

    class Recording(WeightPolicy):
        name = "test_recording"

        @contextlib.contextmanager
        def _forward_weights(self, mb, s):
            seen.append(("forward", mb, s))
            yield

        @contextlib.contextmanager
        def _backward_weights(self, mb, s):
            seen.append(("backward", mb, s))
            yield

    class Inheriting(Recording):
        pass

    class Plain(WeightPolicy):
        pass

    assert Plain._reads_own_forward_weights is False and Plain._reads_own_backward_weights is False
    for cls in (Recording, Inheriting):
        seen.clear()
        model = XWT()
        pol = cls(model, O.SGD(model.parameters(), lr=0.1))
        x = XWT.example().requires_grad_(True)
        with pol.forward(3, s=0):
            y = model(x)
        with pol.backward(3, s=1):
            y.sum().backward()
        assert seen == [("forward", 3, 0), ("backward", 3, 1)], cls.__name__
        assert pol.in_flight == ()


@pytest.mark.parametrize("name", list(POLICIES))
def test_contract_errors(name):
    model, optimizer, pol, _ = build(name, update_every=4) if name == "2bw" else build(name)
    with pol.forward("a", s=1):
        model(XWT.example())
    with pytest.raises(ValueError, match="already in flight"):
        with pol.forward("a", s=1):
            pass
    with pytest.raises(ValueError, match="no forward in flight"):
        with pol.backward("b"):
            pass
    with pytest.raises(ValueError, match="s must be"):
        with pol.forward("c", s=-1):
            pass
    assert pol.in_flight == ("a",)
    pol.discard("a")
    assert pol.in_flight == ()


@pytest.mark.parametrize("name", list(POLICIES))
def test_split_backward_contract_errors(name):
    model, optimizer, pol, _ = build(name, update_every=4) if name == "2bw" else build(name)
    with pol.forward("a", s=1):
        model(XWT.example())
    with pytest.raises(ValueError, match="part must be one of full, input, weight"):
        with pol.backward("a", part="both"):
            pass
    with pytest.raises(ValueError, match="runs after its input part"):
        with pol.backward("a", part="weight"):
            pass
    with pol.backward("a", part="input"):
        pass
    assert pol.in_flight == ("a",) and not pol.should_step()      # no gradient before the weight part
    for part in ("input", "full"):
        with pytest.raises(ValueError, match="already ran the input part"):
            with pol.backward("a", part=part):
                pass
    with pol.backward("a", part="weight"):
        pass
    assert pol.in_flight == ()
    if name != "2bw":
        assert pol.should_step()


def test_2bw_needs_update_every():
    model = XWT()
    with pytest.raises(TypeError, match="update_every"):
        make_policy("2bw", model, O.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="update_every"):
        make_policy("pipeoptim", model, O.SGD(model.parameters(), lr=0.1), update_every=0)


def test_forward_under_no_grad_is_not_left_in_flight():
    model, optimizer, pol, _ = build("stash")
    with torch.no_grad(), pol.forward(0, s=2):
        model(XWT.example())
    assert pol.in_flight == ()


@pytest.mark.parametrize("name", ["none", "stash", "2bw", "pipeoptim", "spectrain"])
def test_a_forward_or_backward_that_raises_leaves_the_policy_as_it_was(name):
    """The exception comes out unchanged; the failed forward is not in flight, its weights and hooks are undone
    (the module reads the real weights again, the same micro-batch runs again); a failed backward leaves its
    micro-batch in flight and its gradient uncounted."""
    model, optimizer, pol, _ = build(name, update_every=2 if name == "2bw" else 1)
    real = {n: p.detach().clone() for n, p in model.named_parameters()}

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with pol.forward(0, s=2):
            model(XWT.example())
            raise Boom
    assert pol.in_flight == ()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), real[n]), n
    x = XWT.example().requires_grad_(True)
    with pol.forward(0, s=2):
        y = model(x)
    assert pol.in_flight == (0,)
    with pytest.raises(Boom):
        with pol.backward(0, s=1):
            raise Boom
    assert pol.in_flight == (0,) and not pol.should_step() and pol._backwards == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), real[n]), n
    with pol.backward(0, s=1):
        y.pow(2).sum().backward()
    assert pol.in_flight == () and pol._backwards == 1


def test_a_policy_context_that_fails_to_enter_exits_what_it_entered():
    model, optimizer, pol, _ = build("pipeoptim")
    real = {n: p.detach().clone() for n, p in model.named_parameters()}
    entered, exited = [], []

    class Failing(type(pol)):
        @contextlib.contextmanager
        def _forward_weights(self, mb, s):
            raise RuntimeError("cannot swap the weights")
            yield

    pol.__class__ = Failing
    hooks = pol.saved.hooks

    def watched(*args, **kwargs):
        ctx = hooks(*args, **kwargs)

        class Watch:
            def __enter__(self):
                entered.append(1)
                return ctx.__enter__()

            def __exit__(self, *exc):
                exited.append(exc[0])
                return ctx.__exit__(*exc)
        return Watch()
    pol.saved.hooks = watched
    with pytest.raises(RuntimeError, match="cannot swap"):
        with pol.forward(0, s=2):
            pytest.fail("the body must not run when entering failed")
    assert entered == [1] and exited == [RuntimeError] and pol.in_flight == ()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), real[n]), n


# ---- what forwards and backwards read: three micro-batches in flight --------------------------------------------


@pytest.mark.parametrize("model_cls", [XWT, MLP])
@pytest.mark.parametrize("name", ["none", "stash", "pipeoptim", "spectrain"])
def test_three_in_flight_each_backward_reads_what_the_policy_defines(name, model_cls):
    """F0(s=3) F1(s=2) F2(s=1), then B0 step B1 step B2 step (SpecTrain's backward look-ahead s_b = 1)."""
    model, optimizer, pol, last = build(name, model_cls=model_cls)
    gen = torch.Generator().manual_seed(7)
    flights = []
    for mb, s in enumerate((3.0, 2.0, 1.0)):
        if name == "pipeoptim":
            wf = {n: reference_prediction(optimizer, p, last[n], s) for n, p in model.named_parameters()}
        elif name == "spectrain":
            wf = smoothed(optimizer, model, s)
        else:
            wf = params64(model)
        flights.append(Flight(model, pol, mb, s, wf, gen))
    if name in ("pipeoptim", "spectrain"):
        assert not torch.allclose(*(next(iter(f.wf.values())) for f in flights[:2]))
    for f in flights:
        s_back = 1.0 if name == "spectrain" else 0
        if name == "stash":
            wb = f.wf
        elif name == "spectrain":
            wb = smoothed(optimizer, model, s_back)
        else:
            wb = params64(model)
        f.backward_and_check(model, pol, wb, s=s_back)
        assert pol.should_step()
        assert pol.step()


@pytest.mark.parametrize("model_cls", [XWT, MLP])
@pytest.mark.parametrize("name", ["none", "stash", "pipeoptim", "spectrain"])
def test_split_backward_parts_read_what_the_policy_defines_with_steps_between_them(name, model_cls):
    """async-zb's pattern on one stage: F0 F1 F2, then I0 I1 W0 step I2 W1 step W2 step. Each input part reads
    the policy's backward weights at its time (stash: the forward's version; none, pipeoptim: the real weights
    then; spectrain: its backward prediction then); each weight part, after steps, adds exactly the weight
    gradients of an unsplit backward at its input part's time (these models' weight gradients do not read the
    weights themselves). Stash keeps a version until the weight part."""
    from pipeoptim.runtime.split_backward import input_pass, weight_pass
    model, optimizer, pol, last = build(name, model_cls=model_cls)
    gen = torch.Generator().manual_seed(11)
    s_back = 1.0 if name == "spectrain" else 0
    flights = []
    for mb, s in enumerate((3.0, 2.0, 1.0)):
        if name == "pipeoptim":
            wf = {n: reference_prediction(optimizer, p, last[n], s) for n, p in model.named_parameters()}
        elif name == "spectrain":
            wf = smoothed(optimizer, model, s)          # Flight passes no look-ahead to the forward
        else:
            wf = params64(model)
        flights.append(Flight(model, pol, mb, s, wf, gen))
    params = list(model.parameters())
    expected, works = {}, {}

    def input_part(f):
        wb = f.wf if name == "stash" else smoothed(optimizer, model, s_back) if name == "spectrain" else \
            params64(model)
        expected[f.mb] = type(model).manual(f.x.detach().double(), f.gy.double(), f.wf, wb)
        with pol.backward(f.mb, s=s_back, part="input"):
            (gx,), works[f.mb] = input_pass([f.y], [f.gy], (f.x,), params)
        err = (gx.double() - expected[f.mb][0]).abs().max()
        assert torch.allclose(gx.double(), expected[f.mb][0], atol=1e-5), err

    def weight_part(f):
        before = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        with pol.backward(f.mb, s=s_back, part="weight"):
            weight_pass(works.pop(f.mb))
        for n, p in model.named_parameters():
            added = p.grad.double() - before[n]
            want = expected[f.mb][1][n]
            assert torch.allclose(added, want, atol=1e-5), (n, (added - want).abs().max())
        assert pol.should_step()
        assert pol.step()

    input_part(flights[0])
    input_part(flights[1])
    weight_part(flights[0])
    input_part(flights[2])                      # one step after its forward's version: stash still holds it
    if name == "stash":
        assert pol.memory_report()["stash"] > 0
    weight_part(flights[1])
    weight_part(flights[2])
    assert pol.in_flight == ()


def test_2bw_accumulates_m_microbatches_with_two_versions():
    """1F1B with 3 in flight and m = 4: one update per 4 backwards, each backward reads its forward's
    version, at most one stashed copy; the update is plain SGD on the sum of the batch's gradients."""
    model, optimizer, pol, _ = build("2bw", opt=lambda p: O.SGD(p, lr=0.05), update_every=4)
    gen = torch.Generator().manual_seed(3)
    flights, done, updates = {}, 0, 0
    order = ["F0", "F1", "F2"] + [a for k in range(3, 12) for a in (f"B{k - 3}", f"F{k}")] + ["B9", "B10", "B11"]
    accumulated = None
    for action in order:
        mb = int(action[1:])
        if action[0] == "F":
            flights[mb] = Flight(model, pol, mb, 0, params64(model), gen)
            continue
        f = flights.pop(mb)
        f.backward_and_check(model, pol, f.wf)
        done += 1
        assert len(pol._stashes) <= 1
        if pol.should_step():
            accumulated = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert pol.step()
            updates += 1
            for n, p in model.named_parameters():
                assert torch.allclose(p.detach(), before[n] - 0.05 * accumulated[n], atol=1e-6)
    assert done == 12 and updates == 3 and accumulated is not None


def test_2bw_refuses_a_third_version_before_changing_anything():
    model, optimizer, pol, _ = build("2bw", opt=lambda p: O.SGD(p, lr=0.05), update_every=1)
    gen = torch.Generator().manual_seed(0)
    flights = [Flight(model, pol, mb, 0, params64(model), gen) for mb in range(2)]
    flights[0].backward_and_check(model, pol, flights[0].wf)
    pol.step()  # version 1 is stashed for F1
    flights.append(Flight(model, pol, 2, 0, params64(model), gen))  # F1 (version 1) and F2 (version 2) in flight
    model(XWT.example()).sum().backward()  # a gradient, so the step would change w
    before = params64(model)
    version = pol.binding.version
    with pytest.raises(RuntimeError, match="third weight version"):
        pol.step()
    assert pol.binding.version == version
    assert all(torch.equal(p.detach().double(), before[n]) for n, p in model.named_parameters())


def test_spectrain_keeps_its_own_average_for_optimizers_without_one():
    model, optimizer, pol, last = build("spectrain", model_cls=MLP, opt=lambda p: O.RMSprop(p, lr=1e-2), warm=0)
    gen = torch.Generator().manual_seed(1)
    ema = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for _ in range(3):
        model(MLP.example()).pow(2).mean().backward()
        for n, p in model.named_parameters():
            ema[n] = 0.9 * ema[n] + 0.1 * p.grad.double()
        pol.step()
    x = MLP.example()
    expected = {n: p.detach().double() - 2.0 * 1e-2 * ema[n] for n, p in model.named_parameters()}
    with torch.no_grad(), pol.forward(0, s=2.0):
        y = model(x)
    a1 = torch.tanh(x.double() @ expected["net.0.weight"].T + expected["net.0.bias"])
    assert torch.allclose(y.double(), a1 @ expected["net.2.weight"].T + expected["net.2.bias"], atol=1e-5)
    assert pol.memory_report()["smoothed_grad"] == sum(p.numel() * 4 for p in model.parameters())
    del gen


@pytest.mark.parametrize("opt", [lambda p: O.Adam(p, lr=1e-2), lambda p: O.SGD(p, lr=0.05, momentum=0.9)])
def test_pipeoptim_fused_step_trains_like_the_unfused_one(opt):
    runs = []
    for fused in (False, True):
        model, optimizer, pol, _ = build("pipeoptim", model_cls=MLP, opt=opt, warm=0, fused=fused)
        gen = torch.Generator().manual_seed(5)
        outs = []
        for k in range(4):
            with pol.forward(k, s=1.0):
                y = model(torch.randn(5, 6, generator=gen))
            with pol.backward(k):
                y.pow(2).mean().backward()
            outs.append(y.detach())
            pol.step(next_s=1.0)
        runs.append((params64(model), outs))
    (w0, o0), (w1, o1) = runs
    assert all(torch.allclose(w0[n], w1[n], atol=1e-6) for n in w0)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(o0, o1))


def test_pipeoptim_paper_and_exact_modes_differ_for_adamw():
    outs = []
    for mode in ("paper", "exact"):
        model, optimizer, pol, _ = build("pipeoptim", mode=mode, opt=lambda p: O.AdamW(p, lr=0.1, weight_decay=0.5))
        with torch.no_grad(), pol.forward(0, s=3.0):
            outs.append(model(torch.ones(2, 6)))
    assert not torch.allclose(*outs)


@pytest.mark.parametrize("working_dtype", [None, torch.bfloat16])
def test_skipped_step_changes_nothing(working_dtype):
    model, optimizer, pol, last = build("pipeoptim", model_cls=MLP, opt=lambda p: O.NAdam(p, lr=1e-2), warm=0,
                                        working_dtype=working_dtype)
    x = MLP.example().to(working_dtype or torch.float32)
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        pol.step()
    with torch.no_grad(), pol.forward(0, s=2.0):
        before_out = model(x)
    weights = params64(model)
    first_master = optimizer.param_groups[0]["params"][0]
    state = {k: v.clone() for k, v in optimizer.state[first_master].items()}
    version = pol.binding.version
    with pol.forward(1, s=2.0):
        y = model(x)
    with pol.backward(1):
        (y * float("inf")).sum().backward()  # an overflow: the executor finds inf and skips
    assert pol.step(skip=True) is False
    assert pol.binding.version == version
    assert all(torch.equal(p.detach().double(), weights[n]) for n, p in model.named_parameters())
    assert all(torch.equal(v, optimizer.state[first_master][k]) for k, v in state.items())
    assert all((p.grad == 0).all() for p in model.parameters())
    with torch.no_grad(), pol.forward(2, s=2.0):
        assert torch.equal(model(x), before_out)


# ---- memory: the report matches what the policy holds ------------------------------------------------------------


def held_extra_bytes(pol):
    """Bytes of tensor storage reachable from the policy, beyond the model's weights, grads and optimizer state."""
    b = pol.binding
    model_storages = set()
    for g in b.groups:
        for t in [g.w, g.work, g.grad, g.master_grad, *g.state.values(), *g.scalars.values()]:
            model_storages.add(t.untyped_storage()._cdata)
    stop = {id(pol.module), id(pol.optimizer)}
    seen, stack, found = set(), [pol], {}
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in stop or isinstance(o, (type, types.ModuleType)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            found[st._cdata] = st.nbytes()
        elif isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()))
        elif isinstance(o, types.MethodType):
            stack.append(o.__self__)
        else:
            stack.extend(gc.get_referents(o))
    return sum(n for key, n in found.items() if key not in model_storages)


@pytest.mark.parametrize("working_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", list(POLICIES))
def test_memory_report_matches_what_the_policy_holds(name, working_dtype):
    options = {"update_every": 2} if name == "2bw" else {}
    model, optimizer, pol, _ = build(name, model_cls=MLP, opt=lambda p: O.SGD(p, lr=0.05), warm=0,
                                     working_dtype=working_dtype, **options)
    dtype = working_dtype or torch.float32
    x = MLP.example().to(dtype)
    flights = {}
    reports = []
    for k in range(6):  # 1F1B with two in flight; the stash holds a version while B(k-1) is pending
        with pol.forward(k, s=1.0):
            flights[k] = model(x)
        if k >= 1:
            with pol.backward(k - 1):
                flights.pop(k - 1).float().pow(2).mean().backward()
            if pol.should_step():
                pol.step()
        assert pol.extra_weight_bytes() == held_extra_bytes(pol)
        reports.append(pol.extra_weight_bytes())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # working dtype
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    # one copy of the working weights (stash or prediction), plus for SGD without momentum SpecTrain's own
    # fp32 gradient average and PipeOptim's fp32 copy of the last gradient
    expected = {"none": 0, "stash": weight_bytes, "2bw": weight_bytes, "spectrain": weight_bytes + fp32_bytes,
                "pipeoptim": weight_bytes + fp32_bytes}[name]
    assert reports[-1] == expected, pol.memory_report()


def test_stash_holds_one_copy_per_stale_version_in_flight():
    model, optimizer, pol, _ = build("stash", model_cls=MLP, opt=lambda p: O.SGD(p, lr=0.05), warm=0)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    outs = {}
    for k in range(3):  # warm-up: three forwards at version 0
        with pol.forward(k):
            outs[k] = model(MLP.example())
    for k in range(3, 6):  # steady 1F1B: each step leaves another version behind
        with pol.backward(k - 3):
            outs.pop(k - 3).sum().backward()
        pol.step()
        with pol.forward(k):
            outs[k] = model(MLP.example())
        versions = set(pol._in_flight.values()) - {pol.binding.version}
        assert len(pol._stashes) == len(versions)
    assert pol.memory_report()["stash"] == 2 * weight_bytes
    for k in range(3, 6):
        with pol.backward(k):
            outs.pop(k).sum().backward()
    assert pol._stashes == {} and pol.extra_weight_bytes() == held_extra_bytes(pol)
    pol.trim()
    assert pol.extra_weight_bytes() == 0 == held_extra_bytes(pol)


@pytest.mark.parametrize("name", ["pipeoptim", "spectrain"])
def test_predictions_use_each_param_groups_own_lr(name):
    from test_predictor import loaded_copy

    def two_groups(params):
        params = list(params)
        return O.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 5e-2}], lr=1e-2)

    model, optimizer, pol, last = build(name, model_cls=MLP, opt=two_groups, warm=2)
    assert len(pol.binding.groups) == 2
    if name == "pipeoptim":
        expected = {n: reference_prediction(optimizer, p, last[n], 2.0) for n, p in model.named_parameters()}
    else:
        lrs = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        expected = {n: p.detach().double() - 2.0 * lrs[id(p)] * optimizer.state[p]["exp_avg"].double()
                    for n, p in model.named_parameters()}
    x = MLP.example()
    with torch.no_grad(), pol.forward(0, s=2.0):
        y = model(x)
    assert torch.allclose(y, loaded_copy(model, expected)(x), atol=1e-5)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("s", [0, 1])
def test_call_forward_and_call_backward_do_what_the_with_forms_do(name, s):
    """The runtime's per-action forms give the same outputs, gradients and bookkeeping as the with forms, bit for
    bit, with a step between the forwards and their backwards where s = 1."""
    options = {"update_every": 2} if name == "2bw" else {}
    runs = []
    for form in ("with", "call"):
        model, optimizer, pol, _ = build(name, **options)
        gen = torch.Generator().manual_seed(7)
        xs = [torch.randn(XWT.example().shape, generator=gen).requires_grad_(True) for _ in range(2)]
        ys, seen = [], []
        for mb, x in enumerate(xs):
            if form == "with":
                with pol.forward(mb, s=s):
                    ys.append(model(x))
            else:
                ys.append(pol.call_forward(mb, s, 0, model, x))
            seen.append(pol.in_flight)
        if s:
            pol.step(skip=False)
        for mb, y in enumerate(ys):
            if form == "with":
                with pol.backward(mb, s=0):
                    y.pow(2).sum().backward()
            else:
                pol.call_backward(mb, 0, lambda y=y: y.pow(2).sum().backward())
            seen.append((pol.in_flight, pol._backwards, pol.should_step()))
        runs.append((ys, xs, {n: p.grad.clone() for n, p in model.named_parameters()}, seen))
    (ya, xa, ga, sa), (yb, xb, gb, sb) = runs
    assert sa == sb
    for a, b in zip(ya + [x.grad for x in xa], yb + [x.grad for x in xb]):
        assert torch.equal(a, b)
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def test_call_forward_skips_the_scope_only_where_it_would_enter_nothing(monkeypatch):
    model, optimizer, pol, _ = build("none")
    scopes = []
    real = type(pol).forward
    monkeypatch.setattr(type(pol), "forward", lambda self, *a, **k: (scopes.append(k.get("s")), real(self, *a, **k))[1])
    pol.call_forward("a", 0, 0, model, XWT.example())                  # none at s = 0: nothing to enter
    pol.call_forward("b", 0.0, 0.0, model, XWT.example())
    assert scopes == [] and pol.in_flight == ("a", "b")
    pol.call_forward("c", 1, 0, model, XWT.example())                  # a step to come: the saved-weight hooks
    pol.call_forward("d", 0, 1, model, XWT.example())                  # a look-ahead: the with form decides
    pol.measure_activations = True
    pol.call_forward("e", 0, 0, model, XWT.example().requires_grad_(True))  # counting: the hooks
    assert scopes == [1, 0, 0] and pol._act["e"] > 0
    with pytest.raises(ValueError, match="s must be"):
        pol.call_forward("f", False, 0, model, XWT.example())          # a bool is refused, as by the with form
    with pytest.raises(ValueError, match="already in flight"):
        pol.call_forward("a", 0, 0, pytest.fail)                        # refused before the body runs
    with torch.no_grad():
        pol.call_forward("g", 0, 0, model, XWT.example())               # no grad: not in flight
    assert pol.in_flight == ("a", "b", "c", "d", "e")
    for name in ("pipeoptim", "stash", "spectrain"):
        assert type(build(name)[2])._plain_at_s0 is False, name


def test_call_backward_refuses_what_the_with_form_refuses_and_a_failure_changes_nothing():
    model, optimizer, pol, _ = build("none")
    with pytest.raises(ValueError, match="no forward in flight"):
        pol.call_backward("a", 0, pytest.fail)
    x = XWT.example().requires_grad_(True)
    y = pol.call_forward("a", 0, 0, model, x)

    class Boom(Exception):
        pass

    def boom():
        raise Boom
    with pytest.raises(Boom):
        pol.call_forward("b", 0, 0, boom)
    with pytest.raises(Boom):
        pol.call_backward("a", 0, boom)
    assert pol.in_flight == ("a",) and pol._backwards == 0             # the failed forward is not in flight
    with pytest.raises(ValueError, match="s must be"):
        pol.call_backward("a", -1, pytest.fail)
    with pol.backward("a", part="input"):
        pass
    with pytest.raises(ValueError, match="already ran the input part"):
        pol.call_backward("a", 0, pytest.fail)
    with pol.backward("a", part="weight"):
        y.sum().backward()
    assert pol.in_flight == () and pol._backwards == 1


def test_the_per_class_flags_follow_what_a_class_overrides():
    from pipeoptim.policies import NoPolicy, StashPolicy

    class Tagging(NoPolicy):
        def _forward_tag(self, mb, s):
            return mb

    class Derived(NoPolicy):
        pass

    calls = []

    class OwnForward(NoPolicy):
        def forward(self, mb, s=0, lookahead=0):
            calls.append(("forward", mb))
            return super().forward(mb, s, lookahead)

    class OwnBackward(NoPolicy):
        def backward(self, mb, s=0, part="full"):
            calls.append(("backward", mb))
            return super().backward(mb, s, part)

    assert NoPolicy._plain_at_s0 and Derived._plain_at_s0 and not Tagging._plain_at_s0
    assert not OwnForward._plain_at_s0 and OwnForward._plain_backward    # a redefined forward is always called
    assert OwnBackward._plain_at_s0 and not OwnBackward._plain_backward
    for cls in (OwnForward, OwnBackward):                                # and the runtime's calls reach them
        model = XWT()
        pol = cls(model, O.SGD(model.parameters(), lr=0.1))
        y = pol.call_forward(0, 0, 0, model, XWT.example())
        pol.call_backward(0, 0, lambda: y.sum().backward())
    assert calls == [("forward", 0), ("backward", 0)]
    assert not WeightPolicy._plain_at_s0
    assert StashPolicy._tracks_gradients and StashPolicy._tracks_releases
    assert not NoPolicy._tracks_gradients and not NoPolicy._tracks_releases


def test_peak_activation_bytes_counts_saved_tensors_of_forwards_in_flight():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False)
    pol = make_policy("none", lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    pol.measure_activations = True
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    ys = []
    for i, x in enumerate(xs):
        with pol.forward(i):
            ys.append(lin(x))  # saves x (128 B) and the weight (not an activation)
    assert pol.peak_activation_bytes == 3 * 4 * 8 * 4
    for i, y in enumerate(ys):
        with pol.backward(i):
            y.sum().backward()
    with pol.forward(9):
        y = lin(xs[0])
    assert pol._act_now == 4 * 8 * 4 and pol.peak_activation_bytes == 3 * 4 * 8 * 4
    pol.discard(9)
    assert pol._act_now == 0


def test_policy_state_dict_refuses_in_flight_and_partial_groups():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    pol = make_policy("spectrain", net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(3, 4)
    with pol.forward(0):
        y = net(x)
    with pytest.raises(RuntimeError, match="in flight"):
        pol.state_dict()
    with pol.backward(0):
        y.sum().backward()
    pol.step()
    sd = pol.state_dict()
    assert set(sd["params"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert sd["params"]["0.weight"]["steps_taken"] == 1 and sd["params"]["0.weight"]["smoothed_grad"].abs().sum() > 0
    del sd["params"]["1.bias"]
    with pytest.raises(ValueError, match="share one flat group"):
        pol.load_state_dict(sd)


def test_pipeoptim_holds_no_prediction_buffer_where_it_never_predicts():
    """The last stage of async 1F1B always has s = 0: its policy must not hold a weight-sized copy
    (it used to allocate one at construction). The first forward with s > 0 allocates it, once."""
    torch.manual_seed(0)
    module = nn.Linear(100, 100)
    policy = make_policy("pipeoptim", module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    for mb in range(3):
        with policy.forward(mb, s=0):
            y = module(torch.randn(2, 100))
        with policy.backward(mb):
            y.sum().backward()
        policy.step()
    assert policy.memory_report()["prediction"] == 0
    with policy.forward(3, s=1):
        y = module(torch.randn(2, 100))
    with policy.backward(3):
        y.sum().backward()
    assert policy.memory_report()["prediction"] == 101 * 100 * 4


# ---- s rules and the public code's rule (mode "reference") ------------------------------------------------
def _lent_s(pol, schedule_s):
    """The s the policy predicts with for a forward the schedule gives `schedule_s` (None: no prediction)."""
    seen = []
    real = pol.predictor.lend

    def spy(s):
        seen.append(s)
        return real(s)
    pol.predictor.lend = spy
    try:
        with torch.no_grad(), pol.forward("probe", s=schedule_s):
            pass
    finally:
        pol.predictor.lend = real
    return seen[0] if seen else None


@pytest.mark.parametrize("stage,schedule_s,expected", [
    (1, 0, {"schedule": 0, "paper": 2.0, "reference": 3.0}),        # warm-up: the constant rules ignore it
    (1, 2, {"schedule": 2, "paper": 2.0, "reference": 3.0}),
    (3, 0, {"schedule": 0, "paper": 0.0, "reference": 1.0}),        # the code predicts on the last stage too
])
def test_s_rules_give_schedule_paper_and_public_code_s(stage, schedule_s, expected):
    for rule, s in expected.items():
        _, _, pol, _ = build("pipeoptim", opt=lambda p: O.SGD(p, lr=0.1, momentum=0.9), s_rule=rule,
                             stage=stage, stages=4)
        assert _lent_s(pol, schedule_s) == s, rule


def test_reference_mode_uses_the_codes_s_and_needs_the_stage():
    _, _, pol, _ = build("pipeoptim", opt=lambda p: O.SGD(p, lr=0.1, momentum=0.9), mode="reference")
    assert pol.s_rule == "reference"
    with pytest.raises(ValueError, match=r"policy.place\(stage, stages\)"):
        _lent_s(pol, 1)
    pol.place(2, 4)
    assert _lent_s(pol, 1) == 2.0
    with pytest.raises(ValueError, match="0 <= stage < stages"):
        pol.place(4, 4)
    with pytest.raises(ValueError, match="s_rule must be one of"):
        build("pipeoptim", s_rule="code")


def test_reference_mode_forward_reads_the_public_codes_prediction():
    """SGD with momentum, dampening and weight decay, stage 0 of 3: the forward reads
    ŵ = w − 3·lr·(μ·buf + (1−τ)·(g + λ·w_b)), w_b the weights before the last step (old torch's p.grad)."""
    lr, mu, tau, wd, D = 0.05, 0.9, 0.1, 0.02, 3
    torch.manual_seed(3)
    model = XWT()
    opt = O.SGD(model.parameters(), lr=lr, momentum=mu, dampening=tau, weight_decay=wd)
    pol = make_policy("pipeoptim", model, opt, mode="reference", stage=0, stages=D)
    for _ in range(3):
        with pol.forward("mb", s=0):
            y = model(XWT.example())
        with pol.backward("mb"):
            y.pow(2).mean().backward()
        w_b = params64(model)
        g = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        pol.step()
    expected = {}
    for n, p in model.named_parameters():
        buf = opt.state[p]["momentum_buffer"].double()
        expected[n] = p.detach().double() - D * lr * (mu * buf + (1 - tau) * (g[n] + wd * w_b[n]))
    x = XWT.example()
    with torch.no_grad(), pol.forward("next", s=0):
        got = model(x).double()
    want = torch.tanh(x.double() @ expected["weight"].T) @ expected["weight2"].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    exact = make_policy("pipeoptim", model, opt, stage=0, stages=D, s_rule="reference", binding=pol.binding)
    with torch.no_grad(), exact.forward("next", s=0):
        assert not torch.allclose(model(x).double(), want, atol=1e-4)   # the exact rule predicts otherwise


def test_activation_bytes_are_counted_only_when_asked_and_reading_them_otherwise_says_how():
    lin = torch.nn.Linear(8, 8, bias=False)
    pol = make_policy("none", lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    with pol.forward(0):
        y = lin(torch.randn(4, 8, requires_grad=True))
    with pol.backward(0):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="measure_activations=True"):
        pol.peak_activation_bytes


@pytest.mark.parametrize("s", [0, 1])
def test_none_at_s0_saves_no_weight_handles_and_its_gradient_is_the_same(s):
    """Without counting, `none` lets autograd save the weights itself when no step comes before the backward
    (s = 0); with a step to come (s = 1) its saved weights still resolve to the real weights at backward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    pol = make_policy("none", lin, opt)
    x = torch.randn(4, 8)
    packed = []
    real = pol.saved.hooks
    pol.saved.hooks = lambda *a, **k: (packed.append(1), real(*a, **k))[1]
    with pol.forward(0, s=s):
        y = lin(x)
    assert packed == ([] if s == 0 else [1])
    ref = torch.nn.Linear(8, 8)
    ref.load_state_dict({k: v.detach().clone() for k, v in lin.state_dict().items()})
    with pol.backward(0):
        (y ** 2).sum().backward()
    (ref(x) ** 2).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)
