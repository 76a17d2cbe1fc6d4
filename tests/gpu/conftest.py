"""GPU tests: the same checks as the CPU suite, on CUDA tensors, for the `cuda` and `triton` backends.

They skip on a machine without a GPU. On the lent GPU run them with TRITON_INTERPRET=0 (see
benchmarks/gpu_check.sh) so that Triton compiles for the device instead of interpreting.
"""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on the lent GPU (benchmarks/gpu_check.sh)")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
