"""Join the process group the way torchrun and the local launcher both set it up (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK), with gloo on CPU and NCCL on GPUs, and start the abort watchdog.

The TCPStore is created here (not by ``init_process_group``) so the watchdog can open a second connection
to the same store; under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) every rank is a client.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .faults import AbortWatch
from .plan import ConfigError

__all__ = ["DistContext", "init_from_env"]


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    watch: AbortWatch | None


_CONTEXT: DistContext | None = None


def init_from_env(device: str = "cpu", timeout_s: float = 300.0) -> DistContext:
    """Initialise torch.distributed from the environment once per process (later calls return the same)."""
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise ConfigError(f"distributed run without {', '.join(missing)} in the environment: start the script "
                          "with `torchrun --nproc-per-node N script.py`, use pipeoptim.runtime.launch(...), or "
                          "pass emulate=True to run every stage in this process")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' but no GPU is visible; use device='cpu' (gloo)")
        tdev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(tdev)
        backend = "nccl"
    else:
        tdev, backend = torch.device("cpu"), "gloo"
    watch = None
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(host, port, world, is_master=(rank == 0 and not agent),
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        watch = AbortWatch(host, port, world, rank,
                           error_file=os.environ.get("PIPEOPTIM_ERROR_DIR") and
                           os.path.join(os.environ["PIPEOPTIM_ERROR_DIR"], f"abort{rank}.txt")).start()
    _CONTEXT = DistContext(dist.get_rank(), dist.get_world_size(), local_rank, tdev, backend, watch)
    return _CONTEXT
