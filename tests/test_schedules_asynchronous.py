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
