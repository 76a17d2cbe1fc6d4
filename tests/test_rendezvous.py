"""runtime/rendezvous.py's attempt keys: what one attempt of a job writes to the store, the next attempt (torchrun
--max-restarts, same store) does not read, and an attempt is this process's TORCHELASTIC_RESTART_COUNT. The
store's listening address is tests/test_launcher_security.py's; a restart end to end is
tests/test_cli_train_faults.py's."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from pipeoptim.runtime import faults
from pipeoptim.runtime.rendezvous import LAUNCH_ATTEMPT, attempt_keys


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server


def test_an_attempts_keys_are_its_own(store):
    first, second = attempt_keys(store, "0"), attempt_keys(store, "1")
    first.set("rank_0", "127.0.0.1:7051")  # (what gloo leaves of a rank that has died with its attempt)
    assert faults.publish(first, "rank 1 was killed by SIGKILL") == (True, "rank 1 was killed by SIGKILL")
    assert not second.check(["rank_0"]) and faults.published(second) is None
    second.set("rank_0", "127.0.0.1:9000")
    assert first.get("rank_0") == b"127.0.0.1:7051" and second.get("rank_0") == b"127.0.0.1:9000"
    assert not store.check(["rank_0"]) and not store.check([faults.ABORT_KEY])  # the raw store holds neither


def test_the_attempt_is_torchruns_restart_count(store, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    attempt_keys(store).set("k", "third restart")
    assert attempt_keys(store, "3").get("k") == b"third restart" and not attempt_keys(store, "0").check(["k"])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    attempt_keys(store).set("k", "no restarts")
    assert attempt_keys(store, LAUNCH_ATTEMPT).get("k") == b"no restarts"
