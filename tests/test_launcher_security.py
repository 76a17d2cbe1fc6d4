"""What the launcher exposes and what it trusts: its rendezvous store listens on loopback only (no other
address of this machine, let alone another machine, can reach it), so does a store rank 0 hosts for a
MASTER_ADDR on loopback, and the per-rank result files are read without running code
(``torch.load(weights_only=True)``). Every connection made here goes to an address of this machine."""
from __future__ import annotations

import ipaddress
import os
import socket
import subprocess

import pytest
import torch

from pipeoptim.runtime import PipelineError, launch
from pipeoptim.runtime.launcher import _load_result


def _hex_address(text: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (host byte order in 32-bit words) -> its usual form."""
    raw = bytes.fromhex(text)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def listening(port: int) -> list[str]:
    """Every address with a socket listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                out.append(_hex_address(address))
    return out


def other_addresses() -> list[str]:
    """This machine's addresses other than 127.0.0.1 (``hostname -I``, and ::1 when IPv6 is on)."""
    try:
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        found = []
    if socket.has_ipv6 and os.path.exists("/proc/net/if_inet6"):
        found.append("::1")
    return [a for a in found if a != "127.0.0.1" and not ipaddress.ip_address(a.split("%")[0]).is_link_local]


def connects(address: str, port: int) -> bool | str:
    """True if a TCP connection to ``address``:``port`` is accepted; otherwise the error, in words."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((address, port))
            return True
        except OSError as e:
            return f"{type(e).__name__}: {e}"


def _report(port: int) -> dict:
    return {"port": port, "listening": listening(port), "loopback": connects("127.0.0.1", port),
            "others": {a: connects(a, port) for a in other_addresses()}}


def _store_job() -> list[dict]:
    """Inside a running job: where the launcher's store listens; then where a store that rank 0 hosts (no
    launcher or agent store, MASTER_ADDR on loopback) listens once this rank has joined through it."""
    launcher = _report(int(os.environ["MASTER_PORT"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    os.environ.update(MASTER_PORT=str(free), TORCHELASTIC_USE_AGENT_STORE="False")
    from pipeoptim.runtime.dist_env import init_from_env
    init_from_env()
    return [launcher, _report(free)]


def test_the_rendezvous_stores_listen_on_loopback_only():
    others = other_addresses()
    if not others:
        pytest.skip("this machine has no address but 127.0.0.1 to try a connection from")
    for report in launch(_store_job, 1, timeout_s=120)[0]:
        port = report["port"]
        assert report["listening"] == ["127.0.0.1"], report  # not 0.0.0.0, not ::
        assert report["loopback"] is True, report             # the store is really there ...
        for address, result in report["others"].items():      # ... and refuses every other address
            assert result is not True and "refused" in result.lower(), (address, port, report)


class _Payload:
    """Pickles as a call to ``open(path, "w")``: whoever unpickles it creates ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _returns_payload(path: str):
    return {"loss": 1.0, "extra": _Payload(path)}


def test_a_result_the_launcher_cannot_load_safely_is_the_ranks_error(tmp_path):
    ran = tmp_path / "payload-ran"
    with pytest.raises(PipelineError) as info:
        launch(_returns_payload, 1, str(ran), timeout_s=120)
    text = str(info.value)
    assert "launch(fn) returned on rank 0 a dict holding something the launcher cannot load safely" in text, text
    assert "open" in text and "return tensors, numbers, strings" in text, text
    assert not ran.exists()  # neither the rank's check nor the launcher ran it


def test_a_result_file_is_read_without_running_it(tmp_path):
    """A result file holding a pickled call (put there behind the rank's back) is refused, naming the file."""
    ran = tmp_path / "payload-ran"
    torch.save({"loss": 1.0, "extra": _Payload(str(ran))}, tmp_path / "result1.pt")
    with pytest.raises(PipelineError, match=r"result1\.pt \(rank 1's result\) holds something "
                                            r"torch\.load\(weights_only=True\) refuses .*nothing in it ran"):
        _load_result(str(tmp_path), 1)
    assert not ran.exists()
    torch.save({"loss": 2.0, "w": torch.ones(2), "history": [{"step": 1}], "name": None}, tmp_path / "result0.pt")
    assert _load_result(str(tmp_path), 0)["history"] == [{"step": 1}]
