"""Every Triton kernel launch of pipeoptim_kernels compiles for sm_80 and sm_90, without a GPU.

tests/triton_targets.py records the launches the backend makes for every rule, fused step, output
dtype, in place, ŵ over the gradient and misaligned views, and compiles each through Triton's own JIT
path down to PTX and a cubin. This proves the kernels compile for real targets with the installed
Triton and shows what the GPU will run (vector widths, rounding); it cannot show that they run
correctly or fast: tests/gpu and benchmarks/gpu_check.sh do that on a GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
ARCHS = (80, 90)


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """The records of the targets this run's tests ask for (a pass may deselect one: the oldest torch's pass
    keeps sm_90, the GPU machine's), compiled in a process each, side by side, each with an empty cache."""
    tmp = tmp_path_factory.mktemp("triton_targets")
    wanted = sorted({item.callspec.params["arch"] for item in request.session.items if item.module is request.module
                     and hasattr(item, "callspec") and "arch" in item.callspec.params})
    procs = {}
    for arch in wanted:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / f"cache{arch}")}
        procs[arch] = subprocess.Popen(
            [sys.executable, str(HERE / "triton_targets.py"), "--arch", str(arch), "--json", str(tmp / f"{arch}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    records = {}
    for arch, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"compiling for sm_{arch} failed:\n{out[-6000:]}"
        records[arch] = json.loads((tmp / f"{arch}.json").read_text())
        print(out.strip())
    return records


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_and_output_dtype_compiles_for_the_target(compiled, arch):
    records = compiled[arch]
    assert records and all(r["ok"] for r in records)
    assert {(r["kernel"], r["out_dtype"]) for r in records} == {
        (k, d) for k in ("_predict_kernel", "_adam_kernel", "_sgd_kernel") for d in ("float32", "bfloat16", "float16")}
    assert all(r["target"].startswith(f"sm_{arch}") for r in records), {r["target"] for r in records}
    assert all(r["cubin_bytes"] > 0 for r in records)


@pytest.mark.parametrize("arch", ARCHS)
def test_square_roots_and_divisions_round_correctly(compiled, arch):
    """sqrt.rn and div.rn as torch.optim and the CUDA kernels compute, not sqrt.approx / div.full."""
    records = compiled[arch]
    for r in records:
        assert set(r["sqrt"]) <= {"sqrt.rn.f32"} and set(r["div"]) <= {"div.rn.f32"} and not r["rcp"], r
    adam = [r for r in records if r["kernel"] == "_adam_kernel"]
    assert adam and all(r["sqrt"] and r["div"] for r in adam), "the Adam step has a square root and a division"


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_buffers_get_vector_accesses_whatever_the_length(compiled, arch):
    """The length here (4099, and 2^31+5) is no multiple of 16: whole blocks are still vectorised."""
    records = compiled[arch]
    aligned = [r for r in records if r["aligned"]]
    assert any(r["n"] % 16 for r in aligned)
    for r in aligned:
        assert r["loads_vector"] > 0 and r["stores_vector"] > 0, r


@pytest.mark.parametrize("arch", ARCHS)
def test_views_misaligned_alike_run_an_aligned_vectorised_body(compiled, arch):
    misaligned = {r["name"] for r in compiled[arch] if "misaligned" in r["name"] and not r["long"]}
    assert misaligned
    for name in misaligned:
        parts = [r for r in compiled[arch] if r["name"] == name]
        body = [r for r in parts if r["aligned"]]
        assert len(parts) == 2 and len(body) == 1 and body[0]["loads_vector"] > 0, parts


@pytest.mark.parametrize("arch", ARCHS)
def test_lengths_past_two_to_the_31_are_64_bit(compiled, arch):
    records = compiled[arch]
    long = [r for r in records if r["long"]]
    assert {r["kernel"] for r in long} == {"_predict_kernel", "_adam_kernel", "_sgd_kernel"}
    assert all(r["n_param_type"] == "u64" for r in long)
    assert all(r["n_param_type"] == "u32" for r in records if not r["long"])
