"""``Schedule``: a pipeline schedule as pure data, with a text form that prints and parses back, and CSV.

A schedule says which device holds which slices of the model (``chunks``) and, per device, the ordered list
of actions it performs (``actions``; see ``actions.py`` for what each action needs and produces). It holds no
timing: the simulator (``pipeoptim.sim``) derives times from costs, the validator (``validate.py``) checks the
rules, ``lower.py`` derives the sends and receives, and the runtime executor walks the lists.

Text form (``to_text`` / ``from_text``; ``Schedule.from_text(s.to_text()) == s``)::

    schedule 1f1b devices=2 microbatches=3 stages=2 synchronous=true
    d0 chunks: s0
    d1 chunks: s1
    d0: F0s0 F1s0 B0s0 F2s0 B1s0 B2s0 STEP:s0
    d1: F0s1 B0s1 F1s1 B1s1 F2s1 B2s1 STEP:s1

Extra generator parameters (``params``) follow ``synchronous=`` as ``key=value``. Two-replica schedules mark
directions on every token (``F0>s0``, ``F2<s3``). Lines starting with ``#`` are comments.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Sequence

from .actions import (Action, Backward, BackwardInput, BackwardWeight, Chunk, Forward, Handoff, Recv, Send,
                      format_action, is_compute, parse_action)

__all__ = ["Schedule"]


def _param_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _param_value(text: str):
    if text in ("true", "false"):
        return text == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _chunk_token(chunk: Chunk, directed: bool) -> str:
    mark = {0: ">", 1: "<"}[chunk.replica] if (directed or chunk.replica) else ""
    return f"{mark}s{chunk.stage}"


def _parse_chunk(token: str) -> Chunk:
    replica = 0
    if token[:1] in "<>" and token:
        replica = 1 if token[0] == "<" else 0
        token = token[1:]
    if not token.startswith("s") or not token[1:].isdigit():
        raise ValueError(f"cannot read chunk {token!r}; expected s<stage>, >s<stage> or <s<stage>")
    return Chunk(replica, int(token[1:]))


@dataclass(frozen=True, eq=True)
class Schedule:
    """Per-device ordered actions plus the placement of model chunks on devices.

    name:              registry name of the generator (free text for hand-written schedules).
    num_devices:       pipeline ranks D; devices are 0..D-1.
    num_microbatches:  micro-batches N in the window (one iteration, or the generated async stream).
    num_stages:        stages per model replica.
    chunks:            per device, the chunks it holds, in chunk-index order (BitPipe's chunk0..chunk3).
    actions:           per device, the ordered actions.
    synchronous:       True if weights are updated once per window after a flush (every micro-batch sees the
                       same weights); False for asynchronous schedules (PipeDream, 2BW).
    params:            generator parameters worth keeping (e.g. ``chunks`` for interleaved, ``update_every``).
    """
    name: str
    num_devices: int
    num_microbatches: int
    num_stages: int
    chunks: tuple[tuple[Chunk, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    synchronous: bool = True
    params: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "chunks", tuple(tuple(c) for c in self.chunks))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        object.__setattr__(self, "params", dict(self.params))
        if len(self.chunks) != self.num_devices or len(self.actions) != self.num_devices:
            raise ValueError(f"schedule {self.name!r} has {self.num_devices} devices but chunks for "
                             f"{len(self.chunks)} and action lists for {len(self.actions)}")
        seen: dict[Chunk, int] = {}
        for device, chunks in enumerate(self.chunks):
            for chunk in chunks:
                if chunk in seen:
                    raise ValueError(f"chunk {_chunk_token(chunk, True)} is placed on devices {seen[chunk]} "
                                     f"and {device}; each chunk lives on exactly one device")
                if chunk.stage >= self.num_stages:
                    raise ValueError(f"chunk {_chunk_token(chunk, True)} on device {device} is beyond the "
                                     f"{self.num_stages} stages of the schedule")
                seen[chunk] = device
        for replica in {c.replica for c in seen}:
            missing = [s for s in range(self.num_stages) if Chunk(replica, s) not in seen]
            if missing:
                raise ValueError(f"replica {replica} has no device for stages {missing}")

    # ---- derived views -------------------------------------------------------------------------------
    @cached_property
    def placement(self) -> dict[Chunk, int]:
        """Chunk -> device holding it."""
        return {c: d for d, cs in enumerate(self.chunks) for c in cs}

    @property
    def num_replicas(self) -> int:
        return 1 + max(c.replica for c in self.placement)

    def device_of(self, stage: int, replica: int = 0) -> int:
        return self.placement[Chunk(replica, stage)]

    @cached_property
    def microbatch_replica(self) -> dict[int, int]:
        """Micro-batch -> the replica its forwards run on (read from the actions)."""
        out: dict[int, int] = {}
        for acts in self.actions:
            for a in acts:
                if isinstance(a, Forward):
                    out.setdefault(a.mb, a.replica)
        return out

    @cached_property
    def _split_backwards(self) -> frozenset[tuple[int, int, int]]:
        return frozenset((a.mb, a.stage, a.replica) for acts in self.actions for a in acts
                         if isinstance(a, (BackwardInput, BackwardWeight)))

    @property
    def split_backward(self) -> bool:
        """Whether some backward is split into an input-gradient ``I`` and a weight-gradient ``W``."""
        return bool(self._split_backwards)

    def backward_of(self, mb: int, stage: int, replica: int = 0) -> Backward | BackwardInput:
        """The action that computes micro-batch ``mb``'s input gradient on ``stage``: its ``I`` where the
        schedule splits that backward, else its ``Backward``."""
        cls = BackwardInput if (mb, stage, replica) in self._split_backwards else Backward
        return cls(mb, stage, replica)

    def compute_actions(self, device: int) -> list:
        return [a for a in self.actions[device] if is_compute(a)]

    def compute_only(self) -> "Schedule":
        """This schedule without Send/Recv/Handoff (they are derived again by ``lower``)."""
        acts = [[a for a in acts if not isinstance(a, (Send, Recv, Handoff))] for acts in self.actions]
        return self.replace(actions=acts)

    def replace(self, **changes) -> "Schedule":
        fields = dict(name=self.name, num_devices=self.num_devices, num_microbatches=self.num_microbatches,
                      num_stages=self.num_stages, chunks=self.chunks, actions=self.actions,
                      synchronous=self.synchronous, params=self.params)
        fields.update(changes)
        return Schedule(**fields)

    @property
    def directed(self) -> bool:
        """Whether tokens print a direction mark on every action (two-replica schedules)."""
        return self.num_replicas > 1

    def format(self, action: Action) -> str:
        return format_action(action, directed=self.directed)

    # ---- text form -----------------------------------------------------------------------------------
    def to_text(self) -> str:
        head = [f"schedule {self.name} devices={self.num_devices} microbatches={self.num_microbatches} "
                f"stages={self.num_stages} synchronous={_param_text(self.synchronous)}"]
        head[0] += "".join(f" {k}={_param_text(v)}" for k, v in self.params.items())
        lines = head
        for d, chunks in enumerate(self.chunks):
            lines.append(f"d{d} chunks: " + " ".join(_chunk_token(c, self.directed) for c in chunks))
        for d, acts in enumerate(self.actions):
            lines.append(f"d{d}: " + " ".join(self.format(a) for a in acts))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if not lines or not lines[0].startswith("schedule "):
            raise ValueError("schedule text must start with a line 'schedule NAME devices=D microbatches=N "
                             "stages=S synchronous=true|false [key=value ...]'")
        words = lines[0].split()
        name, header = words[1], {}
        for w in words[2:]:
            if "=" not in w:
                raise ValueError(f"cannot read {w!r} in the schedule header; expected key=value")
            k, v = w.split("=", 1)
            header[k] = _param_value(v)
        try:
            devices = header.pop("devices")
            microbatches = header.pop("microbatches")
            stages = header.pop("stages")
            synchronous = header.pop("synchronous")
        except KeyError as e:
            raise ValueError(f"schedule header misses {e.args[0]}=") from None
        chunks: list[list[Chunk] | None] = [None] * devices
        actions: list[list[Action] | None] = [None] * devices
        for ln in lines[1:]:
            label, _, rest = ln.partition(":")
            is_chunks = label.endswith(" chunks")
            dev_text = label[: -len(" chunks")] if is_chunks else label
            if not (dev_text.startswith("d") and dev_text[1:].isdigit()):
                raise ValueError(f"cannot read line {ln!r}; expected 'd<device>: actions' or "
                                 f"'d<device> chunks: chunks'")
            d = int(dev_text[1:])
            if d >= devices:
                raise ValueError(f"line {ln!r} names device {d} but the header says devices={devices}")
            if is_chunks:
                chunks[d] = [_parse_chunk(t) for t in rest.split()]
            else:
                actions[d] = [parse_action(t) for t in rest.split()]
        for what, rows in (("chunks", chunks), ("actions", actions)):
            missing = [d for d, r in enumerate(rows) if r is None]
            if missing:
                raise ValueError(f"schedule text has no {what} line for devices {missing}")
        return cls(name, devices, microbatches, stages, chunks, actions, synchronous, header)

    def to_csv(self) -> str:
        """One row per device: ``d<device>`` then one action token per cell."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for d, acts in enumerate(self.actions):
            writer.writerow([f"d{d}"] + [self.format(a) for a in acts])
        return buf.getvalue()

    @staticmethod
    def actions_from_csv(text: str) -> list[list[Action]]:
        """Per-device action lists read back from ``to_csv`` output."""
        rows = list(csv.reader(io.StringIO(text)))
        return [[parse_action(t) for t in row[1:] if t.strip()] for row in rows if row]


def schedule_from_orders(name: str, chunks: Sequence[Sequence[Chunk]], actions: Sequence[Sequence[Action]],
                         num_microbatches: int, num_stages: int, synchronous: bool = True,
                         **params) -> Schedule:
    """Convenience constructor used by the generators."""
    return Schedule(name, len(chunks), num_microbatches, num_stages, chunks, actions, synchronous, params)
