"""The shared execution model: list order, dependency waits, transfer times, syncs, deadlock reports."""
from pipeoptim.schedules import Backward, Chunk, Forward, Schedule, Step, Sync, get_schedule
from pipeoptim.schedules.timeline import run_timeline, unit_durations


def _times(tl):
    return {(r.device, str(r.action)): (r.start, r.end) for recs in tl.records for r in recs}


def test_two_device_1f1b_by_hand():
    # F=1, B=2: d0 F0 [0,1] F1 [1,2]; d1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; d0 B0 [4,6] B1 [7,9]
    tl = run_timeline(get_schedule("1f1b", 2, 2), unit_durations(2.0))
    t = _times(tl)
    assert t[(1, "F0s1")] == (1, 2) and t[(1, "B0s1")] == (2, 4) and t[(1, "B1s1")] == (5, 7)
    assert t[(0, "B0s0")] == (4, 6) and t[(0, "B1s0")] == (7, 9)
    assert tl.complete and tl.makespan == 9


def test_transfer_time_delays_the_consumer_only():
    s = get_schedule("gpipe", 2, 1)
    tl = run_timeline(s, unit_durations(1.0), transfer_time=lambda tr: 0.0 if tr.local else 0.5)
    t = _times(tl)
    assert t[(1, "F0s1")] == (1.5, 2.5) and t[(0, "B0s0")] == (4.0, 5.0)


def test_sync_overlaps_until_a_step_needs_it():
    chunks = [[Chunk(0, 0)], [Chunk(0, 1)]]
    acts = [[Forward(0, 0), Backward(0, 0), Sync((0, 1), (0, 1)), Step(0)],
            [Forward(0, 1), Backward(0, 1), Sync((0, 1), (0, 1)), Step(1)]]
    s = Schedule("x", 2, 1, 2, chunks, acts)
    tl = run_timeline(s, unit_durations(1.0), sync_time=lambda sync: 10.0)
    t = _times(tl)
    # device 1 issues at 3 (after F [1,2] B [2,3]), device 0 at 4 (after its B [3,4]): ends at 14
    assert t[(1, "SYNC:s0+s1@0+1")] == (3.0, 14.0) and t[(0, "SYNC:s0+s1@0+1")] == (4.0, 14.0)
    assert t[(0, "STEP:s0")][0] == 14.0 and t[(1, "STEP:s1")][0] == 14.0


def test_deadlock_is_reported_with_what_each_device_waits_for():
    chunks = [[Chunk(0, 0)], [Chunk(0, 1)]]
    acts = [[Forward(0, 0), Backward(0, 0)], [Backward(0, 1), Forward(0, 1)]]   # B before its own F
    tl = run_timeline(Schedule("x", 2, 1, 2, chunks, acts))
    assert not tl.complete
    stuck = {b.device: b for b in tl.blocked}
    assert stuck[1].action == Backward(0, 1) and "F0s1 on device 1" in stuck[1].waits_for
    assert stuck[0].action == Backward(0, 0) and "B0s1 on device 1" in stuck[0].waits_for
