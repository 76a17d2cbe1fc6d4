"""runtime/data_parallel.py: the checks on ``dp`` and on the rank layout (each a ConfigError naming the fix, raised
before a stage is built) and each replica's share of a global batch. What dp computes is proven with 8 processes
in test_runtime_dp.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.runtime.data_parallel import check_dp, devices_per_replica, replica_rows
from pipeoptim.runtime.plan import ConfigError


@pytest.mark.parametrize("dp", [0, -1, 1.5, True, "2"])
def test_dp_must_be_a_positive_integer(dp):
    with pytest.raises(ConfigError, match="positive integer"):
        check_dp(dp, emulate=False)


def test_the_emulator_runs_one_replica_and_says_what_to_run_instead():
    with pytest.raises(ConfigError, match="emulate=True runs a single pipeline.*concatenated"):
        check_dp(2, emulate=True)
    assert check_dp(1, emulate=True) == 1 and check_dp(4, emulate=False) == 4


def test_the_world_must_hold_whole_replicas():
    assert devices_per_replica(8, 2, None) == 4 and devices_per_replica(8, 2, 4) == 4
    with pytest.raises(ConfigError, match="6 ranks cannot hold dp=4 equal pipeline replicas.*e.g. 4 for 1"):
        devices_per_replica(6, 4, None)
    with pytest.raises(ConfigError, match=r"devices=3 x dp=2 = 6 ranks, but the job has 8; start 6 ranks"):
        devices_per_replica(8, 2, 3)


def _fake_world(monkeypatch, world: int):
    """A rank of a ``world``-rank job, without processes: Pipeline must refuse the layout before any collective."""
    from pipeoptim.runtime import dist_env
    ctx = dist_env.DistContext(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"), backend="gloo",
                               watch=None)
    monkeypatch.setattr(dist_env, "init_from_env", lambda device="cpu": ctx)


@pytest.mark.parametrize("world,devices,dp,words", [
    (6, None, 4, "not a multiple of dp"),
    (8, 3, 2, "devices=3 x dp=2 = 6 ranks, but the job has 8"),
    (8, None, 0, "positive integer"),
])
def test_pipeline_refuses_a_layout_the_world_cannot_hold(monkeypatch, world, devices, dp, words):
    from pipeoptim.train import Pipeline
    _fake_world(monkeypatch, world)
    with pytest.raises(ConfigError, match=words):
        Pipeline([nn.Linear(2, 2) for _ in range(4)], loss_fn=nn.functional.mse_loss, devices=devices, dp=dp,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_pipeline_emulated_with_dp_is_refused():
    from pipeoptim.train import Pipeline
    with pytest.raises(ConfigError, match="dp=2 needs one process per device and replica"):
        Pipeline([nn.Linear(2, 2) for _ in range(2)], loss_fn=nn.functional.mse_loss, devices=2, dp=2, emulate=True,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_replica_rows_are_contiguous_equal_shares():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    assert [replica_rows((x, y), q, 3)[1].tolist() for q in range(3)] == [[0, 1], [2, 3], [4, 5]]
    (a, b), t = replica_rows(((x, x + 100), y), 1, 2)
    assert a.tolist() == x[3:].tolist() and b.tolist() == (x + 100)[3:].tolist() and t.tolist() == [3, 4, 5]
    assert replica_rows((x, y), 0, 1)[0] is not None and torch.equal(replica_rows((x, y), 0, 1)[0], x)
    with pytest.raises(ValueError, match="6 rows cannot be split into dp=4 equal shares"):
        replica_rows((x, y), 0, 4)
    with pytest.raises(ValueError, match="dp_rank 2 is not a replica of dp=2"):
        replica_rows((x, y), 2, 2)


@pytest.mark.parametrize("name", ["async-1f1b", "2bw", "bitpipe"])
def test_the_replicas_syncs_change_no_version_difference(name):
    # Pipeline(dp>1) runs the schedule with_data_parallel: the weight policies must read the same s from it
    from pipeoptim.runtime.config import make_schedule
    from pipeoptim.runtime.plan import Plan
    from pipeoptim.schedules.actions import Forward, Sync
    plain, synced = (Plan(make_schedule(name, 4, 8, data_parallel=dp)) for dp in (False, True))
    assert any(isinstance(a, Sync) and a.dp for row in synced.actions for a in row)
    forwards = [op for row in plain.actions for op in row if isinstance(op, Forward)]
    assert [plain.s_forward(op) for op in forwards] == [synced.s_forward(op) for op in forwards]
    assert plain.s_backward == synced.s_backward and plain.loss_scale == synced.loss_scale
