"""Action values and their one-token notation: every kind prints and parses back, bad input says what is
accepted."""
import pytest

from pipeoptim.schedules.actions import (Backward, BackwardInput, BackwardWeight, Chunk, Forward, Handoff, Recv, Send,
                                         Step, Sync, format_action, input_grad_action, is_compute, parse_action,
                                         weight_grad_action)

EXAMPLES = [
    (Forward(3, 5), "F3s5"),
    (Backward(0, 0), "B0s0"),
    (Forward(12, 7, 1), "F12<s7"),
    (Backward(2, 4, 1), "B2<s4"),
    (Step(5), "STEP:s5"),
    (Step(5, 1), "STEP:<s5"),
    (Sync((4, 7), (0, 3)), "SYNC:s4+s7@0+3"),
    (Sync((1,), (), dp=True), "SYNC:s1@:dp"),
    (Sync((0, 3), (0, 3), dp=True), "SYNC:s0+s3@0+3:dp"),
    (Send(Forward(3, 5), 2), "SEND:F3s5@2"),
    (Recv(Backward(3, 4, 1), 1), "RECV:B3<s4@1"),
    (Handoff(Forward(3, 3)), "HAND:F3s3"),
    (BackwardInput(3, 5), "I3s5"),
    (BackwardWeight(2, 4, 1), "W2<s4"),
    (Send(BackwardInput(3, 5), 2), "SEND:I3s5@2"),
    (Recv(BackwardInput(3, 4, 1), 1), "RECV:I3<s4@1"),
    (Handoff(BackwardInput(0, 4)), "HAND:I0s4"),
]


@pytest.mark.parametrize("action,token", EXAMPLES)
def test_tokens_print_and_parse_back(action, token):
    assert format_action(action) == token
    assert str(action) == token
    assert parse_action(token) == action


@pytest.mark.parametrize("action,token", EXAMPLES)
def test_directed_tokens_parse_back(action, token):
    directed = format_action(action, directed=True)
    assert parse_action(directed) == action
    if is_compute(action) and action.replica == 0:
        assert directed == token.replace("s", ">s", 1)


def test_actions_are_small_frozen_hashable_values():
    a = Forward(1, 2)
    with pytest.raises(AttributeError):
        a.mb = 3
    assert {Forward(1, 2), Forward(1, 2), Backward(1, 2)} == {Forward(1, 2), Backward(1, 2)}
    assert Forward(1, 2) != Backward(1, 2)
    assert Forward(1, 2, 1).chunk == Chunk(1, 2)
    assert is_compute(Backward(0, 0)) and not is_compute(Step(0))
    assert is_compute(BackwardInput(0, 0)) and is_compute(BackwardWeight(0, 0))
    assert BackwardInput(1, 2) != Backward(1, 2) != BackwardWeight(1, 2)
    assert [input_grad_action(a) for a in (Backward(0, 0), BackwardInput(0, 0), BackwardWeight(0, 0))] == \
        [True, True, False]
    assert [weight_grad_action(a) for a in (Backward(0, 0), BackwardInput(0, 0), BackwardWeight(0, 0))] == \
        [True, False, True]


@pytest.mark.parametrize("bad", ["X1s0", "F1", "Fs0", "F-1s0", "STEP:s", "SYNC:@0", "SEND:F1s0", "F1^s0", ""])
def test_unreadable_tokens_name_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="expected one of"):
        parse_action(bad)


@pytest.mark.parametrize("make", [lambda: Forward(-1, 0), lambda: Backward(0, 0, 2), lambda: Step(0, 5),
                                  lambda: Sync((), (0,)), lambda: Sync((1, 1), (0,)), lambda: Sync((1,), ()),
                                  lambda: Send(Step(0), 1), lambda: Forward(1.5, 0),
                                  lambda: Send(BackwardWeight(0, 1), 0), lambda: Handoff(BackwardWeight(0, 1)),
                                  lambda: BackwardWeight(0, 1, 2)])
def test_invalid_values_are_refused(make):
    with pytest.raises(ValueError):
        make()
