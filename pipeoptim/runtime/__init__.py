"""The pipeline runtime: run a schedule's action lists on real processes or in one process.

    plan.Plan          what the executors derive from a schedule (s per forward, channels, loss scale)
    worker             one device's chunks and what each compute/step action does to them
    executor           one process per device on torch.distributed (gloo on CPU, NCCL on GPU)
    emulator           every device in one process, same numbers: the oracle and the fast path
    comm               point-to-point messages with shape headers, in a deadlock-free order
    faults, launcher   one failing rank ends all ranks with its error; local N-process launcher
    config             names -> checked configuration, before any process starts
"""
from .config import make_schedule, check_policy, SCHEDULES
from .emulator import Emulator
from .executor import Executor
from .launcher import launch
from .plan import ConfigError, PipelineError, Plan
from .worker import DeviceWorker, StageRuntime

__all__ = ["Plan", "ConfigError", "PipelineError", "DeviceWorker", "StageRuntime", "Executor", "Emulator",
           "launch", "make_schedule", "check_policy", "SCHEDULES"]
