"""The ``pipeoptim`` command line, one module per subcommand below one entry point.

    main             the entry point: ``main``, ``build_parser`` and the subcommand registry (``register``, ``lazy``)
    schedule         ``pipeoptim schedule`` and ``pipeoptim compare-schedules`` (the simulator; no torch.distributed)
    prepare          ``pipeoptim prepare-data``: a corpus tokenized once into shards
    train            ``pipeoptim train``: its flags made into a ``TrainConfig`` that ``pipeoptim.job`` runs (here, on
                     local processes, or as one rank of a torchrun job)
    train_arguments  train's flags (cheap: ``--help`` builds them); ``pipeoptim.job.TrainConfig`` has their defaults
    help             the ``--help`` formatter every subcommand uses

Each module imports only those listed below it (and ``train`` none of ``main``, ``schedule``, ``prepare``), so
nothing imports ``main`` back: tests/test_layering.py keeps it so. ``pipeoptim.cli:main`` is the console script.
"""
from __future__ import annotations

from .help import HelpFormatter
from .main import COMMANDS, Command, build_parser, lazy, main, register
from .schedule import format_table

__all__ = ["Command", "COMMANDS", "HelpFormatter", "register", "lazy", "build_parser", "main", "format_table"]
