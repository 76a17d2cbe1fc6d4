"""``pipeoptim train`` under torchrun: how a process knows torchrun started it, the flags refused there (before
torch loads), that a parent which is not a torchrun agent is never watched as one, and one data-parallel job
(``--stages 2 --dp 2``) against one pipeline on the doubled batch. The multi-node jobs run in
tests/test_multinode.py, the faults in tests/test_cli_train_faults.py."""
from __future__ import annotations

import pytest

from pipeoptim.job.torchrun import TorchrunEnv, torchrun_env
from pipeoptim.cli.train import main
from pipeoptim.runtime.dist_env import torchrun_agent

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0"}


@pytest.fixture
def under_torchrun(monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIPEOPTIM_LAUNCHED", raising=False)


def test_torchrun_is_told_by_its_environment(monkeypatch, under_torchrun):
    assert torchrun_env() == TorchrunEnv(rank=1, world_size=4, local_world_size=2)
    monkeypatch.setenv("PIPEOPTIM_LAUNCHED", "1")  # runtime.launch's workers carry torchrun's variables too
    assert torchrun_env() is None
    monkeypatch.delenv("PIPEOPTIM_LAUNCHED")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert torchrun_env() is None


@pytest.mark.parametrize("flags, says", [
    (["--emulate"], "--emulate runs every stage in one process, but torchrun started this one as rank 1 of 4"),
    (["--port", "29500"], "--port 29500 is the local launcher's rendezvous port; under torchrun the rendezvous is "
                          "torchrun's"),
    (["--stages", "2"], "torchrun started 4 processes (WORLD_SIZE) but --stages 2 needs 2: pipeoptim train runs "
                        "one process per pipeline device and replica, so pass --stages 4, or start torchrun with "
                        "--nnodes x --nproc-per-node = 2"),
    (["--dp", "2"], "torchrun started 4 processes (WORLD_SIZE) but --stages 4 x --dp 2 needs 8: pipeoptim train "
                    "runs one process per pipeline device and replica, so pass --stages 2 --dp 2"),
])
def test_flags_that_do_not_fit_a_torchrun_job_are_refused(under_torchrun, tmp_path, capsys, flags, says):
    argv = ["--model", "tiny", "--stages", "4", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert "pipeoptim train: invalid configuration (rank 1): " in err and says in err, err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_parent_that_is_no_torchrun_agent_is_not_watched(under_torchrun):
    """pytest's parent is a shell, not torchrun's agent: a worker started through a wrapper must not take
    the wrapper's end for its agent's (it would end itself for nothing)."""
    assert torchrun_agent() is None


def test_without_torchrun_no_agent_is_watched(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun_agent() is None


@pytest.mark.parametrize("argv, agent", [
    (["/usr/bin/torchrun", "--nnodes", "2", "x.py"], True),
    (["/usr/bin/python3", "/usr/bin/torchrun", "--standalone", "x.py"], True),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "4", "x.py"], True),
    (["timeout", "300", "python", "-m", "pytest", "tests/test_cli_torchrun.py"], False),
    (["bash", "-c", "torchrun x.py"], False),
])
def test_a_torchrun_command_line_is_told_from_one_that_mentions_it(argv, agent):
    from pipeoptim.runtime.dist_env import _runs_torchrun
    assert _runs_torchrun(argv) is agent


CLAIMS = r'''
import sys
from pipeoptim.cli.train import main
common = ["--model", "tiny", "--stages", "1", "--schedule", "1f1b", "--microbatches", "2", "--microbatch-size", "1",
          "--no-progress", "--save-every", "0", "--eval-every", "0", "--run-dir", sys.argv[1]]
codes = [main(common + ["--steps", "2"]), main(common + ["--steps", "2"]),
         main(common + ["--steps", "3", "--resume"]), main(common + ["--steps", "3", "--resume"])]
print("codes", codes)
'''


def test_rank_zero_claims_the_run_directory_and_every_rank_acts_on_it(tmp_path):
    """One process as a torchrun job of one rank (rank 0 hosts the store: no agent), four runs in one
    directory: a fresh run; a second one without --resume, refused (the claim's error reaches every rank);
    --resume, which continues from rank 0's checkpoint; --resume once --steps is reached: nothing to do."""
    import socket
    import subprocess
    import sys

    import fault_harness as fh
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = fh.env(TORCHELASTIC_RUN_ID="t", RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=port)
    env.pop("PIPEOPTIM_LAUNCHED", None)
    run = subprocess.run([sys.executable, "-c", CLAIMS, str(tmp_path / "run")], env=env, capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    assert "codes [0, 2, 0, 0]" in out, out
    assert "holds an earlier run (checkpoints up to step 2" in out, out
    assert "resuming from" in out and "(step 2 of 3)" in out, out
    assert "nothing to do: step 3 of 3 already reached" in out, out
    assert out.count("final loss: ") == 3, out


def test_dp_under_torchrun_trains_as_one_pipeline_on_the_doubled_batch(tmp_path, capsys, one_thread):
    """``torchrun --nproc-per-node 4 ... train --stages 2 --dp 2``: every rank's place comes from torchrun's
    environment (replica = rank // stages), and the losses are one pipeline's on both replicas' rows; the
    checkpoint holds the weights once (replica 1's parts hold none)."""
    import json
    import subprocess
    import sys

    import fault_harness as fh
    from pipeoptim.runtime.checkpoint import read
    common = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--schedule", "1f1b", "--steps", "3",
              "--eval-every", "0", "--no-progress"]
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          "-m", "pipeoptim.cli", "train", *common, "--dp", "2", "--microbatch-size", "1",
                          "--run-dir", str(tmp_path / "dp")], env=fh.env(), capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    assert main([*common, "--emulate", "--microbatch-size", "2", "--run-dir", str(tmp_path / "one")]) == 0

    def losses(run):
        rows = json.load(open(tmp_path / run / "history.json"))["history"]
        return [r["loss"] for r in rows] + [rows[-1]["val_loss"]]
    assert losses("dp") == pytest.approx(losses("one"), rel=1e-5) and len(losses("dp")) == 4
    parts = [read(str(tmp_path / "dp" / "checkpoint" / "step-00000003" / f"part-{r}.pt")) for r in range(4)]
    assert [p["dp_rank"] for p in parts] == [0, 0, 1, 1]
    assert all(p["params"] for p in parts[:2]) and not any(p["params"] for p in parts[2:])
