"""GPipe, 1F1B and interleaved 1F1B orders and placements (bubble formulas are pinned in test_sim.py)."""
import pytest

from pipeoptim.schedules import Backward, Chunk, Forward, Step
from pipeoptim.schedules.synchronous import gpipe, interleaved, one_f_one_b


def _tokens(acts):
    return [str(a) for a in acts]


def test_gpipe_runs_all_forwards_then_all_backwards_then_steps():
    s = gpipe(3, 4)
    assert _tokens(s.actions[1]) == [f"F{m}s1" for m in range(4)] + [f"B{m}s1" for m in range(4)] + ["STEP:s1"]


@pytest.mark.parametrize("devices,microbatches", [(4, 8), (4, 2), (2, 1), (5, 3)])
def test_1f1b_warms_up_d_minus_k_minus_1_forwards_then_alternates(devices, microbatches):
    s = one_f_one_b(devices, microbatches)
    for d, acts in enumerate(s.actions):
        compute = [a for a in acts if not isinstance(a, Step)]
        warm = min(devices - d - 1, microbatches)
        assert all(isinstance(a, Forward) for a in compute[:warm])
        assert compute[warm] == Forward(warm, d) if warm < microbatches else isinstance(compute[warm], Backward)
        in_flight = peak = 0
        for a in compute:
            in_flight += 1 if isinstance(a, Forward) else -1
            peak = max(peak, in_flight)
        assert peak == min(devices - d, microbatches)   # at most D micro-batches' activations on stage 0
        assert acts[-1] == Step(d)


def test_interleaved_looping_placement_and_megatron_order():
    s = interleaved(2, 4, chunks=2)
    assert s.chunks == ((Chunk(0, 0), Chunk(0, 2)), (Chunk(0, 1), Chunk(0, 3)))
    # device 0 warms up 2(D-1) + (v-1)D = 4 forwards: mbs 0,1 on chunk 0, then mbs 0,1 on chunk 1
    assert _tokens(s.actions[0])[:6] == ["F0s0", "F1s0", "F0s2", "F1s2", "F2s0", "B0s2"]
    assert _tokens(s.actions[1])[:4] == ["F0s1", "F1s1", "F0s3", "B0s3"]
    assert s.params == {"chunks": 2}
    assert [a for a in s.actions[0] if isinstance(a, Step)] == [Step(2), Step(0)]


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved(4, 8, chunks=1).actions == one_f_one_b(4, 8).actions
