"""Shared by the tests of models nobody here wrote (Hugging Face, torchvision) and of meta-built pipelines:
a gradient recorder that sees what each stage's optimizer steps on, and the unsplit model's reference on the
same micro-batches. Module-level, so spawned ranks can import it."""
from __future__ import annotations

import torch


class GradRecorder:
    """Optimizer factory that records every parameter's gradient just before each step, by parameter object;
    ``by_name(pipe)`` maps them to the pipeline's global names."""

    def __init__(self, lr: float = 0.0, momentum: float = 0.0):
        self.lr, self.momentum = lr, momentum
        self.grads: dict[int, torch.Tensor] = {}

    def __call__(self, params):
        opt = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

        def record(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    self.grads[id(p)] = p.grad.detach().clone()
        opt.register_step_pre_hook(record)
        return opt

    def by_name(self, pipe) -> dict[str, torch.Tensor]:
        return {name: self.grads[id(p)] for name, p in pipe.named_parameters().items() if id(p) in self.grads}


def reference_grads(model, loss_of, micro_batches) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean loss over the micro-batches and the gradients of that mean, by the model's parameter names
    (a parameter shared under two names appears under both)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in micro_batches:
        loss = loss_of(model, mb) / len(micro_batches)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return total, grads


def assert_grads_match(got: dict, want: dict, names: dict, rtol=1e-4, atol=1e-6) -> None:
    """``names``: pipeline global name -> model name; every pipeline parameter must be covered."""
    assert set(got) == set(names), sorted(set(got) ^ set(names))[:6]
    for g, m in names.items():
        torch.testing.assert_close(got[g], want[m], rtol=rtol, atol=atol, msg=lambda s: f"{g} ({m}): {s}")
