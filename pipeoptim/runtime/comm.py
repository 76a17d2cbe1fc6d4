"""Point-to-point transfer of the tensors that cross a stage boundary, over torch.distributed.

A boundary may carry several tensors whose shapes can change between micro-batches (the last, smaller
micro-batch of a batch; a stage whose output shape depends on its input), and a wrong gradient shape must be
reported by the worker instead of hanging in a receive of the wrong size or being silently reshaped. So the
receiver must always know the shapes of what it receives; but asking first (a header message, then the
payload) costs a round trip per transfer. Instead, shapes are agreed once and then assumed:

- a transfer is one message: a byte buffer holding a flag (8 bytes) and every tensor of the boundary, each
  at an offset aligned to 16 bytes (``Layout``), so dtypes gloo cannot send (bfloat16, bool) travel as bytes;
  the sender copies the tensors in (one copy), the receiver hands out views of its buffer (no copy);
- a message whose shapes the receiver cannot know is preceded by a header (``pack_header``: per tensor its
  dtype, rank and shape, or "none" for a missing gradient); shapes are agreed per *slot* (sender, receiver and
  the kind of the consuming op: the forward or the backward of one stage of one replica), and every message
  whose receiver posted its receive in the agreed shapes is the packed message alone;
- when the shapes change, the sender fills the receive already posted with a message of the posted layout
  whose flag says so, then sends a header and the packed message: the receiver reads them and agrees on the
  new shapes. Nothing is reshaped and nothing can be received into a buffer of the wrong size;
- buffers are reused: a channel's i-th message of an iteration is received into (and sent from) the buffer
  of its i-th message of the previous iteration when the layout is the same; by then the iteration that used
  it has ended (``finish``), with every input consumed and every send completed.

When receives are posted. On gloo (CPU tensors) every receive of the iteration whose layout is known is posted
when the iteration starts: each message in the layout the same consumer's message had the last iteration of the
same plan (training or evaluation; both ends know it: every message of that iteration arrived), up to the first
message never seen before; the
rest one ahead, as on NCCL. Headers and the payloads after them then travel under a tag of their own
(``SIDE_TAG``), so they never land in a receive posted ahead. gloo hands a message over only once both ends
have posted theirs (a "send ready" and a "receive ready" notice cross first): a receive posted early lets the
sender's own call write the message at once, where a receive posted late makes the receiver's notice travel to
the sender's I/O thread, which then writes it. On 4 processes sharing 2 cores the late way kept gloo's I/O
threads spinning in ``epoll_wait``: GPipe's step (N = 32, a tiny model) took those threads 72 ms of CPU with one
receive posted ahead, 5.4 ms with all of them (torch's runtime: 42 ms). On NCCL (GPU tensors), which matches
sends and receives by order, not by tag, and runs a pair's transfers one after another, one receive per
channel is posted ahead: the next message's, as soon as the previous one is taken, and the first message of
each channel when the iteration starts, if its slot's shapes are agreed.

Ordering (deadlock freedom): sends are posted as soon as the data exists and never waited on before the end
of the iteration; a receive is waited on just before the compute that needs it. Messages on one channel
(sender -> receiver) are taken in the sender's order (``Plan.channels``); one that arrives before it is
needed waits in an inbox. So the executor blocks only where the schedule's timeline blocks, and the
per-channel order is what NCCL needs.

Emulated link (benchmarks only, ``link=``, ``pipeoptim train --link``). With a ``links.Link`` every message is
delivered no sooner than latency + bytes / bandwidth after it was sent, and never before the message sent ahead
of it on the same channel: the sender writes that delivery time (``time.time()``, so the ranks must share one
machine's clock) into bytes 8-16 of the packed message, after the flag, and goes on computing; the receiver, once
the message has arrived, sleeps until that time before handing it out. Each message is priced on its own, as the
simulator prices a hop (``sim.Costs``: no queueing behind an earlier message's bytes). The real transfer
underneath (loopback, microseconds) is not subtracted, so the emulated link must be slow against it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..schedules.actions import Forward
from .plan import Plan

__all__ = ["P2P", "HEADER_LEN", "SIDE_TAG", "pack_header", "unpack_header", "metas_of"]

HEADER_LEN = 64
_MAX_DIMS = 6
_SLOT = 2 + _MAX_DIMS
_MAX_TENSORS = (HEADER_LEN - 1) // _SLOT
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.bool, torch.int8, torch.int16]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


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


Metas = tuple  # per tensor (dtype, shape), or None for a missing gradient


def metas_of(tensors: tuple) -> Metas:
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


def slot_of(peer: int, key) -> tuple:
    """Messages that share shapes: one peer, and the forward (activations) or the backward (gradients) of one
    stage of one replica."""
    return peer, isinstance(key, Forward), key.stage, key.replica


_SAME, _CHANGED = 0, 1
SIDE_TAG = 1  # (gloo) headers and the payloads after them: never matched with a receive posted ahead
_FLAG_BYTES = 8
_STAMPED_BYTES = 16   # flag, then (emulated link) the float64 time at which the message may be handed out
_ALIGN = 16


class Layout:
    """Where each tensor of a boundary lies in its packed message: the flag (int64) at byte 0, then each
    tensor at an offset aligned to 16 bytes (a view of any dtype needs its element size to divide the offset).
    ``stamped``: bytes 8-16 hold the delivery time of an emulated link (the first tensor starts at 16 either way)."""

    def __init__(self, metas: Metas, stamped: bool = False):
        self.metas = metas
        self.stamped = stamped
        self.spans: list[tuple[int, int] | None] = []
        end = _STAMPED_BYTES if stamped else _FLAG_BYTES
        for m in metas:
            if m is None:
                self.spans.append(None)
                continue
            dtype, shape = m
            start = -(-end // _ALIGN) * _ALIGN
            n = dtype.itemsize
            for d in shape:
                n *= d
            self.spans.append((start, start + n))
            end = start + n
        self.nbytes = end

    def views(self, buf: torch.Tensor) -> tuple:
        """The tensors of a message held in ``buf`` (views, no copy)."""
        return tuple(None if span is None else buf[span[0]:span[1]].view(m[0]).view(m[1])
                     for m, span in zip(self.metas, self.spans))

    def flag(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:_FLAG_BYTES].view(torch.int64)

    def stamp(self, buf: torch.Tensor) -> torch.Tensor:
        """The delivery time (float64 seconds) of a stamped message."""
        return buf[_FLAG_BYTES:_STAMPED_BYTES].view(torch.float64)


class _Buffers:
    """Byte buffers reused across iterations, one per (peer, message index in the channel)."""

    def __init__(self, device):
        self.device = device
        self.held: dict[tuple[int, int], torch.Tensor] = {}
        self.packing: dict[tuple[int, int], tuple] = {}  # key -> (layout, its buffer, the views to pack into)

    def get(self, key: tuple[int, int], nbytes: int) -> torch.Tensor:
        buf = self.held.get(key)
        if buf is None or buf.numel() != nbytes:
            buf = self.held[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def for_sending(self, key: tuple[int, int], layout: Layout) -> tuple[torch.Tensor, tuple]:
        """``key``'s buffer in ``layout`` with its flag set to 'same', and the views to pack the tensors into:
        made once per buffer and layout (the sender never writes another flag into it), not per message."""
        entry = self.packing.get(key)
        if entry is None or entry[0] is not layout:
            buf = self.get(key, layout.nbytes)
            layout.flag(buf).fill_(_SAME)
            entry = self.packing[key] = (layout, buf, layout.views(buf))
        return entry[1], entry[2]


def _start(op, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> list:
    """Start ``op`` (``dist.isend`` or ``dist.irecv``) of each tensor, in order, with global rank ``peer``; returns
    the works. CPU tensors (gloo) go one call each: ``batch_isend_irecv`` adds ~20 µs per call there (measured on
    a 2-core Xeon, 26 µs against 7.6 for an isend) and gloo keeps a pair's messages of one tag in order anyway;
    GPU tensors (NCCL) go in one batch, as NCCL wants its point-to-point calls grouped."""
    if tensors[0].device.type == "cpu":
        return [op(t, peer, tag=tag) for t in tensors]
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer, tag=tag) for t in tensors])


class _Posted:
    """The receive of one message posted ahead, in the layout both ends expect for it."""

    def __init__(self, peer: int, layout: Layout, buf: torch.Tensor):
        self.layout, self.buf = layout, buf
        self.works = _start(dist.irecv, [buf], peer)


class P2P:
    """Messages between pipeline ranks of one data-parallel copy; ``global_rank(d)`` maps a device to a rank."""

    def __init__(self, plan: Plan, me: int, global_rank, device: torch.device, wait=None,
                 post_all_ahead: bool | None = None, link=None):
        """``wait(work, what, peer)`` waits for one transfer (``what`` in words, ``peer`` the global rank on
        the other end); the executor's tells the rank's watchdog what it waits for. ``post_all_ahead``: post
        every receive of an iteration whose layout is known when it starts (default: on gloo, i.e. CPU
        tensors; NCCL posts one ahead per channel, see the module docstring). ``link``: a ``links.Link`` to
        emulate (module docstring), on CPU tensors only; None: messages go as fast as the transport does."""
        self.plan, self.me, self.global_rank, self.device = plan, me, global_rank, device
        if link is not None and torch.device(device).type != "cpu":
            raise ValueError("an emulated link delays CPU messages (gloo); on GPUs the transfers are NCCL's own")
        self.link = link
        self.stamped = link is not None
        self._last_delivery: dict[int, float] = {}   # dst -> delivery time of the last message sent to it
        self.wait = wait or (lambda work, what, peer: work.wait())
        self.post_all_ahead = torch.device(device).type == "cpu" if post_all_ahead is None else post_all_ahead
        # slot -> the layout (shapes) agreed for it: the receiver expects it from this rank / this rank expects it;
        # one per slot, so a job whose shapes keep changing holds no more layouts than it has slots
        self.sent_layouts: dict[tuple, Layout] = {}
        self.recv_layouts: dict[tuple, Layout] = {}
        # (peer, consumer op, forward-only plan?) -> the layout of its last message: what the next iteration of
        # the same plan posts it in ahead (evaluation may cut other shapes than training, so the two plans'
        # messages are told apart; one entry per consumer op of the plans run, each one of the slots' layouts)
        self.sent_by_key: dict[tuple, Layout] = {}
        self.recv_by_key: dict[tuple, Layout] = {}
        self._send_bufs = _Buffers(device)
        self._recv_bufs = _Buffers(device)
        self.reset(plan)

    @property
    def side_tag(self) -> int:
        """The tag of headers and the payloads after them: one of their own where receives are posted ahead."""
        return SIDE_TAG if self.post_all_ahead else 0

    def reset(self, plan: Plan) -> None:
        """Start an iteration of ``plan``: post the receives known ahead (all of them on gloo, the first
        message of each incoming channel on NCCL)."""
        self.plan = plan
        self.kind = bool(getattr(plan, "forward_only", False))
        self.pending: list = []
        self.inbox: dict = {}
        self.taken: dict[int, int] = {}
        self.sent: dict[int, int] = {}
        self.posted: dict[int, _Posted] = {}          # src -> the receive posted for its next message (one ahead)
        self.ahead: dict[int, dict[int, _Posted]] = {}  # src -> message index -> its receive posted at the start
        self.promised: dict[int, list[Layout]] = {}   # dst -> the layouts dst posted its first messages in
        for (src, dst), seq in plan.channels.items():
            if dst == self.me:
                if self.post_all_ahead:
                    self.ahead[src] = {i: _Posted(self.global_rank(src), layout,
                                                  self._recv_bufs.get((src, i), layout.nbytes))
                                       for i, layout in enumerate(_known(self.recv_by_key, src, seq, self.kind))}
                self._post_next(src)
            elif src == self.me and self.post_all_ahead:
                self.promised[dst] = _known(self.sent_by_key, dst, seq, self.kind)

    # ---- sending -----------------------------------------------------------------------------------------
    def send(self, dst: int, key, tensors: tuple) -> None:
        peer = self.global_rank(dst)
        slot = slot_of(dst, key)
        metas = metas_of(tensors)
        i = self.sent.get(dst, 0)
        self.sent[dst] = i + 1
        promised = self.promised.get(dst, ())
        # the layout dst posted this message's receive in (None: it posts none, a header comes first)
        posted = promised[i] if i < len(promised) else self.sent_layouts.get(slot)
        if posted is not None and posted.metas == metas:
            layout, keep = posted, [self._pack(dst, i, posted, tensors)]
            works = _start(dist.isend, keep, peer)
        else:
            header = pack_header(tensors, self.device)   # checks dtypes and ranks before anything is sent
            layout = Layout(metas, self.stamped)
            keep = [header, self._pack(dst, i, layout, tensors, HEADER_LEN * 8)]
            works = []
            if posted is not None:                       # fill the receive dst posted, flagged "changed"
                fill = torch.zeros(posted.nbytes, dtype=torch.uint8, device=self.device)
                posted.flag(fill).fill_(_CHANGED)
                keep = [fill] + keep
                works = _start(dist.isend, [fill], peer)
            works = works + _start(dist.isend, keep[-2:], peer, self.side_tag)
            self.sent_layouts[slot] = layout
        self.sent_by_key[(dst, key, self.kind)] = layout
        self.pending.append((works, keep, key, dst))

    def _pack(self, dst: int, index: int, layout: Layout, tensors: tuple, extra_bytes: int = 0) -> torch.Tensor:
        buf, views = self._send_bufs.for_sending((dst, index), layout)  # its last send completed at the last finish()
        with torch.no_grad():
            for view, t in zip(views, tensors):
                if t is not None:
                    view.copy_(t)
        if self.link is not None:   # in order per channel: never before the message sent ahead of it
            due = time.time() + self.link.transfer_s(layout.nbytes + extra_bytes)
            due = self._last_delivery[dst] = max(due, self._last_delivery.get(dst, 0.0))
            layout.stamp(buf).fill_(due)
        return buf

    def _deliver(self, layout: Layout, buf: torch.Tensor) -> None:
        """(Emulated link) hold a message that arrived until its delivery time."""
        if self.link is not None:
            wait = float(layout.stamp(buf)) - time.time()
            if wait > 0:
                time.sleep(wait)

    # ---- receiving ---------------------------------------------------------------------------------------
    def recv(self, src: int, key) -> tuple:
        seq = self.plan.channels.get((src, self.me), [])
        while (src, key) not in self.inbox:
            i = self.taken.get(src, 0)
            if i >= len(seq):
                raise RuntimeError(f"device {self.me} waits for the input of {key} from device {src}, but the "
                                   f"schedule sends nothing more on that channel")
            self.inbox[(src, seq[i])] = self._recv_one(src, seq[i], i)
            self.taken[src] = i + 1
            self._post_next(src)
        return self.inbox.pop((src, key))

    def _post_next(self, src: int) -> None:
        """Post the receive of ``src``'s next message on this channel if it was not posted at the start and its
        slot's shapes are agreed."""
        seq = self.plan.channels.get((src, self.me), [])
        i = self.taken.get(src, 0)
        if i < len(seq) and src not in self.posted and i not in self.ahead.get(src, ()):
            layout = self.recv_layouts.get(slot_of(src, seq[i]))
            if layout is not None:
                self.posted[src] = _Posted(self.global_rank(src), layout,
                                           self._recv_bufs.get((src, i), layout.nbytes))

    def _recv_one(self, src: int, key, index: int) -> tuple:
        peer = self.global_rank(src)
        ahead = self.ahead.get(src)
        posted = ahead.pop(index) if ahead and index in ahead else self.posted.pop(src, None)
        if posted is not None:                   # None: the first message of its slot, a header comes
            for w in posted.works:
                self.wait(w, f"{key}'s input from rank {peer}", peer)
            if int(posted.layout.flag(posted.buf)) == _SAME:
                self.recv_by_key[(src, key, self.kind)] = posted.layout
                self._deliver(posted.layout, posted.buf)
                return posted.layout.views(posted.buf)
        h = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        for w in _start(dist.irecv, [h], peer, self.side_tag):
            self.wait(w, f"the header of {key}'s input from rank {peer}", peer)
        layout = Layout(tuple(unpack_header(h)), self.stamped)
        buf = self._recv_bufs.get((src, index), layout.nbytes)
        for w in _start(dist.irecv, [buf], peer, self.side_tag):
            self.wait(w, f"{key}'s input from rank {peer}", peer)
        self.recv_layouts[slot_of(src, key)] = layout
        self.recv_by_key[(src, key, self.kind)] = layout
        self._deliver(layout, buf)
        return layout.views(buf)

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


def _known(by_key: dict, peer: int, seq: list, kind: bool) -> list[Layout]:
    """The layouts of a channel's first messages whose consumer had a message before, up to the first one that
    had none: the receives both ends count as posted when an iteration starts."""
    out = []
    for key in seq:
        layout = by_key.get((peer, key, kind))
        if layout is None:
            break
        out.append(layout)
    return out
