"""Builds pipeoptim_kernels._C against the torch already installed: the CPU kernels always, the CUDA kernels
too where torch has CUDA and a CUDA toolkit compiles and links (else one warning, and the CPU kernels alone).

    pip install --no-build-isolation .       # the supported form (torch, setuptools, wheel, ninja installed first)
    pip install -v --no-build-isolation .    # the same, showing the toolkit taken and a line per compile step

pip's default isolated build cannot see the installed torch, and a torch it downloaded would not be the one
the extension runs with, so it stops at once with the command above (see _no_torch).
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_build", HERE / "pipeoptim_kernels" / "_build.py")
build = importlib.util.module_from_spec(_spec)
sys.modules["_build"] = build  # (its dataclass looks its module up there)
_spec.loader.exec_module(build)


def _no_torch() -> str:
    """Why the build cannot import torch, and the command that works."""
    outside = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    found = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('torch'); "
                            "print(s.origin if s else '')"], env=outside, capture_output=True, text=True).stdout
    command = "pip install --no-build-isolation ."
    if found.strip():
        return (f"pipeoptim: the kernels are built against the torch they run with ({found.strip()}), which "
                f"pip's build isolation hides from this build. Install with: {command}")
    return (f"pipeoptim: no torch to build the kernels against. Install torch first (pip install "
            f"'torch>=2.11,<2.15'), then setuptools, wheel and ninja, then: {command}")


def _extension(plan, cpp_extension):
    if plan.with_cuda:
        build.use_toolkit(plan.home)
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", build.DEFAULT_CUDA_ARCH_LIST)
        return cpp_extension.CUDAExtension(
            build.EXT_NAME, build.sources(True, HERE),
            extra_compile_args={"cxx": build.CXX_FLAGS + ["-DPIPEOPTIM_WITH_CUDA"], "nvcc": build.NVCC_FLAGS},
            extra_link_args=build.LINK_FLAGS)
    return cpp_extension.CppExtension(
        build.EXT_NAME, build.sources(False, HERE),
        extra_compile_args={"cxx": build.CXX_FLAGS}, extra_link_args=build.LINK_FLAGS)


def _build_ext():
    cpp_extension = build.cpp_extension()

    class BuildKernels(cpp_extension.BuildExtension):
        """Decides CUDA or CPU once, when the extension is built: not when pip's metadata step lists the sources."""

        def run(self):
            plan = build.cuda_plan()
            print(build.describe(plan), file=sys.stderr, flush=True)
            if not cpp_extension.is_ninja_available():
                print("pipeoptim_kernels: no ninja: compiling one file at a time, without a line per step "
                      "(pip install ninja)", file=sys.stderr, flush=True)
            chosen = _extension(plan, cpp_extension)
            for ext in self.extensions:  # the placeholder setuptools has set up: given the chosen build
                vars(ext).update({k: v for k, v in vars(chosen).items() if not k.startswith("_")})
            super().run()

    return BuildKernels.with_options(use_ninja=True)


try:
    import torch  # noqa: F401  (the build needs the installed torch: see _no_torch)
except ModuleNotFoundError:
    sys.exit(_no_torch())

# The sources listed here put them in an sdist; BuildKernels replaces this with the real extension.
setup(ext_modules=[Extension(build.EXT_NAME, build.sources(True, HERE))], cmdclass={"build_ext": _build_ext()})
