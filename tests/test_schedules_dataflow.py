"""The dependency rules: producers, consumers and transfers (p2p across devices, hand-off on one device)."""
from pipeoptim.schedules import Backward, Forward, get_schedule
from pipeoptim.schedules.dataflow import consumer, input_transfer, output_transfer, producer, requirements


def test_forward_and_backward_chains():
    s = get_schedule("1f1b", devices=3, microbatches=2)
    assert producer(s, Forward(1, 0)) is None
    assert producer(s, Forward(1, 2)) == Forward(1, 1)
    assert producer(s, Backward(1, 2)) is None            # the loss, on the same device
    assert producer(s, Backward(1, 0)) == Backward(1, 1)
    assert consumer(s, Forward(1, 2)) is None and consumer(s, Backward(1, 0)) is None
    assert requirements(s, Backward(1, 1)) == (Backward(1, 2), Forward(1, 1))
    assert requirements(s, Backward(1, 2)) == (Forward(1, 2),)


def test_bitpipe_v_turn_is_a_local_handoff_and_the_rest_is_p2p():
    s = get_schedule("bitpipe", devices=4, microbatches=4)
    turn = output_transfer(s, Forward(0, 3, 0))            # down stage 3 -> 4, both on device 3
    assert turn.local and turn.src == turn.dst == 3 and turn.to_op == Forward(0, 4, 0)
    back = output_transfer(s, Backward(0, 4, 0))
    assert back.local and back.to_op == Backward(0, 3, 0)
    hop = input_transfer(s, Forward(2, 4, 1))              # up stage 4 is device 0, stage 3 too (up V-turn)
    assert hop.local and hop.src == 0
    hop = input_transfer(s, Forward(0, 5, 0))              # down stage 5 on device 2, from device 3
    assert not hop.local and (hop.src, hop.dst) == (3, 2)
