"""Asynchronous orders: 1F1B without a flush, a step after every backward (PipeDream) or every m (2BW)."""
from pipeoptim.schedules import Backward, Step
from pipeoptim.schedules.asynchronous import async_1f1b, two_bw
from pipeoptim.schedules.synchronous import one_f_one_b


def test_async_1f1b_steps_right_after_every_backward_and_never_flushes():
    s = async_1f1b(4, 10)
    assert not s.synchronous
    for d, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if isinstance(a, Backward):
                assert acts[i + 1] == Step(d)
        assert [a for a in acts if not isinstance(a, Step)] == [a for a in one_f_one_b(4, 10).actions[d]
                                                                 if not isinstance(a, Step)]


def test_2bw_steps_once_per_m_backwards():
    s = two_bw(4, 16, update_every=8)
    for d, acts in enumerate(s.actions):
        backwards = 0
        for i, a in enumerate(acts):
            if isinstance(a, Backward):
                backwards += 1
                assert (acts[i + 1] == Step(d)) == (backwards % 8 == 0)
    assert s.params == {"update_every": 8}


def test_in_flight_multiplies_the_warm_up_and_the_staleness():
    """in_flight=k: device d runs k·(D-d-1) forwards before its first backward, and a forward's backward is k
    times as many updates away (async 1F1B: s = k·(D-d-1) in the steady state)."""
    import pytest
    from pipeoptim.schedules import Forward, get_schedule, max_version_difference
    from pipeoptim.schedules.errors import ScheduleConfigError
    D, N = 4, 24
    for k in (1, 2, 3):
        s = async_1f1b(D, N, in_flight=k)
        for d, acts in enumerate(s.actions):
            first_backward = next(i for i, a in enumerate(acts) if isinstance(a, Backward))
            assert sum(isinstance(a, Forward) for a in acts[:first_backward]) == k * (D - d - 1) + 1
            assert sum(isinstance(a, Forward) for a in acts) == N and sum(isinstance(a, Backward) for a in acts) == N
        assert max_version_difference(s) == {d: k * (D - d - 1) for d in range(D)}
        assert s.params == ({} if k == 1 else {"in_flight": k})
        assert get_schedule("async-1f1b", D, N, in_flight=k).actions == s.actions
    assert async_1f1b(D, N, in_flight=1).actions == async_1f1b(D, N).actions   # 1 is the schedule as it was
    w = two_bw(D, 16, in_flight=2)
    assert w.params == {"update_every": 4, "in_flight": 2} and max(max_version_difference(w).values()) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ScheduleConfigError, match="positive integer"):
            get_schedule("async-1f1b", D, N, in_flight=bad)
    with pytest.raises(ScheduleConfigError, match="async-1f1b and 2bw schedules only"):
        get_schedule("1f1b", D, N, in_flight=2)


def test_the_2bw_policy_and_the_stream_refuse_a_deeper_warm_up():
    import pytest
    from pipeoptim.runtime.config import check_policy, make_schedule
    from pipeoptim.runtime.plan import ConfigError
    from pipeoptim.runtime.stream import check_stream
    deep = make_schedule("2bw", 4, 16, in_flight=2)
    for policy in (None, "2bw"):
        with pytest.raises(ConfigError, match="two weight versions.*in_flight=2.*up to 2.*'stash'"):
            check_policy(deep, policy)
    assert check_policy(deep, "stash") == "stash" and check_policy(deep, "pipeoptim") == "pipeoptim"
    assert check_policy(make_schedule("2bw", 4, 16), None) == "2bw"
    with pytest.raises(ConfigError, match="in_flight=2"):
        check_stream(make_schedule("async-1f1b", 4, 16, in_flight=2))
