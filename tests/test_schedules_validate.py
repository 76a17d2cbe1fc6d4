"""The validator: generated schedules pass every rule; each broken rule is named, located and marked."""
import pytest

from pipeoptim.schedules import (SCHEDULES, Backward, BackwardInput, BackwardWeight, Chunk, Forward, Recv, Schedule,
                                 ScheduleError, Send, Step, Sync, get_schedule, lower, validate)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("devices,microbatches", [(2, 2), (2, 6), (4, 4), (4, 8), (6, 12)])
def test_generated_schedules_pass_every_rule(name, devices, microbatches):
    if name == "dualpipev" and microbatches < 2 * devices:
        pytest.skip("dualpipev needs N >= 2D (its rule is tested in test_schedules_registry)")
    lowered = validate(get_schedule(name, devices, microbatches))
    assert any(isinstance(a, Send) for acts in lowered.actions for a in acts)


def _edit(s: Schedule, device: int, fn) -> Schedule:
    acts = [list(a) for a in s.actions]
    acts[device] = fn(acts[device])
    return s.replace(actions=acts)


def _swap(i, j):
    def fn(row):
        row[i], row[j] = row[j], row[i]
        return row
    return fn


def _raises(s, rule, text):
    with pytest.raises(ScheduleError) as e:
        validate(s)
    assert e.value.rule == rule and text in str(e.value), str(e.value)
    assert "!" in e.value.grid
    return e.value


def test_wrong_device_is_named():
    s = _edit(get_schedule("1f1b", 2, 2), 0, lambda r: r[:1] + [Forward(1, 1)] + r[2:])
    err = _raises(s, "placement", "F1s1 runs on device 0, but its chunk is held by device 1")
    assert (err.device, err.index) == (0, 1)


def test_missing_and_repeated_work_is_named():
    s = get_schedule("gpipe", 2, 2)
    _raises(_edit(s, 1, lambda r: [a for a in r if a != Backward(1, 1)]), "completeness",
            "B1s1 is missing from device 1")
    _raises(_edit(s, 0, lambda r: r[:2] + [Forward(1, 0)] + r[2:]), "completeness", "appears twice")
    _raises(_edit(s, 0, lambda r: r + [Forward(5, 0)]), "completeness", "names micro-batch 5")


def test_backward_before_its_forward_is_a_dependency_error_marked_on_the_grid():
    s = _edit(get_schedule("gpipe", 2, 2), 1, _swap(0, 2))     # d1: B0 before F0
    err = _raises(s, "deadlock", "device 1 waits at B0s1 for F0s1 on device 1")
    assert "!B0" in err.grid


def test_cross_device_cycle_is_a_deadlock():
    s = _edit(get_schedule("1f1b", 2, 2), 0, lambda r: [Forward(0, 0), Backward(0, 0), Forward(1, 0),
                                                          Backward(1, 0), Step(0)])
    s = _edit(s, 1, lambda r: [Forward(1, 1), Backward(1, 1), Forward(0, 1), Backward(0, 1), Step(1)])
    _raises(s, "deadlock", "device 0 waits at B0s0")


def test_step_rules():
    s = get_schedule("1f1b", 2, 2)
    _raises(_edit(s, 0, lambda r: [Step(0)] + r[:-1]), "weights", "before the last backward")
    _raises(_edit(s, 0, lambda r: r + [Step(0)]), "weights", "exactly once")
    a = get_schedule("async-1f1b", 2, 2)
    _raises(_edit(a, 0, lambda r: [Step(0)] + r), "weights", "no new gradient")
    _raises(_edit(a, 1, lambda r: [x for x in r if x != Step(1)][:-1] + [r[-2]]), "weights", "never applied")


def test_sync_rules():
    s = get_schedule("bitpipe", 2, 2)
    first_sync = next(i for i, a in enumerate(s.actions[0]) if isinstance(a, Sync))
    _raises(_edit(s, 0, lambda r: [r[first_sync]] + r[:first_sync] + r[first_sync + 1:]), "weights",
            "whose gradient it must include")
    _raises(_edit(s, 1, lambda r: [a for a in r if not isinstance(a, Sync)][:-4] + r[-4:]), "collectives",
            "a collective needs every member")
    _raises(_edit(s, 0, lambda r: r + [Sync((0,), (1,))]), "placement", "not one of its members")


def test_explicit_communication_is_checked_with_blocking_sends():
    low = lower(get_schedule("1f1b", 2, 2))
    assert validate(low) == low
    # move device 0's first receive behind its backward: the input is used before it arrives
    row = list(low.actions[0])
    i = next(k for k, a in enumerate(row) if isinstance(a, Recv))
    recv = row.pop(i)
    row.append(recv)
    bad = low.replace(actions=[row, list(low.actions[1])])
    _raises(bad, "communication", "used before it is received")


def test_rendezvous_deadlock_of_a_naive_send_order_is_found():
    # the classic 1F1B trap: d0 sends its second activation while d1 wants to send a gradient back
    chunks = [[Chunk(0, 0)], [Chunk(0, 1)]]
    f0, f1 = [Forward(m, 0) for m in (0, 1)]
    g0, g1 = [Forward(m, 1) for m in (0, 1)]
    d0 = [f0, Send(f0, 1), f1, Send(f1, 1), Recv(Backward(0, 0), 1), Backward(0, 0), Recv(Backward(1, 0), 1),
          Backward(1, 0), Step(0)]
    d1 = [Recv(g0, 0), g0, Backward(0, 1), Send(Backward(0, 1), 0), Recv(g1, 0), g1, Backward(1, 1),
          Send(Backward(1, 1), 0), Step(1)]
    err = _raises(Schedule("naive", 2, 2, 2, chunks, [d0, d1]), "deadlock", "with blocking sends/receives")
    assert "device 0 waits at SEND:F1s0@1" in str(err) and "device 1 waits at SEND:B0s1@0" in str(err)


def test_split_backward_rules():
    """A split backward needs both halves, the W after its I on the same device, and no full B beside them; a
    flush steps after the last W; an asynchronous step needs a Backward or W since the last one (an I is not a
    gradient)."""
    zb = get_schedule("zb-h1", 2, 2)
    w0 = BackwardWeight(0, 0)
    err = _raises(_edit(zb, 0, lambda r: [a for a in r if a != w0]), "completeness",
                  "W0s0 is missing from device 0 (a split backward needs both its I and its W)")
    assert err.device == 0
    i_at = zb.actions[0].index(BackwardInput(0, 0))
    _raises(_edit(zb, 0, lambda r: [a for a in r if a != w0][:i_at] + [w0] + [a for a in r if a != w0][i_at:]),
            "completeness", "W0s0 comes before its I0s0")
    _raises(_edit(zb, 1, lambda r: r[:-1] + [Backward(0, 1), r[-1]]), "completeness",
            "has a full backward (device 1")
    _raises(_edit(zb, 0, lambda r: [a for a in r if a != w0][:-1] + [Step(0), w0]), "weights",
            "comes before the last backward of its chunk, W0s0")
    az = get_schedule("async-zb", 2, 3)
    first_i = next(j for j, a in enumerate(az.actions[1]) if isinstance(a, BackwardInput))
    _raises(_edit(az, 1, lambda r: r[:first_i + 1] + [Step(1)] + r[first_i + 1:]), "weights", "no new gradient")
