"""benchmarks/network_projection.py: with communication free and even devices it is the time-to-target study's
own time per update (same measured costs, same rules); a link, a slow device and a deeper in-flight depth change
time and memory in the direction they must; gpt16's boundary bytes; the deeper asynchronous schedules."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytest.importorskip("sklearn")

_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


btt = _load("bench_time_to_target")
npj = _load("network_projection")

from pipeoptim.links import PROFILES  # noqa: E402
from pipeoptim.schedules import get_schedule  # noqa: E402
from pipeoptim.schedules.staleness import version_difference  # noqa: E402
from pipeoptim.sim import simulate  # noqa: E402


@pytest.fixture(scope="module")
def study():
    wl = btt.WORKLOADS["gpt16-async"]
    return btt.load_or_measure_costs(wl, btt.RESULTS, measure=False), npj.measure_layer_memory(btt.GPT16)


def test_boundary_bytes_are_gpt16s_hidden_states():
    assert npj.boundary_bytes(16) == 16 * 32 * 64 * 4 == 131072


def test_memory_is_measured_per_layer(study):
    _, memory = study
    assert len(memory.saved_per_sample) == len(memory.param_bytes) == 18       # embedding, 16 blocks, head
    blocks = memory.saved_per_sample[1:17]
    assert len(set(blocks)) == 1 and blocks[0] > npj.boundary_bytes(1)      # a block keeps more than its input
    assert memory.param_bytes[1] == pytest.approx(4 * (12 * 64 * 64 + 13 * 64), rel=0.01)


@pytest.mark.parametrize("schedule, policy", [("gpipe", "none-muon"), ("zbv", "none-muon"), ("2bw", "2bw-muon")])
def test_free_and_even_is_the_studys_time_per_update(study, schedule, policy):
    costs, memory = study
    mine = npj.project(costs, schedule, 4, policy, npj.Setting("free", None), memory)
    theirs = costs.time_per_update(schedule, 4, policy)
    assert mine["time_s"] == pytest.approx(theirs["time_s"], rel=1e-12)
    assert mine["microbatches"] == theirs["microbatches"]


def test_a_link_and_a_slow_device_cost_time_and_the_internet_costs_most(study):
    costs, memory = study
    t = {name: npj.project(costs, "1f1b", 4, "none-muon", npj.Setting(name, PROFILES.get(name)), memory)["time_s"]
         for name in ("free", "nvlink", "ethernet-10g", "internet")}
    assert t["free"] <= t["nvlink"] < t["ethernet-10g"] < t["internet"]
    # 1F1B at D = 4 crosses at least 2 x 3 hops of 30 ms per update on the internet
    assert t["internet"] - t["free"] >= 6 * PROFILES["internet"].latency_s
    uneven = npj.project(costs, "1f1b", 4, "none-muon", npj.Setting("free", None, uneven=True), memory)["time_s"]
    assert uneven > t["free"] * 1.02        # device 2 of 4 is 1.5x slower; stage 3 (the head) was the slowest


def test_more_in_flight_hides_latency_at_a_memory_and_staleness_cost(study):
    costs, memory = study
    internet = npj.Setting("internet", PROFILES["internet"])
    one = npj.project(costs, "2bw", 4, "2bw-muon", internet, memory)
    four = npj.project(costs, "2bw", 4, "2bw-muon", internet, memory, in_flight=4)
    assert four["time_s"] < one["time_s"] and four["peak_activation_bytes"] > one["peak_activation_bytes"]
    assert max(version_difference(npj.deeper_async("async-1f1b", 4, 32, 2)).values()) > \
        max(version_difference(get_schedule("async-1f1b", 4, 32)).values())


def test_deeper_async_at_one_is_the_registrys_schedule():
    for name in ("async-1f1b", "2bw"):
        mine, theirs = npj.deeper_async(name, 4, 16, 1), get_schedule(name, 4, 16)
        assert mine.actions == theirs.actions
        deeper = npj.deeper_async(name, 4, 16, 3)
        assert simulate(deeper).makespan > 0 and len(deeper.actions[0]) == len(theirs.actions[0])
