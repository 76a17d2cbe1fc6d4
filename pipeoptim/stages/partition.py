"""Cut a list of layers into contiguous pipeline stages: by layer count, or by profiled time.

A pipeline runs at the pace of its slowest stage, so the cut that matters minimises the largest stage
cost. ``balance_by_time`` measures each layer's forward+backward on a sample input and solves that
min-max partition exactly (dynamic programming over contiguous cuts); ``balance_by_layers`` splits counts
as evenly as possible. Both return a balance: the number of layers per stage.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:   # torch is imported where layers are profiled: the counting rules serve the CLI without it
    from torch import nn

__all__ = ["balance_by_layers", "balance_by_time", "balance_by_cost", "profile_layers", "check_balance"]


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    from ..errors import ConfigError
    balance = list(balance)
    even = balance_by_layers(num_layers, num_stages) if num_layers >= num_stages else None
    fix = f" (e.g. balance={even}, or leave balance out for that even split)" if even else ""
    if len(balance) != num_stages:
        raise ConfigError(f"balance {balance} has {len(balance)} entries but the schedule has {num_stages} stages; "
                          f"give one layer count per stage{fix}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ConfigError(f"balance {balance}: every stage needs at least one layer{fix}")
    if sum(balance) != num_layers:
        raise ConfigError(f"balance {balance} covers {sum(balance)} layers but the model has {num_layers}: the "
                          f"counts must add up to {num_layers}{fix}")
    return balance


def balance_by_layers(num_layers: int, num_stages: int) -> list[int]:
    from ..errors import ConfigError
    if num_stages > num_layers:
        raise ConfigError(f"{num_stages} stages but only {num_layers} layers: each stage needs a layer; use at "
                          f"most {num_layers} stages (or fewer devices), or split the model into more layers")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i >= num_stages - extra else 0) for i in range(num_stages)]


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous partition of ``costs`` into ``num_stages`` parts minimising the largest part."""
    n = len(costs)
    balance_by_layers(n, num_stages)  # same rule: one layer at least per stage
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    out, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        out.append(i - j)
        i = j
    return out[::-1]


def _as_tensors(y, i: int) -> tuple:
    import torch
    if isinstance(y, torch.Tensor):
        return (y,)
    if isinstance(y, (tuple, list)) and y and all(isinstance(t, torch.Tensor) for t in y):
        return tuple(y)
    raise TypeError(f"layer {i} returned {type(y).__name__}; a pipeline layer must return a tensor or a tuple of "
                    "tensors")


def _sync(xs) -> None:
    if any(t.is_cuda for t in xs):
        import torch
        torch.cuda.synchronize()


def profile_layers(layers: Sequence[nn.Module], sample, repeats: int = 3, prepare=None) -> list[float]:
    """Seconds of forward+backward per layer on ``sample`` (the first layer's input: a tensor or a tuple of
    tensors; a layer returning a tuple feeds the next one's arguments), best of ``repeats``.

    ``prepare(index, layer)`` returns the module to time in the layer's place (e.g. a temporary real copy of
    a meta-built layer, so a large model is profiled one layer at a time)."""
    import torch
    costs = []
    xs = _as_tensors(sample, -1) if not isinstance(sample, torch.Tensor) else (sample,)
    for i, layer in enumerate(layers):
        run = prepare(i, layer) if prepare is not None else layer
        best = float("inf")
        for _ in range(repeats):
            inp = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in xs)
            _sync(inp)
            t0 = time.perf_counter()
            ys = _as_tensors(run(*inp), i)
            grads = [y.float().sum() for y in ys if y.requires_grad]
            if grads:
                torch.stack(grads).sum().backward()
            _sync(ys)
            best = min(best, time.perf_counter() - t0)
        run.zero_grad(set_to_none=True)
        del run
        costs.append(best)
        xs = tuple(y.detach() for y in ys)
    return costs


def balance_by_time(layers: Sequence[nn.Module], sample, num_stages: int, repeats: int = 3,
                    prepare=None) -> list[int]:
    return balance_by_cost(profile_layers(layers, sample, repeats, prepare), num_stages)
