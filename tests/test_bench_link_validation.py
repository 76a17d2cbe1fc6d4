"""benchmarks/bench_link_validation.py: the simulator is fed exactly the per-stage costs the ranks measured
(forward, backward or its I and W halves, step) and the emulated link, with the message size the runtime sends."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_link_validation.py")
_spec = importlib.util.spec_from_file_location("bench_link_validation", _PATH)
lv = importlib.util.module_from_spec(_spec)
sys.modules["bench_link_validation"] = lv
_spec.loader.exec_module(lv)

from pipeoptim.links import parse_link  # noqa: E402
from pipeoptim.runtime.config import make_schedule  # noqa: E402
from pipeoptim.sim import Costs, simulate  # noqa: E402


def test_the_message_is_the_boundary_after_flag_and_stamp():
    assert lv.message_bytes() == 16 + lv.ROWS * lv.GPT["seq_len"] * lv.GPT["d_model"] * 4


def _ranks(ops):
    """Per rank, the op medians it would report: stages k -> rank k (one chunk each) or the ZBV V placement."""
    return [{"ops": [[k, s, v] for (k, s), v in ops.items()]}]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "2bw", "async-1f1b"])
def test_simulated_from_measured_ops(schedule):
    ops = {}
    for s in range(lv.DEVICES):
        ops[("F", s)], ops[("B", s)], ops[("S", s)] = 0.001 * (s + 1), 0.002 * (s + 1), 0.0005
    link = parse_link("internet")
    want = simulate(make_schedule(schedule, lv.DEVICES, lv.MICROBATCHES),
                    Costs(forward=tuple(ops[("F", s)] for s in range(4)),
                          backward=tuple(ops[("B", s)] for s in range(4)), step=(0.0005,) * 4,
                          p2p_latency=link.latency_s, p2p_bandwidth=link.bandwidth_Bps,
                          activation_bytes=(float(lv.message_bytes()),) * 4)).makespan
    assert lv.simulate_setting(schedule, _ranks(ops), "internet") == pytest.approx(want)
    # the link dominates, as the benchmark intends: 2 x 3 hops of 30 ms at least
    assert want > 6 * link.latency_s


def test_split_backward_schedules_use_their_measured_halves():
    ops = {}
    for s in range(2 * lv.DEVICES):
        ops[("F", s)], ops[("I", s)], ops[("W", s)], ops[("S", s)] = 0.001, 0.001, 0.003, 0.0
    slow_w = lv.simulate_setting("zbv", _ranks(ops), "latency=1ms,bandwidth=1Gbit")
    ops.update({("W", s): 0.0005 for s in range(2 * lv.DEVICES)})
    assert lv.simulate_setting("zbv", _ranks(ops), "latency=1ms,bandwidth=1Gbit") < slow_w
