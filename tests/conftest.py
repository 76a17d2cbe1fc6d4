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
