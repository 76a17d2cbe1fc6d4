"""runtime.worker: sum_of_squares (the squared gradient norm in one float32 pass per buffer, checked against a
float64 sum written here, and exactly as finite as the gradients are) and run_backward (autograd's backward
without its argument checks: the same gradients, and a clear error for a loss that is not one number)."""
from __future__ import annotations

import copy

import math

import pytest
import torch

from pipeoptim.runtime.worker import run_backward, sum_of_squares


def _reference(tensors) -> float:
    return math.fsum(float(x) ** 2 for t in tensors for x in t.detach().double().flatten().tolist())


@pytest.mark.parametrize("sizes", [[1], [7, 1023], [4097, 3, 65537], [0, 5]])
def test_matches_a_float64_sum_on_random_buffers(sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    ts = [torch.randn(n, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g).item() for n in sizes]
    got = sum_of_squares(ts)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == pytest.approx(_reference(ts), rel=2e-6)


def test_low_precision_buffers_accumulate_in_float32():
    # one value repeated is float32's worst case (every rounding biased the same way)
    t = torch.full((100003,), 0.1, dtype=torch.bfloat16)
    assert float(sum_of_squares([t])) == pytest.approx(_reference([t]), rel=2e-5)


def test_a_large_buffer_stays_accurate():
    # one float32 norm over 4M elements is off by ~2e-4; rows of 4,096 keep it near float32's own rounding
    t = torch.randn(4 * 2**20 + 123, generator=torch.Generator().manual_seed(3))
    exact = float(t.double().pow(2).sum())
    assert float(sum_of_squares([t])) == pytest.approx(exact, rel=1e-7)
    assert float(sum_of_squares([t[5:-7]])) == pytest.approx(float(t[5:-7].double().pow(2).sum()), rel=1e-6)


def test_empty_list_is_zero():
    assert float(sum_of_squares([])) == 0.0


def test_a_large_finite_gradient_is_finite_not_an_overflow():
    # float32 squares overflow above ~1.8e19; the verdict "non-finite" must mean a NaN or inf element
    t = torch.tensor([3e20, -4e20, 1.0])
    got = float(sum_of_squares([torch.ones(3), t]))
    assert math.isfinite(got) and got == pytest.approx(_reference([torch.ones(3), t]), rel=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_element_makes_the_sum_non_finite(bad):
    t = torch.randn(1000)
    t[517] = bad
    assert not math.isfinite(float(sum_of_squares([torch.randn(5), t])))


@pytest.mark.parametrize("n", [1, 8320, 65536])
def test_a_small_buffer_is_summed_in_float64(n):
    # up to 65,536 elements the sum is float64's own (far tighter than the float32 rows' ~1e-8), whatever the dtype
    for dtype in (torch.float32, torch.bfloat16):
        t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e3).to(dtype)
        assert float(sum_of_squares([t])) == pytest.approx(_reference([t]), rel=1e-13)


def test_run_backward_accumulates_what_torch_autograd_backward_does():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    x = torch.randn(4, 5, requires_grad=True)
    grads = {}
    for how in ("torch", "ours"):
        lin.zero_grad(set_to_none=False)
        x.grad = None
        y = lin(x)
        outs, g = [y, y.tanh()], [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in (1, 2)]
        if how == "torch":
            torch.autograd.backward(outs, g)
        else:
            run_backward(outs, g)
        grads[how] = [x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]
    for a, b in zip(grads["torch"], grads["ours"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])  # a full backward, and one split in two (I then W)
def test_the_last_stage_starts_its_backward_from_the_loss_scale_bit_for_bit(schedule):
    """The loss is not multiplied by the scale (1/N) in the forward: its backward is seeded with the scale, which
    gives the gradients of ``(loss * scale).backward()`` bit for bit (regression: issue 23's op per micro-batch)."""
    from pipeoptim.train import Pipeline
    n = 3  # 1/3 is not exact in binary
    make = lambda i: torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())  # noqa: E731
    torch.manual_seed(0)
    ref = [make(i) for i in range(2)]
    pipe = Pipeline(stages=lambda i: copy.deepcopy(ref[i]), devices=2, emulate=True, schedule=schedule,
                    microbatches=n, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    x, t = torch.randn(n, 6), torch.randn(n, 6)
    pipe.train_step((x, t))
    model = torch.nn.Sequential(*ref)
    for xm, tm in zip(x.chunk(n), t.chunk(n)):
        (((model(xm) - tm) ** 2).mean() * (1 / n)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    mine = pipe.named_parameters()
    theirs = dict(model.named_parameters())
    assert len(mine) == len(theirs)
    for name, p in mine.items():
        stage, rest = name.split(".", 1)
        assert torch.equal(p.detach(), theirs[f"{stage}.{rest}"].detach()), name


def test_a_loss_that_is_not_one_number_is_a_clear_error():
    from pipeoptim.runtime import PipelineError
    from pipeoptim.train import Pipeline
    pipe = Pipeline(stages=lambda i: torch.nn.Linear(4, 4), devices=2, emulate=True, schedule="1f1b", microbatches=2,
                    loss_fn=lambda y, t: (y - t) ** 2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(PipelineError, match=r"the loss has shape \(1, 4\), but a loss must be a single number"):
        pipe.train_step((torch.randn(2, 4), torch.randn(2, 4)))


@pytest.mark.parametrize("values, finite", [
    ([3e38, 3e38, 1.0], True),                     # finite, though their float32 sum overflows
    ([-3e38, -3e38, 1.0], True),
    ([1.0, float("inf"), 2.0], False),
    ([1.0, float("nan"), 2.0], False),
    ([float("inf"), float("-inf"), 2.0], False),   # their sum is NaN, never a finite number
    ([1e-3, -2e-3, 5.0], True),
])
def test_grads_finite_decides_on_the_elements_not_on_a_float32_sum(values, finite):
    """An asynchronous step skips a non-finite gradient (``grads_finite``): a float32 sum settles a finite
    gradient in one pass, and only an overflowing sum is redone in float64, so a large finite gradient still
    steps (regression: the float64 copy of every gradient cost a GPT stage as much as its AdamW step)."""
    from pipeoptim.schedules.actions import Chunk
    from pipeoptim.train import Pipeline
    pipe = Pipeline(stages=lambda i: torch.nn.Linear(3, 3), devices=2, emulate=True, schedule="async-1f1b",
                    microbatches=2, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    worker = pipe.workers[0]
    chunk = Chunk(0, 0)
    for g in worker.stages[chunk].policy.binding.groups:
        g.master_grad.fill_(0.0)
        g.master_grad[: len(values)] = torch.tensor(values)
        g.master_grad[-1] = 7.0  # the rest of the buffer (weight then bias) stays finite
    assert worker.grads_finite([chunk]) is finite
