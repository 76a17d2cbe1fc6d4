"""pipeoptim_kernels/_build.py: the flags the extension is built with, and what the build produced."""
import re

import pytest
import torch
from torch.utils import cpp_extension

from pipeoptim_kernels import _build, compiled


def _archs(flags: list[str]) -> set[str]:
    return set(re.findall(r"(?:sm|compute)_(\d+)", " ".join(flags)))


def test_torch_cuda_arch_list_picks_the_gpu_targets(monkeypatch):
    """TORCH_CUDA_ARCH_LIST=9.0 (the lent H200 alone) builds sm_90 only: torch adds its -gencode flags
    unless ours already name an arch, in which case it silently ignores the list."""
    for wanted, archs in (("9.0", {"90"}), ("8.0;9.0", {"80", "90"})):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", wanted)
        flags = list(_build.NVCC_FLAGS)
        assert _archs(flags + cpp_extension._get_cuda_arch_flags(flags)) == archs


def test_built_extension_holds_code_for_each_requested_gpu():
    """The CUDA kernels compile in every CI run: the extension holds a cubin for each requested target."""
    module = compiled.load()
    if module is None or not module.with_cuda:
        pytest.skip("the extension was built without CUDA (no nvcc or a CPU build of torch)")
    if _build.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to list the extension's GPU code")
    assert _build.cubin_archs(module.__file__) == _build.requested_cuda_archs()
    assert torch.version.cuda is not None


def test_stale_reason_says_why_a_build_is_needed(monkeypatch, tmp_path):
    """What gpu_check.sh's build step asks before building: nothing built, a source newer than the build,
    a missing GPU target; None for the extension this suite runs on (built after its sources)."""
    if compiled.load() is None:
        pytest.skip("the extension is not built")
    assert _build.stale_reason() is None
    with monkeypatch.context() as nothing_built:
        nothing_built.setattr(_build, "ROOT", tmp_path)
        nothing_built.delenv("PIPEOPTIM_KERNELS_BUILD", raising=False)
        (tmp_path / "pipeoptim_kernels").mkdir()
        assert _build.stale_reason() == "not built"
    if compiled.load().with_cuda and _build.cuobjdump():
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5;9.0")
        assert "sm_75" in _build.stale_reason()
    newer = tmp_path / "rules.h"
    newer.write_text("// touched\n")
    monkeypatch.setattr(_build, "CSRC", tmp_path)
    assert "rules.h changed after" in _build.stale_reason()
