"""Join the process group the way torchrun and the local launcher both set it up (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK), with gloo on CPU and NCCL on GPUs, and start the rank's watchdog.

The TCPStore is created here (not by ``init_process_group``) so the watchdog can open a second connection
to the same store. Under torchrun's agent store and under ``runtime.launch`` (both set
TORCHELASTIC_USE_AGENT_STORE=True) the store lives in the launching process and every rank is a client, so
the store outlives any rank; otherwise rank 0 hosts it (``rendezvous.serve``: on loopback only when
MASTER_ADDR is a loopback address, else on every interface, since ranks on other machines must reach it).

The watchdog starts before the rendezvous, busy with it as with a collective: a rank that never arrives
(frozen or stuck before it joins) is named within the same bound as a step, not after the process group's
30-minute timeout.

Under torchrun the watchdog also watches the node's agent (this process's parent): an agent killed outright
leaves its workers running as orphans that nobody reports or stops, so they end themselves, publishing why
(``watchdog``), and the other nodes' ranks stop with that reason.

The process group's own timeout (gloo's and NCCL's) is a backstop set well above the watchdog's: the
watchdog ends a stuck job first, with a message naming the rank that holds it up.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import rendezvous
from ..errors import ConfigError, PipelineError
from .watchdog import COLLECTIVE, DEFAULT_TIMEOUT_S, Watchdog

__all__ = ["DistContext", "init_from_env", "current_watch", "watchdog_timeout_from_env", "torchrun_agent"]

WATCHDOG_ENV = "PIPEOPTIM_WATCHDOG_S"
PG_TIMEOUT_S = 1800.0


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    watch: Watchdog | None


_CONTEXT: DistContext | None = None
_WATCH: Watchdog | None = None
RENDEZVOUS = "the rendezvous (joining the process group)"


def watchdog_timeout_from_env() -> float | None:
    text = os.environ.get(WATCHDOG_ENV)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{WATCHDOG_ENV}={text!r} is not a positive number of seconds; set it to e.g. 600, or "
                          "unset it for the default (max(300 s, 20 x the slowest step))")
    return value


def torchrun_agent() -> tuple[int, str | None] | None:
    """(pid, node rank) of the torchrun agent that started this process, or None when torchrun did not
    (``runtime.launch``'s workers die with their launcher already). The parent counts as the agent only when
    it is one (torch names its process ``pt_elastic``, or its command line runs torchrun): a process started
    through a wrapper that exits early must not take its wrapper's end for its agent's."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("PIPEOPTIM_LAUNCHED") == "1":
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:  # no /proc (not Linux), or the parent is gone already
        return None
    if comm != "pt_elastic" and not _runs_torchrun(argv):
        return None
    return parent, os.environ.get("GROUP_RANK")


def _runs_torchrun(argv: list[str]) -> bool:
    """Whether a command line is torchrun's: ``torchrun ...``, ``python .../torchrun ...`` or ``python -m
    torch.distributed.run ...`` (not any command that merely mentions it, such as a test file's name)."""
    names = [os.path.basename(a) for a in argv[:2]]
    if "torchrun" in names:
        return True
    return any(a == "-m" and b == "torch.distributed.run" for a, b in zip(argv, argv[1:]))


def _abort_communicators() -> None:
    """NCCL kernels may still wait on a peer when the watchdog ends the process: abort the communicators
    first so the exit does not wait for them (gloo has nothing to abort)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()


def current_watch() -> Watchdog | None:
    """This rank's watchdog, once it runs (from the start of the rendezvous on), else None."""
    return _WATCH


def _start_watchdog(host: str, port: int, rank: int, world: int, watchdog_s: float | None,
                    agent: bool) -> Watchdog:
    """The watchdog's own connection to the store, and the watchdog: started before the rendezvous, so that
    a rank that never arrives is named. The store is the launcher's or torchrun's agent's (already up), or
    rank 0's: a rank waits for that one as long as the watchdog would wait for a step (at least 60 s, the
    timeout of the watchdog's store operations). The watchdog starts busy with the rendezvous (``RENDEZVOUS``),
    as with a collective: a rank that never arrives is named within the same bound as a step."""
    global _WATCH
    bound = max(60.0, watchdog_s if watchdog_s is not None else DEFAULT_TIMEOUT_S)
    try:
        watch_store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=bound),
                                    wait_for_workers=False)
    except RuntimeError as e:  # torch's DistStoreError included
        host_of = ("the launcher (pipeoptim.runtime.launch or torchrun) hosts it: it has ended" if agent else
                   "rank 0 hosts it (no torchrun, no launcher): rank 0 never arrived")
        raise PipelineError(f"rank {rank}: the rendezvous store at {host}:{port} did not answer within {bound:.0f} s "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {host_of}, or "
                            "MASTER_ADDR/MASTER_PORT do not name it") from None
    agent_pid, node = torchrun_agent() or (None, None)
    _WATCH = Watchdog(rendezvous.attempt_keys(watch_store), rank, world, timeout_s=watchdog_s,
                      quiet=os.environ.get("PIPEOPTIM_LAUNCHED") == "1", before_exit=_abort_communicators,
                      agent_pid=agent_pid, node=node)
    _WATCH.doing(RENDEZVOUS, COLLECTIVE)
    _WATCH.start()
    atexit.register(_WATCH.stop)  # a rank that finished says so (peers that still wait will name it)
    return _WATCH


def init_from_env(device: str = "cpu", timeout_s: float | None = None) -> DistContext:
    """Initialise torch.distributed from the environment once per process (later calls return the same).
    ``timeout_s``: the process group's timeout (default 30 min, and at least twice the watchdog's)."""
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise ConfigError(f"distributed run without {', '.join(missing)} in the environment: start the script "
                          "with `torchrun --nproc-per-node N script.py`, use pipeoptim.runtime.launch(...), or "
                          "pass emulate=True to run every stage in this process")
    watchdog_s = watchdog_timeout_from_env()
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
        if timeout_s is None:
            timeout_s = max(PG_TIMEOUT_S, 2 * (watchdog_s or 0))
        hosted = rendezvous.serve(host, port, world, timeout_s) if rank == 0 and not agent else None
        watch = _start_watchdog(host, port, rank, world, watchdog_s, agent)
        try:
            store = hosted if hosted is not None else dist.TCPStore(
                host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
            dist.init_process_group(backend, store=rendezvous.attempt_keys(store), rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        finally:
            watch.idle()
    _CONTEXT = DistContext(dist.get_rank(), dist.get_world_size(), local_rank, tdev, backend, watch)
    return _CONTEXT
