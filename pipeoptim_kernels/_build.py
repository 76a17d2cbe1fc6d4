"""How the compiled extension is built: sources and flags, shared by setup.py and the JIT loader.

Kept free of imports from this package so setup.py can load it by path before anything is built.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
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
# -g0: no debug information (Python's own CFLAGS ask for -g; it changes no instruction): the five C++ sources
# compile in 116 s of CPU instead of 186 (AMD EPYC, AVX2, gcc, one at a time), and the library is smaller.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-Wno-psabi", "-g0"]
LINK_FLAGS = ["-fopenmp"]
# The GPU targets come from TORCH_CUDA_ARCH_LIST, which torch turns into -gencode flags (and ignores
# when these flags name an arch themselves); a build with no GPU to ask and no list set gets these.
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0"
NVCC_FLAGS = ["-O3", "-DPIPEOPTIM_WITH_CUDA"]


# Where a CUDA toolkit is looked for when CUDA_HOME (or CUDA_PATH) does not name one: torch's own order.
DEFAULT_CUDA_HOME = "/usr/local/cuda"
# How long a build with CUDA takes, as measured (the README's "Set-up"), to set expectations.
CUDA_BUILD_TIME = ("scripts/install.sh, this build included, took 5.6 minutes on 2 idle cores; the build alone "
                   "took 20 on 2 cores loaded by other jobs")


@dataclass(frozen=True)
class CudaPlan:
    """Whether the extension is built with CUDA: the toolkit taken (None: the CPU kernels only) and why.
    `warn` marks a CPU-only build that the user would have expected to have CUDA (torch has it)."""
    home: str | None
    reason: str
    warn: bool = False

    @property
    def with_cuda(self) -> bool:
        return self.home is not None


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None


def real_nvcc(nvcc: str) -> str:
    """The nvcc binary that `nvcc` runs: links followed, and a wrapper script (`exec /opt/cuda/bin/nvcc "$@"`)
    seen through by asking nvcc where it is (its dry run prints `_HERE_=<its own bin folder>`)."""
    nvcc = str(Path(nvcc).resolve())
    dry = _run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], timeout=30)
    if dry is not None:
        here = re.search(r"^#\$ _HERE_=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
        if here and Path(here.group(1).strip(), "nvcc").is_file():
            return str(Path(here.group(1).strip(), "nvcc").resolve())
    return nvcc


def cuda_lib_dir(home: str) -> Path:
    """The folder torch links libcudart from: lib64, or lib where only that exists (as torch decides)."""
    lib64, lib = Path(home, "lib64"), Path(home, "lib")
    return lib if not lib64.exists() and lib.exists() else lib64


def toolkit_problem(home: str) -> str | None:
    """What makes `home` unusable as the toolkit the build compiles with, or None. (Linking with its
    libcudart is left to the probe: a linker finds it in its own folders too, as in Debian's layout.)"""
    if not Path(home, "bin", "nvcc").is_file():
        return f"{home} has no bin/nvcc"
    if not Path(home, "include", "cuda_runtime.h").is_file():
        return f"{home} has no include/cuda_runtime.h"
    return None


def locate_cuda_toolkit() -> tuple[str | None, str]:
    """The CUDA toolkit in torch's order (CUDA_HOME or CUDA_PATH, else the nvcc on PATH, else
    /usr/local/cuda), checked: (its folder, how it was found), or (None, why none is usable)."""
    named = [(v, os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    if named:  # the user's explicit choice: no other toolkit is tried behind their back
        var, home = named[0]
        problem = toolkit_problem(home)
        return (None, f"{var}={home}, but {problem}") if problem else (home, f"{var}={home}")
    rejected = []
    on_path = shutil.which("nvcc")
    if on_path:
        nvcc = real_nvcc(on_path)
        how = f"the nvcc on PATH, {on_path}" + (f", runs {nvcc}" if nvcc != on_path else "")
        # the folder of the nvcc that really runs; then torch's own guess, the parent of the PATH entry's folder
        for home in dict.fromkeys([str(Path(nvcc).parent.parent), str(Path(on_path).parent.parent)]):
            problem = toolkit_problem(home)
            if problem is None:
                return home, how
            rejected.append(f"{how}: {problem}")
    else:
        rejected.append("no nvcc on PATH")
    if Path(DEFAULT_CUDA_HOME).exists():
        problem = toolkit_problem(DEFAULT_CUDA_HOME)
        if problem is None:
            return str(Path(DEFAULT_CUDA_HOME).resolve()), f"{DEFAULT_CUDA_HOME} ({'; '.join(rejected)})"
        rejected.append(problem)
    else:
        rejected.append(f"no {DEFAULT_CUDA_HOME}")
    return None, "no CUDA toolkit found (CUDA_HOME unset; " + "; ".join(rejected) + ")"


def cuda_home() -> str | None:
    """The CUDA toolkit's folder (see locate_cuda_toolkit), or None."""
    return locate_cuda_toolkit()[0]


def nvcc_release(home: str) -> str | None:
    """The toolkit's CUDA release, e.g. "13.0" (from `nvcc --version`)."""
    out = _run([str(Path(home, "bin", "nvcc")), "--version"], timeout=30)
    found = re.search(r"release (\d+\.\d+)", out.stdout) if out is not None else None
    return found.group(1) if found else None


def cuda_arch_flags() -> list[str]:
    """The -gencode flags torch gives nvcc for TORCH_CUDA_ARCH_LIST (DEFAULT_CUDA_ARCH_LIST when unset)."""
    unset = not os.environ.get("TORCH_CUDA_ARCH_LIST")
    if unset:
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
    try:
        return cpp_extension()._get_cuda_arch_flags(list(NVCC_FLAGS))
    finally:
        if unset:
            del os.environ["TORCH_CUDA_ARCH_LIST"]


_PROBE_SOURCE = """#include <cuda_runtime.h>
__global__ void pipeoptim_probe(float* x) { x[threadIdx.x] = 1.0f; }
int pipeoptim_probe_devices() { int n = 0; return cudaGetDeviceCount(&n) == cudaSuccess ? n : -1; }
"""


def probe_cuda(home: str) -> str | None:
    """Compile a one-line kernel with the toolkit's nvcc for the requested GPU targets and link it against
    its libcudart with the host compiler, as the build will (seconds, where the real build fails only
    after its long compile): None when that works, else what failed."""
    nvcc = str(Path(home, "bin", "nvcc"))
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(prefix="pipeoptim_cuda_probe_") as tmp:
        source, obj, lib = Path(tmp, "probe.cu"), Path(tmp, "probe.o"), Path(tmp, "probe.so")
        source.write_text(_PROBE_SOURCE)
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCH_LIST
        try:
            arch_flags = cuda_arch_flags()
        except ValueError as bad_list:  # torch's own check of the list
            return f"TORCH_CUDA_ARCH_LIST={archs}: {bad_list}"
        compile_ = [nvcc, *arch_flags, "-Xcompiler", "-fPIC", "-c", str(source), "-o", str(obj)]
        link = [cxx, "-shared", str(obj), f"-L{cuda_lib_dir(home)}", "-lcudart", "-o", str(lib)]
        for what, cmd in ((f"compile for TORCH_CUDA_ARCH_LIST={archs}", compile_), ("link", link)):
            done = _run(cmd, timeout=300)
            if done is None or done.returncode != 0:
                said = (done.stderr or done.stdout).strip().splitlines()[-3:] if done is not None else ["did not run"]
                return f"a test {what} failed: `{' '.join(cmd)}`: {' / '.join(said) or 'no output'}"
    return None


def cuda_plan() -> CudaPlan:
    """Decide, in seconds and before anything is compiled, whether the extension gets its CUDA kernels."""
    if os.environ.get("PIPEOPTIM_NO_CUDA", "0") == "1":
        return CudaPlan(None, "PIPEOPTIM_NO_CUDA=1")
    import torch

    if torch.version.cuda is None:
        return CudaPlan(None, f"torch {torch.__version__} is a CPU-only build")
    fix = ("set CUDA_HOME to a CUDA {major}.x toolkit (the folder holding bin/nvcc, include/cuda_runtime.h "
           "and lib64/libcudart.so), or PIPEOPTIM_NO_CUDA=1 to build the CPU kernels without this warning")
    fix = fix.format(major=torch.version.cuda.split(".")[0])
    home, how = locate_cuda_toolkit()
    if home is None:
        return CudaPlan(None, f"{how}; {fix}", warn=True)
    release = nvcc_release(home)
    if release is None:
        return CudaPlan(None, f"{how}: `{home}/bin/nvcc --version` does not run; {fix}", warn=True)
    if release.split(".")[0] != torch.version.cuda.split(".")[0]:
        return CudaPlan(None, f"{how}: nvcc is CUDA {release}, torch {torch.__version__} is built with CUDA "
                              f"{torch.version.cuda}; {fix}", warn=True)
    problem = probe_cuda(home)
    if problem:
        return CudaPlan(None, f"{how}: {problem}; {fix}", warn=True)
    return CudaPlan(home, f"{how}; CUDA {release}, a test compile and link passed")


def describe(plan: CudaPlan) -> str:
    """The line a build prints about its CUDA decision (with WARNING when CUDA was expected and is missing)."""
    if plan.with_cuda:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or f"{DEFAULT_CUDA_ARCH_LIST} (the default)"
        return (f"pipeoptim_kernels: building the CPU and CUDA kernels with the CUDA toolkit at {plan.home} "
                f"({plan.reason}) for TORCH_CUDA_ARCH_LIST={archs}; {_jobs()}; {CUDA_BUILD_TIME}; "
                f"PIPEOPTIM_NO_CUDA=1 builds the CPU kernels alone, in less time")
    if plan.warn:
        return f"pipeoptim_kernels: WARNING: building the CPU kernels only, without CUDA: {plan.reason}"
    return f"pipeoptim_kernels: building the CPU kernels only ({plan.reason}); {_jobs()}"


def _jobs() -> str:
    jobs = os.environ.get("MAX_JOBS")
    return f"MAX_JOBS={jobs} compiles at once" if jobs else "MAX_JOBS unset: ninja's default number of compiles at once"


def cpp_extension():
    """torch.utils.cpp_extension, imported without its log line about the CUDA_HOME it guesses on import
    (`No CUDA runtime is found, using CUDA_HOME='/usr/local'` beside an nvcc wrapper): the build's own line
    says which toolkit it takes."""
    import logging

    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)  # only while importing: its later warnings (a compiler's version...) stay
    try:
        from torch.utils import cpp_extension as module
    finally:
        logger.setLevel(level)
    return module


def use_toolkit(home: str) -> None:
    """Make torch's extension builder compile with this toolkit (it fixes its own guess when imported)."""
    os.environ["CUDA_HOME"] = home
    cpp_extension().CUDA_HOME = home


def want_cuda() -> bool:
    """Whether a build here gets the CUDA kernels (see cuda_plan; PIPEOPTIM_NO_CUDA=1 opts out)."""
    return cuda_plan().with_cuda


def sources(with_cuda: bool, relative_to: Path | None = None) -> list[str]:
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])
    paths = [CSRC / n for n in names]
    return [str(p.relative_to(relative_to)) if relative_to else str(p) for p in paths]


def requested_cuda_archs() -> set[str]:
    """The GPU targets a build asks for, e.g. {"80", "90"}, from TORCH_CUDA_ARCH_LIST or the default."""
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
