"""How the compiled extension is built: sources and flags, shared by setup.py and the JIT loader.

Kept free of imports from this package so setup.py can load it by path before anything is built.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
EXT_NAME = "pipeoptim_kernels._C"

CPU_SOURCES = ["ops.cpp", "cpu/ops_cpu.cpp", "cpu/loops_avx512.cpp", "cpu/loops_avx2.cpp", "cpu/loops_generic.cpp"]
CUDA_SOURCES = ["cuda/ops_cuda.cu"]

# The C++ standard is torch's own choice (C++20 from torch 2.13, C++17 before).
# -fno-math-errno lets the compiler vectorise sqrt; no -ffast-math: the maths stays IEEE fp32.
# -ffp-contract=off: no fused multiply-adds the source does not write, so every CPU loop (each
# instruction set, ordinary or streaming stores) rounds the same way and gives the same bits.
# -Wno-psabi: the loops pass vectors only to always-inlined functions, never across a call ABI.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-Wno-psabi"]
LINK_FLAGS = ["-fopenmp"]
# The GPU targets come from TORCH_CUDA_ARCH_LIST, which torch turns into -gencode flags (and ignores
# when these flags name an arch themselves); a build with no GPU to ask and no list set gets these.
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0"
NVCC_FLAGS = ["-O3", "-DPIPEOPTIM_WITH_CUDA"]


def cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and Path(home, "bin", "nvcc").exists():
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    return None


def want_cuda() -> bool:
    """Build the CUDA kernels when torch has CUDA and nvcc is found (PIPEOPTIM_NO_CUDA=1 opts out)."""
    if os.environ.get("PIPEOPTIM_NO_CUDA", "0") == "1":
        return False
    import torch

    return torch.version.cuda is not None and cuda_home() is not None


def sources(with_cuda: bool, relative_to: Path | None = None) -> list[str]:
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])
    paths = [CSRC / n for n in names]
    return [str(p.relative_to(relative_to)) if relative_to else str(p) for p in paths]
