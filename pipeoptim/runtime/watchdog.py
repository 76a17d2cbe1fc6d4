"""Each rank's watchdog: ends this process when the job has ended elsewhere, and ends the job when it stops
making progress, naming the rank that holds it up and what that rank was doing.

A rank blocked in a gloo or NCCL wait cannot notice anything, so a daemon thread with its own connection to
the rendezvous store does, every ``poll_s``:

- reads the job's abort key (``faults``); once set, ends this process with ``ABORT_EXIT``;
- every ``beat_s``, writes this rank's heartbeat: a counter, pid, host and what the main thread is doing.
  The main thread only assigns one attribute per action (``doing``); no I/O on its path;
- when the main thread has spent longer than the stall timeout on one thing inside the pipeline (a compute,
  a wait for a peer's message, a collective), reads every rank's heartbeat twice, ``2.5 × beat_s`` apart (a
  rank whose counter did not move is not running: stopped by SIGSTOP or a debugger, swapped out, killed with
  no launcher to notice, or hung holding the GIL), follows who waits for whom to the rank holding the job
  up, publishes that as the job's reason to end and ends this process with ``STALL_EXIT``;
- when given ``agent_pid`` (under torchrun: the node's agent, this process's parent), checks that the agent
  still runs. A torchrun agent killed outright (SIGKILL, an OOM kill, a node's session ended) leaves its
  workers behind as orphans, which would go on training with nobody to report or stop them; the watchdog
  publishes that this node's agent is gone and ends this process with ``ORPHAN_EXIT``, so the other nodes'
  ranks stop with that reason and their agents end the job.

The stall timeout is ``timeout_s`` when given (``Pipeline(watchdog_s=...)``, ``PIPEOPTIM_WATCHDOG_S``), else
``max(300 s, 20 × the slowest iteration measured so far)``: a few minutes, more for runs with long steps.
Start-up is watched the same way: the rendezvous (``dist_env``), the collectives that build a ``Pipeline``
and ``load`` are each one thing inside the pipeline, so a rank that never arrives or freezes before them is
named within the same bound; a rank's own work while it builds is only shown in its heartbeat (``working``).
Time a rank spends outside the pipeline (between ``train_step`` calls) never trips its own watchdog; a rank
waiting for such a peer does trip, because that is also how a rank whose program took another path (one
``train_step`` fewer) looks from outside.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Callable, NamedTuple

from .faults import ABORT_EXIT, ORPHAN_EXIT, STALL_EXIT, publish, published

__all__ = ["Watchdog", "Doing", "diagnose", "DEFAULT_TIMEOUT_S", "STEP_FACTOR", "COLLECTIVE"]

DEFAULT_TIMEOUT_S = 300.0
STEP_FACTOR = 20.0
COLLECTIVE = -1          # ``Doing.peer`` of a collective: it waits for every rank of a group
SYMPTOM_DELAY_S = 1.0    # how long a rank that only saw a lost connection lets the cause be published first
LOOK_BEATS = 2.5         # a rank whose heartbeat did not move in this many beat periods is not running


class Doing(NamedTuple):
    """What a rank's main thread is doing: ``what`` (an action or a sentence), ``peer`` the global rank it
    waits for (``COLLECTIVE``: a collective; None: computing), since ``since`` (time.monotonic()). Immutable,
    so the watchdog thread reads one consistent record; a tuple, as the main thread makes several per action
    (`doing` takes 0.8 µs with it, 1.6 with a frozen dataclass)."""
    what: object
    peer: int | None
    since: float
    busy: bool = True


_IDLE = Doing("outside the pipeline", None, 0.0, busy=False)


def _beat_key(rank: int) -> str:
    return f"pipeoptim/beat/{rank}"


class Watchdog:
    def __init__(self, store, rank: int, world_size: int, *, timeout_s: float | None = None,
                 poll_s: float | None = None, beat_s: float = 1.0, quiet: bool = False,
                 before_exit: Callable[[], None] | None = None, agent_pid: int | None = None,
                 node: str | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.agent_pid, self.node = agent_pid, node
        self.poll_s = poll_s if poll_s is not None else (0.2 if world_size <= 64 else 1.0)
        self.beat_s, self.quiet, self.before_exit = beat_s, quiet, before_exit
        self._timeout = timeout_s
        self._slowest = 0.0
        self._doing = _IDLE
        self._origin = False
        self.won: bool | None = None
        self.cause: str | None = None  # the job's published reason to end, once ``signal`` read it
        self._count = 0
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeoptim-watchdog", daemon=True)

    # ---- the main thread's side (cheap: attribute writes) ---------------------------------------------
    def start(self) -> "Watchdog":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank's program is done: say so in a last heartbeat (peers still waiting will name it)."""
        self._stop.set()
        self._beat()

    def doing(self, what, peer: int | None = None) -> None:
        """The main thread starts ``what`` inside the pipeline (waiting for global rank ``peer``)."""
        self._doing = Doing(what, peer, time.monotonic())

    @contextlib.contextmanager
    def during(self, what):
        """``what`` (a phase every rank goes through together: loading a checkpoint) is inside the pipeline."""
        self.doing(what, COLLECTIVE)
        try:
            yield
        finally:
            self.idle()

    def working(self, what) -> None:
        """The main thread does ``what`` on its own, outside the pipeline (building its stages): its heartbeat
        says so, but it is never a stall of this rank's own; a peer that waits for it too long names it."""
        self._doing = Doing(what, None, time.monotonic(), busy=False)

    def idle(self) -> None:
        """The main thread left the pipeline: its own time no longer counts towards a stall."""
        self._doing = _IDLE

    def measured(self, seconds: float) -> None:
        """One iteration took ``seconds``: the default timeout grows with the slowest iteration."""
        self._slowest = max(self._slowest, seconds)

    @property
    def timeout_s(self) -> float:
        if self._timeout is not None:
            return self._timeout
        return max(DEFAULT_TIMEOUT_S, STEP_FACTOR * self._slowest)

    @timeout_s.setter
    def timeout_s(self, seconds: float | None) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"the watchdog timeout must be a positive number of seconds, got {seconds!r}")
        self._timeout = seconds

    def signal(self, message: str, *, symptom: bool = False) -> bool:
        """Publish this rank's failure as the job's reason to end; True if it is the first (the cause).

        ``symptom``: the failure only says a peer's connection went away; the process that knows why (the
        launcher, for a rank killed by a signal) gets ``SYMPTOM_DELAY_S`` to publish that first. Not the first:
        ``cause`` holds the reason that was."""
        self._origin = True
        if self.won is not None:
            return self.won
        try:
            deadline = time.monotonic() + (SYMPTOM_DELAY_S if symptom else 0.0)
            while time.monotonic() < deadline and published(self.store) is None:
                time.sleep(0.05)
            self.won, self.cause = publish(self.store, message)
        except Exception as e:  # the store is gone: the launcher still ends the other ranks
            self.won, self.cause = False, self._lost_store(e)
        return self.won

    # ---- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = time.monotonic() + self.beat_s
        while not self._stop.wait(self.poll_s):
            reason = self._reason()
            if reason is None and self.agent_pid is not None and os.getppid() != self.agent_pid:
                self._orphaned()
            if reason is not None:
                if self._origin or self._stop.is_set():
                    return
                self._end(f"stopping: {reason}", ABORT_EXIT)
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + self.beat_s
            d = self._doing
            if d.busy and not self._origin and now - d.since > self.timeout_s:
                self._stalled(d)

    def _reason(self) -> str | None:
        try:
            return published(self.store)
        except Exception as e:
            if self._stop.is_set():
                return None
            return self._lost_store(e)

    def _lost_store(self, e: Exception) -> str:
        """Why the job ends when the store stopped answering: whoever hosts it has ended."""
        served = getattr(self.store, "underlying_store", self.store)  # (under the attempt's prefix)
        where = f" at {served.host}:{served.port}" if hasattr(served, "host") else ""
        host = ("the torchrun agent of node 0 (the job's first node: it hosts the store) has ended: killed, or its "
                "machine is gone" if self.agent_pid is not None else
                "the launcher or the process hosting the store has ended")
        first = str(e).splitlines()[0] if str(e) else ""
        return f"lost the rendezvous store{where} ({type(e).__name__}: {first}); {host}"

    def _beat(self) -> None:
        d = self._doing
        self._count += 1
        beat = {"n": self._count, "pid": os.getpid(), "host": self._host, "what": str(d.what), "peer": d.peer,
                "for": round(time.monotonic() - d.since, 1) if d.busy else None, "busy": d.busy,
                "ended": self._stop.is_set()}
        try:
            self.store.set(_beat_key(self.rank), json.dumps(beat))
        except Exception:
            pass  # _reason reports a lost store

    def _beats(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world_size):
            try:
                if self.store.check([_beat_key(r)]):
                    out[r] = json.loads(self.store.get(_beat_key(r)))
            except Exception:
                pass
        return out

    def _orphaned(self) -> None:
        """This rank's torchrun agent is gone: publish that as the job's reason and end this process."""
        node = f"node {self.node}" if self.node is not None else "its node"
        message = (f"the torchrun agent of {node} (pid {self.agent_pid} on {self._host}) has ended without "
                   f"stopping its workers (killed, or its session closed), so rank {self.rank} (pid {os.getpid()}) "
                   "and that node's other ranks end with it: the job cannot go on with a node nobody supervises. "
                   "Keep each node's torchrun alive for the whole job (run it under nohup, tmux or the "
                   "scheduler), and resume from the newest checkpoint")
        try:
            won, reason = publish(self.store, message)
        except Exception:  # the store is gone too: say why this process ends all the same
            won, reason = True, message
        self._end(message if won else f"stopping: {reason}", ORPHAN_EXIT if won else ABORT_EXIT)

    def _stalled(self, d: Doing) -> None:
        waited = time.monotonic() - d.since
        before = self._beats()
        deadline = time.monotonic() + LOOK_BEATS * self.beat_s
        while time.monotonic() < deadline:  # keep beating meanwhile: another rank may be diagnosing this one
            time.sleep(min(self.beat_s, max(0.0, deadline - time.monotonic())))
            self._beat()
        after = self._beats()
        if self._doing is not d:  # the main thread moved on after all
            return
        message = diagnose(self.rank, before, after, self.world_size, waited, self.timeout_s,
                           LOOK_BEATS * self.beat_s)
        won, reason = publish(self.store, message)
        if won:
            self._end(message, STALL_EXIT)
        self._end(f"stopping: {reason}", ABORT_EXIT)

    def _end(self, text: str, code: int) -> None:
        if not self.quiet:
            print(f"[pipeoptim rank {self.rank}] {text}", file=sys.stderr, flush=True)
        try:
            if self.before_exit is not None:
                self.before_exit()
        finally:
            os._exit(code)


def _label(beat: dict | None, state: str) -> str:
    if beat is None:
        return "NEVER ARRIVED (no heartbeat: not started yet, stopped, or died before its first one)"
    if state == "frozen":
        return f"NOT RESPONDING (its last heartbeat: {_activity(beat)})"
    return _activity(beat)


def _activity(beat: dict) -> str:
    if beat.get("ended"):
        return "its program had ended"
    if not beat["busy"]:
        return beat["what"]  # "outside the pipeline", or what it does there (``working``)
    peer, took = beat["peer"], f"for {beat['for']:.0f} s"
    if peer is None:
        return f"running {beat['what']} {took}"
    if peer == COLLECTIVE:
        return f"in {beat['what']}, a collective waiting for every rank of its group, {took}"
    return f"{beat['what']} {took}"


def diagnose(me: int, before: dict[int, dict], after: dict[int, dict], world_size: int, waited: float,
             timeout_s: float, looked_s: float = LOOK_BEATS) -> str:
    """Why rank ``me`` made no progress for ``waited`` seconds, from every rank's heartbeat read twice
    (``before``, ``after``): a sentence naming the rank that holds the job up, then every rank's state."""
    def state(r: int) -> str:
        b = after.get(r)
        if b is None:
            return "missing"
        if b.get("ended"):
            return "ended"
        a = before.get(r)
        if a is not None and a["n"] == b["n"]:
            return "frozen"
        if not b["busy"]:
            return "idle"
        return "computing" if b["peer"] is None else "waiting"

    states = {r: state(r) for r in range(world_size)}
    chain, r = [me], me
    cycle = False
    while states[r] == "waiting" and after[r]["peer"] is not None and after[r]["peer"] >= 0:
        r = after[r]["peer"]
        if r in chain:
            cycle = True
            break
        chain.append(r)
    end = chain[-1]

    def who(r: int) -> str:
        b = after.get(r) or before.get(r)
        return f"rank {r} (pid {b['pid']} on {b['host']})" if b else f"rank {r}"

    frozen = [r for r in chain if states[r] in ("frozen", "missing", "ended")] or \
             [r for r in range(world_size) if states[r] in ("frozen", "missing")]
    if frozen:
        r = frozen[0]
        last = after.get(r) or before.get(r)
        if states[r] == "missing":
            head = (f"{who(r)} never arrived: it sent no heartbeat, so it has not started (still importing, or "
                    "never launched), was stopped (SIGSTOP, a debugger) or died before its first one")
        elif states[r] == "ended":
            head = f"{who(r)} has left the job (its program ended) while others still wait for it"
        else:
            head = (f"{who(r)} stopped responding: its heartbeat did not move in {looked_s:.1f} s, and the last one "
                    f"said: {_activity(last)}. A process stopped by SIGSTOP or a debugger, swapped out, killed with "
                    "no launcher watching, or hung while holding the GIL looks like this")
    elif cycle:
        head = "ranks wait for each other in a cycle (a deadlock): " + " -> ".join(
            f"rank {q} ({_activity(after[q])})" for q in chain + [r])
    elif states[end] == "computing":
        head = (f"{who(end)} has been {_activity(after[end])} without waiting for any other rank: that code "
                "hangs, or it is slower than the watchdog allows")
    elif states[end] == "idle" and after[end]["what"] != _IDLE.what:
        head = (f"{who(end)} is still {after[end]['what']} while rank {chain[-2] if len(chain) > 1 else me} waits "
                "for it: it is slower than the watchdog allows, or hangs there")
    elif states[end] == "idle":
        head = (f"{who(end)} is outside the pipeline (not in train_step, eval_step, save or load) while rank "
                f"{chain[-2] if len(chain) > 1 else me} waits for it: every rank must make the same pipeline "
                "calls in the same order; if that rank is busy with other work, raise the watchdog timeout")
    else:  # waiting in a collective: whoever is not in one holds it up
        others = [q for q in range(world_size) if states[q] in ("computing", "idle")]
        if others:
            q = others[0]
            head = f"{who(q)} is {_label(after[q], states[q])} while the others wait in a collective"
        else:
            head = "every rank waits (a collective whose members disagree, or a deadlock)"
    mine = after.get(me)
    lines = [f"the job made no progress for {waited:.0f} s (watchdog timeout {timeout_s:.0f} s): {head}.",
             f"rank {me} noticed it: it was {_activity(mine) if mine else 'waiting'}."]
    shown = sorted(set(range(min(world_size, 16))) | set(chain) | set(frozen))
    lines += [f"  rank {q}: {_label(after.get(q) or before.get(q), states[q])}" for q in shown]
    if len(shown) < world_size:
        lines.append(f"  ... and {world_size - len(shown)} more ranks")
    lines.append("Raise the timeout with Pipeline(watchdog_s=...), PIPEOPTIM_WATCHDOG_S or --watchdog-s if the "
                 "job was only slow.")
    return "\n".join(lines)
