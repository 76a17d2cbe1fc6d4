"""``pipeoptim train`` under torchrun, the parts that need no job: how a process knows torchrun started it,
the flags refused there (before torch loads), and that a parent which is not a torchrun agent is never
watched as one. The jobs themselves run in tests/test_multinode.py."""
from __future__ import annotations

import pytest

from pipeoptim.cli_torchrun import TorchrunEnv, torchrun_env
from pipeoptim.cli_train import main
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
    (["--stages", "2"], "torchrun started 4 processes (WORLD_SIZE) but --stages is 2: pipeoptim train runs one "
                        "process per pipeline device, so pass --stages 4"),
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
