"""Regression tests for runtime failures that used to (or could) hang: one rank raising must end every rank
quickly with that rank's error, named by rank, stage and action."""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from pipeoptim.runtime import PipelineError, launch


class Boom(nn.Module):
    """Identity that raises on its ``at``-th call on rank ``rank``."""

    def __init__(self, rank: int, at: int):
        super().__init__()
        self.rank, self.at, self.calls = rank, at, 0
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.calls += 1
        if int(os.environ["RANK"]) == self.rank and self.calls == self.at:
            raise RuntimeError("injected failure")
        return self.lin(x)


def _job(fail_rank: int):
    from pipeoptim.train import Pipeline
    layers = [Boom(fail_rank, 3) for _ in range(4)]
    p = Pipeline(layers, loss_fn=lambda y, t: (y - t).pow(2).mean(), schedule="1f1b", microbatches=4,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    for _ in range(3):
        p.train_step((torch.randn(8, 4), torch.randn(8, 4)))
    return "finished"


@pytest.mark.parametrize("fail_rank", [1, 3])
def test_one_rank_raising_ends_all_ranks_quickly(fail_rank):
    t0 = time.monotonic()
    # grace_s is long: the other ranks must stop on their own (abort watchdog), not be killed by the launcher
    with pytest.raises(PipelineError) as info:
        launch(_job, 4, fail_rank, grace_s=60, timeout_s=90)
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert f"rank {fail_rank}" in text and f"stage {fail_rank}" in text and "injected failure" in text
    assert "action F2s" in text
    assert elapsed < 30, f"ranks took {elapsed:.0f} s to stop"


def _shape_job():
    from pipeoptim.train import Pipeline

    class Narrow(nn.Module):
        def forward(self, x):
            return x[:, :3]  # the next stage expects width 4

    p = Pipeline([nn.Linear(4, 4), Narrow(), nn.Linear(4, 4)], balance=[2, 1],
                 loss_fn=lambda y, t: (y - t).pow(2).mean(), schedule="gpipe", microbatches=2,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    p.train_step((torch.randn(4, 4), torch.randn(4, 4)))


def test_shape_mismatch_across_a_boundary_is_an_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"rank 1 .*stage 1, action F0s1.*shapes cannot be multiplied"):
        launch(_shape_job, 2, grace_s=60, timeout_s=90)
    assert time.monotonic() - t0 < 30


def test_update_every_is_stable_across_calls():
    """Plan.update_every used to pop from its cached set: the second call for a chunk returned 1, so the
    emulator (which asks once per chunk, then again for the loss scale) scaled 2BW's loss by 1 instead of 1/m."""
    from pipeoptim.runtime.config import make_schedule
    from pipeoptim.runtime.plan import Plan
    from pipeoptim.schedules.actions import Chunk
    plan = Plan(make_schedule("2bw", 4, 8))
    assert [plan.update_every(Chunk(0, 0)) for _ in range(3)] == [4, 4, 4]
    assert plan.loss_scale == 0.25


def test_train_config_from_the_pipeoptim_command_is_picklable():
    """`pipeoptim train` failed to start its workers: the argparse namespace carried cli.py's lazy run
    function (unpicklable) into the config sent to the spawned processes."""
    import pickle

    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config
    args = build_parser().parse_args(["train", "--steps", "1"])
    pickle.dumps(_config(args))


def test_spectrain_forward_predicts_past_the_backward(monkeypatch):
    """SpecTrain's forward on stage k predicts ⌊k/2⌋ + D−k−1 steps ahead (DESIGN.md §3): the schedule's s
    plus the backward's look-ahead. The runtime used to give it the schedule's s alone (stage 2 of 4 got 1,
    not 2)."""
    from pipeoptim.policies import SpecTrainPolicy
    from pipeoptim.train import Pipeline

    seen: dict[int, set] = {}
    original = SpecTrainPolicy._forward_weights

    def spy(self, mb, s):
        seen.setdefault(id(self), set()).add(s)
        return original(self, mb, s)

    monkeypatch.setattr(SpecTrainPolicy, "_forward_weights", spy)
    pipe = Pipeline([nn.Linear(4, 4) for _ in range(4)], loss_fn=lambda y, t: (y - t).pow(2).mean(),
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), devices=4,
                    schedule="async-1f1b", policy="spectrain", microbatches=12, emulate=True)
    pipe.train_step((torch.randn(48, 4), torch.randn(48, 4)))
    steady = {}
    for w in pipe.workers:
        for chunk, st in w.stages.items():
            steady[chunk.stage] = max(seen[id(st.policy)])
    assert steady == {k: k // 2 + 4 - k - 1 for k in range(4)}
