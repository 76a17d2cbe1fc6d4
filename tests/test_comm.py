"""comm.P2P: shapes agreed once per slot, one flag + payloads afterwards, receives posted ahead, and a change of
shapes (or a missing gradient) still arriving exactly, over two real gloo processes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeoptim.runtime import launch
from pipeoptim.runtime.comm import HEADER_LEN, pack_header, unpack_header
from pipeoptim.schedules.actions import Backward, Forward

# What rank 0 sends to rank 1 in each of two iterations: (consumer op, tensors), in sending order.
# Forward(mb, 1, 0) messages share one slot, Backward(mb, 1, 0) messages another.
WIDTHS = [(3, 5), (3, 5), (2, 5), (2, 5), (3, 5)]     # the third message changes the shape, the fifth back


def _messages(iteration: int):
    out = []
    for mb, shape in enumerate(WIDTHS):
        g = torch.Generator().manual_seed(100 * iteration + mb)
        x = torch.randn(shape, generator=g)
        ids = torch.randint(0, 9, (shape[0],), generator=g)
        out.append((Forward(mb, 1, 0), (x, ids)))
    # a gradient slot whose second message has a missing (None) gradient, then bfloat16
    out.append((Backward(0, 1, 0), (torch.ones(2, 2), torch.zeros(4))))
    out.append((Backward(1, 1, 0), (torch.ones(2, 2), None)))
    out.append((Backward(2, 1, 0), (torch.full((2, 2), 3.0, dtype=torch.bfloat16), None)))
    return out


def _p2p_job():
    import os

    import torch.distributed as dist

    from pipeoptim.runtime.comm import P2P
    from pipeoptim.runtime.dist_env import init_from_env

    init_from_env()
    rank = int(os.environ["RANK"])
    sent_ops: list[list[int]] = []
    real = dist.batch_isend_irecv

    def counting(ops):
        if ops and ops[0].op is dist.isend:
            sent_ops.append([t.tensor.numel() for t in ops])
        return real(ops)

    dist.batch_isend_irecv = counting
    keys = [k for k, _ in _messages(0)]
    plan = SimpleNamespace(channels={(0, 1): keys})
    p2p = P2P(plan, rank, lambda d: d, torch.device("cpu"))
    report = {"ok": [], "posted_at_start": []}
    for it in range(2):
        p2p.reset(plan)
        report["posted_at_start"].append(sorted(p2p.posted))
        if rank == 0:
            for key, tensors in _messages(it):
                p2p.send(1, key, tensors)
        else:
            for key, tensors in reversed(_messages(it)):      # taken out of order: the inbox keeps the rest
                got = p2p.recv(0, key)
                same = len(got) == len(tensors) and all(
                    (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                                  and a.shape == b.shape and torch.equal(a, b))
                    for a, b in zip(got, tensors))
                report["ok"].append(bool(same))
        p2p.finish()
    report["sent_ops"] = sent_ops
    return report


@pytest.fixture(scope="module")
def reports():
    return launch(_p2p_job, 2, timeout_s=120)


def test_every_message_arrives_exactly_in_shape_dtype_and_value(reports):
    got = reports[1]["ok"]
    assert len(got) == 2 * len(_messages(0)) and all(got)


def test_a_header_travels_only_when_a_slot_is_new_or_its_shapes_change(reports):
    sent = reports[0]["sent_ops"]
    per_iteration = len(_messages(0))
    first, second = sent[:per_iteration], sent[per_iteration:]
    header = HEADER_LEN
    # iteration 1: F slot new (header), same, changed (flag, fills, header), same, changed; B slot new,
    # changed (None appears), changed (dtype)
    assert [ops[0] for ops in first] == [header, 1, 1, 1, 1, header, 1, 1]
    changed = [i for i, ops in enumerate(first) if header in ops[1:]]
    assert changed == [2, 4, 6, 7]
    # the change sends the flag, zeros in the old shapes (to fill the posted receives), the header, payloads
    assert first[2] == [1, 15, 3, header, 10, 2]
    # iteration 2 starts where iteration 1 ended (F slot agreed at 3x5, B at bf16 + None): the first F
    # message is flag + payload only
    assert second[0] == [1, 15, 3]
    assert [ops[0] for ops in second].count(header) == 0


def test_the_receiver_posts_the_first_message_of_each_channel_ahead_once_shapes_are_agreed(reports):
    assert reports[1]["posted_at_start"] == [[], [0]]
    assert reports[0]["posted_at_start"] == [[], []]     # rank 0 receives nothing


def test_header_round_trip():
    xs = (torch.zeros(2, 3, dtype=torch.bfloat16), None, torch.zeros((), dtype=torch.int64))
    h = pack_header(xs, torch.device("cpu"))
    assert unpack_header(h) == [(torch.bfloat16, (2, 3)), None, (torch.int64, ())]
