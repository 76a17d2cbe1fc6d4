"""Make one rank's failure end every rank quickly, with that rank's error, instead of a hang.

A gloo or NCCL receive cannot be cancelled, and gloo's timed waits tear the connection down, so a rank
whose peer died may block for ever. Each rank therefore runs a watchdog thread with its own connection to
the rendezvous TCPStore. The rank that fails first writes its error (rank, stage, action, exception) under
one key (first writer wins); every watchdog polls that key and, once it is set, prints the error and ends
its process with ``ABORT_EXIT``. The local launcher also kills the siblings of a worker that exited
non-zero, so even a lost store cannot leave processes behind.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["AbortWatch", "ABORT_KEY", "ABORT_EXIT"]

ABORT_KEY = "pipeoptim/abort"
ABORT_EXIT = 3


class AbortWatch:
    def __init__(self, host: str, port: int, world_size: int, rank: int, poll_s: float = 0.2,
                 error_file: str | None = None):
        self.rank, self.poll_s, self.error_file = rank, poll_s, error_file
        self.store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=60),
                                   wait_for_workers=False)
        self._origin = False
        self.won: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pipeoptim-abort-watch", daemon=True)

    def start(self) -> "AbortWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def signal(self, message: str) -> bool:
        """Publish this rank's error for every rank; True if it is the first error published (the cause)."""
        self._origin = True
        if self.won is not None:
            return self.won
        try:
            current = self.store.compare_set(ABORT_KEY, "", message)
            self.won = current.decode(errors="replace") == message
        except Exception:  # the store is gone: the launcher still kills the siblings
            self.won = False
        return self.won

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if not self.store.check([ABORT_KEY]):
                    continue
                message = self.store.get(ABORT_KEY).decode(errors="replace")
            except Exception as e:
                if self._stop.is_set():
                    return
                message = f"lost the rendezvous store ({type(e).__name__}); another rank (rank 0?) ended"
            if self._origin or self._stop.is_set():
                return
            text = f"[pipeoptim rank {self.rank}] stopping because another rank failed: {message}"
            print(text, file=sys.stderr, flush=True)
            if self.error_file:
                try:
                    with open(self.error_file, "w") as f:
                        f.write(text)
                except OSError:
                    pass
            time.sleep(0.05)
            os._exit(ABORT_EXIT)
