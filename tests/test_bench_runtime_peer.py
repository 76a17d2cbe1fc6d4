"""benchmarks/bench_runtime_peer.py: both runtimes run the same stages on every rank (4 stages, or 8 for
interleaved and ZBV), take the same step from the same weights, and the table's ratio is the ratio of the
medians it prints."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_runtime_peer as bench  # noqa: E402

from pipeoptim.runtime import launch  # noqa: E402


def test_both_runtimes_time_the_same_number_of_rounds_on_every_rank():
    per_rank = launch(bench.rank_job, bench.STAGES, "tiny", "1f1b", 4, 2, 1, timeout_s=240)
    assert len(per_rank) == bench.STAGES
    for times in per_rank:
        assert set(times) == {"pipeoptim", "torch", "pipeoptim cpu", "torch cpu"}
        assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
    # the slowest rank's time and the ranks' summed CPU time are all-reduced: every rank reports the same numbers
    assert all(t == per_rank[0] for t in per_rank[1:])


def test_the_ratio_is_the_ratio_of_the_printed_medians():
    row = bench._row("tiny", "4 processes", "1f1b", 8, {"pipeoptim": [3.0, 1.0, 2.0], "torch": [4.0, 8.0, 5.0]},
                     "torch", "1f1b")
    assert row["pipeoptim_s"] == 2.0 and row["peer_s"] == 5.0 and row["ratio"] == pytest.approx(0.4)
    assert row["samples_per_s"] == 4.0 and row["pipeoptim_min_max"] == "1.00000-3.00000"
    assert row["cpu_s"] == row["cpu_paired_ratio"] == ""  # no CPU times given (the one-process rows)


def test_rows_per_microbatch_make_larger_microbatches_and_count_every_sample():
    for model in ("tiny", "gpt"):
        x, t = bench._batch(model, 8, 0, rows=4)
        assert x.shape[0] == t.shape[0] == 32 and x.shape[1:] == bench._batch(model, 8, 0)[0].shape[1:]
    row = bench._row("gpt", "2 processes", "1f1b", 8, {"pipeoptim": [2.0], "torch": [4.0]}, "torch", "1f1b", rows=4)
    assert row["rows_per_microbatch"] == 4 and row["samples_per_s"] == 16.0 and row["peer_samples_per_s"] == 8.0
    assert "N=8 x 4 rows pipeoptim" in bench._format(row)
    assert bench._row("gpt", "2 processes", "1f1b", 8, {"pipeoptim": [2.0], "torch": [4.0]}, "torch",
                      "1f1b")["rows_per_microbatch"] == 1


def test_rows_per_microbatch_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rows-per-microbatch", "0"])
    assert "--rows-per-microbatch must be >= 1" in capsys.readouterr().err


def test_the_cpu_columns_are_the_medians_of_the_summed_cpu_times():
    times = {"pipeoptim": [1.0, 1.0, 1.0], "torch": [1.0, 1.0, 1.0],
             "pipeoptim cpu": [2.0, 6.0, 3.0], "torch cpu": [4.0, 4.0, 4.0]}
    row = bench._row("tiny", "4 processes", "1f1b", 8, times, "torch", "1f1b")
    assert row["cpu_s"] == 3.0 and row["peer_cpu_s"] == 4.0
    assert row["cpu_paired_ratio"] == 0.75  # the per-round ratios 0.5, 1.5, 0.75
    low, high = (float(x) for x in row["cpu_paired_ratio_90ci"].split("-"))
    assert 0.5 <= low <= 0.75 <= high <= 1.5
    assert "CPU paired 0.750" in bench._format(row)


def test_same_initial_weights_in_both_runtimes():
    a, b = bench._stage("tiny", 2), bench._stage("tiny", 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(bench._stage("tiny", 1).parameters()), next(a.parameters()))


def test_interleaved_and_zbv_take_the_same_step_in_both_runtimes():
    # SGD: the update is the gradient itself, so a gradient scaled differently (or a stage computed on the
    # wrong rank) shows; 1000 x the tolerance moved, so agreeing is not agreeing on nothing
    per_rank = launch(bench.sgd_step_checks, bench.STAGES, "tiny", ["interleaved", "zbv"], 8, timeout_s=240)
    for rank, (interleaved, zbv) in enumerate(per_rank):
        assert interleaved["stages"] == [rank, rank + 4]
        assert zbv["stages"] == sorted([rank, 7 - rank])
        for check in (interleaved, zbv):
            assert check["gap"] == 0.0, check
            assert check["moved"] > 1e-3 and check["max_abs_diff"] <= 1e-5 * check["moved"] + 1e-6


def test_weight_gap_names_the_parameter_that_differs():
    class Ours:
        def __init__(self, params):
            self.params = params

        def named_parameters(self):
            return self.params

    theirs = {"0.0.weight": torch.ones(3), "4.0.bias": torch.zeros(2)}
    assert bench.weight_gap(Ours({k: v.clone() for k, v in theirs.items()}), theirs) == (0.0, "")
    off = {k: v.clone() for k, v in theirs.items()}
    off["4.0.bias"][1] = 1e-3
    gap, where = bench.weight_gap(Ours(off), theirs)
    assert where == "4.0.bias" and gap == pytest.approx(1e-3 - 1e-6)
    with pytest.raises(RuntimeError, match="different parameters"):
        bench.weight_gap(Ours({"0.0.weight": torch.ones(3)}), theirs)


def test_the_eight_stage_cut_is_the_four_stage_model():
    for k in range(bench.STAGES):
        four = list(bench._stage("tiny", k).parameters())
        eight = [p for i in (2 * k, 2 * k + 1) for p in bench._stage("tiny", i, 8).parameters()]
        assert len(four) == len(eight) == 4 and all(torch.equal(p, q) for p, q in zip(four, eight))
    for n, cuts in bench._GPT_CUTS.items():    # [embedding, 8 blocks, head]: every layer once, no empty stage
        assert len(cuts) == n + 1 and cuts[0] == 0 and cuts[-1] == 10
        assert all(a < b for a, b in zip(cuts, cuts[1:]))


def test_torch_places_the_stages_as_pipeoptims_schedules_do():
    from pipeoptim.runtime.config import make_schedule
    for schedule in bench.SYNC:
        chunks = make_schedule(schedule, bench.STAGES, 8).chunks
        assert [[c.stage for c in chunks[r]] for r in range(bench.STAGES)] == \
            [bench.rank_stages(schedule, r) for r in range(bench.STAGES)]
        assert bench.num_stages(schedule) == sum(len(c) for c in chunks)


def test_the_staged_floor_takes_the_plain_step_and_every_runner_is_timed():
    torch.set_num_threads(1)
    plain, whole = bench.plain_runner("tiny", 4)
    staged, stages = bench.staged_runner("tiny", 4)
    batch = bench._batch("tiny", 4, 0)
    before = [p.detach().clone() for p in whole.parameters()]
    plain(batch)
    staged(batch)
    after_plain = list(whole.parameters())
    after_staged = [p for st in stages for p in st.parameters()]
    assert len(after_plain) == len(after_staged)
    assert any(not torch.equal(a, b) for a, b in zip(before, after_plain))       # the step moved the weights
    for a, b in zip(after_plain, after_staged):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    times = bench.emulated_job("tiny", 4, 2, 0)
    assert set(times) == {"pipeoptim", "plain", "staged"} and all(len(v) == 2 for v in times.values())


def test_the_asynchronous_rows_run_2bw_with_its_own_policy():
    """An asynchronous schedule without a peer runs alone; here 2BW at one update per window (m = N), the row
    ``test_2bw_with_one_update_per_window_takes_the_synchronous_rows_batch`` builds."""
    per_rank = launch(bench.rank_job, bench.STAGES, "tiny", "2bw", 8, 1, 0, None, "adamw", None, True, 1, "N",
                      timeout_s=240)
    assert bench.ASYNC == (("async-1f1b", "none", False, None), ("async-1f1b", "none", True, None),
                           ("async-1f1b", "pipeoptim", True, None), ("2bw", "2bw", True, None),
                           ("2bw", "2bw", True, "N"), ("2bw", "pipeoptim", True, "N"))
    assert bench._policy("2bw") == "2bw" and bench._policy("async-1f1b") == "none" and bench._policy("1f1b") == "none"
    assert all(set(t) == {"pipeoptim", "pipeoptim cpu"} and len(t["pipeoptim"]) == 1 for t in per_rank)


def test_2bw_with_one_update_per_window_takes_the_synchronous_rows_batch():
    """The m = N row: 2BW's update_every is the window's N micro-batches, so it takes as many optimizer steps per
    window as a synchronous schedule, each over the same batch; the default row keeps the schedule's m = D."""
    from pipeoptim.train import Pipeline

    def two_bw(update_every):
        return Pipeline(stages=lambda i: bench._stage("tiny", i), loss_fn=bench._loss("tiny"), optimizer=bench._adamw,
                        schedule="2bw", policy="2bw", microbatches=8, emulate=True, devices=bench.STAGES,
                        schedule_options=bench._schedule_options(8, update_every))
    per_window = two_bw("N")
    assert [per_window.plan.update_every(c) for c in per_window.plan.schedule.chunks[0]] == [8]
    assert per_window.plan.num_steps == bench.STAGES  # one step per stage per window, as GPipe's
    default = two_bw(None)
    assert [default.plan.update_every(c) for c in default.plan.schedule.chunks[0]] == [bench.STAGES]
    assert [bench.micro_batches_per_update(s, 8, 4, m) for s, _, _, m in bench.ASYNC] == [1, 1, 1, 4, 8, 8]
    assert bench.micro_batches_per_update("gpipe", 8, 4) == 8
    with pytest.raises(ValueError, match="update_every"):
        bench._update_every(8, "all")
    times = {"pipeoptim": [0.9, 1.1], "torch": [1.0, 1.0]}  # (the row's format; the distributed run: above)
    row = bench._row("tiny", "4 processes", "2bw", 8, times, "torch", "gpipe", "adamw", "2bw", True, 1, 8)
    assert row["update_every"] == 8 and "2bw stream m=8" in bench._format(row)


def test_on_two_ranks_every_runtime_trains_the_same_model_cut_in_two():
    """--ranks 2: the 2-stage cut is the 4-stage one joined pairwise, and both runtimes still take the same first
    step (rank_job raises otherwise), for a synchronous row and a streamed asynchronous one."""
    for k in range(2):
        two = list(bench._stage("tiny", k, 2).parameters())
        four = [p for i in (2 * k, 2 * k + 1) for p in bench._stage("tiny", i).parameters()]
        assert len(two) == len(four) and all(torch.equal(a, b) for a, b in zip(two, four))
    assert bench.num_stages("zbv", 2) == 4 and bench.rank_stages("zbv", 1, 2) == [1, 2]
    for schedule, peer, stream in (("interleaved", None, False), ("2bw", "1f1b", True)):
        per_rank = launch(bench.rank_job, 2, "tiny", schedule, 4, 1, 1, peer, "adamw", None, stream, timeout_s=240)
        assert len(per_rank) == 2 and all(len(t["pipeoptim"]) == 1 for t in per_rank)


def test_an_asynchronous_row_runs_side_by_side_with_torchs_synchronous_peer():
    """Its peer may cut the model differently (interleaved: 8 stages for pipeoptim's 4). The rows: async 1F1B
    with PipeOptim (the product's own method: predicted weights, fused step + predict, on every rank), its row
    naming the policy; and async 1F1B as a stream, whose micro-batches carry from one timed step to the next
    (rank_job raises if the stream held nothing in flight after its steps)."""
    runs = {("interleaved", "pipeoptim", False): None, ("gpipe", "none", True): None}
    for peer, policy, stream in runs:
        per_rank = launch(bench.rank_job, bench.STAGES, "tiny", "async-1f1b", 8, 2, 1, peer, "adamw", policy, stream,
                          timeout_s=240)
        assert all(set(t) == {"pipeoptim", "torch", "pipeoptim cpu", "torch cpu"} and
                   all(len(v) == 2 for v in t.values()) for t in per_rank)
        runs[peer, policy, stream] = per_rank[0]
    row = bench._row("tiny", "4 processes", "async-1f1b", 8, runs["interleaved", "pipeoptim", False], "torch",
                     "interleaved", "adamw", "pipeoptim")
    assert row["policy"] == "pipeoptim" and "async-1f1b+pipeoptim" in bench._format(row)
    row = bench._row("tiny", "4 processes", "async-1f1b", 8, runs["gpipe", "none", True], "torch", "gpipe", "adamw",
                     "none", True)
    assert row["stream"] is True and "async-1f1b stream" in bench._format(row)


def test_a_gpu_run_is_emulated_only():
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--models", "tiny"])


def test_the_paired_ratio_cancels_a_load_change_that_hits_both_runtimes():
    theirs = [1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 1.0]           # the machine's load changes from round to round
    ours = [1.1 * t for t in theirs]                      # pipeoptim 10 % slower in every round
    ratio, low, high = bench.paired_ratio(ours, theirs)
    assert ratio == pytest.approx(1.1) and low == pytest.approx(1.1) and high == pytest.approx(1.1)
    row = bench._row("tiny", "4 processes", "1f1b", 8, {"pipeoptim": ours, "torch": theirs}, "torch", "1f1b")
    assert row["paired_ratio"] == 1.1 and row["paired_ratio_90ci"] == "1.100-1.100"


def test_the_paired_ratios_interval_widens_with_noise_and_holds_the_median():
    g = torch.Generator().manual_seed(3)
    theirs = [1.0] * 41
    ours = (1.0 + 0.2 * torch.randn(41, generator=g, dtype=torch.float64)).abs().tolist()
    ratio, low, high = bench.paired_ratio(ours, theirs)
    assert low < ratio < high and high - low > 0.02
    assert ratio == pytest.approx(float(torch.tensor(ours).quantile(0.5)))


def test_the_optimizer_choice_reaches_both_runtimes():
    """--optimizer adamw-fused: torch's fused AdamW on both sides; their weights still agree after the first
    step (rank_job raises otherwise) and both are timed."""
    p = torch.nn.Parameter(torch.zeros(3))
    assert bench.OPTIMIZERS["adamw-fused"]([p]).defaults["fused"] is True
    assert not bench.OPTIMIZERS["adamw"]([p]).defaults["fused"]
    per_rank = launch(bench.rank_job, bench.STAGES, "tiny", "1f1b", 4, 1, 0, None, "adamw-fused", timeout_s=240)
    assert all(set(t) == {"pipeoptim", "torch", "pipeoptim cpu", "torch cpu"} and
               all(len(v) == 1 for v in t.values()) for t in per_rank)
    times = bench.emulated_job("tiny", 4, 1, 0, optimizer="adamw-fused")
    assert set(times) == {"pipeoptim", "plain", "staged"}
