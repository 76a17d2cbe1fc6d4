"""The split backward: input pass then weight pass give exactly the gradients of one ``autograd.backward``, for
chunks of every shape the runtime meets (float64, fresh random inputs), and the weight pass does not walk the
input path again."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.models import GPTConfig
from pipeoptim.models.gpt import Block
from pipeoptim.runtime.split_backward import input_pass, weight_pass

SEED = torch.seed() % (1 << 31)


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls: it sits on the input path, which only the input pass walks."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Count.calls += 1
        return g


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x):
        return self.b(_Count.apply(torch.tanh(self.a(x))))


class Shared(nn.Module):
    """One weight used twice in sequence: two frontier nodes in one parameter group."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.c = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(torch.sin(self.lin(x) * self.c))


class WeightSquared(nn.Module):
    """The weight gradient reads the weight itself (nonlinear in w)."""
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return x * self.w ** 2 + self.w.exp()


class TwoOutputs(nn.Module):
    """A tuple output, one part computed from the parameters alone (a root off the input path)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bias_only = nn.Parameter(torch.randn(3))
        self.unused = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return self.lin(x), self.bias_only * 2.0


class FedRoot(nn.Module):
    """An output computed without the inputs that also feeds the other output: W walks from the outputs."""
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))

    def forward(self, x):
        q = self.p.sin()
        return x * q, q


def _block():
    return Block(GPTConfig(seq_len=6, d_model=8, n_heads=2, n_layers=1))


CASES = [("mlp", MLP, (4, 5)), ("shared", Shared, (3, 4)), ("weight_squared", WeightSquared, (2, 6)),
         ("two_outputs", TwoOutputs, (5, 3)), ("fed_root", FedRoot, (2, 3)), ("gpt_block", _block, (2, 6, 8))]


def _run(make, shape, split: bool, input_grad: bool, seed: int):
    torch.manual_seed(seed)
    m = make().double()
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    x.requires_grad_(input_grad)
    out = m(x)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed + 2)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]
    for p in m.parameters():          # pre-existing gradient: the passes must accumulate, not overwrite
        p.grad = torch.full_like(p, 0.25)
    if split:
        dx, work = input_pass(outs, grads, (x,), list(m.parameters()))
        dx = dx[0]
        before = {n: p.grad.clone() for n, p in m.named_parameters()}
        weight_pass(work)
        unchanged_by_input_pass = all(torch.equal(before[n], torch.full_like(p, 0.25))
                                      for n, p in m.named_parameters())
        assert unchanged_by_input_pass, "the input pass touched a parameter gradient"
    else:
        if input_grad:
            dx = torch.autograd.grad(outs, (x,), grads, retain_graph=True)[0]
        else:
            dx = None
        torch.autograd.backward(outs, grads)
    return dx, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("input_grad", [True, False])
def test_split_equals_one_backward(name, make, shape, input_grad):
    dx_s, g_s = _run(make, shape, True, input_grad, SEED)
    dx_u, g_u = _run(make, shape, False, input_grad, SEED)
    if input_grad:
        torch.testing.assert_close(dx_s, dx_u, rtol=1e-12, atol=1e-12, msg=f"input gradient (seed {SEED})")
    else:
        assert dx_s is None
    assert set(g_s) == set(g_u)
    for n in g_u:
        torch.testing.assert_close(g_s[n], g_u[n], rtol=1e-12, atol=1e-12, msg=f"{name}.{n} (seed {SEED})")


def test_weight_pass_does_not_walk_the_input_path_again():
    _Count.calls = 0
    _run(MLP, (4, 5), True, True, SEED)
    assert _Count.calls == 1
    _Count.calls = 0
    _run(MLP, (4, 5), False, True, SEED)       # control: the unsplit reference walks it twice here (grad + backward)
    assert _Count.calls == 2


def test_unused_parameter_keeps_its_gradient():
    dx, g = _run(TwoOutputs, (5, 3), True, True, SEED)
    assert torch.equal(g["unused"], torch.full((2,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("policy", ["none", "stash", "pipeoptim"])
def test_a_split_backward_under_a_weight_policy_frees_its_graph(policy):
    """Regression: the policy's saved-tensor hooks kept a saved output with its grad_fn, a reference cycle through
    autograd's C++ graph that only a backward without retain_graph breaks. The split backward retains the graph
    in both passes, so every micro-batch's activations leaked (async-zb: ~30 MB per micro-batch of gpt16)."""
    import gc
    import weakref

    from pipeoptim.policies import make_policy
    torch.manual_seed(SEED)
    lin = nn.Linear(8, 8)
    pol = make_policy(policy, lin, torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9))
    x = torch.randn(4, 8, requires_grad=True)
    with pol.forward(0, s=1):                     # s = 1: a step comes before the backward, the hooks are on
        y = torch.tanh(lin(x))                    # tanh saves its own output
    alive = weakref.ref(y)
    with pol.backward(0, part="input"):
        dxs, work = input_pass([y], [torch.ones_like(y)], [x], [p for p in lin.parameters()])
    with pol.backward(0, part="weight"):
        weight_pass(work)
    assert dxs[0] is not None and lin.weight.grad is not None
    del y, work, dxs
    gc.collect()
    assert alive() is None
