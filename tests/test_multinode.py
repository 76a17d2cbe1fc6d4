"""Multi-node torchrun, proven on one machine: two torchrun agents as two nodes (``--nnodes 2 --nproc-per-node
2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``) run a 4-stage ``Pipeline`` and ``pipeoptim train``
with exactly the losses of one 4-process run; a node's agent killed by SIGKILL ends the job within a bound,
with an error naming that agent, and leaves no process behind. The README's multi-node recipe is these
command lines.

Node 0's agent is started first and hosts the c10d rendezvous store (torch binds it in whichever agent runs
on the endpoint's host first); the agent killed is node 1's, whose workers would otherwise train on as
orphans. Marked slow (each job starts 4-6 Python processes that import torch); CI runs it (scripts/test.sh
runs every test, slow ones included).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import uuid

import pytest

import fault_harness as fh

pytestmark = pytest.mark.slow

JOB = os.path.join(fh.TESTS, "multinode_job.py")
KILL_BOUND_S = 60.0   # from the agent's SIGKILL to every process of both nodes gone
START_S = 240.0       # generous: 6 processes importing torch on 2 busy cores
TINY_TRAIN = ["--model", "tiny", "--stages", "4", "--steps", "3", "--microbatches", "4", "--microbatch-size", "2",
              "--no-progress", "--save-every", "0", "--eval-every", "0"]


@pytest.fixture(autouse=True, scope="module")
def _no_leftovers():
    """Kill whatever a failed test left (module-wide: two tests share one running job)."""
    yield
    fh.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def listening(port: int) -> list[str]:
    """The local addresses on which a socket listens on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.append(_address(addr))
    return found


def _address(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # each 32-bit word in host order
    return socket.inet_ntop(socket.AF_INET6, words)


class TwoNodes:
    """Two torchrun agents on this machine, as the README's recipe starts them on two; node 0 first, so that
    it hosts the rendezvous store."""

    def __init__(self, tmp_path, entry: list[str]):
        self.port, rdzv_id = _free_port(), f"test-{uuid.uuid4().hex[:12]}"
        self.jobs, self.store_addresses = [], []
        for node in (0, 1):
            workdir = tmp_path / f"node{node}"
            workdir.mkdir()
            cmd = _torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                            "--rdzv-id", rdzv_id, *entry)
            self.jobs.append(fh.Job(cmd, str(workdir)))
            if node == 0:
                self._wait_for_store()

    def _wait_for_store(self) -> None:
        t0 = time.monotonic()
        while not (found := listening(self.port)):
            if self.jobs[0].proc.poll() is not None or time.monotonic() - t0 > START_S:
                self.jobs[0].kill_all()
                raise AssertionError(f"node 0's agent never listened on {self.port}:\n{self.jobs[0].text()}")
            time.sleep(0.1)
        self.store_addresses = found

    def wait(self, timeout: float = START_S) -> list[int]:
        return [job.wait(timeout) for job in self.jobs]

    def text(self) -> str:
        return "\n".join(f"--- node {n} ---\n{job.text()}" for n, job in enumerate(self.jobs))


def _losses(path) -> list[float]:
    return [float(line) for line in open(path).read().split()]


def _losses_emulated() -> list[float]:
    import multinode_job
    pipe = multinode_job.tiny_pipeline(emulate=True, devices=4)
    return [pipe.train_step(multinode_job.batch(step)) for step in range(multinode_job.STEPS)]


@pytest.fixture(scope="module")
def pipeline_on_two_nodes(tmp_path_factory):
    """The two-node Pipeline job, trained its STEPS steps and training on (``--then-wait``) until a test
    kills it; with the 4-process reference run first."""
    tmp = tmp_path_factory.mktemp("pipeline")
    one = fh.Job(_torchrun("--standalone", "--nproc-per-node", "4", JOB, str(tmp / "one.txt")), str(tmp))
    assert one.wait(START_S) == 0, one.text()
    nodes = TwoNodes(tmp, [JOB, str(tmp / "two.txt"), "--then-wait"])
    fh.wait_for(str(tmp / "two.txt"), nodes.jobs[0], timeout=START_S)
    yield nodes, _losses(tmp / "one.txt"), _losses(tmp / "two.txt")
    for job in nodes.jobs:
        job.kill_all()


def test_pipeline_on_two_nodes_has_the_losses_of_one_four_process_run(pipeline_on_two_nodes):
    nodes, one, two = pipeline_on_two_nodes
    assert len(one) == 3 and two == one  # bit for bit: the same ranks, the same gloo reductions
    assert _losses_emulated() == one  # and the emulator's (one process), as tests/test_runtime.py has it
    # the c10d rendezvous store listens on every interface, even for a loopback endpoint (the README says so)
    assert nodes.store_addresses and set(nodes.store_addresses) <= {"0.0.0.0", "::"}, nodes.store_addresses


def test_a_killed_agent_ends_the_job_naming_it(pipeline_on_two_nodes):
    """SIGKILL to node 1's agent while the job trains: its workers, orphaned, end themselves and publish why;
    node 0's ranks stop with that reason and node 0's agent ends the job, non-zero, within the bound."""
    nodes, _, _ = pipeline_on_two_nodes
    node0, node1 = nodes.jobs
    for job in nodes.jobs:
        job.members()  # record every worker now: node 1's are re-parented once their agent is gone
    t0 = time.monotonic()
    os.kill(node1.proc.pid, signal.SIGKILL)
    code = node0.wait(KILL_BOUND_S)
    ended = time.monotonic() - t0
    gone = ended + max(node0.ended_cleanly(), node1.ended_cleanly())
    text = nodes.text()
    assert code != 0, text
    said = re.search(r"the torchrun agent of node (\d) \(pid (\d+) on [^)]*\) has ended without stopping its "
                     r"workers", node0.text())
    assert said and int(said.group(2)) == node1.proc.pid, text  # node 0's ranks read the reason: node 1's agent
    # torchrun's own report: exit 3 from a rank its watchdog stopped, 1 from one whose step failed first (on the
    # closed connection; its error then starts with the same reason)
    assert "Root Cause" in node0.text() and re.search(r"exitcode  : [13] ", node0.text()), text
    assert gone < KILL_BOUND_S, f"{gone:.1f} s to a clean end"
    print(f"node 0's agent ended {ended:.1f} s after node 1's agent was killed; every process gone at {gone:.1f} s")


def test_the_agent_hosting_the_store_killed_ends_the_job_naming_it(tmp_path):
    """SIGKILL to node 0's agent, which hosts both stores (c10d's rendezvous and the workers'): node 1's ranks
    lose the store and say whose it was, or node 1's agent says it lost c10d's store; node 0's orphaned ranks
    end too, node 1's agent ends non-zero."""
    nodes = TwoNodes(tmp_path, [JOB, str(tmp_path / "losses.txt"), "--then-wait"])
    node0, node1 = nodes.jobs
    fh.wait_for(str(tmp_path / "losses.txt"), node0, timeout=START_S)
    for job in nodes.jobs:
        job.members()
    t0 = time.monotonic()
    os.kill(node0.proc.pid, signal.SIGKILL)
    code = node1.wait(KILL_BOUND_S)
    ended = time.monotonic() - t0
    gone = ended + max(node0.ended_cleanly(), node1.ended_cleanly())
    text = nodes.text()
    assert code != 0, text
    # whichever notices first: node 1's ranks (their watchdogs, or a step failing on the closed connection), or
    # node 1's agent, whose next rendezvous call fails and which then stops its ranks before they can speak
    ours = ("lost the rendezvous store at" in node1.text()
            and "the torchrun agent of node 0 (the job's first node: it hosts the store) has ended" in node1.text())
    assert ours or "The connection to the C10d store has failed" in node1.text(), text
    assert gone < KILL_BOUND_S, f"{gone:.1f} s to a clean end"
    print(f"node 1's agent ended {ended:.1f} s after node 0's agent was killed; every process gone at {gone:.1f} s")


def test_pipeoptim_train_on_two_nodes_has_the_losses_of_one_four_process_run(tmp_path):
    """``torchrun ... -m pipeoptim.cli train``: every process is one rank; rank 0 reports, as the launcher does."""
    one = fh.Job(fh.train_cmd(*TINY_TRAIN, "--run-dir", str(tmp_path / "one")), str(tmp_path))
    nodes = None
    try:
        assert one.wait(START_S) == 0, one.text()
        nodes = TwoNodes(tmp_path, ["-m", "pipeoptim.cli", "train", *TINY_TRAIN, "--run-dir",
                                    str(tmp_path / "two")])
        assert nodes.wait() == [0, 0], nodes.text()
    finally:
        for job in [one] + (nodes.jobs if nodes else []):
            job.kill_all()

    def history(run):
        return [h["loss"] for h in json.load(open(tmp_path / run / "history.json"))["history"]]
    assert len(history("one")) == 3 and history("two") == history("one"), nodes.text()
    final = re.findall(r"final loss: (\S+)", one.text())
    assert final and re.findall(r"final loss: (\S+)", nodes.text()) == final, nodes.text()  # rank 0 only
    assert os.path.isdir(tmp_path / "two" / "checkpoint"), nodes.text()


def test_sigterm_to_one_nodes_agent_stops_both_nodes_after_one_step_with_a_checkpoint(tmp_path):
    """A scheduler's SIGTERM to one node: its agent passes it on to its workers, which carry the request in the
    iteration's scalars to the other node's ranks; every rank stops after the same step and the checkpoint of
    that step is written (torchrun's agents then end with their own status)."""
    run = tmp_path / "run"
    flags = [f for i, f in enumerate(TINY_TRAIN) if f not in ("--steps", "--save-every")
             and TINY_TRAIN[i - 1] not in ("--steps", "--save-every")]
    nodes = TwoNodes(tmp_path, ["-m", "pipeoptim.cli", "train", *flags, "--steps", "100000", "--save-every", "3",
                                "--run-dir", str(run)])
    try:
        def saved():
            root = run / "checkpoint"
            return root.is_dir() and any((d / "manifest.json").exists() for d in root.iterdir())
        saved.description = f"a committed checkpoint in {run / 'checkpoint'}"
        fh.wait_for(saved, nodes.jobs[0], timeout=START_S)
        os.kill(nodes.jobs[1].proc.pid, signal.SIGTERM)
        nodes.wait()
        text = nodes.text()
    finally:
        for job in nodes.jobs:
            job.kill_all()
    m = re.search(r"stopped by SIGTERM after step (\d+) of 100000: every rank stopped after that step, whose "
                  r"checkpoint is (\S+); continue with --resume", text)
    assert m, text
    at = int(m.group(1))
    assert (run / "checkpoint" / f"step-{at:08d}" / "manifest.json").exists(), text
    assert [h["step"] for h in json.load(open(run / "history.json"))["history"]] == list(range(1, at + 1))
