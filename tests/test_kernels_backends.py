"""Backend selection, the compiled extension's build, and the ops under torch.compile."""
import os
import re
import subprocess
import sys

import pytest
import torch

import pipeoptim_kernels as pk
from pipeoptim_kernels import compiled, rules

N = 4097
GROUP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)


def _adam(gen):
    w = torch.randn(N, generator=gen)
    return w, {"exp_avg": torch.randn(N, generator=gen), "exp_avg_sq": torch.rand(N, generator=gen)}


def test_auto_picks_the_compiled_cpu_backend_for_fp32(monkeypatch, gen):
    w, state = _adam(gen)
    calls = []
    monkeypatch.setitem(pk._PREDICT, "cpu", lambda plan, w, out: calls.append("cpu") or compiled.predict(plan, w, out))
    pk.predict("adam", w, state, GROUP, step=2, s=1, out=torch.empty(N))
    assert calls == ["cpu"]


def test_auto_falls_back_to_eager_where_compiled_cannot_run(monkeypatch, gen):
    w, state = _adam(gen)
    calls = []
    monkeypatch.setitem(pk._PREDICT, "eager", lambda plan, w, out: calls.append("eager"))
    w64 = w.double()
    pk.predict("adam", w64, {k: v.double() for k, v in state.items()}, GROUP, step=2, s=1, out=torch.empty(N, dtype=torch.float64))
    assert calls == ["eager"]


def test_extension_reports_its_build():
    module = compiled.load()
    assert module is not None
    assert compiled.cpu_isa() in ("avx512", "avx2", "generic")
    # CI builds against the CUDA build of torch with nvcc present: the CUDA kernels must be compiled in.
    if torch.version.cuda is not None and pk._build.want_cuda():
        assert module.with_cuda, "torch has CUDA and nvcc is present, but the extension was built without CUDA"


def _predict_args(gen):
    w, state = _adam(gen)
    plan = rules.predict_plan("adam", state, GROUP, 3, 2.0, "exact")
    coeffs = [plan.scale, plan.cm, plan.cg, plan.cw, plan.dscale, plan.eps, plan.lam]
    return w, plan, coeffs


def test_opcheck_compiled_ops(gen):
    w, plan, coeffs = _predict_args(gen)
    torch.library.opcheck(torch.ops.pipeoptim.predict_.default,
                          (w, plan.m, None, plan.v, None, torch.empty(N), plan.den, coeffs))
    g = torch.randn(N, generator=gen)
    adam_coeffs = [0.999, 0.1, 1e-3, 1e-8, 1.0, 0.0, 1.0, 1e-2, 0.03, 2e-2, 0.0]
    torch.library.opcheck(torch.ops.pipeoptim.adam_step_predict_.default,
                          (w.clone(), g, torch.zeros(N), torch.zeros(N), None, torch.empty(N), adam_coeffs))
    torch.library.opcheck(torch.ops.pipeoptim.sgd_step_predict_.default,
                          (w.clone(), g, torch.zeros(N), torch.empty(N), False, True, [0.1, 0.9, 0.0, 0.0, 1.0, 0.1]))
    torch.library.opcheck(torch.ops.pipeoptim.adam_step_predict_into_grad_.default,
                          (w.clone(), g.clone(), torch.zeros(N), torch.zeros(N), None, adam_coeffs))
    torch.library.opcheck(torch.ops.pipeoptim.sgd_step_predict_into_grad_.default,
                          (w.clone(), g.clone(), torch.zeros(N), False, True, [0.1, 0.9, 0.0, 0.0, 1.0, 0.1]))


@pytest.mark.parametrize("op", ["pipeoptim::predict_", "pipeoptim::triton_predict_"])
def test_predict_op_under_torch_compile(op, gen):
    if op.startswith("pipeoptim::triton") and "triton" not in pk.available_backends():
        pytest.skip("triton is not installed")
    w, plan, coeffs = _predict_args(gen)
    fn = getattr(torch.ops.pipeoptim, op.split("::")[1])

    def forward_weights(w, m, v, out):
        fn(w, m, None, v, None, out, plan.den, coeffs)
        return out * 1.0

    compiled_fn = torch.compile(forward_weights, backend="aot_eager", fullgraph=True)
    got = compiled_fn(w, plan.m, plan.v, torch.full((N,), float("nan")))
    expect = torch.empty(N)
    pk.predict("adam", w, {"exp_avg": plan.m, "exp_avg_sq": plan.v}, GROUP, step=3, s=2, out=expect, backend="eager")
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


def _with_setting(setter: str, value, fn):
    """fn() with one of the extension's run-time settings (set_cpu_stream, set_cpu_isa) changed."""
    set_ = getattr(compiled.load(), setter)
    previous = set_(value)
    try:
        return fn()
    finally:
        set_(previous)


def _loop_results(gen, dtype, offset, run):
    """The outputs and stepped state of every CPU loop kind (predict with each denominator, Adam and SGD
    step+predict) on fresh inputs, each call made through run(call) and written to a NaN-poisoned output
    that starts `offset` elements off its vector alignment."""
    n = 3 * 1024 + 7
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    predicts = [
        ("adam", {"exp_avg": m, "exp_avg_sq": v}, GROUP),
        ("rmsprop", {"square_avg": v, "grad_avg": 0.1 * m, "momentum_buffer": m},
         dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.9, centered=True, maximize=False)),
        # centered without momentum: the denominator subtracts grad_avg² (kept below square_avg here)
        ("rmsprop", {"square_avg": v + 0.5, "grad_avg": 0.1 * v, "grad": g},
         dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.01, momentum=0.0, centered=True, maximize=False)),
        ("sgd", {"momentum_buffer": m},
         dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)),
        ("adagrad", {"sum": v, "grad": g}, dict(lr=1e-2, lr_decay=0.0, eps=1e-10, weight_decay=0.0, maximize=False)),
        # a linear denominator (Adamax's infinity norm)
        ("adamax", {"exp_avg": m, "exp_inf": v + 0.5},
         dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False)),
    ]
    results = []
    for rule, state, group in predicts:
        out = torch.full((n + offset,), float("nan"), dtype=dtype)[offset:]
        run(lambda: pk.predict(rule, w, state, group, step=3, s=2, out=out, backend="cpu"))
        assert not out.isnan().any(), rule
        results.append(out)
    steps = [("adam", {**GROUP, "amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
             ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False),
              ("momentum_buffer",))]
    for rule, group, names in steps:
        state = {k: (v if k == "exp_avg_sq" else m).clone() for k in names}
        w_step = w.clone()
        out = torch.full((n + offset,), float("nan"), dtype=dtype)[offset:]
        run(lambda: pk.step_predict(rule, w_step, g, state, group, step=3, s=2, out=out, backend="cpu"))
        results += [out, w_step, *state.values()]
    return results


OUT_TYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("offset", [0, 1, 5, 17])
@pytest.mark.parametrize("dtype", OUT_TYPES, ids=str)
def test_streaming_stores_give_the_same_bits_as_ordinary_stores(dtype, offset):
    """Every loop the cpu backend streams, with the output off its vector alignment (head and tail run
    element by element): the same bits as with ordinary stores, and the same stepped state."""
    seed = int.from_bytes(os.urandom(4), "little")
    results = [_loop_results(torch.Generator().manual_seed(seed), dtype, offset,
                             lambda call, mode=mode: _with_setting("set_cpu_stream", mode, call))
               for mode in (0, 1)]
    for a, b in zip(*results):
        assert torch.equal(a, b), f"seed={seed}"


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("dtype", OUT_TYPES, ids=str)
def test_software_prefetch_gives_the_same_bits(dtype, offset):
    """Every loop with its inputs prefetched 64 B, 1 KiB or further than the buffers reach (the bound on
    the last lines), with ordinary and streaming stores: the same bits as without prefetching, in the loops
    of every vector instruction set this processor runs (each prefetches only when it runs on vectors)."""
    module = compiled.load()
    seed = int.from_bytes(os.urandom(4), "little")
    for name in [name for name in ("avx512", "avx2") if _runs(module, name)]:
        results = {}
        for ahead in (0, 64, 1024, 1 << 20):
            for mode in (0, 1):
                run = (lambda call, ahead=ahead, mode=mode: _with_setting("set_cpu_isa", name, lambda: _with_setting(
                    "set_cpu_prefetch", ahead, lambda: _with_setting("set_cpu_stream", mode, call))))
                results[ahead, mode] = _loop_results(torch.Generator().manual_seed(seed), dtype, offset, run)
        for key, got in results.items():
            for a, b in zip(results[0, 0], got):
                assert torch.equal(a, b), f"{name}, prefetch {key[0]} B, stream={key[1]}; seed={seed}"


@pytest.mark.parametrize("dtype", OUT_TYPES, ids=str)
def test_every_instruction_set_gives_the_same_bits(dtype):
    """The loops compiled for each instruction set this processor runs (CI's has AVX-512, so the AVX2 and
    baseline loops are exercised here too), with ordinary and streaming stores: one set of bits."""
    module = compiled.load()
    names = [name for name in ("avx512", "avx2", "generic") if _runs(module, name)]
    assert module.cpu_isa() == names[0], "the best instruction set the processor supports is the default"
    seed = int.from_bytes(os.urandom(4), "little")
    results = []
    for name in names:
        for mode in (0, 1):
            run = (lambda call, name=name, mode=mode:
                   _with_setting("set_cpu_isa", name, lambda: _with_setting("set_cpu_stream", mode, call)))
            results.append((name, mode, _loop_results(torch.Generator().manual_seed(seed), dtype, 5, run)))
    for name, mode, got in results[1:]:
        for a, b in zip(results[0][2], got):
            assert torch.equal(a, b), f"{name} stream={mode} differs from {results[0][0]}; seed={seed}"


def _runs(module, name: str) -> bool:
    try:
        _with_setting("set_cpu_isa", name, lambda: None)
        return True
    except RuntimeError:
        return False


def test_unknown_or_unsupported_instruction_set_is_refused():
    module = compiled.load()
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9'; this processor can run: .*generic"):
        module.set_cpu_isa("sse9")
    assert module.cpu_isa() in ("avx512", "avx2", "generic")


@pytest.mark.parametrize("name, value, message", [("PIPEOPTIM_CPU_ISA", "sse9", "unknown instruction set 'sse9'"),
                                                   ("PIPEOPTIM_CPU_STREAM", "yes", "must be 1 .* got 'yes'"),
                                                   ("PIPEOPTIM_CPU_PREFETCH", "yes", "must be how many bytes .* got 'yes'"),
                                                   ("PIPEOPTIM_CPU_PREFETCH", "-64", "from 0 \\(off\\) .* got '-64'")])
def test_bad_cpu_setting_in_the_environment_is_refused_before_writing(name, value, message):
    code = ("import torch, pipeoptim_kernels as pk\n"
            "w = torch.randn(100); out = torch.zeros(100)\n"
            "st = {'exp_avg': torch.randn(100), 'exp_avg_sq': torch.rand(100)}\n"
            "grp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)\n"
            "try:\n"
            "    pk.predict('adam', w, st, grp, step=3, s=2, out=out, backend='cpu')\n"
            "except RuntimeError as e:\n"
            "    print('untouched' if bool((out == 0).all()) else 'written'); print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, name: value}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("untouched"), done.stdout
    assert re.search(message, done.stdout), done.stdout


def test_instruction_set_from_the_environment():
    env = {**os.environ, "PIPEOPTIM_CPU_ISA": "generic"}
    code = "from pipeoptim_kernels import compiled; print(compiled.cpu_isa())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "generic"


@pytest.mark.parametrize("flag, mode", [(None, -1), ("", -1), ("0", 0), ("1", 1)])
def test_stream_mode_from_the_environment(flag, mode):
    """PIPEOPTIM_CPU_STREAM: unset means auto (-1), 0 off, 1 on."""
    env = {k: v for k, v in os.environ.items() if k != "PIPEOPTIM_CPU_STREAM"}
    if flag is not None:
        env["PIPEOPTIM_CPU_STREAM"] = flag
    code = "from pipeoptim_kernels import compiled; print(compiled.load().set_cpu_stream(0))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(mode)


ISA_PREFETCH_BYTES = {"avx512": 0, "avx2": 1024, "generic": 0}


@pytest.mark.parametrize("flag, isa, expected", [(None, None, None), ("512", None, 512), (None, "generic", 0)])
def test_prefetch_distance_from_the_environment(flag, isa, expected):
    """PIPEOPTIM_CPU_PREFETCH: unset means the instruction set's own distance (what measured best where it was
    measured), a number of bytes otherwise; the baseline loops, which have no vectors, do not prefetch."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIPEOPTIM_CPU_PREFETCH", "PIPEOPTIM_CPU_ISA")}
    if flag is not None:
        env["PIPEOPTIM_CPU_PREFETCH"] = flag
    if isa is not None:
        env["PIPEOPTIM_CPU_ISA"] = isa
    code = "from pipeoptim_kernels import compiled; m = compiled.load(); print(m.cpu_isa(), m.cpu_prefetch_bytes())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    name, got = done.stdout.split()[-2:]
    assert int(got) == (ISA_PREFETCH_BYTES[name] if expected is None else expected)


def test_prefetch_setting_rejects_out_of_range_distances_and_restores():
    module = compiled.load()
    for bad in (-2, (1 << 20) + 1):
        with pytest.raises(RuntimeError, match="bytes must be -1 .* or from 0 \\(off\\) to 1048576"):
            module.set_cpu_prefetch(bad)
    previous = module.set_cpu_prefetch(256)
    try:
        assert module.cpu_prefetch_bytes() == 256
        assert module.set_cpu_prefetch(-1) == 256
        assert module.cpu_prefetch_bytes() == ISA_PREFETCH_BYTES[module.cpu_isa()]
    finally:
        module.set_cpu_prefetch(previous)


def test_stream_mode_rejects_unknown_modes_and_auto_uses_the_cache_size():
    module = compiled.load()
    with pytest.raises(RuntimeError, match="mode must be -1"):
        module.set_cpu_stream(2)
    assert module.cpu_stream_threshold_bytes() >= 1 << 20


def _run_without_extension(tmp_path, code: str, env_extra: dict) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing pipeoptim_kernels._C fails."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pipeoptim_kernels._C':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env_extra}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_missing_extension_falls_back_to_eager_with_one_warning(tmp_path):
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import pipeoptim_kernels as pk\n"
        "    print(pk.available_backends())\n"
        "    pk.available_backends()\n"
        "    w = torch.randn(5); out = pk.predict('sgd', w, {'momentum_buffer': torch.ones(5)}, {'lr': 0.1, 'momentum': 0.9}, step=1, s=1)\n"
        "    assert torch.allclose(out, w - 0.1)\n"
        "print(sum('compiled kernels are not available' in str(c.message) for c in caught))\n")
    result = _run_without_extension(tmp_path, code, {"PIPEOPTIM_NO_JIT": "1", "TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr
    backends, warnings_count = result.stdout.split("\n")[:2]
    assert "cpu" not in backends and "eager" in backends
    assert warnings_count == "1", result.stdout
