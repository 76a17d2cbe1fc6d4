"""Chimera and BitPipe: placement, the published BitPipe order, eager syncs, the paced concatenation.
Times here are in forward-slots: one chunk forward = 1 (timeline with unit costs)."""
import pytest

from pipeoptim.schedules import Chunk, Sync, get_schedule, validate
from pipeoptim.schedules.bidirectional import bidirectional_replicas, bitpipe, bitpipe_chunks, chimera
from pipeoptim.schedules.timeline import run_timeline, unit_durations

# DESIGN.md section 4, stages numbered from 1: chunk0 (down), chunk1 (up), chunk2 (down), chunk3 (up)
TABLE_D4 = [[1, 4, 8, 5], [2, 3, 7, 6], [3, 2, 6, 7], [4, 1, 5, 8]]
REFERENCE_RANK0 = ("F1↓s1 F2↓s1 F3↑s4 F3↑s5 F4↑s4 F4↑s5 F1↓s8 B1↓s8 F2↓s8 B2↓s8 B3↑s5 B3↑s4 B4↑s5 B4↑s4 "
                   "B1↓s1 [sync chunks 2,3] B2↓s1 [sync chunks 0,1]")


def _design_notation(schedule, device):
    """Our device list in DESIGN.md's notation (micro-batches and stages from 1, arrows, chunk syncs)."""
    chunks = schedule.chunks[device]
    out = []
    for a in schedule.actions[device]:
        if isinstance(a, Sync):
            idx = sorted(i for i, c in enumerate(chunks) if c.stage in a.stages)
            out.append(f"[sync chunks {','.join(map(str, idx))}]")
        elif hasattr(a, "mb"):
            out.append(f"{type(a).__name__[0]}{a.mb + 1}{'↓↑'[a.replica]}s{a.stage + 1}")
    return " ".join(out)


def test_bitpipe_placement_is_the_v_shaped_table():
    chunks = bitpipe_chunks(4)
    assert [[c.stage + 1 for c in row] for row in chunks] == TABLE_D4
    assert [[c.replica for c in row] for row in chunks] == [[0, 1, 0, 1]] * 4
    for D in (2, 6, 8):
        for r, row in enumerate(bitpipe_chunks(D)):
            assert row == [Chunk(0, r), Chunk(1, D - 1 - r), Chunk(0, 2 * D - 1 - r), Chunk(1, D + r)]


def test_bitpipe_reproduces_the_published_rank0_order():
    assert _design_notation(bitpipe(4, 4), 0) == REFERENCE_RANK0


def test_bitpipe_mirror_rank_is_the_mirror_image():
    s = bitpipe(4, 4)
    mirrored = _design_notation(s, 3).replace("↓", "x").replace("↑", "↓").replace("x", "↑")
    swap = {"1": "3", "2": "4", "3": "1", "4": "2"}   # down mbs 1,2 <-> up mbs 3,4
    compute = [t for t in mirrored.split() if t[0] in "FB"]
    assert " ".join(t[0] + swap[t[1]] + t[2:] for t in compute) == \
        " ".join(t for t in REFERENCE_RANK0.split() if t[0] in "FB")


@pytest.mark.parametrize("ratio,slots", [(2.0, 28.0), (1.0, 18.0)])
def test_bitpipe_d4_n4_makespan_in_forward_slots(ratio, slots):
    tl = run_timeline(bitpipe(4, 4), unit_durations(ratio))
    assert tl.makespan == slots      # bubble 4/28 = 1/7 with B = 2F, 2/18 = 1/9 with F = B


def test_first_half_goes_down_second_half_up_in_each_group():
    assert bidirectional_replicas(4, 8) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert bidirectional_replicas(6, 6) == [0, 0, 0, 1, 1, 1]
    assert bidirectional_replicas(4, 6) == [0, 0, 1, 1, 0, 1]    # chimera's shorter last group


def test_mirror_devices_sync_the_same_stages():
    for s in (bitpipe(6, 12), chimera(6, 12), bitpipe(4, 8, concat="paced")):
        for d, acts in enumerate(s.actions):
            mine = [a for a in acts if isinstance(a, Sync)]
            theirs = [a for a in s.actions[s.num_devices - 1 - d] if isinstance(a, Sync)]
            assert mine == theirs and all(a.devices == tuple(sorted({d, s.num_devices - 1 - d})) for a in mine)


def test_pp2_works():
    for s in (bitpipe(2, 2), bitpipe(2, 6), chimera(2, 2), chimera(2, 4, concat="paced")):
        validate(s)


def test_activation_peaks_for_one_group_match_the_paper():
    from pipeoptim.sim import simulate
    for D in (4, 8):
        peaks = simulate(bitpipe(D, D)).peak_activations       # in units of one D-th of the model
        assert peaks[0] == peaks[-1] == 3 * D / 4 + 0.5 and max(peaks) == D


def _bubble(s, ratio):
    tl = run_timeline(s, unit_durations(ratio))
    busy = sum(r.end - r.start for recs in tl.records for r in recs)
    return 1 - busy / (s.num_devices * tl.makespan)


@pytest.mark.parametrize("devices,microbatches", [(4, 16), (8, 32)])
def test_paced_concatenation_beats_the_reference_with_backward_twice_forward(devices, microbatches):
    ref = _bubble(bitpipe(devices, microbatches), 2.0)
    paced = _bubble(bitpipe(devices, microbatches, concat="paced", bwd_ratio=2.0), 2.0)
    assert paced < ref - 0.02


def test_paced_bitpipe_beats_interleaved_at_d8_n32_where_the_reference_does_not():
    interleaved = 7 / (2 * 32 + 7)          # (D-1)/(vN+D-1), v = 2
    assert _bubble(bitpipe(8, 32), 2.0) > interleaved
    assert _bubble(bitpipe(8, 32, concat="paced"), 2.0) < interleaved


@pytest.mark.parametrize("devices,microbatches", [(4, 4), (4, 8), (8, 16)])
def test_paced_never_loses_to_the_reference(devices, microbatches):
    for ratio in (1.0, 3.0):
        ref = _bubble(bitpipe(devices, microbatches), ratio)
        assert _bubble(bitpipe(devices, microbatches, "paced", ratio), ratio) <= ref + 1e-12
        ref = _bubble(chimera(devices, microbatches), ratio)
        assert _bubble(chimera(devices, microbatches, "paced", ratio), ratio) <= ref + 1e-12


def test_unknown_concatenation_is_refused():
    with pytest.raises(ValueError, match="reference"):
        get_schedule("bitpipe", 4, 4, concat="glued")
