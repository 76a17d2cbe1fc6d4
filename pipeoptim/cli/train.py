"""``pipeoptim train``: train a small GPT-style byte-level model on the Python standard library's source, or on
the user's own text (``--data``, byte-level or through a local ``--tokenizer`` for the Hugging Face models).

The default is the project's showcase: 4 pipeline stages as 4 local processes on CPU (gloo), asynchronous
1F1B with PipeOptim's weight prediction (from the last applied update) and Muon + AdamW, the asynchronous
configuration that trained this model best; a progress bar with loss, tokens/s and bubble time, a
checkpoint and a loss plot under ``--run-dir``; the last line printed is ``final loss: <float>``.
``--emulate`` runs the same schedule in one process (on ``--device``); ``--device cuda`` uses NCCL, one GPU
per stage. ``--dp 2`` runs two data-parallel replicas of the pipeline (``--stages`` x ``--dp`` processes): each
window draws ``dp`` x the batch and replica q trains on its q-th share (``runtime.data_parallel``), so a window
sees ``dp`` times the rows and, for a synchronous schedule, updates as one pipeline on that doubled batch.
Started by torchrun (``torchrun --nnodes N --nproc-per-node M ... -m pipeoptim.cli train``, on one machine or
several), every process is one rank of the job instead (``job.torchrun``). ``--model hf-gpt2`` / ``hf-llama``
train a Hugging Face GPT-2 / Llama built from a config (random init, nothing downloaded) on the meta device, each
rank materialising only its own stages (``pip install 'pipeoptim[hf]'``).

A run of days: a checkpoint every ``--save-every`` windows (the newest ``--keep-checkpoints`` kept, each
committed by a manifest with hashes); ``--resume`` continues from the newest intact one and says which
(``--resume auto``: where one was committed, else it starts afresh: one command for a run's first start and
every restart, e.g. ``torchrun --max-restarts``'s); a NaN
or inf loss or gradient stops the run with a checkpoint of the last finite state (``--on-nonfinite skip``
drops such updates instead); a rank that dies or freezes ends the job with a message naming it
(``--watchdog-s``); SIGTERM (a scheduler's warning before it kills the job) stops every rank after the step it
is in, with a checkpoint of it, and Ctrl-C ends every rank at once; two runs need two run directories (a lock
says so), and a run directory holding an earlier run's checkpoints is continued (``--resume``) or deleted
(``--overwrite``), never silently overwritten. Every configuration check runs before torch is imported, so a
wrong flag is answered as fast as ``--help``.
Exit status: 0 done, 1 failed, 2 invalid configuration, 3 stopped on a non-finite value, 128+N stopped by
signal N.
"""
from __future__ import annotations

import argparse

from ..job import checks, config, data_checks, derived, outputs, rank, run_dir
from ..job.checks import *  # noqa: F401,F403  (every part's public names, as pipeoptim.cli.train.X)
from ..job.checks import _check_prediction  # noqa: F401
from ..job.derived import *  # noqa: F401,F403
from ..job.derived import _optimizer, _updates_per_window  # noqa: F401
from ..job.config import *  # noqa: F401,F403
from ..job.launch import run as run_config
from ..job.outputs import *  # noqa: F401,F403
from ..job.outputs import _write_outputs  # noqa: F401
from ..job.rank import *  # noqa: F401,F403
from ..job.run_dir import *  # noqa: F401,F403
from ..job.run_dir import (_check_dp_change, _claim_run_dir, _newest_checkpoint, _resume_point,  # noqa: F401
                           _run_dir_lock)
from . import train_arguments
from .help import HelpFormatter
from .train_arguments import *  # noqa: F401,F403
from .train_arguments import add_arguments

_PARTS = (train_arguments, config, checks, data_checks, derived, run_dir, rank, outputs)
__all__ = ["run", "register", "main", *(name for part in _PARTS for name in part.__all__)]


def __getattr__(name: str):
    """The parts' other helpers, as the single module this was had them (``pipeoptim.cli.train._hf_spec``)."""
    for part in _PARTS:
        if hasattr(part, name):
            return getattr(part, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _config(args: argparse.Namespace) -> TrainConfig:  # noqa: F405
    """The checked configuration of a parsed command line (``ConfigError`` if it cannot run)."""
    return check(TrainConfig.from_args(args))  # noqa: F405


def run(args: argparse.Namespace) -> int:
    """``pipeoptim train`` with parsed flags: the job (``pipeoptim.job.run``) of their ``TrainConfig``."""
    return run_config(TrainConfig.from_args(args))  # noqa: F405


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to a ``pipeoptim`` argparse subparsers object."""
    p = subparsers.add_parser("train", help="train a small GPT on the stdlib corpus through a pipeline",
                              description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="pipeoptim train", description=__doc__,
                                              formatter_class=HelpFormatter, allow_abbrev=False))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
