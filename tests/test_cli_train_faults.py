"""`pipeoptim train` meeting the faults of a long run, injected for real: a rank SIGKILLed, SIGTERM/SIGINT and
SIGKILL to the launcher, two runs on one machine, a port taken, checkpoints truncated and corrupted, a loss
that turns NaN. Each ends with the exit status and message the README's table promises, nothing left
running, and a checkpoint that --resume continues from."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest
import torch

import fault_harness as fh

BOUND_S = 30.0  # from the fault to every process of the run gone (README, "What happens when things go wrong")
SMALL = ["--model", "tiny", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2", "--schedule", "1f1b"]


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    fh.cleanup()


def _start(tmp_path, *args, name="run"):
    run = tmp_path / name
    job = fh.Job(fh.train_cmd(*SMALL, "--run-dir", str(run), *args), str(tmp_path))
    return job, run


def _saved(run, step):
    """Wait condition: a committed checkpoint at ``step`` or later. Not step-<step> itself: with --save-every 1
    the newest few are kept, and a fast machine writes and prunes step 2 between two looks."""
    def reached():
        root = run / "checkpoint"
        return root.is_dir() and any(re.fullmatch(r"step-\d+", d.name) and int(d.name[5:]) >= step
                                     and (d / "manifest.json").exists() for d in root.iterdir())
    reached.description = f"a committed checkpoint at step {step} or later in {run / 'checkpoint'}"
    return reached


def _run(tmp_path, *args, timeout=300):
    job = fh.Job(fh.train_cmd(*SMALL, *args), str(tmp_path))
    code = job.wait(timeout)
    return code, job.text()


def test_sigkilled_rank0_ends_the_run_and_resume_continues(tmp_path):
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "1")  # progress bar on: rank 0 holds a lock
    fh.wait_for(_saved(run, 2), job)
    t0 = time.monotonic()
    os.kill(fh.rank_pid(job, 0), signal.SIGKILL)
    code = job.wait(BOUND_S + 30)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code == 1, text
    assert "rank 0 of 2" in text and "killed by SIGKILL" in text, text
    assert "the newest intact checkpoint is" in text and "continue with --resume" in text, text
    assert gone < BOUND_S, f"{gone:.1f} s to a clean end"
    assert not fh.shm_left(job.shm_before)
    at = max(int(p.name.split("-")[1]) for p in (run / "checkpoint").iterdir() if (p / "manifest.json").exists())
    code, text = _run(tmp_path, "--run-dir", str(run), "--resume", "--steps", str(at + 2), "--emulate",
                      "--no-progress")
    assert code == 0, text
    assert f"resuming from {run}/checkpoint/step-{at:08d} (step {at} of {at + 2})" in text, text
    history = json.load(open(run / "history.json"))["history"]
    assert [h["step"] for h in history] == list(range(1, at + 3))


def _history_is_the_newest_checkpoints(run):
    """history.json (and loss.png) hold exactly the steps of the newest committed checkpoint: what a --resume
    continues (issue 44.3: after SIGINT or a second SIGTERM there were none; after a dead rank, older ones)."""
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoint").iterdir()
                 if re.fullmatch(r"step-\d+", p.name) and (p / "manifest.json").exists())
    assert [h["step"] for h in json.load(open(run / "history.json"))["history"]] == list(range(1, newest + 1))
    assert (run / "loss.png").stat().st_size > 1000
    return newest


def test_sigint_to_the_launcher_ends_every_rank(tmp_path):
    sig = signal.SIGINT
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "1", "--no-progress")
    fh.wait_for(_saved(run, 2), job)
    ranks = [fh.rank_pid(job, r) for r in range(2)]
    t0 = time.monotonic()
    os.kill(job.proc.pid, sig)
    code = job.wait(BOUND_S + 30)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code == 128 + sig, text
    assert f"stopped by {sig.name}: every rank has ended" in text, text
    assert gone < BOUND_S, f"{gone:.1f} s to a clean end"
    assert not any(os.path.exists(f"/proc/{p}") and fh._state(p) != "Z" for p in ranks)
    assert _history_is_the_newest_checkpoints(run) >= 2


def test_a_second_sigterm_still_leaves_the_newest_checkpoints_history(tmp_path):
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "1", "--no-progress")
    fh.wait_for(_saved(run, 2), job)
    os.kill(job.proc.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(BOUND_S + 30) == 128 + signal.SIGTERM, job.text()
    assert _history_is_the_newest_checkpoints(run) >= 2


def test_a_rank_killed_in_a_resumed_run_leaves_the_history_of_its_newest_checkpoint(tmp_path):
    # issue 44.3: killed after step 50 was committed, history.json held the first 40 windows (the first run's)
    code, text = _run(tmp_path, "--run-dir", str(tmp_path / "run"), "--steps", "3", "--no-progress")
    assert code == 0, text
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "2", "--resume", "--no-progress")
    fh.wait_for(_saved(run, 7), job)
    os.kill(fh.rank_pid(job, 1), signal.SIGKILL)
    assert job.wait(BOUND_S + 30) == 1, job.text()
    assert _history_is_the_newest_checkpoints(run) >= 7


def _stopped_by_sigterm(tmp_path, job, run, *resume_args):
    """After SIGTERM: exit 143 within the bound, every process gone, the message naming the step, a committed
    checkpoint of exactly that step (the newest), history.json up to it; --resume continues from it."""
    t0 = time.monotonic()
    code = job.wait(BOUND_S + 30)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    text = job.text()
    assert code == 128 + signal.SIGTERM, text
    m = re.search(r"stopped by SIGTERM after step (\d+) of 100000: every rank stopped after that step, whose "
                  r"checkpoint is (\S+); continue with --resume", text)
    assert m, text
    at = int(m.group(1))
    assert m.group(2) == str(run / "checkpoint" / f"step-{at:08d}"), text
    assert "final loss" not in text, text
    assert gone < BOUND_S, f"{gone:.1f} s to a clean end"
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoint").iterdir() if (p / "manifest.json").exists())
    assert newest == at >= 2
    assert [h["step"] for h in json.load(open(run / "history.json"))["history"]] == list(range(1, at + 1))
    code, text = _run(tmp_path, "--run-dir", str(run), "--resume", "--steps", str(at + 2), "--no-progress",
                      *resume_args)
    assert code == 0, text
    assert f"resuming from {run}/checkpoint/step-{at:08d} (step {at} of {at + 2})" in text, text
    assert [h["step"] for h in json.load(open(run / "history.json"))["history"]] == list(range(1, at + 3))


def test_sigterm_to_the_launcher_stops_every_rank_after_one_step_with_a_checkpoint(tmp_path):
    """A scheduler's SIGTERM (before it kills the job): the launcher passes it on, the ranks agree on the step
    in the iteration's scalars, stop after it and save it, so nothing trained is lost."""
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "3", "--no-progress")
    fh.wait_for(_saved(run, 3), job)
    ranks = [fh.rank_pid(job, r) for r in range(2)]
    os.kill(job.proc.pid, signal.SIGTERM)
    _stopped_by_sigterm(tmp_path, job, run, "--emulate")
    assert not any(os.path.exists(f"/proc/{p}") and fh._state(p) != "Z" for p in ranks)


def test_sigterm_to_the_whole_process_group_stops_every_rank_once(tmp_path):
    """``kill -TERM -<pgid>``, as some schedulers do: the launcher and every rank get it at once; the ranks still
    stop after the same step."""
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "3", "--no-progress")
    fh.wait_for(_saved(run, 3), job)
    for pid in [job.proc.pid] + [fh.rank_pid(job, r) for r in range(2)]:
        os.kill(pid, signal.SIGTERM)
    _stopped_by_sigterm(tmp_path, job, run, "--emulate")


def test_sigterm_to_torchruns_agent_stops_every_rank_after_one_step_with_a_checkpoint(tmp_path):
    """torchrun's agent passes SIGTERM on to its workers (and ends with its own traceback and status, which are
    torchrun's); the ranks stop after the same step and rank 0 says so, with the checkpoint of that step."""
    import sys
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pipeoptim.cli", "train", *SMALL, "--run-dir", str(run), "--steps", "100000", "--save-every", "3",
           "--no-progress"]
    job = fh.Job(cmd, str(tmp_path))
    fh.wait_for(_saved(run, 3), job)
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait(BOUND_S + 30)
    job.ended_cleanly()
    text = job.text()
    m = re.search(r"stopped by SIGTERM after step (\d+) of 100000: every rank stopped after that step, whose "
                  r"checkpoint is (\S+); continue with --resume", text)
    assert m, text
    at = int(m.group(1))
    assert m.group(2) == str(run / "checkpoint" / f"step-{at:08d}"), text
    assert (run / "checkpoint" / f"step-{at:08d}" / "manifest.json").exists()
    code, text = _run(tmp_path, "--run-dir", str(run), "--resume", "--steps", str(at + 1), "--no-progress",
                      "--emulate")
    assert code == 0 and f"resuming from {run}/checkpoint/step-{at:08d}" in text, text


def test_torchrun_restarts_a_killed_rank_and_resume_auto_continues_as_if_nothing_happened(tmp_path):
    """One command for a run's first start and its restarts: under ``torchrun --max-restarts 1``, ``--resume
    auto`` starts afresh, a rank SIGKILLed after a checkpoint ends that attempt, torchrun starts the job again
    with the same command, and it resumes from the newest checkpoint: the losses of every step are those of a
    run that was never interrupted."""
    import sys
    steps = 40
    flags = [*SMALL, "--steps", str(steps), "--save-every", "2", "--keep-checkpoints", "40", "--no-progress",
             "--eval-every", "0"]
    (tmp_path / "once").mkdir()
    (tmp_path / "restarted").mkdir()
    once = fh.Job(fh.train_cmd(*flags, "--run-dir", str(tmp_path / "once" / "run")), str(tmp_path / "once"))
    assert once.wait(240) == 0, once.text()
    run = tmp_path / "restarted" / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "pipeoptim.cli", "train", *flags, "--run-dir", str(run), "--resume", "auto"]
    job = fh.Job(cmd, str(tmp_path / "restarted"))
    fh.wait_for(_saved(run, 2), job)
    os.kill(fh.rank_pid(job, 1), signal.SIGKILL)
    code = job.wait(240)
    job.ended_cleanly()
    text = job.text()
    assert code == 0, text
    m = re.search(r"resuming from (\S+)/step-(\d+) \(step (\d+) of 40\)", text)
    assert m and 2 <= int(m.group(3)) < steps, text  # the second attempt resumed; the first had started afresh
    history = lambda d: [h["loss"] for h in json.load(open(d / "history.json"))["history"]]  # noqa: E731
    assert len(history(run)) == steps and history(run) == history(tmp_path / "once" / "run"), text


def test_sigterm_to_an_emulated_run_stops_it_with_a_checkpoint(tmp_path):
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "3", "--no-progress", "--emulate")
    fh.wait_for(_saved(run, 3), job)
    os.kill(job.proc.pid, signal.SIGTERM)
    _stopped_by_sigterm(tmp_path, job, run, "--emulate")


def test_sigkilled_launcher_takes_its_ranks_along(tmp_path):
    job, run = _start(tmp_path, "--steps", "100000", "--save-every", "1", "--no-progress")
    fh.wait_for(_saved(run, 2), job)
    job.members()  # record the ranks before their parent goes
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGKILL)
    job.wait(30)
    gone = time.monotonic() - t0 + job.ended_cleanly()
    assert gone < BOUND_S, f"{gone:.1f} s to a clean end"


def test_two_runs_on_one_machine_both_finish(tmp_path):
    a, _ = _start(tmp_path, "--steps", "40", "--no-progress", name="a")
    b, _ = _start(tmp_path, "--steps", "40", "--no-progress", name="b")
    fh.rank_pid(a, 1), fh.rank_pid(b, 1)
    assert a.proc.poll() is None and b.proc.poll() is None, "the two runs were meant to overlap"
    assert a.wait(300) == 0, a.text()
    assert b.wait(300) == 0, b.text()
    assert "final loss:" in a.text() and "final loss:" in b.text()


def test_a_run_dir_in_use_is_refused_naming_its_holder(tmp_path):
    import fcntl
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as held:  # what a running pipeoptim train holds for its run directory
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242")
        held.flush()
        code, text = _run(tmp_path, "--run-dir", str(run), "--steps", "1", "--no-progress")
    assert code == 2 and f"{run} is in use by another pipeoptim train (pid 4242)" in text, text
    assert not (run / "checkpoint").exists()


def test_port_in_use_is_reported_before_any_rank_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, text = _run(tmp_path, "--run-dir", str(tmp_path / "r"), "--port", str(port), "--no-progress")
    assert code == 2 and f"port {port} on this machine is already in use" in text, text


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 3])
    else:  # flip one byte in the middle: same size, different contents
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])


def test_damaged_checkpoints_are_named_and_resume_takes_the_newest_intact_one(tmp_path):
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--emulate", "--no-progress"]
    code, text = _run(tmp_path, *common, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "3")
    assert code == 0, text
    ck = run / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000003", "step-00000004"]
    _damage(ck / "step-00000004" / "part-0.pt", "truncate")
    _damage(ck / "step-00000003" / "part-0.pt", "flip")
    (ck / "step-00000005").mkdir()  # a checkpoint the run died writing: parts, no manifest
    (ck / "step-00000005" / "part-0.pt").write_bytes(b"half")
    # resumed on 4 stages instead of 2: checkpoints load into any stage count
    code, text = _run(tmp_path, *common, "--steps", "5", "--resume", "--stages", "4")
    assert code == 0, text
    assert "step-00000005 is incomplete: it has no manifest.json" in text, text
    assert f"{ck}/step-00000004/part-0.pt is truncated" in text, text
    assert f"{ck}/step-00000003/part-0.pt is corrupted" in text, text
    assert f"resuming from {ck}/step-00000002 (step 2 of 5)" in text, text
    history = json.load(open(run / "history.json"))["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]


def test_resume_refuses_what_cannot_carry_over(tmp_path):
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--emulate", "--no-progress"]
    code, text = _run(tmp_path, *common, "--steps", "1")
    assert code == 0, text
    code, text = _run(tmp_path, *common, "--steps", "2", "--resume", "--optimizer", "sgd")
    assert code == 2 and "written with --optimizer muon and this run asks for --optimizer sgd" in text, text
    code, text = _run(tmp_path, *common, "--steps", "2", "--resume", "--schedule", "async-1f1b")
    assert code == 2 and "the learning-rate schedule would not carry over" in text, text


def test_nan_stops_with_a_checkpoint_of_the_last_finite_state(tmp_path):
    run = tmp_path / "run"
    # SGD with an absurd learning rate: the weights blow up and the loss turns NaN within a few steps
    blowup = ["--emulate", "--no-progress", "--optimizer", "sgd", "--lr", "1e30", "--clip", "0"]
    code, text = _run(tmp_path, *blowup, "--steps", "20", "--run-dir", str(run))
    assert code == 3, text
    assert "stopped at step" in text and "the loss was nan" in text, text
    stop = json.load(open(run / "history.json"))["history"][-1]["step"]
    assert stop < 20 and f"checkpoint of the last finite state: {run}/checkpoint/step-{stop:08d}" in text, text
    part = torch.load(run / "checkpoint" / f"step-{stop:08d}" / "part-0.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in part["params"].values())
    code, text = _run(tmp_path, *blowup, "--steps", "4", "--on-nonfinite", "skip", "--run-dir", str(tmp_path / "skip"))
    assert code == 0, text
    skipped = [h for h in json.load(open(tmp_path / "skip" / "history.json"))["history"] if h["skipped"]]
    assert skipped, "the run was meant to meet a NaN"


def test_the_wait_sees_a_checkpoint_whose_step_was_already_pruned(tmp_path):
    # regression: the tests waited for step-00000002/manifest.json itself; with --save-every 1 a fast machine
    # wrote and pruned it between two looks, and the wait ran into its 180 s timeout on a healthy job
    run = tmp_path / "run"
    reached = _saved(run, 2)
    assert not reached()                                     # no checkpoint directory yet
    (run / "checkpoint" / "step-00000001").mkdir(parents=True)
    (run / "checkpoint" / "step-00000001" / "manifest.json").write_text("{}")
    (run / "checkpoint" / "step-00000007.damaged").mkdir()
    (run / "checkpoint" / "step-00000008").mkdir()           # being written: no manifest yet
    assert not reached()
    (run / "checkpoint" / "step-00000006").mkdir()
    (run / "checkpoint" / "step-00000006" / "manifest.json").write_text("{}")
    assert reached()
