"""The batches one rank of ``pipeoptim train`` feeds its pipeline, and how their order is kept in a checkpoint.

Only a rank holding the first stage reads inputs and only one holding the last stage reads targets (with data
parallelism: each replica's); every other rank passes ``Pipeline.train_step`` a batch of the right shape whose
values no stage reads (``runtime.worker``: stage 0 reads the inputs, the last stage the targets), so it opens no
data at all (``for_rank``). Rank 0 always reads: it writes the checkpoint's ``extra``, this module's ``state()``.

- ``ShardBatches``: a folder of ``pipeoptim prepare-data`` (``token_shards``): each window read by index, each
  replica reading only its own rows; the order is a counter-based sampler whose position (one per window)
  and the data's hash go in the checkpoint.
- ``TextBatches``: plain text, tokenized in memory when the run starts (``pipeoptim.data``); the order is a
  ``torch.Generator`` whose state goes in the checkpoint (``extra["gen"]``); every reading rank draws the whole
  global batch and keeps its replica's rows.
- ``ShapeOnly``: the batch shape, zeros, for the ranks in between.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..runtime.data_parallel import replica_rows
from .token_shards import TokenShards, WindowSampler, read_windows

VAL_SEED = 1234  # the fixed held-out batch


def reads_data(pipe, rank: int) -> bool:
    """Whether this rank holds the first or the last stage (or is rank 0, which records the data order)."""
    held = {chunk.stage for w in pipe.workers for chunk in w.stages}
    return rank == 0 or 0 in held or pipe.schedule.num_stages - 1 in held


def for_rank(pipe, rank: int, corpus: Callable[[], object], *, seq_len: int, seed: int, dp: int = 1,
             shards: str | None = None):
    """The batch source of this rank: windows of ``seq_len`` tokens from the folder of ``pipeoptim prepare-data``
    ``shards``, or else from ``corpus()`` (the in-memory text), called only where it is read."""
    q = pipe.dp_rank
    if not reads_data(pipe, rank):
        return ShapeOnly(seq_len, dp)
    if shards:
        return ShardBatches(shards, seed, seq_len, q, dp)
    return TextBatches(corpus(), seed, seq_len, q, dp)


class ShardBatches:
    def __init__(self, folder: str, seed: int, seq_len: int, dp_rank: int, dp: int):
        self.shards = TokenShards(folder)
        self.sampler = WindowSampler(seed)
        self.seq_len, self.dp_rank, self.dp = seq_len, dp_rank, dp

    def _batch(self, split: str, rows: int, sampler: WindowSampler, position: int):
        starts = sampler.starts(split, self.shards.tokens(split), rows, self.seq_len, position)
        n = rows // self.dp
        windows = torch.from_numpy(read_windows(self.shards, split, starts[self.dp_rank * n:(self.dp_rank + 1) * n],
                                                self.seq_len))
        return windows[:, :-1], windows[:, 1:]

    def train(self, rows: int):
        """This replica's rows of the next global batch of ``rows`` windows."""
        batch = self._batch("train", rows, self.sampler, self.sampler.position)
        self.sampler.position += 1
        return batch

    def val(self, rows: int):
        return self._batch("val", rows, WindowSampler(VAL_SEED), 0)

    def state(self) -> dict:
        return {"sampler": {**self.sampler.state(), "data_sha256": self.shards.data_sha256}}

    def restore(self, extra: dict, step: int) -> None:
        """Continue at the checkpoint's position (a checkpoint of a plain-text run holds none: its step)."""
        saved = extra.get("sampler")
        self.sampler.position = int(saved["position"]) if saved else step


class TextBatches:
    def __init__(self, corpus, seed: int, seq_len: int, dp_rank: int, dp: int):
        self.corpus, self.seq_len, self.dp_rank, self.dp = corpus, seq_len, dp_rank, dp
        self.gen = torch.Generator().manual_seed(seed)

    def train(self, rows: int):
        """The global batch of ``rows`` drawn with the run's one generator state, this replica's share kept."""
        return replica_rows(self.corpus.batch("train", rows, self.seq_len, self.gen), self.dp_rank, self.dp)

    def val(self, rows: int):
        return replica_rows(self.corpus.batch("val", rows, self.seq_len, torch.Generator().manual_seed(VAL_SEED)),
                            self.dp_rank, self.dp)

    def state(self) -> dict:
        return {"gen": self.gen.get_state()}

    def restore(self, extra: dict, step: int) -> None:
        if "gen" in extra:  # a checkpoint of a prepared-data run holds a sampler position instead: fresh order
            self.gen.set_state(extra["gen"])


class ShapeOnly:
    """A batch of the right shape whose values nothing reads (a middle stage's inputs arrive from its neighbour)."""

    def __init__(self, seq_len: int, dp: int):
        self.seq_len, self.dp = seq_len, dp

    def _zeros(self, rows: int):
        z = torch.zeros(rows // self.dp, self.seq_len, dtype=torch.long)
        return z, z

    def train(self, rows: int):
        return self._zeros(rows)

    def val(self, rows: int):
        return self._zeros(rows)

    def state(self) -> dict:
        return {}

    def restore(self, extra: dict, step: int) -> None:
        pass


__all__ = ["reads_data", "for_rank", "ShardBatches", "TextBatches", "ShapeOnly", "VAL_SEED"]
