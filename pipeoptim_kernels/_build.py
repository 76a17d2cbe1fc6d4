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


def requested_cuda_archs() -> set[str]:
    """The GPU targets a build asks for, e.g. {"80", "90"}, from TORCH_CUDA_ARCH_LIST or the default."""
    import re

    wanted = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCH_LIST
    return {a.split("+")[0].replace(".", "") for a in re.split(r"[;\s,]+", wanted.strip()) if a}


def cuobjdump() -> str | None:
    """CUDA's cuobjdump (from the toolkit, or the copy triton ships), to list the GPU code in a binary."""
    home = cuda_home()
    candidates = [Path(home, "bin", "cuobjdump")] if home else []
    try:
        import triton.backends.nvidia as nvidia

        candidates.append(Path(nvidia.__file__).parent / "bin" / "cuobjdump")
    except ImportError:
        pass
    found = [str(c) for c in candidates if c.exists()] + [shutil.which("cuobjdump")]
    return next((c for c in found if c), None)


def cubin_archs(binary: str) -> set[str]:
    """The archs a binary holds GPU code for, e.g. {"80", "90"} (empty without cuobjdump)."""
    import re
    import subprocess

    tool = cuobjdump()
    if tool is None:
        return set()
    listing = subprocess.run([tool, "--list-elf", binary], capture_output=True, text=True).stdout
    return set(re.findall(r"\.sm_(\d+)a?\.cubin", listing))


def built_extension_dir() -> Path:
    """Where the extension is loaded from: the package itself, or PIPEOPTIM_KERNELS_BUILD's build (the
    folder given to setup.py build_ext --build-lib)."""
    other = os.environ.get("PIPEOPTIM_KERNELS_BUILD")
    return Path(other).resolve() / "pipeoptim_kernels" if other else ROOT / "pipeoptim_kernels"


def stale_reason() -> str | None:
    """Why the extension must be (re)built here, or None when it is current: built after every source,
    loadable by this torch, with CUDA where CUDA can be built and code for each requested GPU.

    benchmarks/gpu_check.sh builds only when this says so (a machine with nothing built always does)."""
    import subprocess
    import sys

    built = sorted(built_extension_dir().glob("_C.*.so"))
    if not built:
        return "not built"
    so = built[-1]
    sources = [p for p in CSRC.rglob("*") if p.is_file()] + [Path(__file__), ROOT / "setup.py"]
    newest = max(sources, key=lambda p: p.stat().st_mtime)
    if newest.stat().st_mtime > so.stat().st_mtime:
        shown = newest.relative_to(ROOT) if newest.is_relative_to(ROOT) else newest
        return f"{shown} changed after {so.name} was built"
    probe = subprocess.run([sys.executable, "-c", "from pipeoptim_kernels import compiled; m = compiled.load(); "
                            "print(compiled._state['error'] if m is None else int(m.with_cuda))"],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PIPEOPTIM_NO_JIT": "1"})
    if probe.returncode != 0 or probe.stdout.strip() not in ("0", "1"):
        lines = (probe.stdout.strip() or probe.stderr.strip() or "no output").splitlines()
        return f"{so.name} does not load here: {lines[-1]}"
    if want_cuda():
        if probe.stdout.strip() != "1":
            return f"{so.name} was built without CUDA, which can be built here"
        missing = requested_cuda_archs() - cubin_archs(str(so))
        if missing:
            return f"{so.name} holds no code for sm_{', sm_'.join(sorted(missing))} (TORCH_CUDA_ARCH_LIST)"
    return None
