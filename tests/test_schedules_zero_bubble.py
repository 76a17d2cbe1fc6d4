"""Zero-bubble schedules (ZB-H1, ZBV, DualPipeV, async-zb): the simulated bubble meets the closed forms, the orders
keep their memory promise, and the version difference of the asynchronous one counts steps up to the W."""
import pytest

from pipeoptim.schedules import (BackwardInput, BackwardWeight, Chunk, Forward, Step, get_schedule,
                                 input_version_difference, validate, version_difference)
from pipeoptim.schedules.zero_bubble import zb_h1_order
from pipeoptim.sim import Costs, simulate


def _costs(schedule, f, i, w):
    """Per-stage costs exactly as given (a chunk of a V schedule costs what the arguments say)."""
    S = schedule.num_stages
    return Costs(forward=[f] * S, backward=[i + w] * S, backward_input=[i] * S, backward_weight=[w] * S)


def _idle(result, d):
    return result.makespan - result.busy[d]


@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1.5, 0.5), (1, 1, 0.5), (1, 3, 1),
                                   (1.3, 1.7, 0.9)])
@pytest.mark.parametrize("D,N", [(2, 2), (3, 5), (4, 4), (4, 9), (8, 8), (8, 32), (16, 17)])
def test_zb_h1_bubble_is_the_papers_closed_form(f, i, w, D, N):
    """Qi et al.'s ZB-H1: every device idles (D-1)(F + I - W) per iteration (1F1B: (D-1)(F + I + W)), where the
    weight gradient is the shortest pass, W <= min(F, I), so that each deferred W fits the gap it fills."""
    s = get_schedule("zb-h1", D, N)
    r = simulate(s, _costs(s, f, i, w))
    bubble = (D - 1) * (f + i - w)
    assert r.makespan == pytest.approx(N * (f + i + w) + bubble)
    assert [_idle(r, d) for d in range(D)] == pytest.approx([bubble] * D)
    assert r.bubble_ratio == pytest.approx(bubble / (N * (f + i + w) + bubble))


@pytest.mark.parametrize("f,i,w", [(1, 1, 2), (1, 0.5, 1.5), (1, 1, 3), (0.7, 1.3, 1.1), (1, 2, 1.5),
                                   (0.5, 2, 0.6), (0.5, 2, 0.4)])
def test_zb_h1_bubble_when_the_weight_gradient_is_not_the_shortest_pass(f, i, w):
    """Outside the paper's regime a deferred W no longer fits its gap: each device idles (D-1) max(F + I - W, F, I),
    the forward ramp (D-1)F or the input-gradient ramp (D-1)I, whichever is longer."""
    for D, N in ((4, 9), (8, 16)):
        s = get_schedule("zb-h1", D, N)
        r = simulate(s, _costs(s, f, i, w))
        assert [_idle(r, d) for d in range(D)] == pytest.approx([(D - 1) * max(f + i - w, f, i)] * D)


@pytest.mark.parametrize("D,N", [(2, 3), (3, 5), (4, 7), (4, 16), (8, 15), (8, 64), (16, 31), (32, 64)])
def test_zbv_bubble_is_only_the_ramp_with_equal_costs(D, N):
    """ZB-V with F = I = W per chunk (the paper's condition for its zero bubble): nothing idles but the ramp of
    the first forward through D-1 chunks, (D-1)F per device; so the bubble ratio is (D-1)/(6N + D-1)."""
    s = get_schedule("zbv", D, N)
    r = simulate(s, _costs(s, 1.0, 1.0, 1.0))
    assert r.makespan == pytest.approx(6 * N + D - 1)
    assert [_idle(r, d) for d in range(D)] == pytest.approx([D - 1.0] * D)
    # the default costs (one D-th of the model: F = 1, B = 2, split I = W = 1) give the same ratio
    assert simulate(s, Costs(forward=1.0, backward=2.0)).bubble_ratio == pytest.approx((D - 1) / (6 * N + D - 1))


def test_closed_forms_against_1f1b():
    """At F = I = W: ZB-H1 idles a third of 1F1B's (D-1)(F+B), ZBV's idle is a sixth of 1F1B's (half-size chunks)."""
    for D, N in ((4, 8), (8, 32)):
        one = simulate(get_schedule("1f1b", D, N), Costs(forward=1.0, backward=2.0))
        zb = simulate(get_schedule("zb-h1", D, N), Costs(forward=1.0, backward=2.0))
        v = simulate(get_schedule("zbv", D, N), Costs(forward=1.0, backward=2.0))
        assert _idle(one, 0) == pytest.approx(3 * _idle(zb, 0)) == pytest.approx(6 * _idle(v, 0))


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "dualpipev"])
def test_activation_memory_is_that_of_1f1bs_first_device(name):
    """ZB-H1 and ZBV promise 1F1B's peak activation memory (D micro-batches of a stage on the busiest device; the
    runtime keeps a split backward's graph until its W, and so does the simulator); DualPipeV holds one more half."""
    D, N = 8, 32
    peak = simulate(get_schedule(name, D, N)).peak_activations
    one = simulate(get_schedule("1f1b", D, N)).peak_activations
    assert max(peak) == pytest.approx(max(one) + (0.5 if name == "dualpipev" else 0))


def test_zb_h1_defers_each_weight_gradient_by_the_device_index():
    order = zb_h1_order(4, 6, 2)
    assert [str(a) for a in order] == ["F0s2", "F1s2", "I0s2", "F2s2", "I1s2", "F3s2", "I2s2", "W0s2", "F4s2",
                                       "I3s2", "W1s2", "F5s2", "I4s2", "W2s2", "I5s2", "W3s2", "W4s2", "W5s2"]


def test_v_placement_and_local_turn():
    s = get_schedule("zbv", 4, 8)
    assert s.num_stages == 8 and s.chunks[0] == (Chunk(0, 0), Chunk(0, 7)) and s.chunks[3] == (Chunk(0, 3), Chunk(0, 4))
    lowered = validate(s)
    hand = [str(a) for a in lowered.actions[3] if type(a).__name__ == "Handoff"]
    assert "HAND:F0s3" in hand and "HAND:I0s4" in hand    # the V turns on the last device, both ways


def test_dualpipev_mixes_full_and_split_backwards():
    s = get_schedule("dualpipev", 4, 8)
    kinds = {type(a).__name__ for acts in s.actions for a in acts}
    assert {"Backward", "BackwardInput", "BackwardWeight"} <= kinds
    validate(s)


def test_async_zb_steps_after_every_weight_gradient():
    s = get_schedule("async-zb", 4, 12)
    validate(s)
    for acts in s.actions:
        for j, a in enumerate(acts):
            if isinstance(a, Step):
                assert isinstance(acts[j - 1], BackwardWeight)
        assert sum(isinstance(a, Step) for a in acts) == 12


def test_async_zb_version_difference_counts_steps_up_to_the_weight_gradient():
    """Device k runs each W k micro-batches after its I, and the step that applies the gradient follows the W:
    s = D-1 on every stage in steady state (D-k-1 steps until the I, k more until the W); in the warm-up of
    the window fewer steps have happened."""
    D, N = 4, 16
    s = get_schedule("async-zb", D, N)
    to_w, to_i = version_difference(s), input_version_difference(s)
    for k in range(D):
        assert to_w[(k, 10)] == D - 1
        assert to_i[(k, 10)] == D - k - 1
    # by hand from the order on device 3 (no warm-up forwards, W three micro-batches late):
    # F0 I0 F1 I1 F2 I2 F3 I3 W0 S F4 I4 W1 S ...: F0..F3 see no step before their W's turn
    assert [to_w[(3, m)] for m in range(6)] == [0, 1, 2, 3, 3, 3]
    assert [to_i[(3, m)] for m in range(6)] == [0] * 6
    # async-1f1b: the two readings agree (a step follows every backward)
    a = get_schedule("async-1f1b", D, N)
    assert version_difference(a) == input_version_difference(a)


def test_split_schedules_sync_after_their_last_weight_gradient_with_data_parallelism():
    from pipeoptim.schedules import Sync
    for name in ("zb-h1", "zbv", "dualpipev"):
        s = get_schedule(name, 4, 8, data_parallel=True)
        validate(s)
        for acts in s.actions:
            for j, a in enumerate(acts):
                if isinstance(a, Sync):
                    stage = a.stages[0]
                    assert not any(isinstance(b, (BackwardWeight, BackwardInput)) and b.stage == stage
                                   for b in acts[j:])


def test_backward_of_names_the_split_action():
    s = get_schedule("zb-h1", 2, 2)
    assert s.backward_of(1, 0) == BackwardInput(1, 0) and s.split_backward
    one = get_schedule("1f1b", 2, 2)
    assert type(one.backward_of(1, 0)).__name__ == "Backward" and not one.split_backward
    assert Forward(0, 0) in s.actions[0]
