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
several), every process is one rank of the job instead (``cli.torchrun``). ``--model hf-gpt2`` / ``hf-llama``
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
import os
import sys
import time

from . import run_dir, train_arguments, train_config, train_outputs, train_rank
from .help import HelpFormatter
from .run_dir import *  # noqa: F401,F403  (every module's public names, as pipeoptim.cli.train.X)
from .run_dir import (_check_dp_change, _claim_run_dir, _newest_checkpoint, _resume_point,  # noqa: F401
                      _run_dir_lock)
from .torchrun_env import torchrun_env
from .train_arguments import *  # noqa: F401,F403
from .train_arguments import add_arguments
from .train_config import *  # noqa: F401,F403
from .train_config import _check_prediction, _config, _optimizer, _updates_per_window  # noqa: F401
from .train_outputs import *  # noqa: F401,F403
from .train_outputs import _nothing_to_do, _outputs_on_the_way_out, _write_outputs, report
from .train_rank import *  # noqa: F401,F403
from .train_rank import train_worker

_PARTS = (train_arguments, train_config, run_dir, train_rank, train_outputs)
__all__ = ["run", "register", "main", *(name for part in _PARTS for name in part.__all__)]


def __getattr__(name: str):
    """The parts' other helpers, as the single module this was had them (``pipeoptim.cli.train._hf_spec``)."""
    for part in _PARTS:
        if hasattr(part, name):
            return getattr(part, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run(args) -> int:
    if torchrun_env() is not None:  # started by torchrun: this process is one rank of the job
        from .torchrun import run_rank
        return run_rank(args)
    from ..runtime.checkpoint_files import CheckpointError
    from ..errors import ConfigError, PipelineError
    ckpt_root = os.path.join(args.run_dir, "checkpoint")
    try:
        cfg = _config(args)  # every check before torch is imported: a wrong flag is answered at once
        with _run_dir_lock(args.run_dir):
            cfg["resume_from"] = None
            if _claim_run_dir(args, ckpt_root):
                try:
                    cfg["resume_from"], at, extra = _resume_point(ckpt_root, cfg)
                except (FileNotFoundError, CheckpointError) as e:
                    raise ConfigError(f"--resume: {e}") from None
                if at >= args.steps:  # nothing to train, nothing to save: the checkpoint stays as it is
                    _nothing_to_do(at, args.steps, cfg["resume_from"], extra)
                    return 0
                print(f"resuming from {cfg['resume_from']} (step {at} of {args.steps})", file=sys.stderr)
            from ..runtime.launcher import JobInterrupted, launch  # loads torch
            t0 = time.perf_counter()
            try:
                if args.emulate:
                    import torch
                    torch.set_num_threads(max(1, torch.get_num_threads()))
                    result = train_worker(cfg)
                else:
                    result = launch(train_worker, args.stages * args.dp, cfg, timeout_s=None, port=args.port,
                                    watchdog_s=args.watchdog_s, forward_sigterm=True)[0]
            except (JobInterrupted, KeyboardInterrupt) as e:
                signum = getattr(e, "signum", 2)
                print(f"pipeoptim train: {e or 'interrupted'}", file=sys.stderr)
                _outputs_on_the_way_out(args.run_dir, cfg)
                if line := _newest_checkpoint(ckpt_root):
                    print(f"pipeoptim train: {line}", file=sys.stderr)
                return 128 + signum
            except PipelineError as e:
                print(f"pipeoptim train: failed: {e}", file=sys.stderr)
                _outputs_on_the_way_out(args.run_dir, cfg)
                if line := _newest_checkpoint(ckpt_root, str(e)):
                    print(f"pipeoptim train: {line}", file=sys.stderr)
                return 1
    except ConfigError as e:
        print(f"pipeoptim train: invalid configuration: {e}", file=sys.stderr)
        return 2
    return report(result, cfg, args, t0)


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
