"""Whether torchrun started this process, and its place in the job: read from the environment alone (no torch).

Its own module because both ways of starting a run ask it: ``job.launch`` (to hand a torchrun process to
``job.torchrun``) and ``job.checks`` (how many ranks share this machine's cores and GPUs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["TorchrunEnv", "torchrun_env"]


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's place in a torchrun job, or None when torchrun did not start it (``runtime.launch``'s
    workers carry some of torchrun's variables too, and PIPEOPTIM_LAUNCHED). Reads the environment only:
    no torch."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or env.get("PIPEOPTIM_LAUNCHED") == "1":
        return None
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunEnv(int(env["RANK"]), world, int(env.get("LOCAL_WORLD_SIZE", world)))
