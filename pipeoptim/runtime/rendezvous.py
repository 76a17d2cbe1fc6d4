"""The rendezvous store's server, listening on one address only; and each attempt's keys kept apart.

torch's ``TCPStore(host, port, is_master=True)`` ignores ``host`` when it serves: it listens on every
interface (``*:<port>``, IPv4 and IPv6), and the store has no authentication, so anyone who can reach the port
can read every rank's heartbeat and end the job through its abort key. A job on one machine needs no more
than loopback, so ``serve`` binds the listening socket itself and hands it to the store
(``master_listen_fd``): the store then listens where that socket does and nowhere else.

torchrun's agent keeps one store for every attempt of a job: ``--max-restarts`` starts the workers again
against the store of the attempt that failed. Its keys (gloo's addresses of the dead ranks, their heartbeats,
the reason the attempt ended) would send the next attempt's ranks to ports nobody listens on, or end it at
once, so every rank reads and writes the job's keys through ``attempt_keys``: under a prefix of its attempt.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["serve", "is_loopback", "attempt_keys", "LAUNCH_ATTEMPT"]

LAUNCH_ATTEMPT = "0"  # runtime.launch starts each job once, on a store of its own


def attempt_keys(store, attempt: str | None = None):
    """``store`` seen through the keys of one attempt of the job: ``attempt``, by default this process's
    (torchrun's TORCHELASTIC_RESTART_COUNT; 0 where nothing restarts it)."""
    if attempt is None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", LAUNCH_ATTEMPT)
    return dist.PrefixStore(f"pipeoptim/attempt_{attempt}", store)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback interface."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _port_in_use(port: int) -> ConfigError:
    return ConfigError(f"port {port} on this machine is already in use (another job's rendezvous, or another "
                       "program): choose another port, or leave the port unset so that a free one is picked")


def _listener(host: str, port: int) -> socket.socket:
    """A listening socket on the loopback address ``host`` names (a name such as localhost: 127.0.0.1)."""
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        address = "127.0.0.1"
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener: TIME_WAIT is no clash
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise _port_in_use(port) from None
        raise
    return sock


def serve(host: str, port: int | None, world_size: int, timeout_s: float = 60.0):
    """A ``TCPStore`` server on ``host``:``port`` (port None or 0: one the system picks). A loopback ``host``
    is bound exactly (the store is reachable from this machine only); any other is torch's default, every
    interface, since ranks on other machines must reach it. A port in use is a ``ConfigError`` naming it."""
    timeout = timedelta(seconds=timeout_s)
    if not is_loopback(host):
        try:
            return dist.TCPStore(host, port or 0, world_size, is_master=True, wait_for_workers=False,
                                 timeout=timeout)
        except RuntimeError as e:
            if "EADDRINUSE" in str(e) or "already in use" in str(e):
                raise _port_in_use(port) from None
            raise
    sock = _listener(host, port or 0)
    chosen = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here and closes it when it ends
    # libuv: the server torch uses by default; in torch 2.14 its older one never answers on a socket handed to it
    try:
        return dist.TCPStore(host, chosen, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                             master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise
