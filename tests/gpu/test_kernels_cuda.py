"""pipeoptim_kernels on CUDA: every rule × GPU backend × output dtype against the float64 reference
(lengths that are and are not multiples of 16), step+predict against torch.optim's own CUDA step,
misaligned views, ŵ over the gradient, a length past 2^31, a side stream, CUDA graphs, opcheck and
torch.compile of the ops. See conftest.py for the CPU dry run (`gpu.cuda` is then the cpu backend)."""
import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import (CONFIGS, assert_close_to_reference, assert_second_moment_close, check_predict,
                              config_id, reference_predict, reference_second_moment)

ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
SGD = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False)
STEP_CASES = [("adam", "Adam", dict(lr=1e-2, weight_decay=0.1)),
              ("adam", "Adam", dict(lr=1e-3, betas=(0.95, 0.9999))),
              ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
              ("sgd", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
              ("sgd", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1))]
STATE = {"sgd": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"]}


def backend_for(gpu, name):
    return getattr(gpu, name) if name in ("cuda", "triton") else name


def rand(n, gen, device, positive=False, offset=0):
    """n random float32 numbers on device, made on the CPU with gen (reproducible from its seed); offset:
    a view that many elements into a larger buffer."""
    t = torch.rand(n + offset, generator=gen) if positive else torch.randn(n + offset, generator=gen)
    return t.to(device)[offset:]


def test_gpu_backends_available(gpu):
    assert {gpu.cuda, gpu.triton} <= set(pk.available_backends()), pk.available_backends()


@pytest.mark.parametrize("backend", ["cuda", "triton", "eager"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_predict_matches_reference(cfg, backend, gpu, gen):
    """Odd lengths (the masked tail) and multiples of 16 (whole vectorised blocks only)."""
    sizes = (7, 4096) if gpu.quick else (1, 7, 4096, 4097, (1 << 20) + 3)
    check_predict(cfg, backend_for(gpu, backend), gpu.device, gen, sizes=sizes)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rule,cls,hp", STEP_CASES, ids=lambda x: str(x))
def test_step_predict_matches_torch(rule, cls, hp, backend, impl, gpu, gen):
    """The step equals torch.optim's own step on the device, and the second moments the float64 reference
    (relatively, see kernel_reference.assert_second_moment_close); the prediction equals the float64 reference.

    The second moments are compared with torch's own only for foreach: torch's fused CUDA Adam casts β2 to
    float32 before forming 1 − β2 (1.3e-5 relatively off at β2 = 0.999, 1.7e-4 at 0.9999: measured on the H200,
    torch 2.11), where torch.optim's other implementations and ours form it in double."""
    n = 4096 if gpu.quick else (1 << 20) + 3
    dev = gpu.device
    p = torch.nn.Parameter(rand(n, gen, dev))
    opt = getattr(torch.optim, cls)([p], **hp, **{impl: True})
    names = STATE[rule] + (["max_exp_avg_sq"] if hp.get("amsgrad") else [])
    state = {k: torch.zeros(n, device=dev) for k in names}
    w = p.detach().clone()
    for step in range(3):
        g = rand(n, gen, dev)
        p.grad = g.clone()
        opt.step()
        out = torch.full((n,), float("nan"), device=dev, dtype=torch.bfloat16)
        before = {k: t.clone() for k, t in state.items()}
        w_before = w.clone()
        if "exp_avg_sq" in before:
            v_ref, max_ref = reference_second_moment(before["exp_avg_sq"], g, w, hp, rule,
                                                     before.get("max_exp_avg_sq"))
        pk.step_predict(rule, w, g, state, opt.param_groups[0], step=step, s=2, out=out,
                        backend=backend_for(gpu, backend))
        msg = f"{backend} {impl} {rule} {hp} step {step + 1} seed={gen.initial_seed()}"
        torch.testing.assert_close(w, p.detach(), rtol=4e-6, atol=2.5e-7, msg=lambda m: f"{msg}: w {m}")
        for k in names:
            if k in ("exp_avg_sq", "max_exp_avg_sq"):
                ref_k = v_ref if k == "exp_avg_sq" else max_ref
                assert_second_moment_close(state[k], ref_k, before["exp_avg_sq"], g, w_before, hp, rule,
                                           msg=f"{msg}: {k} against the float64 reference")
                if impl == "foreach":
                    assert_second_moment_close(state[k], opt.state[p][k], before["exp_avg_sq"], g, w_before, hp, rule,
                                               msg=f"{msg}: {k} against torch")
            else:
                torch.testing.assert_close(state[k], opt.state[p][k], rtol=4e-6, atol=2.5e-7,
                                           msg=lambda m: f"{msg}: {k} {m}")
        ref, term = reference_predict(rule, w.cpu(), {**{k: v.cpu() for k, v in state.items()}, "grad": g.cpu()},
                                      opt.param_groups[0], step + 1, 2)
        assert_close_to_reference(out.cpu(), ref, term, msg=msg)
        w, state = p.detach().clone(), {k: opt.state[p][k].detach().clone() for k in names}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offsets", [(1, 1, 1, 1), (3, 3, 3, 3), (1, 0, 1, 2)], ids=["alike1", "alike3", "mixed"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_predict_on_misaligned_views(backend, offsets, out_dtype, gpu, gen):
    """Views into larger buffers: misaligned alike (a head is peeled, the rest vectorised) or each its own
    way (all scalar). Exact either way, the seam included."""
    n = 4099 if gpu.quick else (1 << 20) + 5
    ow, om, ov, oo = offsets
    w, m, v = rand(n, gen, gpu.device, offset=ow), rand(n, gen, gpu.device, offset=om), \
        rand(n, gen, gpu.device, positive=True, offset=ov)
    out = torch.full((n + oo,), float("nan"), device=gpu.device, dtype=out_dtype)[oo:]
    pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, ADAM, step=3, s=2, out=out, backend=backend_for(gpu, backend))
    ref, term = reference_predict("adam", w.cpu(), {"exp_avg": m.cpu(), "exp_avg_sq": v.cpu()}, ADAM, 3, 2)
    assert_close_to_reference(out.cpu(), ref, term, msg=f"{backend} {offsets} {out_dtype} seed={gen.initial_seed()}")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_step_predict_on_misaligned_views(rule, backend, out_dtype, gpu, gen):
    """The fused step on views one element in gives the eager backend's step and prediction."""
    n = 4099 if gpu.quick else (1 << 20) + 5
    hp = ADAM if rule == "adam" else SGD
    names = STATE[rule]
    results = []
    for name in ("eager", backend_for(gpu, backend)):
        g2 = torch.Generator().manual_seed(gen.initial_seed())
        w, g = rand(n, g2, gpu.device, offset=1), rand(n, g2, gpu.device, offset=1)
        state = {k: rand(n, g2, gpu.device, positive=True, offset=1) for k in names}
        out = torch.full((n + 1,), float("nan"), device=gpu.device, dtype=out_dtype)[1:]
        pk.step_predict(rule, w, g, state, hp, step=3, s=2, out=out, backend=name)
        results.append([w, *state.values(), out])
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=4e-6 if a.dtype == torch.float32 else 1e-2, atol=2.5e-7)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rule,hp", [("adam", {**ADAM, "amsgrad": True}), ("sgd", SGD)])
def test_step_predict_into_grad(rule, hp, backend, gpu, gen):
    """out=grad gives the same bits as a separate output (each thread reads its grad before writing over it)."""
    n = 4099 if gpu.quick else (1 << 20) + 3
    names = STATE[rule] + (["max_exp_avg_sq"] if hp.get("amsgrad") else [])
    w, g = rand(n, gen, gpu.device), rand(n, gen, gpu.device)
    state = {k: rand(n, gen, gpu.device, positive=True) for k in names}
    results = []
    for into_grad in (False, True):
        w_try, g_try, st = w.clone(), g.clone(), {k: v.clone() for k, v in state.items()}
        out = g_try if into_grad else torch.empty(n, device=gpu.device)
        pk.step_predict(rule, w_try, g_try, st, hp, step=3, s=2, out=out, backend=backend_for(gpu, backend))
        results.append([out, w_try, *st.values()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


AROUND = lambda n: (0, (1 << 31) - 3, n - 5)  # noqa: E731  element offsets checked in the long buffers


def _check_slices(got, w, state, rule, hp, step, s, n, msg):
    """Elements around 2^31 and at the end against the float64 reference (it is element-wise)."""
    for lo in AROUND(n):
        sl = slice(lo, min(lo + 8, n))
        ref, term = reference_predict(rule, w[sl].cpu(), {k: t[sl].cpu() for k, t in state.items()}, hp, step, s)
        assert_close_to_reference(got[sl].cpu(), ref, term, msg=f"{msg} at {lo}")


@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_lengths_past_two_to_the_31(backend, gpu):
    """2^31 + 5 elements: the index arithmetic is 64-bit in every kernel (8.6 GB per fp32 buffer)."""
    n = (1 << 31) + 5
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, device="cuda", generator=gen)
    m = torch.randn(n, device="cuda", generator=gen)
    out = torch.full((n,), float("nan"), device="cuda")
    sgd = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    pk.predict("sgd", w, {"momentum_buffer": m}, sgd, step=2, s=3, out=out, backend=backend)
    _check_slices(out, w, {"momentum_buffer": m}, "sgd", sgd, 2, 3, n, f"{backend} predict")
    del out
    g, v = torch.randn(n, device="cuda", generator=gen), torch.rand(n, device="cuda", generator=gen)
    # The step of a few elements around 2^31 and at the end, taken by the eager backend on copies: the oracle.
    slices = [slice(lo, min(lo + 8, n)) for lo in AROUND(n)]
    small = [(w[sl].clone(), g[sl].clone(), {"exp_avg": m[sl].clone(), "exp_avg_sq": v[sl].clone()}) for sl in slices]
    pk.step_predict("adam", w, g, {"exp_avg": m, "exp_avg_sq": v}, ADAM, step=3, s=2, out=g, backend=backend)
    for sl, (ws, gs, sts) in zip(slices, small):
        out_s = torch.empty_like(ws)
        pk.step_predict("adam", ws, gs, sts, ADAM, step=3, s=2, out=out_s, backend="eager")
        for got, want in ((w[sl], ws), (m[sl], sts["exp_avg"]), (v[sl], sts["exp_avg_sq"]), (g[sl], out_s)):
            torch.testing.assert_close(got, want, rtol=4e-6, atol=2.5e-7, msg=lambda e: f"{backend} at {sl}: {e}")
    _check_slices(g, w, {"exp_avg": m, "exp_avg_sq": v}, "adam", ADAM, 4, 2, n, f"{backend} step+predict")


@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_runs_on_the_current_stream(backend, gpu, gen):
    """The kernel joins the caller's stream: queued behind a long sleep and a fill on a side stream, it
    must see the filled input (on the default stream it would race ahead of them)."""
    n = 1 << 20
    w, m, v = rand(n, gen, "cuda"), rand(n, gen, "cuda"), rand(n, gen, "cuda", positive=True)
    out = torch.empty(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU clock cycles
        m.fill_(0.5)
        pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, ADAM, step=3, s=2, out=out, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    ref, term = reference_predict("adam", w.cpu(), {"exp_avg": torch.full((n,), 0.5), "exp_avg_sq": v.cpu()}, ADAM, 3, 2)
    assert_close_to_reference(out.cpu(), ref, term, msg=f"{backend} on a side stream")


@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_captured_in_a_cuda_graph(backend, gpu, gen):
    """step_predict captured once and replayed gives what eager calls give, step after step."""
    n = (1 << 20) + 3
    bk = backend_for(gpu, backend)
    w, g = rand(n, gen, "cuda"), rand(n, gen, "cuda")
    st = {"exp_avg": torch.zeros(n, device="cuda"), "exp_avg_sq": torch.zeros(n, device="cuda")}
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    twin = (w.clone(), {k: t.clone() for k, t in st.items()}, out.clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (Triton compiles here), on copies
        pk.step_predict("adamw", w.clone(), g, {k: t.clone() for k, t in st.items()}, {**ADAM, "weight_decay": 0.01},
                        step=3, s=2, out=out.clone(), backend=bk)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pk.step_predict("adamw", w, g, st, {**ADAM, "weight_decay": 0.01}, step=3, s=2, out=out, backend=bk)
    for _ in range(3):
        graph.replay()
        pk.step_predict("adamw", twin[0], g, twin[1], {**ADAM, "weight_decay": 0.01}, step=3, s=2, out=twin[2],
                        backend=bk)
    torch.cuda.synchronize()
    assert torch.equal(w, twin[0]) and torch.equal(out, twin[2])
    assert all(torch.equal(st[k], twin[1][k]) for k in st)


def test_opcheck_on_the_device(gpu, gen):
    """torch.library.opcheck (schema, fake implementation, autograd registration) of the compiled and
    Triton ops with the device's tensors."""
    n, dev = 4099, gpu.device
    w, m, v, g = rand(n, gen, dev), rand(n, gen, dev), rand(n, gen, dev, positive=True), rand(n, gen, dev)
    coeffs = [0.02, 10.0, 0.0, 0.0, 1.0, 1e-8, 0.0]
    adam = [0.999, 0.1, 1e-3, 1e-8, 1.0, 0.0, 1.0, 1e-2, 0.03, 2e-2, 0.0]
    for prefix in ("", "triton_"):
        ops = torch.ops.pipeoptim
        torch.library.opcheck(getattr(ops, prefix + "predict_").default,
                              (w, m, None, v, None, torch.empty(n, device=dev), 1, coeffs))
        torch.library.opcheck(getattr(ops, prefix + "adam_step_predict_").default,
                              (w.clone(), g, m.clone(), v.clone(), None, torch.empty(n, device=dev), adam))
        torch.library.opcheck(getattr(ops, prefix + "sgd_step_predict_").default,
                              (w.clone(), g, m.clone(), torch.empty(n, device=dev), False, False,
                               [0.1, 0.9, 1.0, 0.0, 1.0, 0.1]))


@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_torch_compile_on_the_device(backend, gpu, gen):
    """The ops inside a compiled function (inductor on CUDA) give the eager result."""
    n = (1 << 20) + 3
    bk = backend_for(gpu, backend)
    w, m, v = rand(n, gen, "cuda"), rand(n, gen, "cuda"), rand(n, gen, "cuda", positive=True)

    def predicted_sum(w, m, v):
        out = torch.empty_like(w)
        pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, ADAM, step=3, s=2, out=out, backend=bk)
        return out * 2.0

    compiled = torch.compile(predicted_sum, fullgraph=False)
    torch.testing.assert_close(compiled(w, m, v), predicted_sum(w, m, v), rtol=0, atol=0)


@pytest.mark.cuda_only
def test_launches_follow_the_buffers_device(gpu, gen):
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: launching on a device that is not the current one needs two")
    n = 4099
    w, m, v = (rand(n, gen, "cuda:1", positive=p) for p in (False, False, True))
    for backend in ("cuda", "triton"):
        out = torch.full((n,), float("nan"), device="cuda:1")
        with torch.cuda.device(0):
            pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, ADAM, step=3, s=2, out=out, backend=backend)
        ref, term = reference_predict("adam", w.cpu(), {"exp_avg": m.cpu(), "exp_avg_sq": v.cpu()}, ADAM, 3, 2)
        assert_close_to_reference(out.cpu(), ref, term, msg=f"{backend} on cuda:1 with cuda:0 current")
