"""runtime/scalars.py: the sum of a few numbers over every rank, the same bits on every rank, by either route."""
from __future__ import annotations

import pytest
import torch

from pipeoptim.runtime import launch

# Values whose float64 sum depends on the order of the additions: the star adds them in rank order.
VALUES = {0: [1e16, 0.5, 3.0], 1: [1.0, 0.25, -1.0], 2: [-1e16, 0.125, 2.0], 3: [1.0, 1e-3, 7.0]}


def _rank_order_sum(world: int) -> list[float]:
    total = list(VALUES[0])
    for r in range(1, world):
        total = [a + b for a, b in zip(total, VALUES[r])]
    return total


def _job(star):
    import torch.distributed as dist

    from pipeoptim.runtime.dist_env import init_from_env
    from pipeoptim.runtime.scalars import RankSum
    init_from_env("cpu")
    rank = dist.get_rank()
    summer = RankSum("cpu", star=star)
    # A pipeline receive posted ahead on the default group must not catch the scalars' messages (their own group).
    pipeline_msg = torch.zeros(3, dtype=torch.float64)
    ahead = dist.irecv(pipeline_msg, src=1) if rank == 0 else None
    totals = [summer(VALUES[rank]) for _ in range(3)]
    if rank == 1:
        dist.send(torch.tensor([4.0, 5.0, 6.0], dtype=torch.float64), dst=0)
    if ahead is not None:
        ahead.wait()
    return {"star": summer.star, "totals": totals, "pipeline_msg": pipeline_msg.tolist()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_takes_the_star_and_every_rank_gets_the_rank_order_sum_bit_for_bit(world):
    results = launch(_job, world, None, timeout_s=120)
    expected = _rank_order_sum(world)
    for r in results:
        assert r["star"] is True
        assert r["totals"] == [expected] * 3  # exact: rank 0 adds in rank order and sends its bits to all
    assert results[0]["pipeline_msg"] == [4.0, 5.0, 6.0]


def test_the_all_reduce_route_agrees_and_is_the_same_on_every_rank():
    results = launch(_job, 4, False, timeout_s=120)
    expected = _rank_order_sum(4)
    for r in results:
        assert r["star"] is False
        assert r["totals"] == results[0]["totals"]
        for total in r["totals"]:
            assert total == pytest.approx(expected, rel=1e-12, abs=4.0)  # 1e16 + 1 - 1e16: order-dependent
    assert results[0]["pipeline_msg"] == [4.0, 5.0, 6.0]


def _one_rank_job(_):
    from pipeoptim.runtime.dist_env import init_from_env
    from pipeoptim.runtime.scalars import RankSum
    init_from_env("cpu")
    return RankSum("cpu")([1.5, 2, -3.25])


def test_one_rank_returns_its_own_values_as_floats():
    assert launch(_one_rank_job, 1, None, timeout_s=60) == [[1.5, 2.0, -3.25]]
