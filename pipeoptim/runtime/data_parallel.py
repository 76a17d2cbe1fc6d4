"""Data x pipeline parallelism (``Pipeline(dp=...)``): the rank layout, each replica's share of the data, and
what the replicas average.

A job of ``world_size = dp x devices`` ranks runs ``dp`` copies (replicas) of one pipeline of ``devices``
devices. Rank ``r`` is pipeline device ``r % devices`` of replica ``dp_rank = r // devices`` (ranks 0..devices-1
are replica 0, the next ``devices`` replica 1, ...); on one node of 8 GPUs with ``dp=2, devices=4`` a replica is
4 neighbouring GPUs. Every rank calls ``train_step`` with its replica's own batch (all ranks of a replica pass
the same one; ``replica_rows`` cuts it from a global batch), so one step trains on ``dp`` times the rows.

- The averages are actions of the schedule: ``Pipeline(dp>1)`` builds it ``with_data_parallel`` (what
  ``pipeoptim schedule NAME --data-parallel`` draws and simulates). A ``Sync`` of the replicas sums the gradient
  over them and divides by ``dp``; the executor averages at the step whatever no ``Sync`` covered (a schedule
  built with ``schedule_options=dict(data_parallel=False)``), with the same result.
- Synchronous schedules: each chunk's gradient is averaged over the replicas after its last backward (BitPipe's
  and Chimera's mirror all-reduce widens to mirror and replicas at once: a sum over the two mirror copies, a
  mean over the replicas); at the first step tied weights are summed over their copies and the global norm is
  taken. So the update is that of ONE pipeline on the replicas' batches concatenated (equal batch sizes: the
  mean loss over ``dp x B`` rows is the average of the replicas' means), clipping included
  (tests/test_runtime_dp.py).
- Asynchronous schedules: each stage's optimizer step averages that stage's gradient over the replicas at the
  same step index, i.e. the gradient of the same micro-batch index j in every replica. Replicas stay
  bit-identical, so their predictions agree; the update equals one pipeline whose micro-batch j holds every
  replica's micro-batch j. Per-stage clipping and the non-finite check see the averaged gradient.
- ``train_step`` returns the mean loss over every replica's micro-batches (the loss of the global batch), the
  same on every rank; ``last_stats['nonfinite']`` counts skipped updates once (not once per replica): a NaN in
  one replica's data reaches every replica through the average, and every replica skips that update.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["check_dp", "devices_per_replica", "replica_rows"]


def check_dp(dp, emulate: bool) -> int:
    """``dp`` as a checked count of pipeline replicas."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"dp is the number of data-parallel pipeline replicas, a positive integer; got {dp!r} "
                          "(dp=1: one pipeline)")
    if emulate and dp != 1:
        raise ConfigError(f"dp={dp} needs one process per device and replica; emulate=True runs a single pipeline "
                          "in this process. Emulate one pipeline on the replicas' batches concatenated (the same "
                          f"update for synchronous schedules), or run dp x devices processes (torchrun "
                          f"--nproc-per-node {dp} x devices, or runtime.launch)")
    return dp


def devices_per_replica(world_size: int, dp: int, devices: int | None) -> int:
    """Pipeline devices per replica for a job of ``world_size`` ranks, checked before anything is built."""
    if devices is None:
        if world_size % dp:
            raise ConfigError(f"{world_size} ranks cannot hold dp={dp} equal pipeline replicas (world size is "
                              f"not a multiple of dp); start dp x devices ranks, e.g. {dp * max(1, world_size // dp)}"
                              f" for {max(1, world_size // dp)} devices per replica")
        return world_size // dp
    if devices * dp != world_size:
        raise ConfigError(f"devices={devices} x dp={dp} = {devices * dp} ranks, but the job has {world_size}; "
                          f"start {devices * dp} ranks (torchrun --nproc-per-node {devices * dp}), or leave "
                          "devices= out (world size // dp)")
    return devices


def replica_rows(batch, dp_rank: int, dp: int):
    """Replica ``dp_rank``'s contiguous share of a global batch ``(inputs, targets)``: rows
    ``dp_rank * n .. (dp_rank + 1) * n - 1`` of its ``dp * n`` rows (inputs a tensor or a tuple of tensors)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("a batch is (inputs, targets); inputs a tensor or a tuple of tensors")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} is not a replica of dp={dp}")
    inputs, targets = batch
    rows = (inputs if isinstance(inputs, torch.Tensor) else inputs[0]).shape[0]
    if rows % dp:
        raise ValueError(f"a global batch of {rows} rows cannot be split into dp={dp} equal shares; use a multiple "
                         f"of {dp} rows (equal shares make the replicas' average the mean over the global batch)")
    n = rows // dp

    def cut(t):
        return t[dp_rank * n:(dp_rank + 1) * n] if isinstance(t, torch.Tensor) and t.dim() >= 1 else t
    inputs = cut(inputs) if isinstance(inputs, torch.Tensor) else tuple(cut(t) for t in inputs)
    return inputs, cut(targets)
