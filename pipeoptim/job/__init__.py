"""The training job of ``pipeoptim train``, for the command line, a torchrun job and Python alike.

    from pipeoptim.job import TrainConfig, run
    status = run(TrainConfig(model="tiny", stages=2, schedule="1f1b", steps=20, emulate=True, run_dir="runs/mine"))

``TrainConfig`` is the run (a field per flag of ``pipeoptim train``; torch-free), ``check`` answers a wrong one with
a ``ConfigError`` before torch loads, ``run`` trains it and returns the command's exit status.

    config        TrainConfig, the defaults its flags stand for, the recipes they apply
    checks        every check of a configuration before torch loads;  data_checks: those of its text and tokens
    derived       what a checked configuration means to a rank (its optimizer, its policy's options)
    launch        run: check, claim the run directory, train here, on local processes or as a torchrun rank
    torchrun      one rank of a torchrun job;  torchrun_env: whether torchrun started this process (no torch)
    rank          what every rank does (train_worker)
    run_dir       the run directory: its lock, claiming it, resuming and what a resume must keep
    outputs       history.json, loss.png and the summary a run prints
"""
from __future__ import annotations

from .checks import check
from .config import TrainConfig
from .launch import run

__all__ = ["TrainConfig", "check", "run"]
