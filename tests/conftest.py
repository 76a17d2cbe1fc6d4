"""Test-wide setup. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here, first:
the Triton backend is tested on CPU tensors through Triton's interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen():
    """A generator with a fresh seed each run (printed on failure) so every run sees new inputs."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)  # g.initial_seed() recovers it


@pytest.fixture
def one_thread():
    """One torch thread for the test: deterministic reductions, and steadier on the shared 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def backend(request):
    """The pipeoptim_kernels backend for a test parametrized indirectly over kernel_reference.CPU_BACKEND_IDS:
    the id itself, except "cpu-stream", which runs "cpu" with streaming stores forced on."""
    name = request.param
    if name != "cpu-stream":
        yield name
        return
    from pipeoptim_kernels import _C

    previous = _C.set_cpu_stream(1)
    try:
        yield "cpu"
    finally:
        _C.set_cpu_stream(previous)


@pytest.fixture
def restore_policy_registry():
    """Undo policies a test registers in the global registry (the benchmarks' ablations add some), so the
    tests after it see the built-ins only."""
    from pipeoptim.policies import POLICIES
    before = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(before)
