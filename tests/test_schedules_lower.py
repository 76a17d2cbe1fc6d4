"""Derived communication: every cross-device output gets a Send/Recv pair, every same-device one a Handoff, and
the result runs under blocking (rendezvous) sends and receives."""
import pytest

from pipeoptim.schedules import (SCHEDULES, Handoff, Recv, Send, check_rendezvous, get_schedule, is_compute, lower,
                                 output_transfer)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("devices,microbatches", [(2, 4), (4, 8)])
def test_lowering_pairs_every_transfer_and_is_deadlock_free(name, devices, microbatches):
    s = get_schedule(name, devices, microbatches)
    low = lower(s)
    assert low.compute_only() == s
    sends = {(d, a.op, a.peer) for d, acts in enumerate(low.actions) for a in acts if isinstance(a, Send)}
    recvs = {(a.peer, d) for d, acts in enumerate(low.actions) for a in acts if isinstance(a, Recv)}
    hands = {a.op for acts in low.actions for a in acts if isinstance(a, Handoff)}
    expected_p2p, expected_local = set(), set()
    for acts in s.actions:
        for a in acts:
            if is_compute(a) and (tr := output_transfer(s, a)) is not None:
                (expected_local.add(a) if tr.local else expected_p2p.add((tr.src, a, tr.dst)))
    assert sends == expected_p2p and hands == expected_local
    assert len(recvs) == len({(src, dst) for src, _, dst in expected_p2p})
    check_rendezvous(low)


def test_each_send_directly_follows_its_producer_and_receives_precede_consumers():
    low = lower(get_schedule("1f1b", 3, 3))
    for acts in low.actions:
        for i, a in enumerate(acts):
            if isinstance(a, Send):
                assert acts[i - 1] == a.op
            if isinstance(a, Recv):
                assert a.op in acts[i + 1:]


def test_bitpipe_v_turn_is_handed_off_on_the_turning_device():
    low = lower(get_schedule("bitpipe", 4, 4))
    assert [str(a) for a in low.actions[3] if isinstance(a, Handoff)][:2] == ["HAND:F0s3", "HAND:F1s3"]
    assert any(isinstance(a, Handoff) and a.op.replica == 1 for a in low.actions[0])
