"""Builds pipeoptim_kernels._C: a CUDA extension where torch has CUDA and nvcc is found, else CPU only.

    pip install --no-build-isolation -e .      # uses the torch already installed
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_build", HERE / "pipeoptim_kernels" / "_build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def extensions():
    from torch.utils import cpp_extension

    with_cuda = build.want_cuda()
    if with_cuda:
        os.environ.setdefault("CUDA_HOME", build.cuda_home())
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", build.DEFAULT_CUDA_ARCH_LIST)
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
        ext = cpp_extension.CUDAExtension(
            build.EXT_NAME, build.sources(True, HERE),
            extra_compile_args={"cxx": build.CXX_FLAGS + ["-DPIPEOPTIM_WITH_CUDA"], "nvcc": build.NVCC_FLAGS},
            extra_link_args=build.LINK_FLAGS)
    else:
        ext = cpp_extension.CppExtension(
            build.EXT_NAME, build.sources(False, HERE),
            extra_compile_args={"cxx": build.CXX_FLAGS}, extra_link_args=build.LINK_FLAGS)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
