"""Start N worker processes on this machine, torchrun-style, and turn every way they can fail into one clean
error here, with every process of the job gone.

``launch(fn, nprocs, *args)`` spawns N processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
set (one torch thread each by default: N processes share the cores), runs ``fn(*args)`` in each and returns
the per-rank results. A result travels as a file read back with ``torch.load(weights_only=True)``, which runs
no code: it may hold tensors, numbers, strings, bytes, None and lists, tuples, sets and dicts of them; a rank
returning anything else (an object of its own class, a numpy array) fails with a ``TypeError`` saying so.

- The rendezvous store lives in this process, as torchrun's agent store does, listening on 127.0.0.1 only
  (``rendezvous``: no other machine can reach it), on a port the operating system picks (``port=None``: two
  jobs on one machine never meet) or on ``port=`` (one in use is a ``ConfigError`` naming it, before any
  process starts). It outlives every rank, so the job's reason to end still reaches
  everyone when rank 0 is the one that died.
- Workers are named ``pipeoptim-r<rank>`` (``ps``, ``top``), ignore SIGINT (Ctrl-C reaches the terminal's
  whole process group; this process ends the job in order) and die with this process
  (``PR_SET_PDEATHSIG``), so a launcher killed outright leaves no orphans.
- Each worker is a fresh interpreter (``spawn``, as torchrun starts them), which spends seconds of CPU importing
  torch. ``PIPEOPTIM_LAUNCH_METHOD=forkserver`` forks the workers instead from one server process that imported
  torch once (and lives as long as this process): for a script or a test suite that launches many jobs, each
  job then starts in a fraction of the time. A worker still gets this process's environment as it is at
  ``launch`` and dies with this process (a thread of it waits for this process to end).
- A worker that raises publishes its error (``faults``); every other rank's watchdog then ends its process.
  A worker killed by a signal (the out-of-memory killer's SIGKILL) cannot say anything: this process sees
  its exit within ``POLL_S``, publishes "rank r ... was killed by SIGKILL" for the others and raises with it.
  A frozen worker is found by the other ranks' watchdogs (``watchdog``), which end the job naming it.
- Once the job has failed, workers get ``grace_s`` to end on their own; any left (a stopped process cannot)
  are killed. SIGINT or SIGTERM to this process publishes the stop, ends every worker the same way and
  raises ``JobInterrupted``. ``timeout_s`` bounds the whole run.
- ``forward_sigterm=True`` (``pipeoptim train``): the first SIGTERM is passed on to every worker instead, and
  the job runs on; a worker that takes SIGTERM (from this process or straight from a scheduler that signals
  the whole process group) only records it (``sigterm_received``) for ``fn`` to act on: the training loop
  then stops every rank after the same step, with a checkpoint. A second SIGTERM, or SIGINT, ends the job as
  above.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.util
import os
import pickle
import select
import signal
import tempfile
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from . import faults, rendezvous
from ..errors import ConfigError, PipelineError

__all__ = ["launch", "host_store", "JobInterrupted", "POLL_S", "sigterm_received"]

POLL_S = 0.05
_sigterm = False  # a worker of a forward_sigterm job: SIGTERM arrived (maybe before fn could handle it itself)


def sigterm_received() -> bool:
    """In a worker started with ``forward_sigterm=True``: whether SIGTERM has arrived since it started."""
    return _sigterm


def _record_sigterm(signum, frame) -> None:
    global _sigterm
    _sigterm = True


class JobInterrupted(PipelineError):
    """The launcher was asked to stop (SIGINT, SIGTERM) and ended every worker; ``signum`` says which."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class _Interrupt(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


START_METHODS = ("spawn", "forkserver")


def start_method() -> str:
    """How workers start: ``PIPEOPTIM_LAUNCH_METHOD``, spawn when unset (module docstring)."""
    name = os.environ.get("PIPEOPTIM_LAUNCH_METHOD", "spawn")
    if name not in START_METHODS:
        raise ConfigError(f"PIPEOPTIM_LAUNCH_METHOD={name!r} is not a way to start workers: use spawn (the default: "
                         "each a fresh interpreter, as torchrun starts them) or forkserver (forked from one server "
                         "that imported torch once: faster to start when one process launches many jobs)")
    return name


def host_store(port: int | None, world_size: int):
    """The job's rendezvous store, served from this process on 127.0.0.1 only (port None or 0: a free one)."""
    return rendezvous.serve("127.0.0.1", port, world_size, timeout_s=60)


def _die_with(parent: int, via_server: bool) -> None:
    """Linux: SIGKILL this process when ``parent`` (the launcher) dies. A worker the forkserver forked is the
    server's child, and the server outlives the launcher while any of its workers lives (each holds the
    server's liveness pipe): such a worker watches the launcher itself (``_watch``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, f"pipeoptim-r{os.environ['RANK']}".encode()[:15])  # PR_SET_NAME: ps, top
    except (OSError, AttributeError):
        pass
    if via_server:
        _watch(parent)
    elif os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(faults.ABORT_EXIT)


def _watch(launcher: int) -> None:
    """SIGKILL this process as soon as ``launcher`` ends, from a daemon thread: it waits on a pidfd (Linux 5.3),
    else it looks every ``POLL_S``."""
    try:
        handle = os.pidfd_open(launcher)
    except ProcessLookupError:  # already gone
        os._exit(faults.ABORT_EXIT)
    except (AttributeError, OSError):
        handle = None

    def wait_then_die() -> None:
        if handle is not None:
            select.select([handle], [], [])  # readable once the process has ended
        else:
            while _alive(launcher):
                time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=wait_then_die, name="pipeoptim-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process now has the number: ours is gone
        return False
    return True


def _save_result(result, path: str, rank: int) -> None:
    """Write a rank's result where the launcher reads it with ``torch.load(weights_only=True)``; checked here,
    by the same loader, so that a result it would refuse is this rank's error, naming what to return."""
    torch.save(result, path)
    try:
        torch.load(path, weights_only=True, mmap=True)  # mapped: a large result is not read twice
    except pickle.UnpicklingError as e:
        raise TypeError(f"launch(fn) returned on rank {rank} a {type(result).__name__} holding something the "
                        f"launcher cannot load safely ({_refused(e)}); return tensors, numbers, strings, bytes, "
                        "None and lists, tuples, sets and dicts of them (e.g. a dict of floats, or a module's "
                        "state_dict())") from None


def _load_result(workdir: str, rank: int):
    """Rank ``rank``'s result, read without running any code it may hold (``weights_only=True``)."""
    path = os.path.join(workdir, f"result{rank}.pt")
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise PipelineError(f"{path} (rank {rank}'s result) holds something torch.load(weights_only=True) refuses "
                            f"({_refused(e)}); it was not loaded: nothing in it ran") from None


def _refused(e: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that names what it refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    line = next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0] if lines else "?")
    return line.split(" Please use")[0].removeprefix("WeightsUnpickler error: ")


def _child(rank: int, nprocs: int, port: int, workdir: str, threads: int, parent: int, watchdog_s, fn,
           args, forward_sigterm: bool = False, env: dict | None = None) -> None:
    via_server = env is not None
    if via_server:  # forked by the forkserver, which holds the environment it started with: the launcher's now
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=rendezvous.LAUNCH_ATTEMPT, PIPEOPTIM_LAUNCHED="1")
    if watchdog_s is not None:
        os.environ["PIPEOPTIM_WATCHDOG_S"] = str(watchdog_s)
    _die_with(parent, via_server)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if forward_sigterm:
        signal.signal(signal.SIGTERM, _record_sigterm)
    # the platform's default start method again (spawn set this process's): a rank behaves like one started
    # by torchrun, and its locks (tqdm's) are unnamed under fork, so a killed rank leaves none in /dev/shm
    multiprocessing.set_start_method(None, force=True)
    if threads:
        torch.set_num_threads(threads)
    from . import dist_env
    try:
        _save_result(fn(*args), os.path.join(workdir, f"result{rank}.pt"), rank)
        if dist_env.current_watch() is not None:
            dist_env.current_watch().stop()
        multiprocessing.util._run_finalizers(0)  # release semaphores (tqdm's lock) before the hard exit
    except BaseException as e:
        first = True
        watch = dist_env.current_watch()
        if watch is not None:
            first = watch.signal(str(e) if isinstance(e, PipelineError) else f"rank {rank}: {type(e).__name__}: {e}",
                                 symptom=faults.is_connection_loss(e))
        # a rank that failed only because another one did (e.g. its peer's connection closed) is secondary
        with open(os.path.join(workdir, f"{'error' if first else 'secondary'}{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        os._exit(faults.FAILED_EXIT)
    os._exit(0)  # skip interpreter teardown: process-group destructors may wait on dead peers


class _Job:
    def __init__(self, fn, nprocs: int, args, threads: int, port: int | None, watchdog_s: float | None,
                 workdir: str, forward_sigterm: bool = False):
        self.nprocs, self.workdir = nprocs, workdir
        method = start_method()
        self.store = host_store(port, nprocs)
        self.keys = rendezvous.attempt_keys(self.store, rendezvous.LAUNCH_ATTEMPT)  # what the workers' watchdogs see
        ctx = mp.get_context(method)
        env = None
        if method == "forkserver":
            ctx.set_forkserver_preload(["torch"])  # (read when the server starts: this process's first such job)
            env = dict(os.environ)
        self.procs = [ctx.Process(target=_child, name=f"pipeoptim-r{r}", daemon=False,
                                  args=(r, nprocs, self.store.port, workdir, threads, os.getpid(), watchdog_s, fn,
                                        args, forward_sigterm, env))
                      for r in range(nprocs)]
        self.signalled: set[int] = set()  # ranks this process killed (their signal is not news)
        self.cause: str | None = None     # a death the workers cannot report themselves

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def publish(self, message: str) -> None:
        try:
            faults.publish(self.keys, message)
        except Exception:
            pass

    def watch(self, timeout_s: float | None, grace_s: float) -> None:
        """Return when every worker has ended, or the job failed and ``grace_s`` has passed."""
        start = time.monotonic()
        failed_at = None
        while any(p.exitcode is None for p in self.procs):
            now = time.monotonic()
            for r, p in enumerate(self.procs):
                code = p.exitcode
                if code is not None and code < 0 and r not in self.signalled and self.cause is None:
                    self.cause = faults.killed_message(r, p.pid, -code, self.nprocs)
                    self.publish(self.cause)
                if failed_at is None and code not in (None, 0):
                    failed_at = now
            if failed_at is None and self._published() is not None:
                failed_at = now  # a watchdog ended the job: its rank exits at once, a stopped one never does
            if failed_at is not None and now - failed_at > grace_s:
                return
            if failed_at is None and timeout_s is not None and now - start > timeout_s:
                self.publish(f"the job did not finish within {timeout_s:.0f} s (the launcher's timeout_s); "
                             "stopping every rank")
                failed_at = now
            time.sleep(POLL_S)

    def _published(self) -> str | None:
        try:
            return faults.published(self.keys)
        except Exception:
            return None

    def end(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the workers to end, then kill what is left (also stopped processes)."""
        deadline = time.monotonic() + grace_s
        while any(p.pid is not None and p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.kill()
        self.join()

    def join(self) -> None:
        for p in self.procs:
            if p.pid is not None:
                p.join(10)

    def kill(self) -> None:
        for r, p in enumerate(self.procs):
            if p.pid is not None and p.exitcode is None:
                self.signalled.add(r)
                p.kill()

    def summary(self) -> str:
        return ", ".join(f"rank {r}: " + ("killed by the launcher (it had not ended on its own)"
                                           if r in self.signalled else faults.describe_exit(p.exitcode))
                         for r, p in enumerate(self.procs))

    def report(self) -> PipelineError:
        summary = self.summary()
        reason = self.cause or self._published()
        origin = None
        for kind in ("error", "secondary"):
            for r in range(self.nprocs):
                path = os.path.join(self.workdir, f"{kind}{r}.txt")
                if os.path.exists(path):
                    origin = (r, open(path).read())
                    break
            if origin:
                break
        if reason is None and origin is not None:
            reason = origin[1].splitlines()[0]
        if reason is None:
            reason = "workers ended without saying why"
        text = f"{reason}\n(exit status: {summary})"
        if origin is not None and not self.cause:
            text += f"\n\ntraceback of rank {origin[0]}:\n{origin[1]}"
        return PipelineError(text)


def launch(fn, nprocs: int, *args, timeout_s: float | None = None, grace_s: float = 3.0, threads: int = 1,
           port: int | None = None, watchdog_s: float | None = None, forward_sigterm: bool = False) -> list:
    """Run ``fn(*args)`` on ``nprocs`` local processes; returns each rank's result (tensors, numbers, strings,
    bytes, None and containers of them: read back with ``torch.load(weights_only=True)``), or raises
    ``PipelineError`` naming the rank that failed (and how), ``JobInterrupted`` on SIGINT/SIGTERM, or
    ``ConfigError`` when ``port`` is taken. ``watchdog_s``: the ranks' stall timeout (``watchdog``).
    ``forward_sigterm``: the first SIGTERM goes on to the workers, which decide how to stop (module docstring)."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if watchdog_s is not None and not watchdog_s > 0:
        raise ValueError(f"watchdog_s must be a positive number of seconds, got {watchdog_s!r}")
    with tempfile.TemporaryDirectory(prefix="pipeoptim-launch-") as workdir:
        job = _Job(fn, nprocs, args, threads, port, watchdog_s, workdir, forward_sigterm)
        previous = {}
        received: list[int] = []
        forwarded: list[int] = []

        def interrupt(signum, frame):
            if signum == signal.SIGTERM and forward_sigterm and not forwarded and not received:
                forwarded.append(signum)
                for p in job.procs:
                    if p.pid is not None and p.exitcode is None:
                        try:
                            os.kill(p.pid, signal.SIGTERM)
                        except ProcessLookupError:  # it ended between the look and the signal
                            pass
                return
            if not received:  # a second Ctrl-C while the workers are being ended changes nothing
                received.append(signum)
                raise _Interrupt(signum)

        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                previous[s] = signal.signal(s, interrupt)
        try:
            try:
                job.start()
                job.watch(timeout_s, grace_s)
            except _Interrupt:
                pass
            if received:
                job.publish(f"the launcher (pid {os.getpid()}) received {faults.signal_name(received[0])}: "
                            "stopping every rank")
            try:
                job.end(grace_s if not received else min(grace_s, 2.0))
            except _Interrupt:  # interrupted while the failed job was ending: end it now
                pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            job.kill()
            job.join()
        codes = [p.exitcode for p in job.procs]
        if received:
            raise JobInterrupted(received[0], f"stopped by {faults.signal_name(received[0])}: every rank has ended "
                                 f"(exit status: {job.summary()})")
        if all(c == 0 for c in codes):
            return [_load_result(workdir, r) for r in range(nprocs)]
        raise job.report()
