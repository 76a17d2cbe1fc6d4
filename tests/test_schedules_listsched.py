"""List scheduling: the priority decides among ready work, the admission rule bounds in-flight activations."""
import pytest

from pipeoptim.schedules import Backward, Chunk, Forward, Schedule
from pipeoptim.schedules.listsched import backward_first_deep, list_schedule


def _shell(devices):
    return Schedule("x", devices, 0, devices, [[Chunk(0, d)] for d in range(devices)], [[]] * devices)


def unit(op):
    return 1.0 if isinstance(op, Forward) else 2.0


def test_backward_first_gives_1f1b_on_a_chain_when_forwards_are_capped():
    shell = _shell(2)
    # stage 0 may hold 2 micro-batches, stage 1 one: exactly 1F1B's in-flight counts
    order = list_schedule(shell, [0] * 4, unit, backward_first_deep,
                          admit=lambda d, op, held: held + 1 <= (2 if d == 0 else 1))
    assert [str(a) for a in order[0]] == ["F0s0", "F1s0", "B0s0", "F2s0", "B1s0", "F3s0", "B2s0", "B3s0"]
    assert [str(a) for a in order[1]] == ["F0s1", "B0s1", "F1s1", "B1s1", "F2s1", "B2s1", "F3s1", "B3s1"]


def test_without_a_cap_forwards_fill_idle_time():
    order = list_schedule(_shell(2), [0] * 3, unit, backward_first_deep)
    assert [str(a) for a in order[0]][:3] == ["F0s0", "F1s0", "F2s0"]


def test_patience_waits_for_a_backward_instead_of_starting_a_forward():
    # device 0 is free at 3 with F3 ready; B0s0 is known to arrive at 4 (d1: F0 [1,2], B0 [2,4])
    eager = list_schedule(_shell(2), [0] * 4, unit, backward_first_deep)
    patient = list_schedule(_shell(2), [0] * 4, unit, backward_first_deep, patience=1.5)
    assert str(eager[0][3]) == "F3s0" and str(patient[0][3]) == "B0s0"


def test_a_cap_that_admits_nothing_stalls_with_advice():
    with pytest.raises(RuntimeError, match="loosen the in-flight limit"):
        list_schedule(_shell(2), [0], unit, admit=lambda d, op, held: False)


def test_every_op_appears_once_on_its_device():
    order = list_schedule(_shell(3), [0] * 5, unit)
    for d, ops in enumerate(order):
        assert sorted(str(o) for o in ops) == sorted([f"F{m}s{d}" for m in range(5)] + [f"B{m}s{d}" for m in range(5)])
        assert all(isinstance(o, (Forward, Backward)) for o in ops)
