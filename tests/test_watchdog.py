"""The watchdog's parts that run without killing the test process: the diagnosis that names the rank holding
a job up, the heartbeat, the job's one reason to end (first writer wins), the timeout. The thread's stall
and abort exits are tested on real processes in test_faults.py."""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipeoptim.runtime import faults
from pipeoptim.runtime.watchdog import COLLECTIVE, DEFAULT_TIMEOUT_S, STEP_FACTOR, Watchdog, diagnose


def beat(n, what="outside the pipeline", peer=None, busy=True, took=5.0, ended=False, pid=None):
    return {"n": n, "pid": pid or 100 + n, "host": "h", "what": what, "peer": peer, "for": took if busy else None,
            "busy": busy, "ended": ended}


def test_a_frozen_peer_is_named_with_its_last_action():
    before = {0: beat(1, "waiting for the header of F3s1's input from rank 1", 1), 1: beat(7, "B2s1", pid=555),
              2: beat(3, "waiting for F3s2's input from rank 1", 1)}
    after = {0: beat(4, "waiting for the header of F3s1's input from rank 1", 1, took=8.0), 1: beat(7, "B2s1", pid=555),
             2: beat(6, "waiting for F3s2's input from rank 1", 1)}
    text = diagnose(0, before, after, 3, 8.0, 6.0)
    head = text.splitlines()[0]
    assert "rank 1 (pid 555 on h) stopped responding" in head and "running B2s1 for 5 s" in head
    assert "rank 0 noticed it: it was waiting for the header of F3s1's input from rank 1 for 8 s" in text
    assert "rank 1: NOT RESPONDING" in text


def test_a_stage_stuck_in_its_own_compute_is_named():
    before = {0: beat(1, "waiting for B1s0's input from rank 1", 1), 1: beat(1, "waiting for B1s1's input from rank 2", 2),
              2: beat(1, "F3s2")}
    after = {r: dict(b, n=b["n"] + 3) for r, b in before.items()}
    after[2]["for"] = 40.0
    head = diagnose(0, before, after, 3, 30.0, 30.0).splitlines()[0]
    assert "rank 2 (pid 101 on h) has been running F3s2 for 40 s without waiting for any other rank" in head


def test_a_peer_outside_the_pipeline_is_named():
    before = {0: beat(1, busy=False), 1: beat(1, "waiting for F0s1's input from rank 0", 0)}
    after = {0: beat(5, busy=False), 1: beat(5, "waiting for F0s1's input from rank 0", 0)}
    head = diagnose(1, before, after, 2, 30.0, 30.0).splitlines()[0]
    assert "rank 0 (pid 105 on h) is outside the pipeline" in head and "while rank 1 waits for it" in head


def test_ranks_waiting_for_each_other_are_a_deadlock():
    before = {0: beat(1, "waiting for x from rank 1", 1), 1: beat(1, "waiting for y from rank 0", 0)}
    after = {0: beat(5, "waiting for x from rank 1", 1), 1: beat(5, "waiting for y from rank 0", 0)}
    head = diagnose(0, before, after, 2, 30.0, 30.0).splitlines()[0]
    assert "a cycle (a deadlock)" in head and "rank 0 (waiting for x" in head and "rank 1 (waiting for y" in head


def test_in_a_collective_the_rank_not_in_it_is_named():
    before = {0: beat(1, "SYNC:s0+s3", COLLECTIVE), 1: beat(1, "F2s1"), 2: beat(1, "SYNC:s0+s3", COLLECTIVE)}
    after = {r: dict(b, n=b["n"] + 2) for r, b in before.items()}
    head = diagnose(2, before, after, 3, 30.0, 30.0).splitlines()[0]
    assert "rank 1 (pid 101 on h) is running F2s1" in head and "while the others wait in a collective" in head


def test_a_peer_whose_program_ended_is_named():
    before = {0: beat(1, "waiting for x from rank 1", 1), 1: beat(9, ended=True, busy=False)}
    after = {0: beat(4, "waiting for x from rank 1", 1), 1: beat(9, ended=True, busy=False)}
    head = diagnose(0, before, after, 2, 30.0, 30.0).splitlines()[0]
    assert "rank 1 (pid 109 on h) has left the job" in head


def test_a_rank_that_never_arrived_is_named():
    """Rank 1 never wrote a heartbeat (stopped or still starting) while rank 0 waits in the rendezvous."""
    before = {0: beat(1, "the rendezvous (joining the process group)", COLLECTIVE)}
    after = {0: beat(4, "the rendezvous (joining the process group)", COLLECTIVE, took=8.0)}
    text = diagnose(0, before, after, 2, 8.0, 6.0)
    assert "rank 1 never arrived: it sent no heartbeat" in text.splitlines()[0]
    assert "rank 1: NEVER ARRIVED" in text


def test_a_peer_still_building_is_named_with_what_it_does():
    """A rank's own start-up work is not busy (never its own stall) but its heartbeat says what it is."""
    before = {0: beat(1, "the collectives that build a Pipeline", COLLECTIVE),
              1: beat(1, "building its stages (Pipeline start-up)", busy=False)}
    after = {0: beat(4, "the collectives that build a Pipeline", COLLECTIVE),
             1: beat(4, "building its stages (Pipeline start-up)", busy=False)}
    head = diagnose(0, before, after, 2, 30.0, 30.0).splitlines()[0]
    assert "rank 1 (pid 104 on h) is building its stages (Pipeline start-up) while the others" in head


def test_working_is_shown_but_never_a_stall_of_its_own(store):
    w = Watchdog(store(), 0, 1, timeout_s=0.01)
    w.working("building its stages (Pipeline start-up)")
    w._beat()
    got = json.loads(w.store.get("pipeoptim/beat/0"))
    assert got["what"] == "building its stages (Pipeline start-up)" and got["busy"] is False
    with w.during("loading checkpoint x"):
        assert w._doing.busy and w._doing.peer == COLLECTIVE
    assert not w._doing.busy and w._doing.what == "outside the pipeline"


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield lambda: dist.TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=timedelta(seconds=10))


def test_the_first_reason_published_wins(store):
    a, b = Watchdog(store(), 0, 2), Watchdog(store(), 1, 2)
    assert a.signal("rank 0: the first error") is True
    assert b.signal("rank 1: a later error") is False
    assert faults.published(store()) == "rank 0: the first error"


def test_a_lost_connection_lets_the_cause_be_published_first(store):
    """A rank that only saw its peer's connection close waits briefly: the launcher names the dead rank."""
    launcher = store()
    threading.Timer(0.3, faults.publish, (launcher, "rank 2 was killed by SIGKILL")).start()
    w = Watchdog(store(), 1, 3)
    assert w.signal("rank 1: Connection closed by peer", symptom=True) is False
    assert faults.published(launcher) == "rank 2 was killed by SIGKILL"


def test_heartbeat_says_what_the_main_thread_does(store):
    w = Watchdog(store(), 0, 1, beat_s=0.05, poll_s=0.02).start()
    try:
        w.doing("waiting for F1s0's input from rank 1", 1)
        time.sleep(0.3)
        got = json.loads(store().get("pipeoptim/beat/0"))
        assert got["what"] == "waiting for F1s0's input from rank 1" and got["peer"] == 1 and got["busy"]
        w.idle()
        time.sleep(0.3)
        assert json.loads(store().get("pipeoptim/beat/0"))["busy"] is False
    finally:
        w.stop()
    assert json.loads(store().get("pipeoptim/beat/0"))["ended"] is True


def test_timeout_default_grows_with_the_slowest_step(store):
    w = Watchdog(store(), 0, 1)
    assert w.timeout_s == DEFAULT_TIMEOUT_S
    w.measured(2.0)
    assert w.timeout_s == DEFAULT_TIMEOUT_S
    w.measured(60.0)
    assert w.timeout_s == STEP_FACTOR * 60.0
    w.timeout_s = 12.5
    assert w.timeout_s == 12.5
    with pytest.raises(ValueError, match="positive number of seconds"):
        w.timeout_s = 0


def test_exit_codes_and_signals_are_described():
    assert faults.describe_exit(-9) == "killed by SIGKILL"
    assert faults.describe_exit(faults.ABORT_EXIT) == "stopped after another process ended the job"
    assert faults.describe_exit(faults.STALL_EXIT) == "its watchdog found the job stuck"
    assert faults.describe_exit(faults.ORPHAN_EXIT) == "its torchrun agent was gone, so it ended itself"
    text = faults.killed_message(2, 1234, 9, 4)
    assert text.startswith("rank 2 of 4 (pid 1234) was killed by SIGKILL (signal 9)") and "out-of-memory" in text
    assert faults.is_connection_loss(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:123"))
    assert not faults.is_connection_loss(RuntimeError("shapes cannot be multiplied"))


ORPHAN = r"""
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from pipeoptim.runtime.watchdog import Watchdog
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=10))
Watchdog(store, 1, 2, agent_pid=int(sys.argv[2]), node="1").start()
time.sleep(60)  # the watchdog ends this process long before
"""


def test_a_rank_whose_torchrun_agent_is_gone_ends_itself_and_says_why(store):
    """A worker's agent (its parent) killed outright left it training on as an orphan (issue 24): the watchdog
    sees another parent than the agent it was given, publishes why and ends the process (exit ORPHAN_EXIT)."""
    import os
    import subprocess
    import sys
    server = store()
    gone = 999_999_999  # no process has this pid, so it is not this process's parent: "the agent is gone"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", ORPHAN, str(server.port), str(gone)], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == faults.ORPHAN_EXIT, proc.stderr
    reason = faults.published(server)
    assert reason.startswith(f"the torchrun agent of node 1 (pid {gone} on ") and "has ended without stopping its " \
        "workers" in reason and "so rank 1 (pid " in reason, reason
    assert f"[pipeoptim rank 1] {reason}" in proc.stderr
    assert time.monotonic() - t0 < 30


def test_a_rank_that_was_not_first_learns_the_cause(store):
    """The executor raises the published cause, not only its own symptom (under torchrun nothing else tells)."""
    a, b = Watchdog(store(), 0, 2), Watchdog(store(), 1, 2)
    assert a.signal("rank 0: the cause") is True and a.cause == "rank 0: the cause"
    assert b.signal("rank 1: Connection closed by peer", symptom=True) is False
    assert b.cause == "rank 0: the cause"


def test_a_rank_that_cannot_reach_the_store_learns_that_it_is_gone():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2))
    w = Watchdog(dist.TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=timedelta(seconds=2)), 1, 2)
    del server  # the process hosting the store ends
    assert w.signal("rank 1: Connection closed by peer", symptom=True) is False
    assert w.cause.startswith("lost the rendezvous store at 127.0.0.1:") and "hosting the store has ended" in w.cause
