"""The pipeline runtime: run a schedule's action lists on real processes or in one process.

    plan.Plan          what the executors derive from a schedule (s per forward, channels, loss scale)
    microbatches       a batch checked and split into the micro-batches a schedule runs
    worker             one device's chunks and what each compute/step action does to them
    grad_norm          the squared gradient norm in one accurate pass per buffer
    executor           one process per device on torch.distributed (gloo on CPU, NCCL on GPU)
    emulator           every device in one process, same numbers: the oracle and the fast path
    comm               point-to-point messages with shape headers, in a deadlock-free order
    faults             the job's one reason to end (first writer wins); exit codes and signals in words
    watchdog           per rank: ends it when the job ended elsewhere; names the rank holding a stuck job up
    launcher           local N-process launcher: hosts the store, names a rank killed by a signal, SIGINT/TERM
    rendezvous         the store's server on one address (loopback for a job on one machine)
    config             names -> checked configuration, before any process starts
    checkpoint         state keyed by global parameter names
    checkpoint_files   atomic files, a manifest with hashes as the commit, the newest intact one, keep K

Names are imported lazily so that ``pipeoptim --help`` does not load torch.distributed.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Plan": "plan", "ConfigError": "plan", "PipelineError": "plan",
    "DeviceWorker": "worker", "StageRuntime": "worker", "Executor": "executor", "Emulator": "emulator",
    "launch": "launcher", "JobInterrupted": "launcher", "make_schedule": "config", "check_policy": "config",
    "SCHEDULES": "config", "CheckpointError": "checkpoint_files",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
