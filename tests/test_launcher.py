"""How the launcher starts its workers (pipeoptim/runtime/launcher.py): spawn by default, or forked from a
forkserver that imported torch once (``PIPEOPTIM_LAUNCH_METHOD=forkserver``, what scripts/test.sh runs the suite
with). Under both a worker gets the launcher's environment as it is at ``launch``, returns its result, and dies
with the launcher. The fault drills (tests/test_faults.py) run under spawn, the default."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipeoptim.runtime import launch
from pipeoptim.runtime.launcher import START_METHODS, start_method
from pipeoptim.runtime.plan import ConfigError


def report_env(name: str) -> dict:
    """A worker's view: its rank, its parent and the environment variable ``name``."""
    return {"rank": int(os.environ["RANK"]), "value": os.environ.get(name), "pid": os.getpid(),
            "parent": os.getppid()}


def test_spawn_is_the_default_and_an_unknown_method_is_refused_naming_both(monkeypatch):
    monkeypatch.delenv("PIPEOPTIM_LAUNCH_METHOD", raising=False)
    assert start_method() == "spawn" and START_METHODS == ("spawn", "forkserver")
    monkeypatch.setenv("PIPEOPTIM_LAUNCH_METHOD", "fork")
    with pytest.raises(ConfigError, match="PIPEOPTIM_LAUNCH_METHOD='fork' is not a way to start workers: use spawn"):
        launch(report_env, 2, "X")


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_see_the_environment_of_each_launch_and_return_their_results(monkeypatch, method):
    monkeypatch.setenv("PIPEOPTIM_LAUNCH_METHOD", method)
    monkeypatch.setenv("PIPEOPTIM_TEST_VALUE", "first")
    first = launch(report_env, 2, "PIPEOPTIM_TEST_VALUE", timeout_s=120)
    # a forkserver started by the first job holds the environment it started with: the second job must not see it
    monkeypatch.setenv("PIPEOPTIM_TEST_VALUE", "second")
    second = launch(report_env, 2, "PIPEOPTIM_TEST_VALUE", timeout_s=120)
    assert [r["rank"] for r in first] == [r["rank"] for r in second] == [0, 1]
    assert {r["value"] for r in first} == {"first"} and {r["value"] for r in second} == {"second"}
    if method == "spawn":
        assert {r["parent"] for r in first + second} == {os.getpid()}
    else:  # forked by the one server, which this process started and which outlives the jobs
        servers = {r["parent"] for r in first + second}
        assert len(servers) == 1 and os.getpid() not in servers, servers


_LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from pipeoptim.runtime import launch

    def sleep_forever(folder):
        with open(os.path.join(folder, f"pid{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        launch(sleep_forever, 2, sys.argv[1])
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended: only its parent has not reaped it yet
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers die with the launcher through prctl")
@pytest.mark.parametrize("method", START_METHODS)
def test_workers_die_with_a_launcher_killed_outright(tmp_path, method):
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    env = {**os.environ, "PIPEOPTIM_LAUNCH_METHOD": method}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        time.sleep(0.2)  # (the files are written: their pids are complete)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        assert all(_alive(p) for p in pids)
        proc.kill()  # SIGKILL: the launcher ends nothing itself
        proc.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), f"workers {pids} outlived their launcher ({method})"
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in range(2):
            pid_file = tmp_path / f"pid{r}"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
