"""Point-to-point transfer of the tensors that cross a stage boundary, over torch.distributed.

A boundary may carry several tensors whose shapes can change between micro-batches (the last, smaller
micro-batch of a batch; a stage whose output shape depends on its input), and a wrong gradient shape must be
reported by the worker instead of hanging in a receive of the wrong size or being silently reshaped. So the
receiver must always know the shapes of what it receives; but asking first (a header message, then the
payload) costs a round trip per transfer. Instead, shapes are agreed once per *slot* (sender, receiver and
the kind of the consuming op: the forward or the backward of one stage of one replica) and then assumed:

- the first message of a slot is a header (``pack_header``: per tensor its dtype, rank and shape, or "none"
  for a missing gradient) followed by the payloads;
- every later message is a one-element flag followed by the payloads in the agreed shapes, posted together,
  so the receiver posts its receives ahead (as soon as the previous message of the channel is taken, and for
  the first message of each channel when the iteration starts) and a transfer costs no round trip;
- when the shapes change, the sender says so in the flag, fills the receives already posted with zeros of
  the agreed shapes, and sends a header and the payloads: the receiver reads them and agrees on the new
  shapes. Nothing is reshaped and nothing can be received into a buffer of the wrong size.

Ordering (deadlock freedom): sends are posted as soon as the data exists and never waited on before the end
of the iteration; a receive is waited on just before the compute that needs it. Messages on one channel
(sender -> receiver) are taken in the sender's order (``Plan.channels``); one that arrives before it is
needed waits in an inbox. So the executor blocks only where the schedule's timeline blocks, and the
per-channel order is what NCCL needs (it matches sends and receives by order, not by tag).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedules.actions import Forward
from .plan import Plan

__all__ = ["P2P", "HEADER_LEN", "pack_header", "unpack_header", "metas_of"]

HEADER_LEN = 64
_MAX_DIMS = 6
_SLOT = 2 + _MAX_DIMS
_MAX_TENSORS = (HEADER_LEN - 1) // _SLOT
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.bool, torch.int8, torch.int16]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
# gloo has no bfloat16/bool p2p: such payloads travel as raw bytes of a same-size integer type.
_WIRE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def pack_header(tensors: tuple, device) -> torch.Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a stage boundary carries {len(tensors)} tensors; at most {_MAX_TENSORS} are supported "
                         "(pack them into fewer tensors)")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = len(tensors)
    for i, t in enumerate(tensors):
        base = 1 + i * _SLOT
        if t is None:
            h[base] = -1
            continue
        if t.dtype not in _CODE:
            raise ValueError(f"tensor {i} crossing a stage boundary has dtype {t.dtype}; supported: "
                             f"{', '.join(str(d) for d in _DTYPES)}")
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"tensor {i} crossing a stage boundary has {t.dim()} dims; at most {_MAX_DIMS} "
                             "are supported (reshape it before the boundary)")
        h[base] = _CODE[t.dtype]
        h[base + 1] = t.dim()
        h[base + 2: base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h.to(device)


def unpack_header(h: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]] | None]:
    h = h.cpu().tolist()
    n = h[0]
    if not 0 <= n <= _MAX_TENSORS:
        raise RuntimeError(f"corrupt message header (count {n}): sender and receiver disagree on the message "
                           "order; both must run the same schedule")
    out = []
    for i in range(n):
        base = 1 + i * _SLOT
        code = h[base]
        if code == -1:
            out.append(None)
            continue
        nd = h[base + 1]
        out.append((_DTYPES[code], tuple(h[base + 2: base + 2 + nd])))
    return out


def _wire(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(_WIRE[t.dtype]) if t.dtype in _WIRE else t


Metas = tuple  # per tensor (dtype, shape), or None for a missing gradient


def metas_of(tensors: tuple) -> Metas:
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


def slot_of(peer: int, key) -> tuple:
    """Messages that share shapes: one peer, and the forward (activations) or the backward (gradients) of one
    stage of one replica."""
    return peer, isinstance(key, Forward), key.stage, key.replica


_SAME, _CHANGED = 0, 1


class _Posted:
    """The receives of one message posted ahead in the agreed shapes: the flag, then the payloads."""

    def __init__(self, peer: int, metas: Metas, device):
        self.metas = metas
        self.flag = torch.empty(1, dtype=torch.int64, device=device)
        self.bufs = tuple(None if m is None else torch.empty(m[1], dtype=m[0], device=device) for m in metas)
        wires = [self.flag] + [_wire(b) for b in self.bufs if b is not None]
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in wires])


class P2P:
    """Messages between pipeline ranks of one data-parallel copy; ``global_rank(d)`` maps a device to a rank."""

    def __init__(self, plan: Plan, me: int, global_rank, device: torch.device, wait=None):
        """``wait(work, what, peer)`` waits for one transfer (``what`` in words, ``peer`` the global rank on
        the other end); the executor's tells the rank's watchdog what it waits for."""
        self.plan, self.me, self.global_rank, self.device = plan, me, global_rank, device
        self.wait = wait or (lambda work, what, peer: work.wait())
        self.sent_metas: dict[tuple, Metas] = {}     # slot -> shapes the receiver expects from this rank
        self.recv_metas: dict[tuple, Metas] = {}     # slot -> shapes this rank expects
        self._flags = {v: torch.tensor([v], dtype=torch.int64, device=device) for v in (_SAME, _CHANGED)}
        self.reset(plan)

    def reset(self, plan: Plan) -> None:
        """Start an iteration of ``plan``; post the receive of each incoming channel's first message."""
        self.plan = plan
        self.pending: list = []
        self.inbox: dict = {}
        self.taken: dict[int, int] = {}
        self.posted: dict[int, _Posted] = {}         # src -> the receive posted for its next message
        for (src, dst) in plan.channels:
            if dst == self.me:
                self._post_next(src)

    # ---- sending -----------------------------------------------------------------------------------------
    def send(self, dst: int, key, tensors: tuple) -> None:
        peer = self.global_rank(dst)
        slot = slot_of(dst, key)
        metas = metas_of(tensors)
        agreed = self.sent_metas.get(slot)
        payload = [_wire(t) for t in tensors if t is not None]
        if agreed == metas:
            keep = [self._flags[_SAME]] + payload
        else:
            header = pack_header(tensors, self.device)   # checks dtypes and ranks before anything is sent
            keep = [header] + payload
            if agreed is not None:                       # fill the receives the peer posted in the old shapes
                fill = [_wire(torch.zeros(m[1], dtype=m[0], device=self.device)) for m in agreed if m is not None]
                keep = [self._flags[_CHANGED]] + fill + keep
            self.sent_metas[slot] = metas
        ops = [dist.P2POp(dist.isend, t, peer) for t in keep]
        self.pending.append((dist.batch_isend_irecv(ops), keep, key, dst))

    # ---- receiving ---------------------------------------------------------------------------------------
    def recv(self, src: int, key) -> tuple:
        seq = self.plan.channels.get((src, self.me), [])
        while (src, key) not in self.inbox:
            i = self.taken.get(src, 0)
            if i >= len(seq):
                raise RuntimeError(f"device {self.me} waits for the input of {key} from device {src}, but the "
                                   f"schedule sends nothing more on that channel")
            self.taken[src] = i + 1
            self.inbox[(src, seq[i])] = self._recv_one(src, seq[i])
        return self.inbox.pop((src, key))

    def _post_next(self, src: int) -> None:
        """Post the receive of ``src``'s next message on this channel if its shapes are agreed."""
        seq = self.plan.channels.get((src, self.me), [])
        i = self.taken.get(src, 0)
        if i < len(seq) and src not in self.posted:
            agreed = self.recv_metas.get(slot_of(src, seq[i]))
            if agreed is not None:
                self.posted[src] = _Posted(self.global_rank(src), agreed, self.device)

    def _recv_one(self, src: int, key) -> tuple:
        peer = self.global_rank(src)
        posted = self.posted.pop(src, None)      # None: the first message of its slot, a header comes
        if posted is not None:
            for w in posted.works:
                self.wait(w, f"{key}'s input from rank {peer}", peer)
            if int(posted.flag) == _SAME:
                self._post_next(src)
                return posted.bufs
        bufs = self._recv_with_header(src, key)
        self._post_next(src)
        return bufs

    def _recv_with_header(self, src: int, key) -> tuple:
        peer = self.global_rank(src)
        h = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, peer)]):
            self.wait(w, f"the header of {key}'s input from rank {peer}", peer)
        metas = tuple(unpack_header(h))
        bufs = tuple(None if m is None else torch.empty(m[1], dtype=m[0], device=self.device) for m in metas)
        wires = [_wire(b) for b in bufs if b is not None]
        if wires:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in wires]):
                self.wait(w, f"{key}'s input from rank {peer}", peer)
        self.recv_metas[slot_of(src, key)] = metas
        return bufs

    def finish(self) -> None:
        """Wait for every send of the iteration; check that every expected message was taken."""
        for works, _, key, dst in self.pending:
            for w in works:
                self.wait(w, f"rank {self.global_rank(dst)} to receive the output sent for {key}",
                          self.global_rank(dst))
        self.pending.clear()
        for (src, dst), seq in self.plan.channels.items():
            if dst == self.me and self.taken.get(src, 0) != len(seq):
                raise RuntimeError(f"device {self.me} received {self.taken.get(src, 0)} of the {len(seq)} messages "
                                   f"device {src} sent this iteration")
        if self.inbox:
            raise RuntimeError(f"device {self.me} received inputs it never used: {list(self.inbox)[:4]}")
