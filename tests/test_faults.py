"""Faults injected for real into running jobs (runtime.launch, torchrun): a rank killed by SIGKILL, a rank
frozen by SIGSTOP (while training, or during start-up), a rank whose stage never returns, a port already
taken. Each must end every process of the job within a stated bound, with a message naming the rank and
what happened, and leave nothing behind.

BOUND_S is the bound the README states; the times measured here are typically far below it (see
benchmarks/fault_bounds.py). Job start-up (imports, rendezvous) is not counted: the clock starts at the fault.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

import pytest

import fault_harness as fh
import fault_jobs as fj
from pipeoptim.runtime import launch
from pipeoptim.runtime.plan import ConfigError

BOUND_S = 30.0           # from a rank's death to every process of the job gone
WATCHDOG_S = 6.0         # the stall timeout these tests give the ranks
STALL_BOUND_S = WATCHDOG_S + 30.0
JOB = os.path.join(fh.TESTS, "fault_jobs.py")


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    fh.cleanup()


def _start_launch_job(tmp_path, nprocs, *extra):
    markers = tmp_path / "markers"
    markers.mkdir()
    job = fh.Job([sys.executable, JOB, "launch", str(nprocs), str(markers), *extra], str(tmp_path))
    for r in range(nprocs):
        fh.wait_for(str(markers / f"running.{r}"), job)
    return job


def test_sigkilled_rank_under_launch_ends_the_job_naming_it(tmp_path):
    job = _start_launch_job(tmp_path, 3)
    t0 = time.monotonic()
    os.kill(fh.rank_pid(job, 1), signal.SIGKILL)
    code = job.wait(BOUND_S + 30)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code == 1, text
    assert "rank 1 of 3" in text and "killed by SIGKILL" in text, text
    assert gone < BOUND_S, f"{gone:.1f} s to a clean end"
    assert not fh.shm_left(job.shm_before)


def test_frozen_rank_is_named_by_the_watchdog(tmp_path):
    job = _start_launch_job(tmp_path, 3, "--watchdog", str(WATCHDOG_S))
    t0 = time.monotonic()
    os.kill(fh.rank_pid(job, 1), signal.SIGSTOP)
    code = job.wait(STALL_BOUND_S + 30)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code == 1, text
    assert "rank 1 (pid" in text and "stopped responding" in text, text
    # what the rank that noticed was waiting for: rank 1's message, or, when the SIGSTOP landed between two
    # iterations (CI saw it), the loss all-reduce that rank 1 never joined
    assert "rank 1: NOT RESPONDING" in text, text
    assert re.search(r"noticed it: it was .*(from rank 1|a collective waiting for every rank of its group)", text), \
        text
    assert WATCHDOG_S < gone < STALL_BOUND_S, f"{gone:.1f} s to a clean end"


def test_stage_that_never_returns_is_named_with_its_action(tmp_path):
    """A peer that never posts its send: its process is alive (heartbeats go on) but its forward hangs."""
    job = _start_launch_job(tmp_path, 3, "--watchdog", str(WATCHDOG_S), "--hang-rank", "2")
    t0 = time.monotonic()
    code = job.wait(STALL_BOUND_S + 60)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code == 1, text
    assert "rank 2 (pid" in text and "running F" in text and "s2 for" in text, text
    assert "without waiting for any other rank" in text, text
    assert gone < STALL_BOUND_S + 30, f"{gone:.1f} s to a clean end"


def test_sigkilled_rank_under_torchrun_ends_the_job(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    job = fh.Job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB,
                  "torchrun", str(markers)], str(tmp_path))
    for r in range(2):
        fh.wait_for(str(markers / f"running.{r}"), job)
    t0 = time.monotonic()
    os.kill(fh.rank_pid(job, 1), signal.SIGKILL)
    code = job.wait(BOUND_S + 60)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code != 0, text
    cause = text[text.index("Root Cause"):]  # torchrun's own report names the rank the signal killed
    assert "rank      : 1" in cause and "Signal 9 (SIGKILL)" in cause, text
    assert gone < BOUND_S, f"{gone:.1f} s to a clean end"


def _never_runs():
    raise AssertionError("no worker may start when the port is taken")


def test_port_in_use_is_a_clear_error_before_any_process_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=f"port {port} on this machine is already in use"):
            launch(_never_runs, 2, port=port)
        assert time.monotonic() - t0 < 5


STARTUP_WATCHDOG_S = 4.0


def test_a_rank_frozen_at_start_up_is_named_within_the_bound(tmp_path):
    """Rank 1 of 2 SIGSTOPs itself before the rendezvous, while building its stage, or as load begins (three
    jobs at once, to keep the test short): each job ends within the watchdog's bound, naming rank 1, where
    the other ranks used to wait for the process group's 30-minute timeout. The clock starts once rank 1 has
    stopped and rank 0 has reached the rendezvous."""
    jobs = {}
    for where in fj.STARTUP_PHASES:
        markers = tmp_path / where
        markers.mkdir()
        jobs[where] = (fh.Job([sys.executable, JOB, "startup", str(markers), where, "--watchdog",
                               str(STARTUP_WATCHDOG_S)], str(markers)), markers)
    started = {}
    for where, (job, markers) in jobs.items():
        for name in ("stopping.1", "arrived.0"):
            fh.wait_for(str(markers / name), job)
        # rank 1 writes stopping.1 just before it stops itself: on a loaded machine the stop can come a moment later
        stopped = lambda job=job: fh._state(fh.rank_pid(job, 1)) == "T"  # noqa: E731
        stopped.description = f"{where}: rank 1 to be stopped (SIGSTOP, state T)"
        fh.wait_for(stopped, job, timeout=30)
        started[where] = time.monotonic()
    bound = STARTUP_WATCHDOG_S + 30.0
    for where, (job, markers) in jobs.items():
        code = job.wait(bound + 30)
        gone = time.monotonic() - started[where] + job.ended_cleanly()
        text = job.text()
        assert code == 1, f"{where}:\n{text}"
        if where == "rendezvous":  # no heartbeat ever came from it
            assert "rank 1 never arrived" in text and "rank 1: NEVER ARRIVED" in text, text
            assert "rank 0 noticed it: it was in the rendezvous (joining the process group)" in text, text
        else:
            assert "rank 1 (pid" in text and "stopped responding" in text and "rank 1: NOT RESPONDING" in text, text
            if where == "build":
                assert "the last one said: building its stages (Pipeline start-up)" in text, text
            waited = {"build": "the collectives that build a Pipeline",
                      "load": f"loading checkpoint {markers / 'ckpt'}"}[where]
            assert f"rank 0 noticed it: it was in {waited}" in text, text
        assert "killed by the launcher" in text, text  # the stopped rank could not end on its own
        assert gone < bound, f"{where}: {gone:.1f} s to a clean end"
        assert not fh.shm_left(job.shm_before)


def _sigterm_once_running(marker: str, ranks: int):
    """A thread that sends this process SIGTERM once every rank of a ``fj.wait_for_sigterm`` job runs."""
    import threading

    def send():
        while not all(os.path.exists(f"{marker}.{r}") for r in range(ranks)):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_the_launcher_passes_the_first_sigterm_on_when_asked_and_the_job_ends_normally(tmp_path):
    """``launch(..., forward_sigterm=True)`` (what ``pipeoptim train`` uses): the first SIGTERM to the launcher
    reaches every worker as a recorded request, the job runs on and returns each rank's result."""
    marker = str(tmp_path / "running")
    sender = _sigterm_once_running(marker, 2)
    results = launch(fj.wait_for_sigterm, 2, marker, timeout_s=120, forward_sigterm=True)
    sender.join(5)
    assert results == ["SIGTERM recorded", "SIGTERM recorded"]


def test_without_forwarding_sigterm_to_the_launcher_ends_every_rank(tmp_path):
    from pipeoptim.runtime.launcher import JobInterrupted
    marker = str(tmp_path / "running")
    sender = _sigterm_once_running(marker, 2)
    with pytest.raises(JobInterrupted, match="stopped by SIGTERM: every rank has ended") as e:
        launch(fj.wait_for_sigterm, 2, marker, timeout_s=120)
    sender.join(5)
    assert e.value.signum == signal.SIGTERM
