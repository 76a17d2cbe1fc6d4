"""Start N worker processes on this machine, torchrun-style, and make their failure a clean error here.

``launch(fn, nprocs, *args)`` spawns N processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set (one torch thread each by default: N processes share the cores), runs ``fn(*args)`` in each
and returns the per-rank results. When a worker exits non-zero, the others get ``grace_s`` seconds to stop on
their own (the abort watchdog ends them with the failing rank's message) and are then killed; the error
raised here carries the failing rank's message and traceback. ``timeout_s`` bounds the whole run.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from .plan import PipelineError

__all__ = ["launch", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, nprocs: int, port: int, workdir: str, threads: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PIPEOPTIM_ERROR_DIR=workdir)
    if threads:
        torch.set_num_threads(threads)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
        import multiprocessing.util
        multiprocessing.util._run_finalizers(0)  # release semaphores (tqdm's lock) before the hard exit
    except BaseException as e:
        from . import dist_env
        first = True
        if dist_env._CONTEXT is not None and dist_env._CONTEXT.watch is not None:
            first = dist_env._CONTEXT.watch.signal(f"rank {rank}: {type(e).__name__}: {e}")
        # a rank that failed only because another one did (e.g. its peer's connection closed) is secondary
        with open(os.path.join(workdir, f"{'error' if first else 'secondary'}{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: process-group destructors may wait on dead peers


def launch(fn, nprocs: int, *args, timeout_s: float | None = None, grace_s: float = 5.0,
           threads: int = 1) -> list:
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pipeoptim-launch-") as workdir:
        procs = [ctx.Process(target=_child, args=(r, nprocs, port, workdir, threads, fn, args), daemon=False)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        start = time.monotonic()
        failed_at = None
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > grace_s:
                    break
                if timeout_s is not None and now - start > timeout_s:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(nprocs)]
        errors = []
        for r in range(nprocs):
            path = os.path.join(workdir, f"error{r}.txt")
            if os.path.exists(path):
                errors.append((r, open(path).read()))
        for kind in ("secondary", "abort"):
            if errors:
                break
            for r in range(nprocs):
                path = os.path.join(workdir, f"{kind}{r}.txt")
                if os.path.exists(path):
                    errors.append((r, open(path).read()))
        elapsed = time.monotonic() - start
        if errors:
            r, text = errors[0]
            head = text.splitlines()[0] if text else ""
            raise PipelineError(f"worker rank {r} failed (exit codes {codes}): {head}\n\n{text}")
        if timeout_s is not None and elapsed > timeout_s:
            raise PipelineError(f"workers did not finish within {timeout_s:.0f} s (exit codes {codes}); killed them")
        raise PipelineError(f"workers exited with codes {codes} without an error message (killed by a signal? "
                            "out of memory?)")
