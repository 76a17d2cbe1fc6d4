"""comm.P2P: shapes agreed once per slot, then one message per transfer (flag and payloads packed in one byte
buffer, reused across iterations), receives posted ahead (every known one at the start of an iteration on gloo,
one per channel as on NCCL), and a change of shapes (or a missing gradient) still arriving exactly, over two
real gloo processes, in both ways of posting."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeoptim.runtime import launch
from pipeoptim.runtime.comm import HEADER_LEN, SIDE_TAG, pack_header, unpack_header
from pipeoptim.schedules.actions import Backward, Forward

# What rank 0 sends to rank 1 in each of two iterations: (consumer op, tensors), in sending order.
# Forward(mb, 1, 0) messages share one slot, Backward(mb, 1, 0) messages another.
WIDTHS = [(3, 5), (3, 5), (2, 5), (2, 5), (3, 5)]     # the third message changes the shape, the fifth back
WIDTHS_LAST = [(2, 5), (3, 5), (3, 5), (3, 5), (3, 5)]  # the third iteration: other shapes at other places
ITERATIONS = 3


def _messages(iteration: int):
    out = []
    for mb, shape in enumerate(WIDTHS if iteration < 2 else WIDTHS_LAST):
        g = torch.Generator().manual_seed(100 * iteration + mb)
        x = torch.randn(shape, generator=g)
        ids = torch.randint(0, 9, (shape[0],), generator=g)
        out.append((Forward(mb, 1, 0), (x, ids)))
    # a gradient slot whose second message has a missing (None) gradient, then bfloat16
    out.append((Backward(0, 1, 0), (torch.ones(2, 2), torch.zeros(4))))
    out.append((Backward(1, 1, 0), (torch.ones(2, 2), None)))
    out.append((Backward(2, 1, 0), (torch.full((2, 2), 3.0, dtype=torch.bfloat16), None)))
    return out


def _p2p_job(post_all_ahead: bool):
    import os

    import torch.distributed as dist

    from pipeoptim.runtime import comm
    from pipeoptim.runtime.comm import P2P
    from pipeoptim.runtime.dist_env import init_from_env

    init_from_env()
    rank = int(os.environ["RANK"])
    sent_ops: list[list[int]] = []   # per transfer, the sizes of the tensors sent (fill, header, payload, ...)
    sent_tags: list[list[int]] = []  # and the tag of each
    real = comm._start

    def counting(op, tensors, peer, tag=0):
        if op is dist.isend:
            sent_ops[-1] += [t.numel() for t in tensors]
            sent_tags[-1] += [tag] * len(tensors)
        return real(op, tensors, peer, tag)

    comm._start = counting
    keys = [k for k, _ in _messages(0)]
    plan = SimpleNamespace(channels={(0, 1): keys})
    p2p = P2P(plan, rank, lambda d: d, torch.device("cpu"), post_all_ahead=post_all_ahead)
    report = {"ok": [], "posted_at_start": [], "storages": []}
    for it in range(ITERATIONS):
        p2p.reset(plan)
        report["posted_at_start"].append((sorted(p2p.posted), {src: sorted(a) for src, a in p2p.ahead.items()}))
        if rank == 0:
            for key, tensors in _messages(it):
                sent_ops.append([])
                sent_tags.append([])
                p2p.send(1, key, tensors)
        else:
            for key, tensors in reversed(_messages(it)):      # taken out of order: the inbox keeps the rest
                got = p2p.recv(0, key)
                same = len(got) == len(tensors) and all(
                    (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                                  and a.shape == b.shape and torch.equal(a, b))
                    for a, b in zip(got, tensors))
                report["ok"].append(bool(same))
                report["storages"].append([None if t is None else t.untyped_storage().data_ptr() for t in got])
        p2p.finish()
    report["sent_ops"], report["sent_tags"] = sent_ops, sent_tags
    report["layouts"] = (len(p2p.sent_layouts), len(p2p.recv_layouts))
    return report


@pytest.fixture(scope="module", params=[True, False], ids=["all-ahead", "one-ahead"])
def reports(request):
    return request.param, launch(_p2p_job, 2, request.param, timeout_s=120)


def test_every_message_arrives_exactly_in_shape_dtype_and_value(reports):
    got = reports[1][1]["ok"]
    assert len(got) == ITERATIONS * len(_messages(0)) and all(got)


def _packed(*nbytes):
    """Bytes of one packed message: an 8-byte flag, then each payload at the next multiple of 16."""
    end = 8
    for n in nbytes:
        end = (end + 15) // 16 * 16 + n
    return end


def test_a_transfer_is_one_message_and_a_header_travels_only_when_a_slot_is_new_or_its_shapes_change(reports):
    all_ahead, (sender, receiver) = reports
    sent = sender["sent_ops"]
    n = len(_messages(0))
    first, second, third = sent[:n], sent[n:2 * n], sent[2 * n:]
    header = HEADER_LEN
    # iteration 1: F slot new (header, message), same, changed (the old layout's message flagged "changed",
    # header, message), same, changed; B slot new, changed (None appears), changed (dtype)
    assert [len(ops) for ops in first] == [2, 1, 3, 1, 3, 2, 3, 3]
    assert [i for i, ops in enumerate(first) if header in ops] == [0, 2, 4, 5, 6, 7]
    f35, f25 = _packed(3 * 5 * 4, 3 * 8), _packed(2 * 5 * 4, 2 * 8)   # float32 x and int64 ids
    assert first[0] == [header, f35] and first[1] == [f35]
    assert first[2] == [f35, header, f25] and first[3] == [f25]
    assert first[6] == [_packed(16, 16), header, _packed(16)]           # a missing gradient takes no bytes
    assert first[7] == [_packed(16), header, _packed(8)]                # 2 x 2 bfloat16
    if all_ahead:
        # every receive was posted at the start in the layout its message had the iteration before: iteration
        # 2 repeats iteration 1's shapes, one message each; in iteration 3 the F messages whose shape differs
        # from that message's last one (0, 2, 3) fill the posted receive and send a header
        assert [len(ops) for ops in second] == [1] * n
        assert [len(ops) for ops in third] == [3, 1, 3, 3, 1, 1, 1, 1]
        assert third[0] == [f35, header, f25] and third[2] == [f25, header, f35]
        # headers and the payloads after them travel under their own tag, never into a receive posted ahead
        for ops, tags in zip(sent, sender["sent_tags"]):
            assert tags == ([SIDE_TAG] * 2 if len(ops) == 2 else [0] + [SIDE_TAG] * 2 if len(ops) == 3 else [0])
    else:
        # one receive ahead per channel, in the slot's agreed shapes: iteration 2 starts where iteration 1
        # ended (F slot agreed at 3x5, B at bf16 + None): unchanged shapes are one message each
        assert [len(ops) for ops in second] == [1, 1, 3, 1, 3, 3, 3, 3]
        assert second[0] == [f35]
        assert [len(ops) for ops in third] == [3, 3, 1, 1, 1, 3, 3, 3]
        assert all(set(tags) == {0} for tags in sender["sent_tags"])    # NCCL matches by order, not by tag


def test_receive_buffers_are_reused_across_iterations_when_the_layout_is_the_same(reports):
    all_ahead, (_, receiver) = reports
    storages = receiver["storages"]
    n = len(_messages(0))
    first, second = storages[:n][::-1], storages[n:2 * n][::-1]       # (taken in reverse order)
    for i in (range(n) if all_ahead else (0, 1, 3)):   # the messages that arrive in the posted layout in both
        assert first[i] == second[i]
    # within an iteration every message has its own buffer (all were held in the inbox at once)
    ptrs = [p for msg in first for p in set(msg) if p is not None]
    assert len(ptrs) == len(set(ptrs))


def test_the_receiver_posts_ahead_what_it_knows_when_an_iteration_starts(reports):
    all_ahead, (sender, receiver) = reports
    n = len(_messages(0))
    if all_ahead:   # every message whose consumer had one the iteration before
        assert receiver["posted_at_start"] == [([], {0: []}), ([], {0: list(range(n))}), ([], {0: list(range(n))})]
    else:           # the first message of each channel once its slot's shapes are agreed
        assert receiver["posted_at_start"] == [([], {}), ([0], {}), ([0], {})]
    assert all(posted == ([], {}) for posted in sender["posted_at_start"])     # rank 0 receives nothing


def test_header_round_trip():
    xs = (torch.zeros(2, 3, dtype=torch.bfloat16), None, torch.zeros((), dtype=torch.int64))
    h = pack_header(xs, torch.device("cpu"))
    assert unpack_header(h) == [(torch.bfloat16, (2, 3)), None, (torch.int64, ())]


def test_a_rank_holds_one_layout_per_slot_however_often_shapes_change(reports):
    """Shapes changed 5 times per iteration over 2 slots (F and B): each rank keeps the current layout of each
    slot, not one per shape it ever saw (the module-wide cache this replaced grew without bound)."""
    from pipeoptim.runtime import comm
    _, (sender, receiver) = reports
    assert sender["layouts"] == (2, 0) and receiver["layouts"] == (0, 2)
    assert not any(isinstance(v, dict) and v and all(isinstance(x, comm.Layout) for x in v.values())
                   for v in vars(comm).values())


def _train_eval_job(post_all_ahead: bool):
    """Training iterations, an evaluation whose forwards carry other shapes, then training again: the message
    counts per transfer of each iteration, and whether every message arrived exactly."""
    import os

    import torch.distributed as dist

    from pipeoptim.runtime import comm
    from pipeoptim.runtime.comm import P2P
    from pipeoptim.runtime.dist_env import init_from_env

    init_from_env()
    rank = int(os.environ["RANK"])
    counts: list[int] = []
    real = comm._start

    def counting(op, tensors, peer, tag=0):
        if op is dist.isend:
            counts[-1] += len(tensors)
        return real(op, tensors, peer, tag)

    comm._start = counting
    train = SimpleNamespace(channels={(0, 1): [k for k, _ in _messages(0)]}, forward_only=False)
    keys = [Forward(mb, 1, 0) for mb in range(3)]
    evaluation = SimpleNamespace(channels={(0, 1): keys}, forward_only=True)
    eval_messages = [(k, (torch.full((4, 5), float(mb)), torch.arange(4))) for mb, k in enumerate(keys)]
    p2p = P2P(train, rank, lambda d: d, torch.device("cpu"), post_all_ahead=post_all_ahead)
    report = {"counts": [], "ok": []}
    for plan, messages in [(train, _messages(1)), (train, _messages(1)), (evaluation, eval_messages),
                           (train, _messages(1))]:
        p2p.reset(plan)
        counts.clear()
        if rank == 0:
            for key, tensors in messages:
                counts.append(0)
                p2p.send(1, key, tensors)
        else:
            for key, tensors in messages:
                got = p2p.recv(0, key)
                report["ok"].append(all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, tensors)))
        p2p.finish()
        report["counts"].append(list(counts))
    return report


@pytest.mark.parametrize("all_ahead", [True, False], ids=["all-ahead", "one-ahead"])
def test_an_evaluation_with_other_shapes_leaves_trainings_receives_posted_in_trainings_shapes(all_ahead):
    sender, receiver = launch(_train_eval_job, 2, all_ahead, timeout_s=120)
    assert receiver["ok"] and all(receiver["ok"])
    first, second, evaluation, after = sender["counts"]
    assert evaluation[0] == 3 and evaluation[1:] == [1, 1]   # new shapes: the posted receive filled, a header
    if all_ahead:   # training's messages were posted in training's shapes again: one message each
        assert second == [1] * len(first) and after == [1] * len(first)
    else:           # the slot's agreed shapes are evaluation's now: the first forward changes back
        assert after[0] == 3


# ---- emulated link (pipeoptim.links.Link; ``pipeoptim train --link``) ----------------------------------------------
LINK_LATENCY_S, LINK_BANDWIDTH = 0.05, 1e6     # 50 ms, 1 MB/s: large against loopback and scheduling noise
LINK_SIZES = [4000, 8, 4000, 8, 8]             # float64 elements: 32 kB (32 ms at 1 MB/s), then 64 bytes, ...


def _link_job():
    import os
    import time

    from pipeoptim.links import Link
    from pipeoptim.runtime.comm import P2P
    from pipeoptim.runtime.dist_env import init_from_env

    init_from_env()
    rank = int(os.environ["RANK"])
    keys = [Forward(mb, 1, 0) for mb in range(len(LINK_SIZES))]
    plan = SimpleNamespace(channels={(0, 1): keys})
    p2p = P2P(plan, rank, lambda d: d, torch.device("cpu"), link=Link(LINK_LATENCY_S, LINK_BANDWIDTH))
    out = {"sent_s": [], "send_calls_s": 0.0, "got": []}
    for _ in range(2):                          # the second iteration: receives posted ahead, same layouts
        p2p.reset(plan)
        if rank == 0:
            t0 = time.time()
            for key, n in zip(keys, LINK_SIZES):
                x = torch.full((n,), time.time(), dtype=torch.float64)   # the message carries its send time
                p2p.send(1, key, (x,))
            out["send_calls_s"] = max(out["send_calls_s"], time.time() - t0)
        else:
            for key in keys:
                (x,) = p2p.recv(0, key)
                out["got"].append((float(x[0]), time.time(), x.numel() * 8))
        p2p.finish()
    return out


def test_an_emulated_link_delivers_each_message_after_latency_plus_bytes_over_bandwidth_in_order():
    sender, receiver = launch(_link_job, 2, timeout_s=120)
    # the sender is not held up: five sends take far less than one message's latency
    assert sender["send_calls_s"] < LINK_LATENCY_S / 2
    got = receiver["got"]
    assert len(got) == 2 * len(LINK_SIZES)
    for sent, arrived, nbytes in got:
        assert arrived - sent >= LINK_LATENCY_S + nbytes / LINK_BANDWIDTH - 1e-3
    # in order per peer: a small message sent after a large one is not handed out before it
    arrivals = [arrived for _, arrived, _ in got]
    assert arrivals == sorted(arrivals)
    # ... it waits for the large one's delivery, due latency + 32 ms after the large one was sent (the small one's
    # own send time comes later by however long the large send took, milliseconds on a loaded machine)
    (large_sent, _, large_bytes), (_, small_arrived, _) = got[0], got[1]
    assert small_arrived - large_sent >= LINK_LATENCY_S + large_bytes / LINK_BANDWIDTH - 1e-3
