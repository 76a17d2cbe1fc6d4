"""runtime.stream: an asynchronous schedule run as one stream across train_step calls (Pipeline(stream=True))."""
from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from pipeoptim.runtime.config import make_schedule
from pipeoptim.runtime.launcher import launch
from pipeoptim.runtime.plan import COMPUTE, ConfigError
from pipeoptim.runtime.stream import CARRY, Carried, Stream
from pipeoptim.schedules.actions import Backward, Forward, Step

CALLS = 3


def _stream(name="async-1f1b", D=4, N=8, **params):
    return Stream(lambda n: make_schedule(name, D, n, **params), N)


@pytest.mark.parametrize("D,N", [(4, 8), (4, 4), (2, 5), (3, 6)])
def test_every_segment_runs_each_window_once_and_keeps_what_1f1b_keeps_in_flight(D, N):
    st = _stream(D=D, N=N)
    A, B = st.steady
    for d in range(D):
        warm = D - 1 - d
        assert [a.mb for a in st.fill.actions[d] if isinstance(a, Forward)] == list(range(N))
        assert [a.mb for a in A.actions[d] if isinstance(a, Forward)] == list(range(N, 2 * N))
        assert [a.mb for a in B.actions[d] if isinstance(a, Forward)] == list(range(N))
        # the backwards: A finishes the fill's (or B's) last `warm` micro-batches, B finishes A's
        back = lambda seg: [a.mb for k, a, _, _ in seg.program[d] if k is COMPUTE and isinstance(a, Backward)]  # noqa: E731
        assert back(st.fill) == list(range(N - warm))
        assert back(A) == list(range(N - warm, 2 * N - warm))
        assert back(B) == list(range(2 * N - warm, 2 * N)) + list(range(N - warm))
        assert back(st.drains[0]) == list(range(2 * N - warm, 2 * N))
        assert back(st.drains[1]) == list(range(N - warm, N))
        # async 1F1B steps after every backward, whichever call runs it
        for seg in (st.fill, A, B, *st.drains):
            assert sum(isinstance(a, Step) for a in seg.actions[d]) == len(back(seg))
        assert {mb for mb, _ in st.fill.in_flight_after[d]} == set(range(N - warm, N))
        assert {mb for mb, _ in A.in_flight_after[d]} == set(range(2 * N - warm, 2 * N))
        assert B.in_flight_after[d] == st.fill.in_flight_after[d]
        assert st.drains[0].in_flight_after[d] == set() == st.drains[1].in_flight_after[d]


def test_only_the_last_backward_of_a_call_waits_for_the_next_call_and_is_sent_first_there():
    st = _stream(D=4, N=8)
    for seg in (st.fill, *st.steady):
        for d, row in enumerate(seg.program):
            carried = [out for k, _, _, out in row if k is COMPUTE and isinstance(out, Carried)]
            # device d's last backward feeds device d - 1's next backward; the last device's forwards never wait
            assert len(carried) == (1 if d > 0 else 0), (seg, d)
    for seg in (*st.steady, *st.drains):
        for d, row in enumerate(seg.program):
            head = [e for e in row if e[0] is CARRY]
            assert len(head) == (1 if d > 0 else 0) and (not head or row[0] is head[0])
            if head:  # the receiver's first message on that channel, and the consumer runs in this segment
                assert seg.channels[(d, d - 1)][0] == head[0][1]
                assert head[0][1] in seg.actions[d - 1]


def test_the_next_forwards_s_of_a_calls_last_step_is_the_steady_states():
    st = _stream(D=4, N=8)
    A, B = st.steady
    for seg in (A, B):
        for d in range(4):
            steps = [j for j, (k, a, _, _) in enumerate(seg.program[d]) if isinstance(a, Step)]
            # s of the next forward: the steady state's on every device (D - 1 - d steps in flight)
            assert {seg.next_s(d, j) for j in steps} == {4 - 1 - d}
            s = {seg.s_forward(a) for a in seg.actions[d] if isinstance(a, Forward)}
            assert s == {4 - 1 - d}


def test_the_stream_alternates_its_steady_segments_and_drains_what_is_in_flight():
    st = _stream(D=2, N=4)
    assert st.drain() is None
    order = []
    for _ in range(4):
        seg, first = st.next()
        order.append((seg.name, first))
        st.advance(seg)
    assert order == [("fill", 0), ("A", 4), ("B", 0), ("A", 4)]
    assert st.drain().name == "drain after A"
    st.advance(st.drain())
    assert st.drain() is None and st.next()[0] is st.fill


@pytest.mark.parametrize("name,D,N,params,message", [
    ("1f1b", 4, 8, {}, "not one"), ("async-zb", 4, 8, {}, "not one"), ("async-1f1b", 4, 3, {}, "at least as many"),
    ("2bw", 4, 6, {"update_every": 4}, "multiple of it")])
def test_a_schedule_that_cannot_stream_is_refused_with_the_fix(name, D, N, params, message):
    with pytest.raises(ConfigError, match=message):
        _stream(name, D, N, **params)


def test_pipeline_refuses_stream_on_a_synchronous_schedule():
    with pytest.raises(ConfigError, match="stream=True"):
        rc.make_pipeline(("1f1b", None, 4, 4, 1, {}), emulate=True, stream=True)


# ---- a stream of K calls and a drain is one window of K x N micro-batches -------------------------------------
def _long_window(case, calls=CALLS):
    sched, policy, D, N, dp, opts = case
    pipe = rc.make_pipeline((sched, policy, D, calls * N, dp, opts), emulate=True)
    batches = [rc.batch(i) for i in range(calls)]
    loss = pipe.train_step((torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))
    return loss, {k: v.detach().clone() for k, v in pipe.named_parameters().items()}


STREAM_CASES = [("async-1f1b", "none", 4, 4, 1, {}), ("async-1f1b", "stash", 4, 4, 1, {}),
                ("async-1f1b", "pipeoptim", 4, 4, 1, {"policy_options": {"fused": False}}),
                ("2bw", "2bw", 4, 8, 1, {}), ("2bw", "2bw", 4, 8, 1, {"schedule_options": {"update_every": 8}}),
                ("2bw", "pipeoptim", 4, 8, 1, {"schedule_options": {"update_every": 8}}),
                ("async-1f1b", "none", 2, 8, 1, {}),
                ("async-1f1b", "stash", 4, 4, 1, {"precision": "bf16"}),
                ("async-1f1b", "pipeoptim", 4, 4, 1, {"checkpoint_stages": True, "policy_options": {"fused": False}})]


@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: f"{c[0]}-{c[1]}-D{c[2]}-N{c[3]}-{'-'.join(c[5])}")
def test_a_stream_of_calls_and_its_drain_equal_one_long_window_bit_for_bit(case, one_thread):
    loss, want = _long_window(case)
    pipe = rc.make_pipeline(case, emulate=True, stream=True)
    got = rc.train_stream(pipe, CALLS)
    for name, value in want.items():
        assert torch.equal(got["params"][name], value), name
    assert sum(got["losses"]) / CALLS == pytest.approx(loss, rel=1e-12)  # each call's loss is its own window's
    assert pipe.stream.in_flight is None


@pytest.mark.parametrize("policy", ["pipeoptim", "spectrain"])
def test_policies_that_look_ahead_differ_from_a_long_window_only_next_to_its_end(policy, one_thread):
    """PipeOptim's fused step + predict runs at a call's last step (the stream goes on: the next forward's s is
    known), where a long window ends with a plain step; SpecTrain's look-ahead is the steady state's in every
    call, where the long window's last micro-batches have a drain's. So the weights differ in the last bits."""
    case = ("async-1f1b", policy, 4, 4, 1, {})
    loss, want = _long_window(case)
    got = rc.train_stream(rc.make_pipeline(case, emulate=True, stream=True), CALLS)
    assert any(not torch.equal(got["params"][k], v) for k, v in want.items())
    for name, value in want.items():  # (AdamW at lr 1e-2 moves a weight ~1e-2 per step)
        torch.testing.assert_close(got["params"][name], value, rtol=1e-3, atol=1e-4)
    assert sum(got["losses"]) / CALLS == pytest.approx(loss, rel=1e-5)


def test_a_stream_keeps_micro_batches_in_flight_between_calls_where_windows_drain(one_thread):
    case = ("async-1f1b", "none", 4, 4, 1, {})
    stream, windows = (rc.make_pipeline(case, emulate=True, stream=s) for s in (True, False))
    assert stream.train_step(rc.batch(0)) == windows.train_step(rc.batch(0))  # the same forwards; then a drain
    assert [len(w.saved) for w in stream.workers] == [3, 2, 1, 0]  # D - 1 - d in flight on device d
    assert all(not w.saved for w in windows.workers)
    assert stream.train_step(rc.batch(1)) != windows.train_step(rc.batch(1))


# ---- reading or replacing the weights drains first -----------------------------------------------------------
@pytest.mark.parametrize("opts", [{}, {"checkpoint_stages": True}], ids=["", "recompute"])
def test_eval_drains_and_the_next_call_fills_again(opts, one_thread):
    """eval_step runs under no_grad; its drain's backwards (a recomputing one too) still get their graph."""
    case = ("async-1f1b", "pipeoptim", 4, 4, 1, opts)
    pipe = rc.make_pipeline(case, emulate=True, stream=True)
    pipe.train_step(rc.batch(0))
    pipe.train_step(rc.batch(1))
    before = {k: v.clone() for k, v in pipe.named_parameters().items()}
    pipe.eval_step(rc.batch(5))
    assert pipe.stream.in_flight is None and all(not w.saved for w in pipe.workers)
    assert any(not torch.equal(before[k], v) for k, v in pipe.named_parameters().items())  # the drain's steps
    assert pipe.stream.next()[0] is pipe.stream.fill
    pipe.train_step(rc.batch(2))


def test_a_resumed_stream_equals_one_that_went_on_after_its_save(tmp_path, one_thread):
    case = ("async-1f1b", "pipeoptim", 4, 4, 1, {})
    going = rc.make_pipeline(case, emulate=True, stream=True)
    for i in range(2):
        going.train_step(rc.batch(i))
    going.save(str(tmp_path))
    losses = [going.train_step(rc.batch(i)) for i in range(2, 4)]
    going.drain()
    resumed = rc.make_pipeline(case, emulate=True, stream=True)
    resumed.load(str(tmp_path))
    assert [resumed.train_step(rc.batch(i)) for i in range(2, 4)] == losses
    resumed.drain()
    for name, value in going.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[name], value), name


# ---- the distributed executor ----------------------------------------------------------------------------------
DIST_CASES = [("async-1f1b", "pipeoptim", 4, 4, 1, {}), ("2bw", "2bw", 4, 8, 1, {}),
              ("async-1f1b", "none", 4, 4, 1, {}), ("async-1f1b", "pipeoptim", 2, 4, 2, {})]


def test_distributed_stream_equals_the_emulated_one(one_thread):
    results = launch(rc.run_stream_cases, 4, DIST_CASES, CALLS, timeout_s=200)
    for i, case in enumerate(DIST_CASES):
        params = {}
        for r in results:
            params.update(r[i]["params"])
        emu = rc.train_stream(rc.make_pipeline(case, emulate=True, stream=True), CALLS)
        assert set(params) == set(emu["params"]), case
        for name, value in emu["params"].items():
            assert torch.equal(params[name], value), (case, name)
        for r in results:
            assert r[i]["losses"] == emu["losses"], case


def test_2bw_at_one_update_per_window_is_synchronous_as_windows_and_not_as_a_stream(one_thread):
    """Why a stream of 2BW at m = N learns less per update than its windows (bench_stream_convergence.py): as
    windows each window's update lands before the next window's first forward, which is GPipe's synchronous
    training, bit for bit (no clipping: an asynchronous schedule clips each stage by its own norm); as a stream
    the next window's first forwards start before that update lands, on the weights one update old."""
    m_n = ("2bw", "2bw", 4, 8, 1, {"schedule_options": {"update_every": 8}})
    gpipe = rc.train(rc.make_pipeline(("gpipe", "none", 4, 8, 1, {}), emulate=True), steps=3)
    windows = rc.train(rc.make_pipeline(m_n, emulate=True), steps=3)
    assert windows["losses"] == gpipe["losses"]
    for name, value in gpipe["params"].items():
        assert torch.equal(windows["params"][name], value), name
    stream = rc.train_stream(rc.make_pipeline(m_n, emulate=True, stream=True), calls=3)
    assert stream["losses"][0] == gpipe["losses"][0]  # the first window: the initial weights in both
    assert all(abs(a - b) > 1e-4 for a, b in zip(stream["losses"][1:], gpipe["losses"][1:]))
    assert any(not torch.equal(stream["params"][k], v) for k, v in gpipe["params"].items())
