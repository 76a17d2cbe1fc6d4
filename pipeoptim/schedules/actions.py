"""The actions a device performs, as small immutable values, and their one-token text notation.

A schedule is, per device, an ordered list of these actions (see ``schedule.py``). They exist as plain
frozen dataclasses so that generators, the validator, the simulator, the pictures and the runtime executor
all read the same data and nothing has behaviour hidden in it.

Vocabulary
----------
- micro-batch ``mb``: 0-based index inside the schedule's window (one iteration for synchronous schedules,
  the whole generated stream for asynchronous ones).
- stage ``stage``: 0-based index of a slice of the model, in data-flow order (stage 0 reads the input, the
  last stage computes the loss). Every replica of the model has the same ``num_stages`` stages.
- replica ``replica``: which copy of the model a micro-batch flows through. Single-copy schedules use
  replica 0 only. Bidirectional schedules (Chimera, BitPipe) have replica 0 ("down": enters on device 0)
  and replica 1 ("up": enters on the last device). A micro-batch flows through exactly one replica.
- chunk: a (replica, stage) pair held by one device (``Chunk``).

Compute actions and their data flow (what the executor must honour)
-------------------------------------------------------------------
``Forward(mb, stage, replica)``
    Before it: ``Forward(mb, stage - 1, replica)`` (none for stage 0, which reads micro-batch ``mb`` of the
    data). Input: the output of that forward, from the device holding (replica, stage - 1); a ``Recv`` when
    that is another device, a ``Handoff`` when it is this one. Output: goes to the device holding
    (replica, stage + 1); on the last stage the output is the loss of micro-batch ``mb``.
``Backward(mb, stage, replica)``
    Before it: ``Forward(mb, stage, replica)`` on this same device (its saved activations), and
    ``Backward(mb, stage + 1, replica)`` (none on the last stage, which starts from the loss). Input: the
    gradient of the loss with respect to this stage's output. Output: the gradient with respect to this
    stage's input, sent to the device holding (replica, stage - 1) (nothing on stage 0). The weight
    gradient is accumulated into the chunk's gradient buffer.
``BackwardInput(mb, stage, replica)`` (``I``), ``BackwardWeight(mb, stage, replica)`` (``W``)
    The backward split in two (zero-bubble schedules): ``I`` takes the place of ``Backward`` in the data flow
    (same requirements, same input and output) but computes only the gradient of the stage's input, keeping
    what the weight gradient needs; ``W``, later on the same device, computes the weight gradient and
    accumulates it. Before ``W``: its ``I``. ``W`` has no input from and no output to another action, so it
    can fill any idle slot. A micro-batch's stage runs either ``Backward`` or ``I`` and ``W``.

Weight actions
--------------
``Step(stage, replica)``
    Apply the optimizer to this device's copy of (replica, stage) with the gradient accumulated since its
    previous ``Step`` (synchronous schedules: one ``Step`` per chunk per iteration after all its backwards;
    asynchronous ones: after every backward, or every m backwards). A split backward's gradient exists only
    after its ``W``, so a ``Step`` counts ``Backward`` and ``W`` actions, never ``I``. If a ``Sync`` covering the stage comes
    before it in this device's list, the step uses the synchronised gradient and must wait for that sync.
``Sync(stages, devices, dp)``
    All-reduce (average) the gradients of the local chunks of ``stages`` among ``devices`` (pipeline ranks of
    this schedule; every one of them has an identical ``Sync`` in its list, in the same relative order, as for
    any collective). With ``dp=True`` the all-reduce also spans the data-parallel copies of this pipeline.
    Before it: every ``Backward`` on this device of the chunks it covers (in the current iteration).
    BitPipe's eager sync pairs rank r with its mirror D-1-r, which hold the same stages of the other replica.

Communication actions (derived by ``lower.py``; generators emit compute and weight actions only)
-------------------------------------------------------------------------------------------------
``Send(op, peer)``  send the output of compute action ``op`` (run earlier on this device) to device ``peer``.
``Recv(op, peer)``  receive the input of compute action ``op`` (run later on this device) from device ``peer``.
``Handoff(op)``     the output of ``op`` becomes, without communication, the input of the next compute of the
                    same micro-batch on this device (BitPipe's V-turn, where stages D-1 and D share a device).

Executing a lowered schedule (``validate`` returns one; every rule below is checked there)
------------------------------------------------------------------------------------------
Walk the device's list in order. ``Recv``: post the receive (``irecv`` may be posted early; a blocking one is
also safe, the order is deadlock-free under rendezvous semantics) and file it under its op. ``Forward``: take
its input from the data loader (stage 0), the filed receive, or the hand-off buffer; run it; keep what its
backward needs. ``Send``: send that output (``isend``). ``Handoff``: put that output in the hand-off buffer of
the consumer op. ``Backward``: take the output gradient from the loss (last stage), a receive or the hand-off
buffer; accumulate weight gradients; free the activations. ``I``: the same input and output, but only the
input gradient (the graph is kept for ``W``). ``W``: accumulate the weight gradient of that ``I``; free the
activations. ``Sync``: all-reduce the gradients of the local chunks of its stages among its devices (and the
data-parallel group if ``dp``); it may run asynchronously, but a later ``Step`` of those stages must wait for
it. ``Step``: optimizer step of that chunk, then zero its
gradient. For asynchronous schedules ``staleness.version_difference`` gives each forward's s.

Text notation (one token per action, no spaces; ``parse_action(format_action(a)) == a``)
----------------------------------------------------------------------------------------
``F3s5``  forward of micro-batch 3 on stage 5 (replica 0).      ``B3s5`` the backward.
``I3s5``, ``W3s5``                   the backward split: input gradient, weight gradient.
``F3<s5`` the same on replica 1 ("up"); ``F3>s5`` names replica 0 explicitly ("down").
``STEP:s5``, ``STEP:<s5``            optimizer step of stage 5 (of replica 0 / 1).
``SYNC:s4+s7@0+3``, ``...@0+3:dp``   gradient all-reduce of stages 4 and 7 among devices 0 and 3.
``SEND:F3s5@2``                      send the output of F3s5 to device 2.
``RECV:F3s6@1``                      receive the input of F3s6 from device 1.
``HAND:F3>s3``                       local hand-off of F3>s3's output.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

__all__ = [
    "Chunk", "Forward", "Backward", "BackwardInput", "BackwardWeight", "Step", "Sync", "Send", "Recv", "Handoff",
    "Action", "Compute", "format_action", "parse_action", "is_compute", "input_grad_action", "weight_grad_action",
]

_DIRECTION = {0: ">", 1: "<"}
_REPLICA = {">": 0, "<": 1, "": 0}


def _check_index(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _check_replica(replica: int) -> None:
    if replica not in (0, 1):
        raise ValueError(f"replica must be 0 (down) or 1 (up), got {replica!r}")


@dataclass(frozen=True, slots=True, order=True)
class Chunk:
    """A slice of the model held by one device: stage ``stage`` of model copy ``replica``."""
    replica: int
    stage: int

    def __post_init__(self):
        _check_replica(self.replica)
        _check_index("stage", self.stage)


_CHUNKS: dict[tuple[int, int], Chunk] = {}


def _chunk_of(replica: int, stage: int) -> Chunk:
    """The Chunk (replica, stage), built and checked once: the runtime asks an action for it several times per
    action it runs."""
    c = _CHUNKS.get((replica, stage))
    if c is None:
        c = _CHUNKS[(replica, stage)] = Chunk(replica, stage)
    return c


@dataclass(frozen=True, slots=True)
class _MicrobatchAction:
    """The fields and checks the four compute actions share; each is its own type (actions of two kinds on the
    same micro-batch and stage are never equal)."""
    mb: int
    stage: int
    replica: int = 0

    def __post_init__(self):
        _check_index("mb", self.mb)
        _check_index("stage", self.stage)
        _check_replica(self.replica)

    @property
    def chunk(self) -> Chunk:
        return _chunk_of(self.replica, self.stage)

    def __str__(self):
        return format_action(self)


@dataclass(frozen=True, slots=True)
class Forward(_MicrobatchAction):
    """Forward of micro-batch ``mb`` through stage ``stage`` of replica ``replica``."""


@dataclass(frozen=True, slots=True)
class Backward(_MicrobatchAction):
    """Backward of micro-batch ``mb`` through stage ``stage`` of replica ``replica``."""


@dataclass(frozen=True, slots=True)
class BackwardInput(_MicrobatchAction):
    """Input-gradient half of micro-batch ``mb``'s backward through stage ``stage`` (token ``I``)."""


@dataclass(frozen=True, slots=True)
class BackwardWeight(_MicrobatchAction):
    """Weight-gradient half of micro-batch ``mb``'s backward through stage ``stage`` (token ``W``)."""


Compute = Union[Forward, Backward, BackwardInput, BackwardWeight]
_COMPUTE_TYPES = (Forward, Backward, BackwardInput, BackwardWeight)
_KIND = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}
_OF_KIND = {v: k for k, v in _KIND.items()}


@dataclass(frozen=True, slots=True)
class Step:
    """Optimizer step of this device's copy of stage ``stage`` of replica ``replica``."""
    stage: int
    replica: int = 0

    def __post_init__(self):
        _check_index("stage", self.stage)
        _check_replica(self.replica)

    @property
    def chunk(self) -> Chunk:
        return _chunk_of(self.replica, self.stage)

    def __str__(self):
        return format_action(self)


@dataclass(frozen=True, slots=True)
class Sync:
    """Gradient all-reduce of the local chunks of ``stages`` among pipeline ranks ``devices``."""
    stages: tuple[int, ...]
    devices: tuple[int, ...]
    dp: bool = False

    def __post_init__(self):
        stages, devices = tuple(self.stages), tuple(self.devices)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "devices", devices)
        if not stages:
            raise ValueError("Sync needs at least one stage")
        for s in stages:
            _check_index("stage", s)
        for d in devices:
            _check_index("device", d)
        if len(set(stages)) != len(stages) or len(set(devices)) != len(devices):
            raise ValueError(f"Sync lists a stage or device twice: stages={stages} devices={devices}")
        if not devices and not self.dp:
            raise ValueError("Sync among no devices does nothing: give devices, or dp=True")

    def __str__(self):
        return format_action(self)


@dataclass(frozen=True, slots=True)
class Send:
    """Send the output of compute action ``op`` (already run on this device) to device ``peer``."""
    op: Compute
    peer: int

    def __post_init__(self):
        if not isinstance(self.op, (Forward, Backward, BackwardInput)):
            raise ValueError(f"Send carries the output of a Forward, Backward or BackwardInput (a BackwardWeight has no "
                             f"data to move), got {self.op!r}")
        _check_index("peer", self.peer)

    def __str__(self):
        return format_action(self)


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive the input of compute action ``op`` (run later on this device) from device ``peer``."""
    op: Compute
    peer: int

    def __post_init__(self):
        if not isinstance(self.op, (Forward, Backward, BackwardInput)):
            raise ValueError(f"Recv carries the input of a Forward, Backward or BackwardInput (a BackwardWeight has no "
                             f"data to move), got {self.op!r}")
        _check_index("peer", self.peer)

    def __str__(self):
        return format_action(self)


@dataclass(frozen=True, slots=True)
class Handoff:
    """The output of ``op`` becomes the input of the next compute of its micro-batch, on this device."""
    op: Compute

    def __post_init__(self):
        if not isinstance(self.op, (Forward, Backward, BackwardInput)):
            raise ValueError(f"Handoff carries the output of a Forward, Backward or BackwardInput (a BackwardWeight has no "
                             f"data to move), got {self.op!r}")

    def __str__(self):
        return format_action(self)


Action = Union[Forward, Backward, BackwardInput, BackwardWeight, Step, Sync, Send, Recv, Handoff]


def is_compute(action) -> bool:
    return isinstance(action, _COMPUTE_TYPES)


def input_grad_action(action) -> bool:
    """Whether ``action`` computes its stage's input gradient (a full ``Backward`` or an ``I``)."""
    return isinstance(action, (Backward, BackwardInput))


def weight_grad_action(action) -> bool:
    """Whether ``action`` leaves its micro-batch's weight gradient complete (a full ``Backward`` or a ``W``)."""
    return isinstance(action, (Backward, BackwardWeight))


def _dir(replica: int, directed: bool) -> str:
    return _DIRECTION[replica] if (directed or replica != 0) else ""


def format_action(action: Action, directed: bool = False) -> str:
    """One token for ``action``. ``directed=True`` also marks replica 0 (``>``), as two-replica schedules print."""
    if isinstance(action, _COMPUTE_TYPES):
        return f"{_KIND[type(action)]}{action.mb}{_dir(action.replica, directed)}s{action.stage}"
    if isinstance(action, Step):
        return f"STEP:{_dir(action.replica, directed)}s{action.stage}"
    if isinstance(action, Sync):
        stages = "+".join(f"s{s}" for s in action.stages)
        devices = "+".join(str(d) for d in action.devices)
        return f"SYNC:{stages}@{devices}" + (":dp" if action.dp else "")
    if isinstance(action, Send):
        return f"SEND:{format_action(action.op, directed)}@{action.peer}"
    if isinstance(action, Recv):
        return f"RECV:{format_action(action.op, directed)}@{action.peer}"
    if isinstance(action, Handoff):
        return f"HAND:{format_action(action.op, directed)}"
    raise TypeError(f"not a schedule action: {action!r}")


_COMPUTE = r"([FBIW])(\d+)([<>]?)s(\d+)"
_PATTERNS = [
    ("compute", re.compile(_COMPUTE)),
    ("step", re.compile(r"STEP:([<>]?)s(\d+)")),
    ("sync", re.compile(r"SYNC:(s\d+(?:\+s\d+)*)@((?:\d+(?:\+\d+)*)?)(:dp)?")),
    ("send", re.compile(r"SEND:" + _COMPUTE + r"@(\d+)")),
    ("recv", re.compile(r"RECV:" + _COMPUTE + r"@(\d+)")),
    ("hand", re.compile(r"HAND:" + _COMPUTE)),
]

_GRAMMAR = ("F<mb>s<stage>, B<mb><s<stage>, I<mb>s<stage>, W<mb>s<stage>, STEP:s<stage>, SYNC:s<a>+s<b>@<dev>+<dev>[:dp], "
            "SEND:F<mb>s<stage>@<dev>, RECV:B<mb>s<stage>@<dev>, HAND:F<mb>>s<stage>")


def _compute(kind: str, mb: str, direction: str, stage: str) -> Compute:
    return _OF_KIND[kind](int(mb), int(stage), _REPLICA[direction])


def parse_action(token: str) -> Action:
    """Inverse of ``format_action``; raises ValueError naming the accepted forms."""
    text = token.strip()
    for kind, pattern in _PATTERNS:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        g = m.groups()
        if kind == "compute":
            return _compute(*g)
        if kind == "step":
            return Step(int(g[1]), _REPLICA[g[0]])
        if kind == "sync":
            stages = tuple(int(s[1:]) for s in g[0].split("+"))
            devices = tuple(int(d) for d in g[1].split("+")) if g[1] else ()
            return Sync(stages, devices, dp=bool(g[2]))
        if kind == "send":
            return Send(_compute(*g[:4]), int(g[4]))
        if kind == "recv":
            return Recv(_compute(*g[:4]), int(g[4]))
        return Handoff(_compute(*g))
    raise ValueError(f"cannot read schedule action {token!r}; expected one of: {_GRAMMAR}")
