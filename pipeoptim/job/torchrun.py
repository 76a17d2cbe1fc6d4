"""``pipeoptim train`` under torchrun: every process torchrun starts is one rank of the job.

Without torchrun, ``pipeoptim train`` (and ``pipeoptim.job.run``) starts its own ranks on this machine
(``runtime.launch``). Started by torchrun (``torchrun ... -m pipeoptim.cli train ...``, or a script of the user's
that calls ``pipeoptim.job.run``; torchrun's environment says so: TORCHELASTIC_RUN_ID, RANK, WORLD_SIZE), each
process runs the same per-rank training instead, with the rank torchrun gave it, so
one job can span machines (torchrun's ``--nnodes``, ``--rdzv-backend c10d``). The flags mean the same; the
ones that belong to the local launcher (``--port``, ``--emulate``) are refused, and ``--stages`` must be the
job's process count.

The run directory is rank 0's to claim: it holds the run-directory lock, deletes an earlier run
(``--overwrite``) or finds the checkpoint to resume from, after every rank has joined the process group and
before any rank reads the directory; then it tells every rank the outcome (the checkpoint, or the error every
rank exits with), as bytes in a broadcast, never a pickle. Checkpoints are written by every rank into that
one directory: across machines it must be on a file system every node sees.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from .run_dir import _claim_run_dir, _newest_checkpoint, _resume_point, _run_dir_lock
from .torchrun_env import TorchrunEnv, torchrun_env
from .checks import _check_fields
from .checks import check as check_config
from .config import TrainConfig
from .outputs import NONFINITE_EXIT, _nothing_to_do, _outputs_on_the_way_out, report
from .rank import train_worker

__all__ = ["TorchrunEnv", "torchrun_env", "check", "run_rank"]


def check(config: TrainConfig, tr: TorchrunEnv) -> None:
    """ConfigError for flags that do not fit a torchrun job (every rank raises the same, before torch loads)."""
    from ..errors import ConfigError
    if config.emulate:
        raise ConfigError("--emulate runs every stage in one process, but torchrun started this one as rank "
                          f"{tr.rank} of {tr.world_size}: drop --emulate, or run pipeoptim train --emulate "
                          "without torchrun")
    if config.port is not None:
        raise ConfigError(f"--port {config.port} is the local launcher's rendezvous port; under torchrun the "
                          "rendezvous is torchrun's (--rdzv-endpoint HOST:PORT, or --master-port): drop --port")
    dp = config.dp
    if config.stages * dp != tr.world_size:
        given = f"--stages {config.stages}" + (f" x --dp {dp}" if dp > 1 else "")
        raise ConfigError(f"torchrun started {tr.world_size} processes (WORLD_SIZE) but {given} needs "
                          f"{config.stages * dp}: pipeoptim train runs one process per pipeline device and replica, so "
                          f"pass --stages {tr.world_size // dp if tr.world_size % dp == 0 else tr.world_size}"
                          f"{f' --dp {dp}' if dp > 1 and tr.world_size % dp == 0 else ''}, or start torchrun with "
                          f"--nnodes x --nproc-per-node = {config.stages * dp}")


def _share(text: str | None, ctx) -> str:
    """Rank 0's ``text`` on every rank (UTF-8 bytes in two broadcasts: a length, then the bytes)."""
    import torch
    import torch.distributed as dist
    dev = ctx.device
    data = torch.tensor(list(text.encode()) if text is not None else [], dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    dist.broadcast(n, 0)
    buf = data.to(dev) if ctx.rank == 0 else torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    if buf.numel():
        dist.broadcast(buf, 0)
    return bytes(buf.cpu().tolist()).decode()


_OK, _DONE, _ERROR = "ok:", "done:", "error:"


def _claim(cfg: TrainConfig, ckpt_root: str) -> str:
    """Rank 0: claim the run directory; ``ok:<checkpoint or empty>``, ``done:`` (nothing left to train, said
    already) or ``error:<message>``."""
    from ..runtime.checkpoint_files import CheckpointError
    from ..errors import ConfigError
    try:
        if not _claim_run_dir(cfg, ckpt_root):
            return _OK
        try:
            directory, at, extra = _resume_point(ckpt_root, cfg)
        except (FileNotFoundError, CheckpointError) as e:
            raise ConfigError(f"--resume: {e}") from None
        if at >= cfg.steps:
            _nothing_to_do(at, cfg.steps, directory, extra)
            return _DONE
        print(f"resuming from {directory} (step {at} of {cfg.steps})", file=sys.stderr)
        return _OK + directory
    except ConfigError as e:
        return _ERROR + str(e)


def run_rank(config: TrainConfig) -> int:
    """This process's rank of ``pipeoptim train`` under torchrun; the same exit statuses as without it."""
    import contextlib

    from ..errors import ConfigError, PipelineError
    tr = torchrun_env()
    ckpt_root = os.path.join(config.run_dir, "checkpoint")
    try:
        _check_fields(config)  # (what the parser checks of a flag: a config from Python skipped it)
        check(config, tr)
        cfg = check_config(config)
    except ConfigError as e:
        print(f"pipeoptim train: invalid configuration (rank {tr.rank}): {e}", file=sys.stderr)
        return 2
    cfg = cfg.replace(local_ranks=tr.local_world_size)
    if cfg.watchdog_s is not None:  # the rendezvous is watched with it too
        os.environ["PIPEOPTIM_WATCHDOG_S"] = str(cfg.watchdog_s)
    from ..runtime.dist_env import init_from_env
    try:
        with contextlib.ExitStack() as held:
            ctx = init_from_env(cfg.device)
            claimed = None
            if tr.rank == 0:
                try:
                    held.enter_context(_run_dir_lock(cfg.run_dir))
                    claimed = _claim(cfg, ckpt_root)
                except ConfigError as e:
                    claimed = _ERROR + str(e)
            if ctx.watch is not None and tr.rank != 0:
                ctx.watch.doing("waiting for rank 0 to claim the run directory", 0)
            try:
                outcome = _share(claimed, ctx)
            finally:
                if ctx.watch is not None:
                    ctx.watch.idle()
            if outcome.startswith(_ERROR):
                if tr.rank == 0:
                    print(f"pipeoptim train: invalid configuration: {outcome[len(_ERROR):]}", file=sys.stderr)
                return 2
            if outcome == _DONE:
                return 0
            cfg = cfg.replace(resume_from=outcome[len(_OK):] or None)
            t0 = time.perf_counter()
            result = train_worker(cfg)
    except KeyboardInterrupt:
        if tr.rank == 0:
            _outputs_on_the_way_out(cfg.run_dir, cfg)
        return 130
    except PipelineError as e:
        print(f"pipeoptim train: rank {tr.rank} failed: {e}", file=sys.stderr)
        if tr.rank == 0:
            _outputs_on_the_way_out(cfg.run_dir, cfg)
            if line := _newest_checkpoint(ckpt_root, str(e)):
                print(f"pipeoptim train: {line}", file=sys.stderr)
        return 1
    if tr.rank != 0:  # rank 0 speaks for the job; every rank holds the same losses (and the same stop)
        if result.get("preempted"):
            return 128 + signal.SIGTERM
        return NONFINITE_EXIT if result.get("stopped") else 0
    return report(result, cfg, t0)
