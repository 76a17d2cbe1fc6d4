"""Version difference s(stage, micro-batch), counted from the action lists (DESIGN.md section 2)."""
import pytest

from pipeoptim.schedules import Backward, Chunk, Forward, Schedule, Step, get_schedule, max_version_difference, \
    version_difference


@pytest.mark.parametrize("devices,microbatches", [(2, 5), (4, 12), (6, 9)])
def test_async_1f1b_warm_up_and_steady_state(devices, microbatches):
    s = version_difference(get_schedule("async-1f1b", devices, microbatches))
    for k in range(devices):
        for j in range(microbatches):
            assert s[(k, j)] == min(j, devices - k - 1), (k, j)
    assert max_version_difference(get_schedule("async-1f1b", devices, microbatches)) == \
        {k: min(devices - k - 1, microbatches - 1) for k in range(devices)}


def test_2bw_counts_updates_not_microbatches():
    D, m = 4, 4
    s = version_difference(get_schedule("2bw", D, 16, update_every=m))
    for k in range(D):
        warm = D - k - 1
        for j in range(16):
            # steps before the backward of j: j // m; before its forward: max(j - warm, 0) // m
            assert s[(k, j)] == j // m - max(j - warm, 0) // m
    assert max(s.values()) == 1


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "chimera", "bitpipe"])
def test_synchronous_schedules_have_no_staleness(name):
    assert set(version_difference(get_schedule(name, 4, 8)).values()) == {0}


def test_hand_written_steps_are_counted_where_they_are():
    acts = [[Forward(0, 0), Forward(1, 0), Step(0), Step(0), Backward(0, 0), Step(0), Backward(1, 0), Step(0)]]
    s = Schedule("x", 1, 2, 1, [[Chunk(0, 0)]], acts, synchronous=False)
    assert version_difference(s) == {(0, 0): 2, (0, 1): 3}


def test_backward_before_forward_is_refused():
    s = Schedule("x", 1, 1, 1, [[Chunk(0, 0)]], [[Backward(0, 0), Forward(0, 0)]])
    with pytest.raises(ValueError, match="before its forward"):
        version_difference(s)
