"""Running a job in its own session, injecting a fault into one of its processes for real, and checking that
the job ended cleanly: every process of the session gone, nothing new left in /dev/shm.

A job is started in a session of its own; its processes are that session's members and the descendants of
its first process (torchrun starts each worker in a session of its own). ``Job.members`` records every one
it sees, with its start time, so ``ended_cleanly`` can tell that each has exited even after an orphan was
re-parented. The processes a fault goes to are found by name (``pipeoptim-r<rank>``, set by
``runtime.launch``) or by their RANK environment variable (torchrun's workers).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]),
             TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


_STARTED: list["Job"] = []


def cleanup() -> None:
    """Kill what is left of every job started so far (a test that failed halfway); call after each test."""
    while _STARTED:
        job = _STARTED.pop()
        job.kill_all()
        for f in (job.out, job.err):
            f.close()


class Job:
    def __init__(self, cmd: list[str], workdir: str, **extra_env):
        self.out_path = os.path.join(workdir, "job.out")
        self.err_path = os.path.join(workdir, "job.err")
        self.out, self.err = open(self.out_path, "w"), open(self.err_path, "w")
        self.shm_before = shm()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, env=env(**extra_env), cwd=workdir,
                                     start_new_session=True)
        self.sid = self.proc.pid
        self._seen: dict[int, int] = {}
        _STARTED.append(self)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.text()}") from None

    def text(self) -> str:
        self.out.flush()
        self.err.flush()
        return open(self.out_path).read() + open(self.err_path).read()

    def members(self) -> dict[int, int]:
        """pid -> start time of every live process of the job now, added to those seen before."""
        procs = processes()
        children: dict[int, list[int]] = {}
        for pid, _, _, ppid, _ in procs:
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), [self.sid]
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.add(pid)
                todo += children.get(pid, [])
        for pid, _, state, _, sid in procs:
            if (sid == self.sid or pid in tree) and state != "Z":
                start = _start_time(pid)
                if start is not None:
                    self._seen.setdefault(pid, start)
        return dict(self._seen)

    def left(self) -> list[tuple[int, str]]:
        """Processes of the job (ever seen) that still run (not zombies)."""
        self.members()
        out = []
        for pid, start in self._seen.items():
            if _start_time(pid) == start and _state(pid) not in (None, "Z"):
                out.append((pid, _comm(pid)))
        return out

    def kill_all(self) -> None:
        """Clean up after a failed test: kill whatever of the job is left (by pid, one at a time)."""
        for pid, _ in self.left():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ended_cleanly(self, timeout: float = 10.0) -> float:
        """Seconds until no process of the job is left (zombies hold nothing and do not count)."""
        t0 = time.monotonic()
        while self.left():
            if time.monotonic() - t0 > timeout:
                left = self.left()
                self.kill_all()
                raise AssertionError(f"processes of the job are still alive {timeout} s later: {left}")
            time.sleep(0.05)
        return time.monotonic() - t0


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return [stat[stat.index("(") + 1: stat.rindex(")")]] + stat[stat.rindex(")") + 2:].split()


def _start_time(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[20]) if st else None


def _state(pid: int) -> str | None:
    st = _stat(pid)
    return st[1] if st else None


def _comm(pid: int) -> str:
    st = _stat(pid)
    return st[0] if st else "?"


def processes() -> list[tuple[int, str, str, int, int]]:
    """(pid, comm, state, ppid, session) of every process."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out.append((int(name), comm, fields[0], int(fields[1]), int(fields[3])))
    return out


def rank_pid(job: Job, rank: int, timeout: float = 120.0) -> int:
    """The pid of rank ``rank`` of ``job`` (named by runtime.launch, or RANK in its environment)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for pid in job.members():
            comm, state = _comm(pid), _state(pid)
            if state in (None, "Z"):
                continue
            if comm == f"pipeoptim-r{rank}":
                return pid
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
                return pid
        time.sleep(0.1)
    job.kill_all()
    raise AssertionError(f"rank {rank} did not appear within {timeout} s")


def wait_for(what, job: Job, timeout: float = 180.0) -> None:
    """Wait until the job reached a point worth interrupting, while it runs: ``what`` is a path that must exist,
    or a function that returns True once that point is reached (its ``description`` names the point)."""
    reached = what if callable(what) else (lambda: os.path.exists(what))
    name = getattr(what, "description", repr(what)) if callable(what) else f"{what} to exist"
    t0 = time.monotonic()
    while not reached():
        if job.proc.poll() is not None:
            raise AssertionError(f"the job ended while waiting for {name}:\n{job.text()}")
        if time.monotonic() - t0 > timeout:
            job.kill_all()
            raise AssertionError(f"still waiting for {name} after {timeout} s:\n{job.text()}")
        time.sleep(0.1)


def shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def shm_left(before: set[str]) -> set[str]:
    """New /dev/shm entries that no live process maps (other jobs on this machine may hold their own)."""
    new = shm() - before
    if not new:
        return set()
    mapped = set()
    for pid, _, _, _, _ in processes():
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.rsplit("/", 1)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return {n for n in new if n not in mapped and os.path.exists(os.path.join("/dev/shm", n))}


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeoptim.cli", "train", *args]
