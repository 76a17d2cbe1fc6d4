"""The ``pipeoptim`` command: one entry point, subcommands registered in ``COMMANDS``.

Each subcommand is a ``Command(help, add_arguments, run)``. ``add_arguments`` must stay cheap (it runs to build
``--help``); ``run`` imports what it needs when it runs, so ``pipeoptim schedule`` never loads
torch.distributed. To add a subcommand elsewhere in the package::

    from pipeoptim.cli import register, lazy
    register("train", "train a model through a pipeline", add_arguments, lazy("pipeoptim.cli.train", "run"))

Run as ``pipeoptim ...`` (installed entry point) or ``python -m pipeoptim.cli ...``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from .help import HelpFormatter
from .schedule import compare_arguments, compare_run, schedule_arguments, schedule_run

__all__ = ["Command", "COMMANDS", "register", "lazy", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    if name in COMMANDS:
        raise ValueError(f"subcommand {name!r} is already registered")
    COMMANDS[name] = Command(help, add_arguments, run)


def lazy(module: str, attr: str) -> Callable[[argparse.Namespace], int]:
    """A ``run`` function that imports ``module`` only when the subcommand runs."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), attr)(args)
    return run


register("schedule", "print, draw and time one schedule", schedule_arguments, schedule_run)
register("compare-schedules", "tabulate bubble, memory and traffic of all schedules", compare_arguments, compare_run)


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from .train import add_arguments
    add_arguments(p)


register("train", "train a small GPT (or a Hugging Face model) through a pipeline (4 local processes by default) "
                  "on the standard library's source or on your text (--data)",
         _train_arguments, lazy("pipeoptim.cli.train", "run"))


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    from .prepare import add_arguments
    add_arguments(p)


register("prepare-data", "tokenize a corpus once into token shards that train --data reads by index",
         _prepare_arguments, lazy("pipeoptim.cli.prepare", "run"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeoptim", description="Pipeline-parallel training tools.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in COMMANDS.items():
        # allow_abbrev off: "--resum" is an error, not --resume
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=HelpFormatter,
                           allow_abbrev=False)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
