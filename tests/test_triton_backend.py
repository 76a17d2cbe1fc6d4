"""triton_backend's launcher: the device it launches on and how it splits misaligned views (the kernels'
numbers are checked with every backend in test_kernels_*; their compiled form in test_triton_targets)."""
import contextlib

import pytest
import torch

import pipeoptim_kernels as pk
from kernel_reference import assert_close_to_reference, reference_predict
from pipeoptim_kernels import triton_backend

pytestmark = pytest.mark.skipif("triton" not in pk.available_backends(), reason="triton is not installed")

GROUP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)


class _CudaBuffer:
    """Stands in for a CUDA buffer on a second device (this machine has none)."""

    def __init__(self, index, n=4096):
        self.device, self.n = torch.device("cuda", index), n

    def numel(self):
        return self.n

    def data_ptr(self):
        return 1 << 20

    def element_size(self):
        return 4


def test_launch_runs_on_the_buffers_device_not_the_current_one(monkeypatch):
    active, seen = [], []

    @contextlib.contextmanager
    def device(d):
        active.append(torch.device(d))
        yield
        active.pop()

    monkeypatch.setattr(triton_backend.torch.cuda, "device", device)
    monkeypatch.setattr(triton_backend, "run_kernel", lambda kernel, buffers, n, coeffs, consts: seen.append(list(active)))
    buffers = [_CudaBuffer(1) for _ in range(3)]
    triton_backend.launch(None, buffers, [1.0], {})
    assert seen == [[torch.device("cuda", 1)]]


def test_aligned_head_finds_the_offset_that_aligns_every_buffer():
    base32, base16 = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
    assert triton_backend.aligned_head([base32[:32], base16[:32]]) == 0
    assert triton_backend.aligned_head([base32[1:33], base32[1:33]]) == 3
    assert triton_backend.aligned_head([base32[1:33], base16[1:33]]) == 7  # 4 + 7·4 and 2 + 7·2 bytes: both 16-aligned
    assert triton_backend.aligned_head([base32[1:33], base32[2:34]]) == -1


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_views_misaligned_alike_are_split_and_exact(monkeypatch, out_dtype, gen):
    """A view one element into each buffer: the first elements launch on their own, the rest from an
    aligned start; the result is the float64 reference's, every element (the split seam included)."""
    n = 70001  # the interpreter's block is 65536: the body spans two programs, the last one partial
    base = [torch.randn(n + 1, generator=gen) for _ in range(3)]
    w, m, v = base[0][1:], base[1][1:], base[2][1:].abs_()
    out = torch.full((n + 1,), float("nan"), dtype=out_dtype)[1:]
    launches = []
    real = triton_backend.run_kernel
    monkeypatch.setattr(triton_backend, "run_kernel", lambda k, bufs, size, c, consts: (
        launches.append((size, [b.data_ptr() % 16 for b in bufs])), real(k, bufs, size, c, consts)))
    pk.predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, GROUP, step=3, s=2, out=out, backend="triton")
    head = 3 if out_dtype == torch.float32 else 7
    assert [size for size, _ in launches] == [head, n - head]
    assert launches[1][1] == [0] * 6
    ref, term = reference_predict("adam", w, {"exp_avg": m, "exp_avg_sq": v}, GROUP, 3, 2)
    assert_close_to_reference(out, ref, term, msg=f"triton misaligned {out_dtype} seed={gen.initial_seed()}")


def test_step_predict_on_misaligned_views_matches_the_eager_step(gen):
    n = 5003
    views = {k: torch.randn(n + 1, generator=gen)[1:] for k in ("w", "g", "exp_avg")}
    views["exp_avg_sq"] = torch.rand(n + 1, generator=gen)[1:]
    results = []
    for backend in ("eager", "triton"):
        w, st = views["w"].clone(), {k: views[k].clone() for k in ("exp_avg", "exp_avg_sq")}
        w, st = _misaligned(w), {k: _misaligned(t) for k, t in st.items()}
        out = _misaligned(torch.full((n,), float("nan")))
        pk.step_predict("adamw", w, views["g"], st, {**GROUP, "weight_decay": 0.01}, step=3, s=2, out=out,
                        backend=backend)
        results.append((w, st["exp_avg"], st["exp_avg_sq"], out))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=4e-6, atol=2.5e-7)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    base[1:] = t
    return base[1:]
