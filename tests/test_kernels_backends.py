"""Backend selection, the compiled extension's build, and the ops under torch.compile."""
import os
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
    adam_coeffs = [0.9, 0.999, 1e-8, 1.0, 0.0, 1.0, 1e-2, 0.03, 2e-2, 0.0]
    torch.library.opcheck(torch.ops.pipeoptim.adam_step_predict_.default,
                          (w.clone(), g, torch.zeros(N), torch.zeros(N), None, torch.empty(N), adam_coeffs))
    torch.library.opcheck(torch.ops.pipeoptim.sgd_step_predict_.default,
                          (w.clone(), g, torch.zeros(N), torch.empty(N), False, True, [0.1, 0.9, 0.0, 0.0, 1.0, 0.1]))


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


def test_streaming_stores_path_is_exact(tmp_path):
    """PIPEOPTIM_CPU_STREAM=1 (opt-in non-temporal stores) must give the same bits as ordinary stores."""
    script = tmp_path / "stream.py"
    script.write_text(
        "import torch, pipeoptim_kernels as pk\n"
        "g = torch.Generator().manual_seed(0)\n"
        "n = 3 * 2048 + 5\n"
        "w = torch.randn(n, generator=g); st = {'exp_avg': torch.randn(n, generator=g), 'exp_avg_sq': torch.rand(n, generator=g)}\n"
        "grp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)\n"
        "outs = []\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    out = torch.empty(n + 1, dtype=dtype)[1:]\n"  # misaligned start: exercises the head copy
        "    pk.predict('adam', w, st, grp, step=3, s=2, out=out, backend='cpu'); outs.append(out.clone())\n"
        "    o2 = torch.empty(n, dtype=dtype); w2 = w.clone(); s2 = {k: v.clone() for k, v in st.items()}\n"
        "    pk.step_predict('adam', w2, st['exp_avg'], s2, grp, step=3, s=2, out=o2, backend='cpu'); outs += [o2, w2]\n"
        "import sys; torch.save(outs, sys.argv[1])\n")
    results = []
    for flag in ("0", "1"):
        path = tmp_path / f"out{flag}.pt"
        env = {**os.environ, "PIPEOPTIM_CPU_STREAM": flag}
        subprocess.run([sys.executable, str(script), str(path)], check=True, env=env, timeout=120)
        results.append(torch.load(path))
    for a, b in zip(*results):
        assert torch.equal(a, b)


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
