"""Chimera and BitPipe: placement, BitPipe's published order on every rank, eager syncs, the greedy and paced
concatenations. Times here are in forward-slots: one chunk forward = 1 (timeline with unit costs)."""
import pytest

from pipeoptim.schedules import Backward, Chunk, Forward, ScheduleConfigError, Step, Sync, get_schedule, validate
from pipeoptim.schedules.bidirectional import (bidirectional_replicas, bitpipe, bitpipe_chunks, chimera,
                                               paced_order)
from pipeoptim.schedules.timeline import run_timeline, unit_durations
from pipeoptim.sim import simulate

# DESIGN.md section 4, stages numbered from 1: chunk0 (down), chunk1 (up), chunk2 (down), chunk3 (up)
TABLE_D4 = [[1, 4, 8, 5], [2, 3, 7, 6], [3, 2, 6, 7], [4, 1, 5, 8]]
REFERENCE_RANK0 = ("F1↓s1 F2↓s1 F3↑s4 F3↑s5 F4↑s4 F4↑s5 F1↓s8 B1↓s8 F2↓s8 B2↓s8 B3↑s5 B3↑s4 B4↑s5 B4↑s4 "
                   "B1↓s1 [sync chunks 2,3] B2↓s1 [sync chunks 0,1]")
# Worked by hand from the public code's forward/backward index lists for 8 micro-batches on 4 ranks and its
# loop phases: the second group's first forward (F5) comes after B1 of the first group, not before F3.
REFERENCE_D4_N8_RANK0 = (
    "F1↓s1 F2↓s1 F3↑s4 F3↑s5 F4↑s4 F4↑s5 F1↓s8 B1↓s8 F2↓s8 B2↓s8 B3↑s5 B3↑s4 B4↑s5 B4↑s4 B1↓s1 "
    "F5↓s1 B2↓s1 F6↓s1 F7↑s4 F7↑s5 F8↑s4 F8↑s5 F5↓s8 B5↓s8 F6↓s8 B6↓s8 B7↑s5 B7↑s4 B8↑s5 B8↑s4 B5↓s1 "
    "[sync chunks 2,3] B6↓s1 [sync chunks 0,1]")
# The public code's per-rank forward lists for 8 micro-batches on 4 ranks, in its numbering: id i < 8 is
# micro-batch i's first pass on the rank (chunk 0 or 1), id 8 + i its second pass (chunk 2 or 3).
PUBLISHED_FORWARD_IDS_D4_N8 = [
    [0, 1, 2, 10, 3, 11, 8, 9, 4, 5, 6, 14, 7, 15, 12, 13],
    [0, 2, 1, 3, 10, 8, 11, 9, 4, 6, 5, 7, 14, 12, 15, 13],
    [2, 0, 3, 1, 8, 10, 9, 11, 6, 4, 7, 5, 12, 14, 13, 15],
    [2, 3, 0, 8, 1, 9, 10, 11, 6, 7, 4, 12, 5, 13, 14, 15],
]


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


# ---- an independent statement of the public code's loops, to generate expectations -------------------------
def _published_by_loops(D, N, rank):
    """Rank `rank`'s actions as the public BitPipe code walks them: it numbers 2N passes (id < N: micro-batch
    id's first pass on this rank, id >= N: micro-batch id - N's second pass), builds a forward and a backward id
    list from five loops per group, then runs warm-up forwards, per group (forward, backward) pairs, the
    group's remaining backwards interleaved with the next group's warm-up, and a cool-down with two sync
    markers (-1) in the backward list."""
    P, T, u = D, 2 * N, D // 2
    chunk_of = lambda i: (i % P) // u + (0 if i < T // 2 else 2)          # noqa: E731
    by_chunk = [[i for i in range(T) if chunk_of(i) == c] for c in range(4)]
    h = rank // u
    n0 = u - rank if rank < u else rank - u + 1
    fwd, bwd = [], []
    for j in range(T // P // 2):
        b = j * u
        fwd += [by_chunk[h][b + i] for i in range(n0)]
        for i in range(u - n0):
            fwd += [by_chunk[1 - h][b + i], by_chunk[h][b + i + n0]]
        for i in range(n0):
            fwd += [by_chunk[1 - h][b + i + u - n0], by_chunk[3 - h][b + i]]
        for i in range(u - n0):
            fwd += [by_chunk[2 + h][b + i], by_chunk[3 - h][b + i + n0]]
        fwd += [by_chunk[2 + h][b + i + u - n0] for i in range(n0)]
        bwd += [by_chunk[2 + h][b + k] for k in range(n0)]
        for k in range(u - n0):
            bwd += [by_chunk[3 - h][b + k], by_chunk[2 + h][b + k + n0]]
        for k in range(n0):
            bwd += [by_chunk[3 - h][b + k + u - n0], by_chunk[1 - h][b + k]]
        for k in range(u - n0):
            bwd += [by_chunk[h][b + k], by_chunk[1 - h][b + k + n0]]
        bwd += [by_chunk[h][b + k + u - n0] for k in range(n0)]
    if rank in (u - 1, u):
        bwd.append(-1)
    else:
        bwd.insert(len(bwd) - 1, -1)
    bwd.append(-1)

    warm = P + P // 2 + (rank if rank < u else P - 1 - rank)
    remain = 2 * P - warm
    loops = T // P // 2 - 1
    seq = [("F", i) for i in fwd[:warm]]
    for j in range(loops):
        off = 2 * P * j
        for k in range(remain):
            seq += [("F", fwd[k + warm + off]), ("B", bwd[k + off])]
        seq += [("B", bwd[k + off + remain]) for k in range(warm - remain + 1)]
        for k in range(remain - 1):
            seq += [("F", fwd[k + 2 * P + off]), ("B", bwd[k + warm + 1 + off])]
        seq += [("F", fwd[k + 2 * P + off + remain - 1]) for k in range(warm - remain + 1)]
    mid = loops * 2 * P
    for k in range(remain):
        seq += [("F", fwd[k + warm + mid]), ("B", bwd[k + mid])]
    seq += [("B", bwd[k + mid + remain]) for k in range(2 * P - remain + 2)]

    chunks = bitpipe_chunks(D)[rank]
    mirror = tuple(sorted({rank, D - 1 - rank}))
    out, markers = [], 0
    for kind, i in seq:
        if i == -1:
            half = chunks[2:] if markers == 0 else chunks[:2]
            out.append(Sync(tuple(sorted(c.stage for c in half)), mirror))
            markers += 1
            continue
        chunk = chunks[chunk_of(i)]
        out.append((Forward if kind == "F" else Backward)(i % N, chunk.stage, chunk.replica))
    return out + [Step(c.stage, c.replica) for c in chunks]


PINNED = [(2, 2), (2, 6), (4, 4), (4, 8), (4, 16), (6, 6), (6, 18), (8, 8), (8, 24), (12, 24), (16, 32)]


@pytest.mark.parametrize("devices,microbatches", PINNED)
def test_reference_is_the_published_order_on_every_rank(devices, microbatches):
    s = bitpipe(devices, microbatches)
    validate(s)
    for r in range(devices):
        assert list(s.actions[r]) == _published_by_loops(devices, microbatches, r), f"rank {r}"


def test_reference_matches_hand_checked_orders():
    assert _design_notation(bitpipe(4, 4), 0) == REFERENCE_RANK0
    assert _design_notation(bitpipe(4, 8), 0) == REFERENCE_D4_N8_RANK0
    # D=8: ranks 1, 2, 5, 6 take the far direction's first micro-batch before the near one's last
    s = bitpipe(8, 8)
    assert _design_notation(s, 1).split()[:5] == ["F1↓s2", "F2↓s2", "F3↓s2", "F5↑s7", "F4↓s2"]
    assert _design_notation(s, 6).split()[:5] == ["F5↑s2", "F6↑s2", "F7↑s2", "F1↓s7", "F8↑s2"]
    s = bitpipe(4, 8)
    for r, ids in enumerate(PUBLISHED_FORWARD_IDS_D4_N8):
        forwards = [a for a in s.actions[r] if isinstance(a, Forward)]
        chunks = s.chunks[r]
        assert [f.mb + (8 if chunks.index(f.chunk) >= 2 else 0) for f in forwards] == ids, f"rank {r}"


def test_bitpipe_placement_is_the_v_shaped_table():
    chunks = bitpipe_chunks(4)
    assert [[c.stage + 1 for c in row] for row in chunks] == TABLE_D4
    assert [[c.replica for c in row] for row in chunks] == [[0, 1, 0, 1]] * 4
    for D in (2, 6, 8):
        for r, row in enumerate(bitpipe_chunks(D)):
            assert row == [Chunk(0, r), Chunk(1, D - 1 - r), Chunk(0, 2 * D - 1 - r), Chunk(1, D + r)]


@pytest.mark.parametrize("devices,microbatches", [(4, 4), (4, 12), (8, 16)])
@pytest.mark.parametrize("concat", ["reference", "greedy", "paced"])
def test_mirror_rank_is_the_mirror_image(devices, microbatches, concat):
    """Rank D-1-r runs rank r's order with the directions swapped: down micro-batch i of a group <-> up
    micro-batch i, and each stage <-> the same stage of the other replica."""
    D, half = devices, devices // 2
    s = bitpipe(D, microbatches, concat)

    def swap(a):
        g, i = divmod(a.mb, D)
        mb = g * D + (i + half if i < half else i - half)
        return type(a)(mb, a.stage, 1 - a.replica)
    for r in range(D):
        mine = [swap(a) for a in s.actions[r] if isinstance(a, (Forward, Backward))]
        assert mine == [a for a in s.actions[D - 1 - r] if isinstance(a, (Forward, Backward))], f"rank {r}"


@pytest.mark.parametrize("ratio,slots", [(2.0, 28.0), (1.0, 18.0)])
def test_bitpipe_d4_n4_makespan_in_forward_slots(ratio, slots):
    tl = run_timeline(bitpipe(4, 4), unit_durations(ratio))
    assert tl.makespan == slots      # bubble 4/28 = 1/7 with B = 2F, 2/18 = 1/9 with F = B


def _bubble(s, ratio):
    tl = run_timeline(s, unit_durations(ratio))
    busy = sum(r.end - r.start for recs in tl.records for r in recs)
    return 1 - busy / (s.num_devices * tl.makespan)


@pytest.mark.parametrize("devices,microbatches", [(2, 4), (4, 4), (4, 12), (6, 18), (8, 16), (8, 32)])
@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0, 3.0])
def test_reference_idle_grows_by_d_minus_2_times_b_minus_f_per_group(devices, microbatches, ratio):
    """The published order's makespan: G groups of per-device work 2D(F+B), plus the one-group fill
    (D-2)B, plus (D-2)(B-F) for every further group: with B > F the joints between groups cost idle time
    that grows with N (bubble towards (D-2)/(7D-2) ~ 1/7 at B = 2F); with B = F it is the closed formula."""
    D, G, R = devices, microbatches // devices, ratio
    expected = G * 2 * D * (1 + R) + (D - 2) * R + (G - 1) * (D - 2) * (R - 1)
    assert run_timeline(bitpipe(D, microbatches), unit_durations(R)).makespan == pytest.approx(expected)


@pytest.mark.parametrize("concat", ["reference", "greedy", "paced"])
@pytest.mark.parametrize("devices,microbatches", [(2, 2), (4, 8), (6, 12), (8, 32)])
def test_equal_costs_meet_the_closed_formula(concat, devices, microbatches):
    D, N = devices, microbatches
    assert _bubble(bitpipe(D, N, concat, bwd_ratio=1.0), 1.0) == pytest.approx((D - 2) / (4 * N + D - 2))


def test_bubbles_at_backward_twice_forward():
    assert _bubble(bitpipe(4, 16), 2.0) == pytest.approx(0.0943, abs=5e-5)
    assert _bubble(bitpipe(8, 32), 2.0) == pytest.approx(0.1351, abs=5e-5)
    assert _bubble(bitpipe(4, 16, "greedy"), 2.0) == pytest.approx(0.0857, abs=5e-5)
    assert _bubble(bitpipe(8, 32, "greedy"), 2.0) == pytest.approx(0.1312, abs=5e-5)


@pytest.mark.parametrize("devices", [4, 8])
def test_reference_activations_stay_at_one_groups_and_greedy_raises_the_ends(devices):
    D = devices
    one_group = [3 * D / 4 + 0.5 + min(r, D - 1 - r) / 2 for r in range(D)]   # in units of one D-th of the model
    assert simulate(bitpipe(D, D)).peak_activations == one_group
    for N in (2 * D, 4 * D):
        assert simulate(bitpipe(D, N)).peak_activations == one_group
        greedy = simulate(bitpipe(D, N, "greedy")).peak_activations
        assert greedy == [D] * D and max(greedy) == max(one_group)    # the busiest device holds no more


def test_first_half_goes_down_second_half_up_in_each_group():
    assert bidirectional_replicas(4, 8) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert bidirectional_replicas(6, 6) == [0, 0, 0, 1, 1, 1]
    assert bidirectional_replicas(4, 6) == [0, 0, 1, 1, 0, 1]    # chimera's shorter last group


def test_mirror_devices_sync_the_same_stages():
    for s in (bitpipe(6, 12), bitpipe(8, 16, "greedy"), chimera(6, 12), bitpipe(4, 8, concat="paced")):
        for d, acts in enumerate(s.actions):
            mine = [a for a in acts if isinstance(a, Sync)]
            theirs = [a for a in s.actions[s.num_devices - 1 - d] if isinstance(a, Sync)]
            assert mine == theirs and all(a.devices == tuple(sorted({d, s.num_devices - 1 - d})) for a in mine)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_published_sync_places(devices):
    """Second-half chunks (2, 3) sync just before the last backward and the first half after it, except on the
    two middle ranks, which sync both halves after the last backward."""
    s = bitpipe(devices, 2 * devices)
    for r, acts in enumerate(s.actions):
        chunks = s.chunks[r]
        tail = [a for a in acts if not isinstance(a, Step)][-3:]
        late = Sync(tuple(sorted(c.stage for c in chunks[2:])), tuple(sorted({r, devices - 1 - r})))
        early = Sync(tuple(sorted(c.stage for c in chunks[:2])), late.devices)
        if r in (devices // 2 - 1, devices // 2):
            assert isinstance(tail[0], Backward) and tail[1:] == [late, early], f"rank {r}"
        else:
            assert tail[0] == late and isinstance(tail[1], Backward) and tail[2] == early, f"rank {r}"


def test_pp2_works():
    for s in (bitpipe(2, 2), bitpipe(2, 6), bitpipe(2, 6, "greedy"), chimera(2, 2), chimera(2, 4, concat="paced")):
        validate(s)


@pytest.mark.parametrize("devices,microbatches", [(4, 16), (8, 32)])
def test_paced_concatenation_beats_the_reference_with_backward_twice_forward(devices, microbatches):
    ref = _bubble(bitpipe(devices, microbatches), 2.0)
    paced = _bubble(bitpipe(devices, microbatches, concat="paced", bwd_ratio=2.0), 2.0)
    assert paced < ref - 0.02


def test_paced_bitpipe_beats_interleaved_at_d8_n32_where_the_reference_does_not():
    interleaved = 7 / (2 * 32 + 7)          # (D-1)/(vN+D-1), v = 2
    assert _bubble(bitpipe(8, 32), 2.0) > interleaved
    assert _bubble(bitpipe(8, 32, concat="paced"), 2.0) < interleaved


def _idle_per_device(schedule, actions, ratio):
    s = schedule.replace(actions=actions)
    tl = run_timeline(s, unit_durations(ratio))
    work = sum(r.end - r.start for recs in tl.records for r in recs) / s.num_devices
    return tl.makespan - work


@pytest.mark.parametrize("devices", [4, 6, 8])
@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0])
def test_paced_order_idle_does_not_grow_with_the_number_of_groups(devices, ratio):
    """The paced order as generated (no fall-back to another order): each device's idle time stays within
    1.5 x one group's idle time for every number of groups, where the published order's grows by
    (D-2)(B-F) per group; with B = F it is exactly one group's (the closed formula)."""
    D = devices
    one_group = _idle_per_device(bitpipe(D, D), bitpipe(D, D).actions, ratio)
    for groups in (2, 3, 5):
        shell = bitpipe(D, groups * D, "greedy")
        idle = _idle_per_device(shell, paced_order(shell, ratio), ratio)
        if ratio == 1.0:
            assert idle == pytest.approx(one_group)
        assert idle <= 1.5 * one_group + 1e-9, (groups, idle, one_group)
    published = _idle_per_device(shell, bitpipe(D, 5 * D).actions, ratio)
    if ratio > 1.0:
        assert published > 1.5 * one_group      # the bound separates pacing from direct concatenation


def test_unknown_concatenation_is_refused():
    with pytest.raises(ScheduleConfigError, match="reference"):
        get_schedule("bitpipe", 4, 4, concat="glued")
    with pytest.raises(ScheduleConfigError, match="chimera has no concatenation 'greedy'"):
        get_schedule("chimera", 4, 4, concat="greedy")
