"""The ``pipeoptim`` command line, one module per subcommand below one entry point.

    main        the entry point: ``main``, ``build_parser`` and the subcommand registry (``register``, ``lazy``)
    schedule    ``pipeoptim schedule`` and ``pipeoptim compare-schedules`` (the simulator; no torch.distributed)
    prepare     ``pipeoptim prepare-data``: a corpus tokenized once into shards
    train       ``pipeoptim train``: started here (the local launcher) or by torchrun (``torchrun`` below it)
    torchrun    ``pipeoptim train`` as one rank of a torchrun job
    train_job   what both ways of starting ``train`` share: its arguments, configuration, run directory and
                resume, the per-rank worker and the outputs
    torchrun_env  whether torchrun started this process (the environment only)
    help        the ``--help`` formatter every subcommand uses

The imports run one way: ``main`` → ``train`` → ``torchrun`` → ``train_job`` → ``torchrun_env`` and ``help``;
nothing imports ``main`` back (tests/test_layering.py keeps it so). ``pipeoptim.cli:main`` is the console script.
"""
from __future__ import annotations

from .help import HelpFormatter
from .main import COMMANDS, Command, build_parser, lazy, main, register
from .schedule import format_table

__all__ = ["Command", "COMMANDS", "HelpFormatter", "register", "lazy", "build_parser", "main", "format_table"]
