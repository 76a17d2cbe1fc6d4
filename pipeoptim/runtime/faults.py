"""How a job ends when something goes wrong: one reason, published once, read by every process of the job.

A gloo or NCCL wait cannot be cancelled, so a rank whose peer died or froze may block for ever. Every process
of a job therefore shares one key in the rendezvous store, ``ABORT_KEY``: the first process that knows why
the job must end (a rank that raised, a rank's watchdog that found the job stuck, the launcher that saw a
rank killed by a signal or was itself interrupted) writes the reason there, and the first writer wins. Each
rank's watchdog (``watchdog``) polls the key and ends its process with ``ABORT_EXIT`` once it is set; the
reason, not a secondary symptom such as a closed connection, is what the user reads.

This module holds that protocol and the words for what happened to a process: exit codes and the signals
that kill processes without a Python exception (the out-of-memory killer's SIGKILL above all).
"""
from __future__ import annotations

import signal

__all__ = ["ABORT_KEY", "FAILED_EXIT", "ABORT_EXIT", "STALL_EXIT", "ORPHAN_EXIT", "publish", "published",
           "describe_exit", "signal_name", "killed_message", "is_connection_loss"]

ABORT_KEY = "pipeoptim/abort"
FAILED_EXIT = 1  # this rank raised; its error is the published reason or came after it
ABORT_EXIT = 3   # this rank stopped because the job ended for a reason published by another process
STALL_EXIT = 4   # this rank's watchdog found the job making no progress and published why
ORPHAN_EXIT = 5  # this rank's torchrun agent (its parent) is gone: the rank ended itself and published why

_HINTS = {
    signal.SIGKILL: "the kernel's out-of-memory killer sends SIGKILL (check `dmesg` or the job's memory), as do "
                    "`kill -9` and schedulers that end a job past its limits",
    signal.SIGSEGV: "a crash in native code (a CUDA or C++ extension, or a corrupted install)",
    signal.SIGBUS: "a bus error: often /dev/shm or a memory-mapped file ran out of space",
    signal.SIGABRT: "native code aborted (a failed assertion in C++ or CUDA, or NCCL's watchdog)",
    signal.SIGTERM: "something asked it to stop (a scheduler, `kill`, or a launcher ending the job)",
    signal.SIGINT: "an interrupt (Ctrl-C)",
}


def publish(store, message: str) -> tuple[bool, str]:
    """Write ``message`` as the job's reason to end unless one is there; returns (ours won, the reason)."""
    current = store.compare_set(ABORT_KEY, "", message).decode(errors="replace")
    return current == message, current


def published(store) -> str | None:
    """The job's reason to end, or None while it runs normally."""
    if not store.check([ABORT_KEY]):
        return None
    return store.get(ABORT_KEY).decode(errors="replace")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None) -> str:
    """What a worker's exit code says happened to it (a negative code: killed by that signal)."""
    if code is None:
        return "still running"
    if code == 0:
        return "finished"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return {FAILED_EXIT: "raised an error", ABORT_EXIT: "stopped after another process ended the job",
            STALL_EXIT: "its watchdog found the job stuck",
            ORPHAN_EXIT: "its torchrun agent was gone, so it ended itself"}.get(code, f"exited with status {code}")


def killed_message(rank: int, pid: int, signum: int, world_size: int) -> str:
    """The reason published for a rank that a signal killed (it could not say anything itself)."""
    hint = _HINTS.get(signum)
    text = f"rank {rank} of {world_size} (pid {pid}) was killed by {signal_name(signum)} (signal {signum})"
    return f"{text}: {hint}" if hint else text


_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
         "socket closed", "remote process exited", "transport endpoint is not connected", "ncclremoteerror",
         "recvbytes", "read error")


def is_connection_loss(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer's connection went away: a symptom of that peer's death, not a cause."""
    text = str(exc).lower()
    return any(s in text for s in _LOST)
