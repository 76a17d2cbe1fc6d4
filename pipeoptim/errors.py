"""The exceptions that cross the library's layers, in the one module every layer may import.

``ConfigError`` (a configuration that cannot run) is raised by low modules (cutting a model, balancing stages,
recomputation, copies of tied weights) and by the runtime, and caught by the Pipeline and the CLI;
``PipelineError`` (an action failed on some rank) is raised by the runtime and caught by the launcher, the CLI and
users. Defining them here, below everything, lets a low module raise them without importing the runtime.
Nothing here imports torch or any other part of ``pipeoptim``.

The old paths keep working: ``pipeoptim.runtime.plan.ConfigError`` is this very class, so every ``except`` clause
matches whichever path it names. Exceptions that only one layer raises and its callers catch stay beside it:
``schedules.ScheduleConfigError`` and ``ScheduleError``, ``runtime.checkpoint_files.CheckpointError``,
``data.DataError``, ``links.LinkSpecError``, ``recompute.CheckpointStagesError`` (a ``ConfigError``),
``models.hf_config.HFConfigError`` and ``train.NonFiniteError``.
"""
from __future__ import annotations

__all__ = ["ConfigError", "PipelineError"]


class ConfigError(ValueError):
    """A pipeline configuration that cannot run; raised before any process starts, naming the rule and a fix."""


class PipelineError(RuntimeError):
    """An action failed on some rank; the message names the rank, the stage and the action."""
