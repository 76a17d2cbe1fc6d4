"""The job tests/test_multinode.py runs under torchrun (one or two agents): a 4-stage ``Pipeline`` of a tiny
seeded model trains ``STEPS`` steps; rank 0 writes every step's loss to OUT (one ``repr`` per line, so the
floats compare exactly). With ``--then-wait`` every rank goes on training after that, until the test kills
something (or ``--max-s`` passes: a job nobody stops still ends).

    torchrun ... tests/multinode_job.py OUT [--then-wait] [--max-s S]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

STEPS = 3


def tiny_pipeline(**kw):
    from pipeoptim.train import Pipeline
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    return Pipeline(layers, loss_fn=lambda y, t: (y - t).pow(2).mean(), schedule="1f1b", microbatches=4,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), **kw)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--then-wait", action="store_true")
    p.add_argument("--max-s", type=float, default=120.0)
    args = p.parse_args(argv)
    pipe = tiny_pipeline()
    losses = [pipe.train_step(batch(step)) for step in range(STEPS)]
    if int(os.environ["RANK"]) == 0:
        with open(args.out + ".tmp", "w") as f:
            f.write("".join(f"{loss!r}\n" for loss in losses))
        os.replace(args.out + ".tmp", args.out)  # the test sees the whole file or none
    t0, step = time.monotonic(), STEPS
    while args.then_wait and time.monotonic() - t0 < args.max_s:
        pipe.train_step(batch(step))
        step += 1
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
