"""GPU tests: the kernel checks of the CPU suite on CUDA tensors, for the `cuda` and compiled `triton`
backends, plus what only a GPU has (streams, graphs, lengths past 2^31).

On the lent GPU run them with TRITON_INTERPRET=0 (benchmarks/gpu_check.sh does) so that Triton compiles
for the device. Without a GPU they skip, unless PIPEOPTIM_GPU_TESTS_ON_CPU=1: then they run on CPU
tensors, the `cpu` backend and Triton's interpreter standing in, at small sizes, and the tests marked
`cuda_only` skip. That is a dry run of the test code (benchmarks/gpu_check.sh --dry-run), so a typo
cannot cost the GPU's few minutes; it proves nothing about the GPU.

With PIPEOPTIM_GPU_TESTS_CSV set, each test's outcome is appended to that CSV as it finishes, so a run
cut short by its time limit keeps what it saw.
"""
import csv
import os
from types import SimpleNamespace

import pytest
import torch

ON_CPU = os.environ.get("PIPEOPTIM_GPU_TESTS_ON_CPU", "0") == "1"


@pytest.fixture(scope="session")
def gpu():
    """Where these tests run: device, the backends standing for `cuda` and `triton`, and whether small."""
    if ON_CPU:
        return SimpleNamespace(device="cpu", cuda="cpu", triton="triton", quick=True)
    return SimpleNamespace(device="cuda", cuda="cuda", triton="triton", quick=False)


def pytest_collection_modifyitems(config, items):
    here = [item for item in items if "tests/gpu" in str(item.fspath)]
    if ON_CPU:
        skip = pytest.mark.skip(reason="needs CUDA itself (streams, graphs, memory past 2^31 elements): "
                                       "runs on the lent GPU only")
        for item in here:
            if item.get_closest_marker("cuda_only"):
                item.add_marker(skip)
    elif not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on the lent GPU (benchmarks/gpu_check.sh); "
                                       "PIPEOPTIM_GPU_TESTS_ON_CPU=1 runs them on the CPU as a dry run")
        for item in here:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("PIPEOPTIM_GPU_TESTS_CSV")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["test", "phase", "outcome", "seconds", "message"])
        message = str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""
        writer.writerow([report.nodeid, report.when, report.outcome, round(report.duration, 3), message])
