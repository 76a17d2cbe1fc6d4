"""The ``pipeoptim`` command line, one module per subcommand below one entry point.

    main             the entry point: ``main``, ``build_parser`` and the subcommand registry (``register``, ``lazy``)
    schedule         ``pipeoptim schedule`` and ``pipeoptim compare-schedules`` (the simulator; no torch.distributed)
    prepare          ``pipeoptim prepare-data``: a corpus tokenized once into shards
    train            ``pipeoptim train``: started here (the local launcher) or by torchrun (``torchrun`` below it)
    torchrun         ``pipeoptim train`` as one rank of a torchrun job
    train_rank       what every rank of a run does (``train_worker``)
    run_dir          the run directory: its lock, claiming it, resuming and what a resume must keep
    train_outputs    history.json, loss.png and the summary a run prints
    train_config     train's flags made into one checked configuration, before torch is imported
    train_arguments  train's flags and the recipes they apply (cheap: ``--help`` builds them)
    torchrun_env     whether torchrun started this process (the environment only)
    help             the ``--help`` formatter every subcommand uses

Each module imports only those listed below it (and ``train`` none of ``main``, ``schedule``, ``prepare``), so
nothing imports ``main`` back: tests/test_layering.py keeps it so. ``pipeoptim.cli:main`` is the console script.
"""
from __future__ import annotations

from .help import HelpFormatter
from .main import COMMANDS, Command, build_parser, lazy, main, register
from .schedule import format_table

__all__ = ["Command", "COMMANDS", "HelpFormatter", "register", "lazy", "build_parser", "main", "format_table"]
