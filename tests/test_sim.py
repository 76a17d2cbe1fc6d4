"""The simulator. Bubble ratio, as everywhere in pipeoptim: idle device-time / (devices x makespan), with a device
busy while it computes. With equal forward/backward costs and free communication every device is equally busy,
so this is also each device's idle/total, the quantity of the closed formulas pinned here."""
import pytest

from pipeoptim.schedules import get_schedule
from pipeoptim.sim import Costs, compare, profile_stages, simulate

EQUAL = Costs(forward=1.0, backward=1.0)


def _check(schedule, expected):
    r = simulate(schedule, EQUAL)
    assert r.bubble_ratio == pytest.approx(expected, abs=1e-12)
    for d in range(schedule.num_devices):
        assert r.device_bubble(d) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("devices,microbatches", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 3), (8, 32), (16, 20)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b(name, devices, microbatches):
    D, N = devices, microbatches
    _check(get_schedule(name, D, N), (D - 1) / (N + D - 1))


@pytest.mark.parametrize("devices,microbatches", [(2, 4), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved(devices, microbatches, chunks):
    D, N, v = devices, microbatches, chunks
    _check(get_schedule("interleaved", D, N, chunks=v), (D - 1) / (v * N + D - 1))


@pytest.mark.parametrize("devices,microbatches", [(2, 2), (4, 4), (4, 8), (6, 12), (8, 8), (8, 24)])
def test_chimera(devices, microbatches):
    D, N = devices, microbatches
    _check(get_schedule("chimera", D, N), (D - 2) / (2 * N + D - 2))


@pytest.mark.parametrize("devices,microbatches", [(2, 2), (2, 8), (4, 4), (4, 12), (6, 6), (8, 16), (8, 32),
                                                  (16, 32)])
@pytest.mark.parametrize("concat", ["reference", "paced"])
def test_bitpipe(devices, microbatches, concat):
    D, N = devices, microbatches
    _check(get_schedule("bitpipe", D, N, concat=concat, bwd_ratio=1.0), (D - 2) / (4 * N + D - 2))


def test_bitpipe_d4_n4_backward_twice_forward_takes_28_forward_slots():
    s = get_schedule("bitpipe", 4, 4)
    r = simulate(s, Costs(forward=1.0, backward=2.0))
    chunk_forward = 1.0 * s.num_devices / s.num_stages     # scalar costs are per D-th of the model
    assert r.makespan / chunk_forward == 28
    assert r.bubble_ratio == pytest.approx(1 / 7)


def test_per_stage_costs_are_used_as_given():
    s = get_schedule("gpipe", 2, 1)
    r = simulate(s, Costs(forward=[1.0, 3.0], backward=[2.0, 5.0]))
    assert r.makespan == 1 + 3 + 5 + 2
    with pytest.raises(ValueError, match="one value per stage"):
        simulate(s, Costs(forward=[1.0, 2.0, 3.0], backward=1.0))


def test_point_to_point_latency_and_bandwidth():
    s = get_schedule("gpipe", 3, 2)
    base = simulate(s, EQUAL).makespan
    # 2(D-1) hops on the critical path, each latency 0.25 + 2 bytes / 8 bytes per unit = 0.5
    r = simulate(s, Costs(forward=1.0, backward=1.0, p2p_latency=0.25, p2p_bandwidth=8.0, activation_bytes=2.0))
    assert r.makespan == base + 4 * 0.5


def test_allreduce_time_delays_the_step_after_the_last_sync():
    s = get_schedule("chimera", 2, 2)
    base = simulate(s, EQUAL).makespan
    r = simulate(s, Costs(forward=1.0, backward=1.0, allreduce_latency=5.0))
    assert r.makespan == base + 5.0
    # each device all-reduces its two stages (1 byte each) with its mirror: ring factor 2(n-1)/n = 1
    assert r.allreduce_bytes == [2.0, 2.0]


def test_optimizer_step_and_prediction_costs():
    s = get_schedule("async-1f1b", 3, 6)
    plain = simulate(s, Costs(forward=1.0, backward=2.0))
    costed = simulate(s, Costs(forward=1.0, backward=2.0, step=0.5, predict=0.25), prediction=True)
    # steps: 6 per device; predictions: forwards with s > 0 (stage 0: 5, stage 1: 5, stage 2: none)
    assert [b - a for a, b in zip(plain.busy, costed.busy)] == [6 * 0.5 + 5 * 0.25, 6 * 0.5 + 5 * 0.25, 6 * 0.5]


def test_memory_weight_versions_and_traffic():
    one = simulate(get_schedule("1f1b", 4, 8))
    assert one.peak_activations == [4, 3, 2, 1] and one.peak_weight_versions == [1] * 4
    assert simulate(get_schedule("gpipe", 4, 8)).peak_activations == [8] * 4
    assert simulate(get_schedule("async-1f1b", 4, 8)).peak_weight_versions == [4, 3, 2, 1]   # stashing: D-k
    assert simulate(get_schedule("2bw", 4, 8)).peak_weight_versions == [2, 2, 2, 1]
    bp = simulate(get_schedule("bitpipe", 4, 8))
    assert bp.weight_copies == [2] * 4 and one.weight_copies == [1] * 4
    assert one.p2p_messages == [8, 16, 16, 8] and one.p2p_bytes == [8.0, 16.0, 16.0, 8.0]
    assert bp.p2p_messages == [16, 32, 32, 16]          # twice 1F1B's: each micro-batch crosses 2D-2 hops each way


def test_compare_rows_and_steady_state_of_async_schedules():
    rows = {r["schedule"]: r for r in compare(4, 8, Costs(forward=1.0, backward=2.0))}
    assert set(rows) == {"gpipe", "1f1b", "interleaved", "chimera[reference]", "chimera[paced]",
                         "bitpipe[reference]", "bitpipe[paced]", "zb-h1", "zbv", "dualpipev", "async-1f1b",
                         "async-zb", "2bw"}
    assert rows["1f1b"]["steady_bubble"] == rows["1f1b"]["bubble_ratio"] == pytest.approx(3 / 11)
    assert rows["async-1f1b"]["steady_bubble"] == pytest.approx(0.0)     # no flush: a long run has no bubble
    rows = {r["schedule"]: r for r in compare(4, 6)}
    assert "multiple of the number of devices" in rows["bitpipe[reference]"]["error"]


def test_profiled_stage_times_feed_the_simulator():
    import torch
    stages = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(2)]
    p = profile_stages(stages, torch.randn(4, 16), repeats=2, warmup=1)
    assert len(p["forward"]) == len(p["backward"]) == 2 and min(p["forward"] + p["backward"]) > 0
    assert p["activation_bytes"] == [4 * 16 * 4.0] * 2 and p["param_bytes"] == [(16 * 16 + 16) * 4.0] * 2
    costs = Costs.from_measurements(p["forward"], p["backward"], activation_bytes=p["activation_bytes"],
                                    param_bytes=p["param_bytes"])
    r = simulate(get_schedule("1f1b", 2, 4), costs)
    busiest = max(p["forward"][k] + p["backward"][k] for k in range(2))
    assert 4 * busiest <= r.makespan <= 4 * (sum(p["forward"]) + sum(p["backward"]))   # overlap, never serial+


def test_profiled_split_backward_times_feed_the_simulator():
    import torch
    stages = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(2)]
    p = profile_stages(stages, torch.randn(4, 16), repeats=2, warmup=1, split=True)
    assert len(p["backward_input"]) == len(p["backward_weight"]) == 2
    assert min(p["backward_input"] + p["backward_weight"]) > 0
    assert all(p.grad is None for st in stages for p in st.parameters())   # gradients of the timing runs dropped
    costs = Costs.from_measurements(p["forward"], p["backward"], backward_input=p["backward_input"],
                                    backward_weight=p["backward_weight"])
    r = simulate(get_schedule("zb-h1", 2, 4), costs)
    assert r.busy[0] == pytest.approx(4 * (p["forward"][0] + p["backward_input"][0] + p["backward_weight"][0]))


def test_split_costs_default_to_half_the_backward_and_scale_like_it():
    s = get_schedule("zbv", 2, 3)                 # 4 stages on 2 devices: a chunk is half of one D-th
    r = simulate(s, Costs(forward=1.0, backward=3.0))
    assert r.busy[0] == pytest.approx(2 * 3 * (0.5 + 0.75 + 0.75))
    r = simulate(s, Costs(forward=1.0, backward=3.0, backward_input=2.0, backward_weight=1.0))
    assert r.busy[0] == pytest.approx(2 * 3 * (0.5 + 1.0 + 0.5))
    with pytest.raises(ValueError, match="backward_weight must be positive"):
        simulate(s, Costs(backward_weight=0.0))


def test_profile_stages_reads_the_clock_it_is_given():
    """A clock that advances one unit per reading times every forward and backward as exactly one unit (the
    benchmarks pass time.thread_time: CPU time, which other processes on a shared machine do not inflate)."""
    import itertools

    import torch
    ticks = itertools.count()
    stages = [torch.nn.Linear(8, 8) for _ in range(3)]
    p = profile_stages(stages, torch.randn(2, 8), repeats=3, warmup=1, clock=lambda: float(next(ticks)))
    assert p["forward"] == [1.0] * 3 and p["backward"] == [1.0] * 3
    assert next(ticks) == 2 * 2 * 3 * (3 + 1)  # two readings per op, forward and backward, 3 stages, 4 passes


class _TwoOut(__import__("torch").nn.Module):
    """A stage that passes an integer tensor along with its activations (like a Hugging Face cut's position ids)."""

    def __init__(self):
        import torch
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h, positions=None):
        import torch
        positions = torch.arange(h.shape[1]) if positions is None else positions
        return self.lin(h) + positions.float().mean(), positions


def test_profile_stages_follows_tuple_boundaries_and_backpropagates_through_every_stage():
    import torch
    stages = [_TwoOut() for _ in range(3)]
    reached = []
    for k, st in enumerate(stages):
        st.lin.weight.register_hook(lambda g, k=k: reached.append(k))
    p = profile_stages(stages, torch.randn(2, 8), repeats=2, warmup=1, split=True)
    assert len(p["forward"]) == len(p["backward"]) == len(p["backward_weight"]) == 3
    assert min(p["forward"] + p["backward"]) > 0
    assert p["activation_bytes"] == [2 * 8 * 4.0 + 8 * 8.0] * 3                   # the float and the int64 output
    assert reached.count(0) == reached.count(2) == 3 * 2                          # 3 passes, full and split
    assert all(q.grad is None for st in stages for q in st.parameters())


def test_profile_stages_times_a_hugging_face_cut():
    import torch
    transformers = pytest.importorskip("transformers")
    from pipeoptim.models.hf import causal_lm_layers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=8,
                                                                 vocab_size=32))
    cut = causal_lm_layers(model)
    ids = torch.randint(0, 32, (2, 8))
    p = profile_stages(cut.layers, ids, loss_fn=lambda logits: cut.loss_fn(logits, ids), repeats=1, warmup=0)
    assert len(p["backward"]) == 4 and min(p["forward"] + p["backward"]) > 0
    assert p["activation_bytes"][-1] == 2 * 8 * 32 * 4.0                            # the logits


# ---- links and uneven devices (issue 43) ----------------------------------------------------------------------------
def test_a_hop_costs_latency_plus_bytes_over_bandwidth_on_the_critical_path():
    # GPipe, one micro-batch: the forward crosses D - 1 hops and the backward D - 1 more, nothing overlaps them
    D, latency, nbytes, bandwidth = 4, 0.5, 100.0, 400.0
    free = simulate(get_schedule("gpipe", D, 1), EQUAL).makespan
    linked = simulate(get_schedule("gpipe", D, 1), Costs(forward=1.0, backward=1.0, p2p_latency=latency,
                                                          p2p_bandwidth=bandwidth, activation_bytes=nbytes)).makespan
    assert linked - free == pytest.approx(2 * (D - 1) * (latency + nbytes / bandwidth))


def test_jitter_is_seeded_mean_preserving_and_refused_outside_its_range():
    sched = get_schedule("1f1b", 4, 64)
    plain = simulate(sched, EQUAL)
    jittered = [simulate(sched, Costs(forward=1.0, backward=1.0, jitter=0.3, jitter_seed=s)) for s in (0, 0, 1)]
    assert jittered[0].makespan == jittered[1].makespan != jittered[2].makespan
    # each op's factor has mean 1, so the busy time barely moves; the waits for the slowest op lengthen the run
    assert sum(jittered[0].busy) == pytest.approx(sum(plain.busy), rel=0.05)
    assert jittered[0].makespan > plain.makespan
    assert simulate(sched, Costs(forward=1.0, backward=1.0, jitter=0.0, jitter_seed=7)).makespan == plain.makespan
    with pytest.raises(ValueError, match="jitter must be in"):
        simulate(sched, Costs(jitter=1.0))
