"""benchmarks/bench_time_to_target.py: its --quick study end to end, its time model on hand-made costs with known
closed forms, the snapshots it evaluates, and resuming."""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
from collections import defaultdict

import pytest

pytest.importorskip("sklearn")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_time_to_target.py")
_spec = importlib.util.spec_from_file_location("bench_time_to_target", _PATH)
ttt = importlib.util.module_from_spec(_spec)
sys.modules["bench_time_to_target"] = ttt  # dataclasses look their module up while the class is made
_spec.loader.exec_module(ttt)
bc = ttt.bc
QUICK = ttt.WORKLOADS["quick"]


pytestmark = pytest.mark.usefixtures("restore_policy_registry")  # the ablations register policies


def _crossing(curve, target, higher_is_better):
    """The test's own statement of 'updates to target': linear interpolation between evaluations."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v1 is None or (isinstance(v1, float) and math.isnan(v1)):
            return None
        hit = v1 >= target if higher_is_better else v1 <= target
        if hit:
            return s0 + (s1 - s0) * (target - v0) / (v1 - v0)
    return None


def test_updates_to_interpolates_and_stops_at_divergence():
    gpt = ttt.WORKLOADS["gpt16"]
    curve = [(0, 3.0), (32, 2.6), (64, 2.2)]
    assert ttt.updates_to(curve, 2.4, gpt) == pytest.approx(48.0)
    assert ttt.updates_to(curve, 2.6, gpt) == pytest.approx(32.0)
    assert ttt.updates_to(curve, 2.0, gpt) is None
    assert ttt.updates_to([(0, 3.0), (32, float("nan")), (64, 2.0)], 2.4, gpt) is None
    assert ttt.updates_to([(0, 0.1), (4, 0.2), (8, 0.3)], 0.25, QUICK) == pytest.approx(6.0)  # accuracy: higher


def _uniform_costs(wl, unit=1e-3, overhead=None):
    """Every layer: forward = backward = `unit` seconds per sample; no policy work unless `overhead` says."""
    layers = 8  # the digits net
    layer_rows = [{"layer": j, "microbatch_size": b, "forward_s": unit * b, "backward_s": unit * b}
                  for j in range(layers) for b in ttt.microbatch_sizes(wl)]
    stage_rows = []
    for D in wl.depths:
        for k in range(D):
            for v in ("none", "stash", "2bw", "spectrain", "pipeoptim", "pipeoptim-code"):
                o = (overhead or {}).get(v, (0.0, 0.0, 0.0))
                stage_rows.append({"devices": D, "stage": k, "variant": v, "forward_overhead_s": o[0],
                                   "backward_overhead_s": o[1], "step_s": o[2]})
    return ttt.MeasuredCosts(wl, layer_rows, stage_rows)


@pytest.mark.parametrize("D", [2, 4])
def test_time_per_update_matches_closed_forms(D):
    wl = dataclasses.replace(QUICK, batch=8, window=8)
    costs = _uniform_costs(wl)
    u = 1e-3
    per_sample_stage = 2 * (8 // D) * u          # forward + backward of one sample on one stage
    # 1F1B and GPipe, uniform stages: (N + D - 1)(F + B); best N is the largest (8 micro-batches of 1 sample)
    for name in ("1f1b", "gpipe"):
        t = costs.time_per_update(name, D, "none")
        assert t["microbatches"] == 8
        assert t["time_s"] == pytest.approx((8 + D - 1) * per_sample_stage)
    # interleaved, v = 2, F = B: (F + B)(N + (D - 1)/v) per update
    t = costs.time_per_update("interleaved", D, "none")
    assert t["time_s"] == pytest.approx(8 * per_sample_stage * (1 + (D - 1) / (2 * 8)))
    # BitPipe can do no better than each device's own work (the whole batch through its share of the model)
    t = costs.time_per_update("bitpipe", D, "none")
    assert t["time_s"] >= 8 * per_sample_stage * (1 - 1e-9) and t["variant"] in ("reference", "paced")
    # async 1F1B: a window of W micro-batches of the whole batch takes (W + D - 1)(F + B), W updates
    W = wl.window
    t = costs.time_per_update("async-1f1b", D, "pipeoptim")
    assert t["time_s"] == pytest.approx((W + D - 1) * 8 * per_sample_stage / W)
    # 2BW: micro-batches of batch/D, one update per D of them: the same time per update here
    t2 = costs.time_per_update("2bw", D, "2bw")
    assert t2["microbatch_size"] == 8 // D and t2["time_s"] == pytest.approx(t["time_s"])
    # costs already proportional to samples: the "compute ∝ samples" scenario is the same
    assert costs.time_per_update("1f1b", D, "none", linear=True)["time_s"] == pytest.approx(
        costs.time_per_update("1f1b", D, "none")["time_s"])


def test_policy_work_is_charged_to_its_method_only():
    wl = dataclasses.replace(QUICK, batch=8, window=8)
    plain = _uniform_costs(wl)
    extra = _uniform_costs(wl, overhead={"pipeoptim": (1e-4, 0.0, 2e-4)})
    assert extra.time_per_update("async-1f1b", 4, "pipeoptim")["time_s"] > \
        plain.time_per_update("async-1f1b", 4, "pipeoptim")["time_s"] + 2e-4
    assert extra.time_per_update("async-1f1b", 4, "stash")["time_s"] == \
        plain.time_per_update("async-1f1b", 4, "stash")["time_s"]


def _task_and_pipe(method, D, lr=0.01, window=8):
    import torch
    torch.manual_seed(0)
    task = bc.Task("digits", 0)
    pipe, mb, kw = bc.build_pipeline(method, task, dict(devices=D, mbs=8, optimizer="sgd", lr=lr), window)
    return task, pipe, kw, mb


def test_snapshots_are_the_weights_after_that_many_updates(one_thread):
    import torch
    task, pipe, kw, mb = _task_and_pipe("sync", 2)
    snaps = ttt.Snapshots(pipe, every=2)
    for _ in range(4):
        pipe.train_step(task.batch(mb))
    taken = snaps.take()
    assert [c for c, _ in taken] == [2, 4] and snaps.take() == []
    final = pipe.named_parameters()
    assert set(taken[1][1]) == set(final)
    assert all(torch.equal(taken[1][1][n], final[n]) for n in final)
    task2, pipe2, _, _ = _task_and_pipe("sync", 2)   # the same run stopped after 2 updates
    for _ in range(2):
        pipe2.train_step(task2.batch(mb))
    assert all(torch.equal(taken[0][1][n], p) for n, p in pipe2.named_parameters().items())


@pytest.mark.parametrize("method", ["stash", "pipeoptim-exact", "2bw"])
def test_async_snapshot_at_window_end_is_the_final_model(one_thread, method):
    import torch
    task, pipe, kw, mb = _task_and_pipe(method, 2)
    per_update = 2 if method == "2bw" else 1
    snaps = ttt.Snapshots(pipe, every=2 if method == "2bw" else 4)
    pipe.train_step(task.batch(mb * kw["microbatches"]))
    taken = snaps.take()
    last = 8 // per_update
    assert [c for c, _ in taken] == ([2, 4] if method == "2bw" else [4, 8]) and taken[-1][0] == last
    final = pipe.named_parameters()
    assert all(torch.equal(taken[-1][1][n], final[n]) for n in final)
    assert any(not torch.equal(taken[0][1][n], final[n]) for n in final)  # mid-window copy is an earlier model
    wl = dataclasses.replace(QUICK, updates=8 // per_update * 2, eval_every=2 if method == "2bw" else 4)
    task, pipe, kw, mb = _task_and_pipe(method, 2)
    curve, diverged, _ = ttt.train_with_snapshots(pipe, task, wl, mb * kw["microbatches"],
                                                  kw["microbatches"] // per_update)
    assert not diverged and curve[-1][0] == wl.updates
    assert curve[-1][1] == task.evaluate(pipe)["acc"]


def test_divergence_ends_the_run_and_is_recorded(one_thread):
    row = ttt.run_curve("quick", "pipeoptim-exact", 2, 30.0, 0)
    assert row["diverged"] is True and math.isnan(row["final"])
    curve = json.loads(row["curve"])
    assert curve[-1][1] is None and curve[0][0] == 0


def _summary(out):
    with open(os.path.join(out, "time_to_target_quick_summary.csv"), newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_quick_study_end_to_end_and_resume(tmp_path, one_thread, capsys, monkeypatch):
    out = str(tmp_path)
    assert ttt.main(["--quick", "--out", out, "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    assert "D = 2:" in text and "D = 4:" in text and "s ablation, PipeOptim at D = 4" in text
    runs = ttt.read_runs(os.path.join(out, "time_to_target_quick_runs.csv"))
    wl = QUICK
    seed0 = wl.seeds[0]
    # every (run, depth, lr) of the sweep ran once; sync once for every depth
    sweep = defaultdict(list)
    for r in runs:
        if r["seed"] == seed0 and r["lr"] in wl.lrs and r["method"] not in ttt.ABLATION:
            sweep[(r["method"], r["devices"])].append(r)
    assert set(sweep) == {("sync", 0)} | {(m, d) for m in ttt.ASYNC_RUNS for d in wl.depths}
    assert all(sorted(r["lr"] for r in rs) == sorted(wl.lrs) for rs in sweep.values())
    assert sum(r["diverged"] for r in runs) >= 3  # lr 30 diverges

    def best(rs):  # the test's own statement of "each method at its own best lr"
        ok = [r for r in rs if not r["diverged"]]
        hits = [(_crossing(r["curve"], wl.targets[0], True), r) for r in ok]
        hits = [(u, r) for u, r in hits if u is not None]
        if hits:
            return min(hits, key=lambda x: (x[0], x[1]["lr"]))[1]["lr"]
        return max(ok, key=lambda r: float(r["final"]))["lr"]

    summary = [r for r in _summary(out) if float(r["target"]) == wl.targets[0]]
    trained = ("sync",) + wl.async_runs  # every method the workload trains, each at every depth (candidates of
    shown = [m for m, (run, _) in ttt.METHODS.items() if run in trained]  # other workloads are not trained here)
    assert "zbv" in shown and {(r["method"], int(r["devices"])) for r in summary} >= {(m, d) for m in shown
                                                                                      for d in wl.depths}
    for s in summary:
        run = ttt.METHODS.get(s["method"], (s["method"],))[0]
        rd = 0 if run == "sync" else int(s["devices"])
        lr = float(s["lr"])
        if s["method"] in ttt.ABLATION:
            assert lr == float(next(x["lr"] for x in summary if x["method"] == "pipeoptim"
                                    and x["devices"] == s["devices"]))
        else:
            assert lr == best(sweep[(run, rd)]), s
            # divergences of the sweep are counted, and a diverged lr is never the one chosen
            assert int(s["diverged_sweep"]) == sum(r["diverged"] for r in sweep[(run, rd)])
            assert not any(r["diverged"] for r in sweep[(run, rd)] if r["lr"] == lr)
        at = [r for r in runs if r["method"] == run and r["devices"] == rd and r["lr"] == lr]
        assert sorted(r["seed"] for r in at) == list(wl.seeds) and int(s["seeds"]) == len(wl.seeds)
        ups = [_crossing(r["curve"], wl.targets[0], True) for r in at if not r["diverged"]]
        ups = [u for u in ups if u is not None]
        assert int(s["reached"]) == len(ups)
        if ups:  # time to target = updates to target x time per update, both as measured
            assert float(s["updates_mean"]) == pytest.approx(statistics.mean(ups))
            assert float(s["time_to_target_s"]) == pytest.approx(statistics.mean(ups) * float(s["time_per_update_s"]))
        else:
            assert s["time_to_target_s"] == ""
        assert float(s["time_per_update_s"]) > 0
    for D in wl.depths:  # the synchronous schedules share one convergence run, not one time per update
        sync = [s for s in summary if s["method"] in ("gpipe", "1f1b", "interleaved", "bitpipe")
                and int(s["devices"]) == D]
        assert len({(s["lr"], s["updates_mean"]) for s in sync}) == 1
        assert len({s["time_per_update_s"] for s in sync}) > 1
    assert os.path.exists(os.path.join(out, "time_to_target_quick_D4.png"))

    # resume: nothing left to run
    path = os.path.join(out, "time_to_target_quick_runs.csv")
    before = open(path).read()

    def no_more(*a, **k):
        raise AssertionError(f"a finished run was run again: {a}")
    monkeypatch.setattr(ttt, "run_curve", no_more)
    ttt.run_study(wl, out, jobs=1, threads=1)
    assert open(path).read() == before
    # a run lost to a crash (its row missing) is the only one run again
    lines = before.splitlines(keepends=True)
    with open(path, "w") as fh:
        fh.writelines(lines[:-1])
    lost = list(csv.DictReader([lines[0], lines[-1]]))[0]
    calls = []
    typed = dict(lost, final=float(lost["final"]), diverged=lost["diverged"] == "True")
    monkeypatch.setattr(ttt, "run_curve", lambda *a: calls.append(a) or typed)
    ttt.run_study(wl, out, jobs=1, threads=1)
    assert calls == [("quick", lost["method"], int(lost["devices"]), float(lost["lr"]), int(lost["seed"]))]
    assert len(ttt.read_runs(path)) == len(lines) - 1


def _weight_stashing_reference(layers, balance, batch, window, lr, lags):
    """Plain PyTorch, no pipeline: one optimizer over the whole model, one update per micro-batch; stage k computes
    micro-batch i (forward and backward) on its weights max(0, i - lags[k]) updates old, and the gradient is
    applied to the current weights. With lags[k] = D-1-k this is PipeDream's weight stashing over one window that
    starts from a drained pipeline (micro-batch i cannot be older than the i updates made so far)."""
    import copy
    from torch import nn
    from pipeoptim.models.gpt import lm_loss
    x, y = batch
    model = nn.Sequential(*layers)
    opt = bc.make_optimizer("adamw", lr, fused=True)(model.parameters())
    starts = [sum(balance[:k]) for k in range(len(balance))]
    stages = [nn.Sequential(*layers[s:s + n]) for s, n in zip(starts, balance)]
    versions = [[copy.deepcopy(st)] for st in stages]   # versions[k][v]: stage k after v updates
    mb = len(x) // window
    losses = []
    for i in range(window):
        used = [versions[k][max(0, i - lags[k])] for k in range(len(stages))]
        for u in used:
            u.zero_grad(set_to_none=True)
        h = x[i * mb:(i + 1) * mb]
        for u in used:
            h = u(h)
        loss = lm_loss(h, y[i * mb:(i + 1) * mb])
        loss.backward()
        losses.append(loss.item())
        for st, u in zip(stages, used):
            for p, q in zip(st.parameters(), u.parameters()):
                p.grad = q.grad.clone()
        opt.step()
        for k, st in enumerate(stages):
            versions[k].append(copy.deepcopy(st))
    return dict(model.named_parameters()), sum(losses) / len(losses)


def test_async_stash_on_the_gpt_path_is_plain_weight_stashing(one_thread):
    """The gpt16 study's asynchronous runs plateau near 3.1 nats/byte (RESULTS.md section 5). This pins that on
    that study's code path (gpt_balance, fused AdamW, one micro-batch per update, Snapshots' window) the pipeline
    computes exactly what PipeDream's weight stashing prescribes, so the plateau belongs to the method on that model,
    not to the runtime; and that the comparison can tell staleness from none."""
    import copy
    import torch
    cfg = dict(seq_len=8, d_model=16, n_heads=2, n_layers=4)
    D, window, batch, lr = 4, 8, 2, 1e-2
    torch.manual_seed(0)
    task = bc.Task("gpt", 0, cfg)
    balance = ttt.gpt_balance(cfg["n_layers"])(D)
    fresh = copy.deepcopy(task.layers)
    data = task.batch(batch * window)
    pipe, mb, kw = bc.build_pipeline("stash", task, dict(devices=D, mbs=batch, optimizer="adamw", lr=lr), window,
                                     balance=balance, fused=True)
    assert mb == batch and kw["microbatches"] == window
    loss = pipe.train_step(data)
    got = pipe.named_parameters()
    want, want_loss = _weight_stashing_reference(copy.deepcopy(fresh), balance, data, window, lr,
                                                 [D - 1 - k for k in range(D)])
    fresh_weights = dict(torch.nn.Sequential(*fresh).named_parameters())
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert all(not torch.equal(got[n], fresh_weights[n]) for n in got if n.endswith("weight"))
    no_stale, _ = _weight_stashing_reference(copy.deepcopy(fresh), balance, data, window, lr, [0] * D)
    assert max((no_stale[n] - got[n]).abs().max().item() for n in got) > 1e-3


def _tiny_hf(monkeypatch):
    pytest.importorskip("transformers")
    wl = dataclasses.replace(ttt.WORKLOADS["hfgpt2"], name="hftiny", depths=(2,), lrs=(1e-3,), batch=4, window=4,
                             updates=8, eval_every=4, targets=(5.0,), balance=ttt.gpt_balance(2),
                             gpt_cfg=dict(seq_len=8, d_model=16, n_heads=2, n_layers=2), cost_repeats=1,
                             overhead_iters=2)
    monkeypatch.setitem(ttt.WORKLOADS, wl.name, wl)
    return wl


def test_costs_of_the_hugging_face_workload_are_measured_through_its_tuple_boundaries(one_thread, monkeypatch):
    wl = _tiny_hf(monkeypatch)
    layers = ttt.measure_layer_costs(wl)
    assert {(r["layer"], r["microbatch_size"]) for r in layers} == {(j, b) for j in range(4) for b in (1, 2, 4)}
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in layers)
    stages = ttt.measure_stage_overheads(wl)
    assert {(r["stage"], r["variant"]) for r in stages} == \
        {(k, v) for k in (0, 1) for v in ("none", "stash", "2bw", "spectrain", "pipeoptim", "pipeoptim-code",
                                          "pipeoptim-2bw")}
    assert all(r["step_s"] > 0 for r in stages)
    costs = ttt.MeasuredCosts(wl, layers, stages)
    assert costs.time_per_update("async-1f1b", 2, "pipeoptim")["time_s"] > 0


@pytest.mark.parametrize("method", ["sync", "pipeoptim-exact"])
def test_a_hugging_face_gpt2_run_records_its_curve(one_thread, monkeypatch, method):
    _tiny_hf(monkeypatch)
    row = ttt.run_curve("hftiny", method, 0 if method == "sync" else 2, 1e-3, 0)
    curve = json.loads(row["curve"])
    assert not row["diverged"] and [s for s, _ in curve] == [0, 4, 8]
    assert curve[-1][1] < curve[0][1] and row["final"] == pytest.approx(curve[-1][1], abs=1e-5)


def test_suite_runs_every_workload_once_in_order(monkeypatch, capsys, tmp_path):
    done = []
    monkeypatch.setattr(ttt, "run_study", lambda wl, out, jobs, threads, only, depths, screen:
                        done.append(("run", wl.name, jobs)))
    monkeypatch.setattr(ttt, "report", lambda wl, out: done.append(("report", wl.name)))
    assert ttt.main(["--workload", "suite", "gpt16", "--jobs", "2", "--out", str(tmp_path)]) == 0
    assert done == [x for name in ("gpt16", "hfgpt2", "digits") for x in (("run", name, 2), ("report", name))]
    printed = capsys.readouterr().out
    assert all(f"{name}: " in printed for name in ttt.SUITE) and "wall time of this command" in printed
    done.clear()
    assert ttt.main(["--workload", "digits", "--report", "--out", str(tmp_path)]) == 0
    assert done == [("report", "digits")]


def _row(method, devices, lr, final, seed=0, diverged=False):
    curve = [(0, 5.0), (32, float("nan") if diverged else final)]
    return {"method": method, "devices": devices, "lr": lr, "seed": seed, "diverged": diverged,
            "final": float("nan") if diverged else final, "curve": curve}


def test_sweep_is_widened_past_an_edge_that_holds_the_best_until_bracketed():
    wl = dataclasses.replace(ttt.WORKLOADS["gpt16"], lrs=(5e-4, 1e-3, 2e-3), widen=2, targets=(0.0,))
    # none reaches target 0.0: the best is the lowest final loss
    rows = [_row("stash", 4, 5e-4, 3.0), _row("stash", 4, 1e-3, 2.9), _row("stash", 4, 2e-3, 2.8)]
    assert ttt.widen_sweep(wl, rows, "stash", 4) == pytest.approx(4e-3)          # best at the top edge
    rows.append(_row("stash", 4, 4e-3, 2.7))
    assert ttt.widen_sweep(wl, rows, "stash", 4) == pytest.approx(8e-3)          # still the edge: once more
    rows.append(_row("stash", 4, 8e-3, 2.6))
    assert ttt.widen_sweep(wl, rows, "stash", 4) is None                         # widened twice: no further
    low = [_row("sync", 0, 5e-4, 2.5), _row("sync", 0, 1e-3, 2.6), _row("sync", 0, 2e-3, None, diverged=True)]
    assert ttt.widen_sweep(wl, low, "sync", 0) == pytest.approx(2.5e-4)          # best at the bottom edge
    low.append(_row("sync", 0, 2.5e-4, 2.55))
    assert ttt.widen_sweep(wl, low, "sync", 0) is None and ttt.best_lr(wl, low, "sync", 0) == 5e-4  # bracketed
    assert ttt.widen_sweep(wl, [_row("2bw", 4, 1e-3, 2.0)], "2bw", 4) is None    # one lr: nothing to bracket
    # runs at lrs outside the (widened) sweep, or of other seeds, do not count
    stray = rows + [_row("stash", 4, 3e-3, 1.0), _row("stash", 4, 5e-4, 1.0, seed=1)]
    assert ttt.best_lr(wl, stray, "stash", 4) == pytest.approx(8e-3)
    planned = ttt.plan_runs(wl, [_row("sync", 0, lr, f) for lr, f in ((5e-4, 3), (1e-3, 2), (2e-3, 1))], "widen")
    assert planned == [("sync", 0, pytest.approx(4e-3), 0)]


def test_a_workload_reads_the_costs_of_the_one_it_names(tmp_path):
    wl = ttt.WORKLOADS["gpt16-lookahead"]
    assert wl.costs_of == "gpt16-async" and wl.newton_schulz == "bf16-in-fp32"
    with pytest.raises(SystemExit, match="gpt16-lookahead"):
        ttt.load_or_measure_costs(dataclasses.replace(wl, costs_of=""), str(tmp_path), measure=False)
    costs = ttt.load_or_measure_costs(wl, ttt.RESULTS, measure=False)
    own = ttt.load_or_measure_costs(ttt.WORKLOADS["gpt16-async"], ttt.RESULTS, measure=False)
    # the look-ahead costs what PipeOptim's prediction on 2BW costs: γ changes what is predicted, not the work
    assert (costs.time_per_update("2bw", 16, ttt.POLICY_OF_RUN["lookahead-2bw-muon"])
            == own.time_per_update("2bw", 16, "pipeoptim-2bw-muon"))


def test_warmup_ramps_every_methods_lr_linearly_then_holds_it():
    import torch
    wl = dataclasses.replace(ttt.WORKLOADS["gpt16"], warmup=4)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.8)
    sched = wl.lr_scheduler()(opt)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    assert ttt.WORKLOADS["gpt16"].lr_scheduler() is None     # the section-6 study had none


def test_only_restricts_the_asynchronous_runs_trained(tmp_path, monkeypatch):
    wl = ttt.WORKLOADS["gpt16-async"]
    with pytest.raises(SystemExit, match="not a run of workload gpt16-async"):
        ttt.run_study(wl, str(tmp_path), jobs=1, threads=1, only=("spectrain",))
    planned = []
    monkeypatch.setattr(ttt, "load_or_measure_costs", lambda *a, **k: None)
    monkeypatch.setattr(ttt, "run_missing", lambda w, todo, *a: planned.extend(todo))
    ttt.run_study(wl, str(tmp_path), jobs=1, threads=1, only=("sync", "pipeoptim-2bw"))
    assert {m for m, *_ in planned} == {"sync", "pipeoptim-2bw"}
    assert {d for m, d, *_ in planned if m == "pipeoptim-2bw"} == set(wl.depths)
    planned.clear()  # another command's share: no sync, two depths, the sweep only (seed 0)
    ttt.run_study(wl, str(tmp_path), jobs=1, threads=1, only=("stash",), depths=(4, 16), screen=True)
    assert {(m, d) for m, d, *_ in planned} == {("stash", 4), ("stash", 16)}
    assert {seed for *_, seed in planned} == {wl.seeds[0]}
    with pytest.raises(SystemExit, match="runs at depths 4 8 16"):
        ttt.run_study(wl, str(tmp_path), jobs=1, threads=1, depths=(2,))


def test_a_run_recorded_twice_counts_once(tmp_path):
    path = str(tmp_path / "runs.csv")
    row = {"workload": "quick", "method": "stash", "devices": 2, "lr": 0.01, "seed": 0, "updates": 4,
           "microbatch_size": 1, "diverged": False, "final": 0.5, "best": 0.5, "curve": "[[0, 0.1], [4, 0.5]]",
           "wall_s": 1.0, "cpu_s": 1.0}
    ttt._append(path, row)
    ttt._append(path, {**row, "final": 0.7})
    ttt._append(path, {**row, "seed": 1})
    runs = ttt.read_runs(path)
    assert [(r["seed"], float(r["final"])) for r in runs] == [(0, 0.5), (1, 0.5)]


def test_a_synchronous_candidate_is_trained_once_and_timed_on_every_synchronous_schedule():
    """sync-muon (Muon + AdamW on a synchronous schedule) is trained at devices 0 like "sync", and its methods are
    the synchronous schedules, charged Muon's measured stage work."""
    assert "sync-muon" in ttt.SYNC_RUNS
    wl = ttt.WORKLOADS["gpt16-async"]
    assert ttt.run_depths(wl, "sync-muon") == [0]
    planned = ttt.plan_runs(dataclasses.replace(wl, runs=("sync-muon",), train_sync=False), [], "sweep")
    assert {(m, d) for m, d, *_ in planned} == {("sync-muon", 0)}
    assert {name for name, (run, _) in ttt.METHODS.items() if run == "sync-muon"} == \
        {"1f1b-muon", "bitpipe-muon", "zbv-muon"}
    muon_runs = ("sync-muon", "stash-muon", "pipeoptim-muon", "2bw-muon", "pipeoptim-2bw-muon")
    assert {ttt.POLICY_OF_RUN[r] for r in muon_runs} == set(ttt.MUON_VARIANTS)
    trained = [r for r in muon_runs if r in wl.async_runs]
    assert len(trained) >= 4 and {ttt.POLICY_OF_RUN[r] for r in trained} <= set(ttt.needed_variants(wl))
    assert ttt.needed_variants(QUICK) == ttt.STAGE_VARIANTS


def test_stage_costs_missing_a_new_runs_variant_are_completed_not_remeasured(tmp_path, monkeypatch):
    """A run added to a workload after its costs were measured: only its variants are measured and appended; the
    rows already there stay as they were; --report (measure=False) refuses instead of measuring."""
    wl = dataclasses.replace(QUICK, runs=("stash", "stash-muon"))
    layer = tmp_path / f"time_to_target_{wl.name}_layer_costs.csv"
    stage = tmp_path / f"time_to_target_{wl.name}_stage_costs.csv"
    layer.write_text("layer,microbatch_size,forward_s,backward_s\n0,1,0.001,0.002\n")
    old = [{"devices": 2, "stage": 0, "variant": v, "s": 1.0, "lookahead": 0, "forward_overhead_s": 0.5,
            "backward_overhead_s": 0.5, "step_s": 0.5} for v in ttt.STAGE_VARIANTS]
    ttt._write_csv(str(stage), old)
    with pytest.raises(SystemExit, match="stash-muon"):
        ttt.load_or_measure_costs(wl, str(tmp_path), measure=False)
    asked = []

    def fake_measure(w, variants):
        asked.append(variants)
        return [{**old[0], "variant": v, "step_s": 9.0} for v in variants]
    monkeypatch.setattr(ttt, "measure_stage_overheads", fake_measure)
    costs = ttt.load_or_measure_costs(wl, str(tmp_path))
    assert asked == [("stash-muon",)]
    assert costs.stage[(2, 0, "stash-muon")][2] == 9.0 and costs.stage[(2, 0, "stash")][2] == 0.5
    ttt.load_or_measure_costs(wl, str(tmp_path))
    assert asked == [("stash-muon",)]   # measured once, kept in the CSV


def test_muon_stage_work_is_measured_with_muon(one_thread, monkeypatch):
    """A Muon variant steps with Muon + AdamW and the policy options of its run (prediction from the last update)."""
    from pipeoptim import policies
    seen = []
    real = policies.make_policy

    def spy(name, module, opt, **options):
        seen.append((name, type(opt).__name__, options))
        return real(name, module, opt, **options)
    monkeypatch.setattr(policies, "make_policy", spy)
    wl = dataclasses.replace(QUICK, depths=(2,), overhead_iters=2)
    rows = ttt.measure_stage_overheads(wl, ("pipeoptim-muon", "stash"))
    assert {(r["variant"], r["stage"]) for r in rows} == {(v, k) for v in ("pipeoptim-muon", "stash") for k in (0, 1)}
    muon = [x for x in seen if x[2].get("delta") == "last_update"]
    assert muon and all(x[0] == "pipeoptim" for x in muon)
    assert all(x[1] != "SGD" for x in muon) and all(x[1] == "SGD" for x in seen if x not in muon)
    assert all(r["step_s"] > 0 for r in rows)
