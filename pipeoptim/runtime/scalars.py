"""Summing a few numbers over every rank of a job, with the same total, bit for bit, on every rank.

Each iteration ends with a handful of scalars every rank must agree on (``Executor._reduce_scalars``: the squared
gradient norm, the losses, the times, the skipped updates, the requests to stop). On NCCL that is one all-reduce of
a tensor on the rank's GPU. On gloo an all-reduce runs on the process group's worker thread as a ring of 2 (P - 1)
hops, and with more processes than cores each hop waits for a process to be scheduled: 3.8 ms median on 4 processes
sharing a 2-core Xeon, a tenth of the tiny model's pipelined step in ``bench_runtime_peer.py``. Gloo's
point-to-point messages are sent from the calling thread, so there rank 0 gathers the numbers (one message from each
rank), adds them in rank order and sends the total back: two hops, 0.57 ms on the same processes
(``benchmarks/probe_scalar_allreduce.py`` measures both; ``benchmarks/results/probe_scalar_allreduce_cpu.txt``).
The messages travel in a process group of their own, so they never meet the pipeline's receives posted ahead
on the default group. Above ``STAR_MAX_RANKS`` ranks gloo's all-reduce is used again: rank 0 handles 2 (P - 1)
messages in the star, and somewhere past a few dozen ranks that must cost more than the ring (an assumed
bound: only 2 to 4 ranks were measured here).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RankSum", "STAR_MAX_RANKS"]

STAR_MAX_RANKS = 64


class RankSum:
    """``RankSum(device)(values)``: the element-wise sum of ``values`` (a list of floats, the same length on
    every rank) over all ranks of the default process group, as float64. Create it on every rank, in the same
    order as the job's other groups (it may create one)."""

    def __init__(self, device: torch.device | str = "cpu", *, star: bool | None = None):
        self.device = torch.device(device)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if star is None:
            star = dist.get_backend() == "gloo" and self.world <= STAR_MAX_RANKS
        self.star = star and self.world > 1
        self.group = dist.new_group(list(range(self.world))) if self.star else None

    def __call__(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return [float(v) for v in values]
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        if not self.star:
            dist.all_reduce(mine)
            return mine.tolist()
        if self.rank != 0:
            total = torch.empty_like(mine)
            sent = dist.isend(mine, dst=0, group=self.group)
            dist.irecv(total, src=0, group=self.group).wait()
            sent.wait()
            return total.tolist()
        parts = [torch.empty_like(mine) for _ in range(self.world - 1)]
        works = [dist.irecv(p, src=r, group=self.group) for r, p in enumerate(parts, start=1)]
        for w in works:
            w.wait()
        for p in parts:  # rank order, so the total does not depend on who arrived first
            mine += p
        works = [dist.isend(mine, dst=r, group=self.group) for r in range(1, self.world)]
        for w in works:
            w.wait()
        return mine.tolist()
