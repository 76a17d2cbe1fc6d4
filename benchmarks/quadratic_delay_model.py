"""Stability of delayed momentum on a quadratic: where asynchronous pipelines lose the sharp directions, and
which cure gets them back (issue 20). Pure Python + numpy, about half a minute of one core.

Model. One eigen-direction of a quadratic, f(w) = h·w²/2, after Adam's preconditioning (frozen: v constant, so
the direction's preconditioned curvature is x = lr·h/√v; every update is lr·m/√v). Adam-style momentum:

    m_t = β1·m_{t−1} + (1 − β1)·g_t,      w_t = w_{t−1} − lr·m_t        (lr·h folded into x: g = h·(weights read))

The gradient g_t applied at step t was computed s steps earlier, when the stage held (w_{t−1−s}, m_{t−1−s}):

    sync        g_t = h·w_{t−1}                                   (s = 0)
    stash       g_t = h·w_{t−1−s}                                 (PipeDream: forward and backward on old weights)
    pipeoptim   g_t = h·ŵ,  ŵ = w_{t−1−s} − s·lr·m_{t−1−s}         (prediction: the next s updates = the last Δ)
    damped      ŵ = w_{t−1−s} − γ·s·lr·m_{t−1−s}                   (prediction scaled by γ)
    dc-stash    g_t = h·w_{t−1−s} + c·h·(w_{t−1} − w_{t−1−s})      (DC-ASGD: first-order correction of the stale
                                                                  gradient to today's weights, curvature estimate
                                                                  c·h; DC-ASGD's λ·g⊙g, or Adam's v, estimates h)
    dc-pipeoptim g_t = h·ŵ + c·h·(w_{t−1} − ŵ)                      (the same correction on PipeOptim's gradient)

The recurrence is linear in the state (the last s+1 values of w and m), so stability is the spectral radius of
its matrix being < 1. "Stable up to x*" is the largest x* with every x in (0, x*] stable. A step's gradient on
stage k of D under async 1F1B is s = D − k − 1 updates old: the first stages of a 16-stage pipeline see s up to 15.

    python benchmarks/quadratic_delay_model.py                  # prints the tables of quadratic_delay_model.md
"""
from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

Rule = Callable[[list, list, float, int], float]   # (w history newest first, m history, x, s) -> h·(weights read)


def _sync(w, m, x, s):
    return x * w[0]


def _stash(w, m, x, s):
    return x * w[s]


def _pipeoptim(gamma: float = 1.0) -> Rule:
    def rule(w, m, x, s):
        return x * (w[s] - gamma * s * m[s])
    return rule


def _dc(base: Rule, c: float) -> Rule:
    """DC-ASGD's correction on `base`: + c·h·(w_now − weights the base gradient read)."""
    def rule(w, m, x, s):
        g = base(w, m, x, s)
        read = g / x
        return g + c * x * (w[0] - read)
    return rule


def transition(rule: Rule, x: float, s: int, beta1: float) -> np.ndarray:
    """The matrix of one step on the state (w_{t−1..t−1−s}, m_{t−1..t−1−s}) (lr·h folded into x, lr = 1)."""
    n = s + 1
    A = np.zeros((2 * n, 2 * n))
    for j in range(2 * n):
        e = np.zeros(2 * n)
        e[j] = 1.0
        w, m = list(e[:n]), list(e[n:])
        g = rule(w, m, x, s)
        m_new = beta1 * m[0] + (1 - beta1) * g
        w_new = w[0] - m_new
        A[:, j] = np.array([w_new] + w[:-1] + [m_new] + m[:-1])
    return A


def spectral_radius(rule: Rule, x: float, s: int, beta1: float) -> float:
    return float(max(abs(np.linalg.eigvals(transition(rule, x, s, beta1)))))


def stability_limit(rule: Rule, s: int, beta1: float, lo: float = 1e-4, hi: float = 1e3) -> float:
    """Largest x* such that every x in (lo, x*] is stable (a log scan, then bisection at the first failure)."""
    grid = np.geomspace(lo, hi, 2000)
    prev = lo
    for x in grid:
        if spectral_radius(rule, x, s, beta1) >= 1.0:
            a, b = prev, x
            for _ in range(60):
                mid = 0.5 * (a + b)
                if spectral_radius(rule, mid, s, beta1) >= 1.0:
                    b = mid
                else:
                    a = mid
            return a
        prev = x
    return hi


METHODS: dict[str, Rule] = {
    "sync": _sync,
    "stash": _stash,
    "pipeoptim": _pipeoptim(1.0),
    "pipeoptim γ=0.5": _pipeoptim(0.5),
    "pipeoptim γ=1.5": _pipeoptim(1.5),
    "dc-stash c=1": _dc(_stash, 1.0),
    "dc-stash c=0.5": _dc(_stash, 0.5),
    "dc-stash c=2": _dc(_stash, 2.0),
    "dc-pipeoptim c=0.5": _dc(_pipeoptim(1.0), 0.5),
    "dc-pipeoptim c=1": _dc(_pipeoptim(1.0), 1.0),
}


def table(methods: list[str], delays: list[int], beta1: float) -> str:
    head = "| method | " + " | ".join(f"s = {s}" for s in delays) + " |"
    rows = [head, "|---|" + "---|" * len(delays)]
    for name in methods:
        rule = METHODS[name]
        cells = []
        for s in delays:
            if name == "sync" and s:
                cells.append("—")
                continue
            cells.append(f"{stability_limit(rule, s, beta1):.3g}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def rate_table(methods: list[str], s: int, beta1: float, xs: list[float]) -> str:
    """Spectral radius (per-step contraction; lower is faster, ≥ 1 diverges) at a few curvatures."""
    rows = ["| method | " + " | ".join(f"x = {x:g}" for x in xs) + " |", "|---|" + "---|" * len(xs)]
    for name in methods:
        rows.append(f"| {name} | " + " | ".join(f"{spectral_radius(METHODS[name], x, s, beta1):.4f}" for x in xs)
                    + " |")
    return "\n".join(rows)


def c_sweep_table(cs: list[float], delays: list[int], beta1: float) -> str:
    """Stability limits of the DC corrections when the curvature estimate is c times the truth."""
    head = ("| c | " + " | ".join(f"dc-stash s = {s}" for s in delays) + " | "
            + " | ".join(f"dc-pipeoptim s = {s}" for s in delays) + " |")
    rows = [head, "|---|" + "---|" * (2 * len(delays))]
    for c in cs:
        cells = [stability_limit(_dc(_stash, c), s, beta1) for s in delays]
        cells += [stability_limit(_dc(_pipeoptim(1.0), c), s, beta1) for s in delays]
        rows.append(f"| {c:g} | " + " | ".join(f"{v:.3g}" for v in cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2, 3, 7, 15])
    p.add_argument("--beta1", type=float, nargs="+", default=[0.9, 0.99])
    args = p.parse_args(argv)
    for beta1 in args.beta1:
        print(f"\n### Stability limit x* of lr·(preconditioned curvature), β1 = {beta1}\n")
        print(table(list(METHODS), args.delays, beta1))
    print("\n### Contraction per step (spectral radius) at s = 3, β1 = 0.9\n")
    print(rate_table(["sync", "stash", "pipeoptim", "dc-stash c=1", "dc-stash c=0.5", "dc-pipeoptim c=0.5"], 3, 0.9,
                     [0.01, 0.1, 0.5, 1.0, 2.0]))
    print("\n### The DC corrections with a curvature estimate c·h, β1 = 0.9 (stability limit x*)\n")
    print(c_sweep_table([0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 6.0], [1, 3, 15], 0.9))


if __name__ == "__main__":
    main()
