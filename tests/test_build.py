"""pipeoptim_kernels/_build.py: the flags the extension is built with, and what the build produced."""
import os
import re
import shutil
import subprocess
from pathlib import Path

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


def _requested_archs() -> set[str]:
    wanted = os.environ.get("TORCH_CUDA_ARCH_LIST") or _build.DEFAULT_CUDA_ARCH_LIST
    return {a.split("+")[0].replace(".", "") for a in re.split(r"[;\s]+", wanted.strip()) if a}


def _cuobjdump() -> str | None:
    home = _build.cuda_home()
    candidates = [Path(home, "bin", "cuobjdump")] if home else []
    try:  # triton ships one
        import triton.backends.nvidia as nvidia
        candidates.append(Path(nvidia.__file__).parent / "bin" / "cuobjdump")
    except ImportError:
        pass
    found = [str(c) for c in candidates if c.exists()] + [shutil.which("cuobjdump")]
    return next((c for c in found if c), None)


def test_built_extension_holds_code_for_each_requested_gpu():
    """The CUDA kernels compile in every CI run: the extension holds a cubin for each requested target."""
    module = compiled.load()
    if module is None or not module.with_cuda:
        pytest.skip("the extension was built without CUDA (no nvcc or a CPU build of torch)")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to list the extension's GPU code")
    listing = subprocess.run([str(tool), "--list-elf", module.__file__], capture_output=True, text=True, check=True)
    assert set(re.findall(r"\.sm_(\d+)\.cubin", listing.stdout)) == _requested_archs(), listing.stdout
    assert torch.version.cuda is not None
