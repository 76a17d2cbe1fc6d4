"""Point-to-point transfer of the tensors that cross a stage boundary, over torch.distributed.

Each message is a small int64 header (how many tensors; per tensor its dtype, rank and shape, or "none" for
a missing gradient) followed by one payload per tensor, all posted with ``dist.batch_isend_irecv``. The
receiver allocates from the header, so a boundary may carry several tensors whose shapes change between
micro-batches, and a wrong gradient shape is reported by the worker instead of hanging in a receive of the
wrong size or being silently reshaped.

Ordering (deadlock freedom): sends are posted as soon as the data exists and never waited on before the end
of the iteration; a receive is waited on just before the compute that needs it. Messages on one channel
(sender -> receiver) are taken in the sender's order (``Plan.channels``); one that arrives before it is
needed waits in an inbox. So the executor blocks only where the schedule's timeline blocks, and the
per-channel order is what NCCL needs (it matches sends and receives by order, not by tag).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .plan import Plan

__all__ = ["P2P", "HEADER_LEN", "pack_header", "unpack_header"]

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


class P2P:
    """Messages between pipeline ranks of one data-parallel copy; ``global_rank(d)`` maps a device to a rank."""

    def __init__(self, plan: Plan, me: int, global_rank, device: torch.device, wait=None):
        """``wait(work, what, peer)`` waits for one transfer (``what`` in words, ``peer`` the global rank on
        the other end); the executor's tells the rank's watchdog what it waits for."""
        self.plan, self.me, self.global_rank, self.device = plan, me, global_rank, device
        self.wait = wait or (lambda work, what, peer: work.wait())
        self.reset(plan)

    def reset(self, plan: Plan) -> None:
        self.plan = plan
        self.pending: list = []
        self.inbox: dict = {}
        self.taken: dict[int, int] = {}

    def send(self, dst: int, key, tensors: tuple) -> None:
        peer = self.global_rank(dst)
        keep = [pack_header(tensors, self.device)] + [_wire(t) for t in tensors if t is not None]
        ops = [dist.P2POp(dist.isend, t, peer) for t in keep]
        self.pending.append((dist.batch_isend_irecv(ops), keep, key, dst))

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

    def _recv_one(self, src: int, key) -> tuple:
        peer = self.global_rank(src)
        h = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, peer)]):
            self.wait(w, f"the header of {key}'s input from rank {peer}", peer)
        metas = unpack_header(h)
        bufs, wires = [], []
        for m in metas:
            if m is None:
                bufs.append(None)
                continue
            dtype, shape = m
            b = torch.empty(shape, dtype=dtype, device=self.device)
            bufs.append(b)
            wires.append(_wire(b))
        if wires:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in wires]):
                self.wait(w, f"{key}'s input from rank {peer}", peer)
        return tuple(bufs)

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
