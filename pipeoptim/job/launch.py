"""``run``: a run of ``pipeoptim train`` from its ``TrainConfig``, as the command line starts it and as Python may.

It checks the configuration (before torch is imported), claims the run directory (its lock; ``resume`` or
``overwrite``), then trains: every stage in this process (``emulate``), one process per stage and replica on this
machine (the local launcher), or, in a process torchrun started, as that one rank of the job (``job.torchrun``).
What the run says goes to stderr, the summary and ``final loss: <float>`` to stdout; what it leaves is in
``run_dir`` (``checkpoint/``, ``history.json``, ``loss.png``).
"""
from __future__ import annotations

import os
import sys
import time

from .checks import check
from .config import TrainConfig
from .outputs import _nothing_to_do, _outputs_on_the_way_out, report
from .rank import train_worker
from .run_dir import _claim_run_dir, _newest_checkpoint, _resume_point, _run_dir_lock
from .torchrun_env import torchrun_env

__all__ = ["run"]


def run(config: TrainConfig) -> int:
    """Train as ``pipeoptim train`` does; returns its exit status: 0 done, 1 failed, 2 invalid configuration (said
    on stderr, nothing written), 3 stopped on a non-finite value, 128+N stopped by signal N."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"run() takes a pipeoptim.job.TrainConfig, not {type(config).__name__}: "
                        "TrainConfig(model='tiny', stages=2, ...), or TrainConfig.from_args(parsed_flags)")
    if torchrun_env() is not None:  # started by torchrun: this process is one rank of the job
        from .torchrun import run_rank
        return run_rank(config)
    from ..errors import ConfigError, PipelineError
    from ..runtime.checkpoint_files import CheckpointError
    ckpt_root = os.path.join(config.run_dir, "checkpoint")
    try:
        cfg = check(config)  # every check before torch is imported: a wrong flag is answered at once
        with _run_dir_lock(cfg.run_dir):
            if _claim_run_dir(cfg, ckpt_root):
                try:
                    resume_from, at, extra = _resume_point(ckpt_root, cfg)
                except (FileNotFoundError, CheckpointError) as e:
                    raise ConfigError(f"--resume: {e}") from None
                if at >= cfg.steps:  # nothing to train, nothing to save: the checkpoint stays as it is
                    _nothing_to_do(at, cfg.steps, resume_from, extra)
                    return 0
                print(f"resuming from {resume_from} (step {at} of {cfg.steps})", file=sys.stderr)
                cfg = cfg.replace(resume_from=resume_from)
            from ..runtime.launcher import JobInterrupted, launch  # loads torch
            t0 = time.perf_counter()
            try:
                if cfg.emulate:
                    import torch
                    torch.set_num_threads(max(1, torch.get_num_threads()))
                    result = train_worker(cfg)
                else:
                    result = launch(train_worker, cfg.stages * cfg.dp, cfg, timeout_s=None, port=cfg.port,
                                    watchdog_s=cfg.watchdog_s, forward_sigterm=True)[0]
            except (JobInterrupted, KeyboardInterrupt) as e:
                signum = getattr(e, "signum", 2)
                print(f"pipeoptim train: {e or 'interrupted'}", file=sys.stderr)
                _outputs_on_the_way_out(cfg.run_dir, cfg)
                if line := _newest_checkpoint(ckpt_root):
                    print(f"pipeoptim train: {line}", file=sys.stderr)
                return 128 + signum
            except PipelineError as e:
                print(f"pipeoptim train: failed: {e}", file=sys.stderr)
                _outputs_on_the_way_out(cfg.run_dir, cfg)
                if line := _newest_checkpoint(ckpt_root, str(e)):
                    print(f"pipeoptim train: {line}", file=sys.stderr)
                return 1
    except ConfigError as e:
        print(f"pipeoptim train: invalid configuration: {e}", file=sys.stderr)
        return 2
    return report(result, cfg, t0)
