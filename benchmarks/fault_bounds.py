"""How long each fault a long run meets takes to end the job cleanly, measured by injecting it for real.

Every scenario starts a real job in a session of its own (tests/fault_harness.py), waits until it is training
(its first checkpoints are on disk), injects the fault (SIGKILL, SIGSTOP, SIGTERM, SIGINT to a rank or to the
launcher; a port taken; a NaN) and measures the time from the fault to the moment no process of the job is
left. Start-up time is not counted. Writes benchmarks/results/fault_bounds.csv; the README's table "What
happens when things go wrong" quotes it.

    python benchmarks/fault_bounds.py                  # every scenario once
    python benchmarks/fault_bounds.py --repeat 3       # the worst of three per scenario
    python benchmarks/fault_bounds.py --only kill-rank2,torchrun-kill   # replaces these rows of the CSV only
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import fault_harness as fh  # noqa: E402

WATCHDOG_S = 10
TRAIN = ["--model", "tiny", "--steps", "100000", "--save-every", "1", "--no-progress"]
JOB = os.path.join(fh.TESTS, "fault_jobs.py")


def _first_line(text: str, *keys: str) -> str:
    for line in text.splitlines():
        if any(k in line for k in keys):
            return line.strip()[:220]
    return text.strip().splitlines()[-1][:220] if text.strip() else ""


def _train(tmp: str, *extra: str) -> tuple[fh.Job, str]:
    run = os.path.join(tmp, "run")
    job = fh.Job(fh.train_cmd(*TRAIN, "--run-dir", run, *extra), tmp)
    fh.wait_for(os.path.join(run, "checkpoint", "step-00000002", "manifest.json"), job, timeout=600)
    return job, run


def _measure(job: fh.Job, inject, timeout: float) -> tuple[int, float]:
    job.members()
    t0 = time.monotonic()
    inject()
    code = job.wait(timeout)
    return code, time.monotonic() - t0 + job.ended_cleanly(30)


def kill_rank(rank: int):
    def run(tmp):
        job, _ = _train(tmp)
        code, took = _measure(job, lambda: os.kill(fh.rank_pid(job, rank), signal.SIGKILL), 120)
        return code, took, _first_line(job.text(), "failed:")
    return run


def stop_rank(tmp):
    job, _ = _train(tmp, "--watchdog-s", str(WATCHDOG_S))
    code, took = _measure(job, lambda: os.kill(fh.rank_pid(job, 1), signal.SIGSTOP), 300)
    return code, took, _first_line(job.text(), "failed:")


def signal_launcher(sig):
    def run(tmp):
        job, _ = _train(tmp)
        code, took = _measure(job, lambda: os.kill(job.proc.pid, sig), 120)
        return code, took, _first_line(job.text(), "stopped by", "Killed")
    return run


def _torchrun(tmp, nprocs=4, **env):
    markers = os.path.join(tmp, "markers")
    os.makedirs(markers)
    job = fh.Job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs), JOB,
                  "torchrun", markers], tmp, **env)
    for r in range(nprocs):
        fh.wait_for(os.path.join(markers, f"running.{r}"), job, timeout=600)
    return job


def torchrun_kill(tmp):
    job = _torchrun(tmp)
    code, took = _measure(job, lambda: os.kill(fh.rank_pid(job, 1), signal.SIGKILL), 120)
    return code, took, _first_line(job.text(), "SIGKILL", "exitcode")


def torchrun_stop(tmp):
    job = _torchrun(tmp, PIPEOPTIM_WATCHDOG_S=WATCHDOG_S)
    code, took = _measure(job, lambda: os.kill(fh.rank_pid(job, 1), signal.SIGSTOP), 300)
    return code, took, _first_line(job.text(), "stopped responding")


def hang_stage(tmp):
    markers = os.path.join(tmp, "markers")
    os.makedirs(markers)
    job = fh.Job([sys.executable, JOB, "launch", "4", markers, "--watchdog", str(WATCHDOG_S), "--hang-rank", "2"], tmp)
    for r in range(4):
        fh.wait_for(os.path.join(markers, f"running.{r}"), job, timeout=600)
    # the hang starts by itself at the third step: count from the moment every rank has trained one
    code, took = _measure(job, lambda: None, 300)
    return code, took, _first_line(job.text(), "made no progress")


def nan_loss(tmp):
    """The time counted: from the commit of the checkpoint the stop writes to the last process gone."""
    run = os.path.join(tmp, "run")
    job = fh.Job(fh.train_cmd("--model", "tiny", "--optimizer", "sgd", "--lr", "1e30", "--clip", "0", "--steps",
                              "50", "--no-progress", "--run-dir", run), tmp)
    code = job.wait(600)
    job.ended_cleanly(30)
    ended = time.time()
    stop = json.load(open(os.path.join(run, "history.json")))["history"][-1]["step"]
    manifest = os.path.join(run, "checkpoint", f"step-{stop:08d}", "manifest.json")
    return code, ended - os.path.getmtime(manifest), _first_line(job.text(), "stopped at")


def torchrun_restart(tmp):
    """The time counted: from the SIGKILL to the restarted attempt's first new checkpoint (training again);
    then the job is stopped with SIGTERM (its exit status is that stop's)."""
    run = os.path.join(tmp, "run")
    job = fh.Job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "--max-restarts", "1", "-m", "pipeoptim.cli", "train", *TRAIN, "--stages", "2", "--run-dir", run,
                  "--resume", "auto"], tmp)
    fh.wait_for(os.path.join(run, "checkpoint", "step-00000002", "manifest.json"), job, timeout=600)
    job.members()
    t0 = time.monotonic()
    os.kill(fh.rank_pid(job, 1), signal.SIGKILL)

    def training_again():
        m = re.search(r"resuming from \S+ \(step (\d+) of", job.text())
        root = os.path.join(run, "checkpoint")
        return bool(m) and any(int(d[5:]) > int(m.group(1)) and os.path.exists(os.path.join(root, d, "manifest.json"))
                               for d in os.listdir(root) if re.fullmatch(r"step-\d+", d))
    training_again.description = "the restarted attempt's first new checkpoint"
    fh.wait_for(training_again, job, timeout=300)
    took = time.monotonic() - t0
    os.kill(job.proc.pid, signal.SIGTERM)
    code = job.wait(120)
    job.ended_cleanly(30)
    return code, took, _first_line(job.text(), "resuming from")


def port_taken(tmp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        job = fh.Job(fh.train_cmd(*TRAIN, "--run-dir", os.path.join(tmp, "run"), "--port",
                                  str(s.getsockname()[1])), tmp)
        t0 = time.monotonic()
        code = job.wait(300)
        took = time.monotonic() - t0 + job.ended_cleanly(30)
    return code, took, _first_line(job.text(), "already in use")


SCENARIOS = {
    "kill-rank2": ("pipeoptim train, SIGKILL to rank 2 of 4", kill_rank(2), 30),
    "kill-rank0": ("pipeoptim train, SIGKILL to rank 0 of 4", kill_rank(0), 30),
    "stop-rank1": (f"pipeoptim train --watchdog-s {WATCHDOG_S}, SIGSTOP to rank 1", stop_rank, WATCHDOG_S + 30),
    "hang-stage": (f"Pipeline under runtime.launch, stage 2's forward never returns (watchdog {WATCHDOG_S} s)",
                   hang_stage, WATCHDOG_S + 30),
    "sigterm": ("pipeoptim train, SIGTERM to the launcher", signal_launcher(signal.SIGTERM), 30),
    "sigint": ("pipeoptim train, SIGINT (Ctrl-C) to the launcher", signal_launcher(signal.SIGINT), 30),
    "kill-launcher": ("pipeoptim train, SIGKILL to the launcher", signal_launcher(signal.SIGKILL), 30),
    "torchrun-kill": ("torchrun --nproc-per-node 4, SIGKILL to rank 1", torchrun_kill, 30),
    "torchrun-stop": (f"torchrun, PIPEOPTIM_WATCHDOG_S={WATCHDOG_S}, SIGSTOP to rank 1", torchrun_stop,
                      WATCHDOG_S + 60),
    "torchrun-restart": ("torchrun --max-restarts 1 ... pipeoptim train --resume auto, SIGKILL to rank 1 of 2; "
                         "seconds to the restarted run's first new checkpoint", torchrun_restart, 60),
    "nan": ("pipeoptim train --optimizer sgd --lr 1e30 --clip 0 (the loss turns NaN)", nan_loss, 30),
    "port": ("pipeoptim train --port <a port in use>", port_taken, 30),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--only", default=None, help="comma-separated scenario names: " + ", ".join(SCENARIOS))
    p.add_argument("--csv", default=os.path.join(HERE, "results", "fault_bounds.csv"))
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    rows = []
    for name in names:
        what, run, bound = SCENARIOS[name]
        times, code, seen = [], None, ""
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix=f"fault-{name}-") as tmp:
                try:
                    code, took, seen = run(tmp)
                finally:
                    fh.cleanup()
                times.append(took)
        worst = max(times)
        rows.append({"scenario": name, "fault": what, "exit_status": code, "seconds_to_clean_end": f"{worst:.1f}",
                     "bound_s": bound, "runs": len(times), "user_sees": seen})
        print(f"{name:14s} exit {code!s:>4}  {worst:6.1f} s (bound {bound} s)  {seen}", flush=True)
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    kept = []  # the rows of scenarios not run this time stay (--only reruns some)
    if os.path.exists(args.csv):
        with open(args.csv, newline="") as f:
            kept = [r for r in csv.DictReader(f) if r["scenario"] not in names and r["scenario"] in SCENARIOS]
    order = list(SCENARIOS)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(sorted(kept + rows, key=lambda r: order.index(r["scenario"])))
    print(f"wrote {args.csv}")
    return 0 if all(float(r["seconds_to_clean_end"]) < r["bound_s"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
