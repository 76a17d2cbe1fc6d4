"""Smoke test of benchmarks/bench_convergence.py's logic (tiny runs, well under 20 s on one thread)."""
from __future__ import annotations

import csv
import importlib.util
import os

import pytest

pytest.importorskip("sklearn")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_convergence.py")
_spec = importlib.util.spec_from_file_location("bench_convergence", _PATH)
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

TINY = dict(task="digits", devices=2, optimizer="sgd", lr=0.01, steps=8, mbs=8, eval_every=4, target=0.5)


pytestmark = pytest.mark.usefixtures("restore_policy_registry")  # the ablations register policies


def test_method_config_matches_samples_per_update():
    kw, size = bc.method_config("2bw", 4, 32, 8)
    assert kw["schedule"] == "2bw" and size == 8  # 4 micro-batches of 8 = 32 samples per update
    kw, size = bc.method_config("sync", 4, 32, 8)
    assert kw["microbatches"] == 1 and size == 32
    with pytest.raises(ValueError, match="divisible"):
        bc.method_config("2bw", 4, 30, 8)
    with pytest.raises(ValueError, match="unknown method"):
        bc.method_config("pipedream-3", 4, 32, 8)


def _lent_s_per_stage(method, cfg, window, windows=2):
    """Train `windows` windows of `method`; returns ({stage: [s of every forward's prediction]}, pipeline)."""
    import torch
    torch.manual_seed(0)
    task = bc.Task(cfg["task"], 0)
    pipe, mb_size, kw = bc.build_pipeline(method, task, cfg, window)
    seen = {}
    for w in pipe.workers:
        for chunk, st in w.stages.items():
            log = seen.setdefault(chunk.stage, [])
            real = st.policy.predictor.lend
            st.policy.predictor.lend = lambda s, real=real, log=log: (log.append(s), real(s))[1]
    for _ in range(windows):
        pipe.train_step(task.batch(mb_size * kw["microbatches"]))
    return seen, pipe


def test_ablation_methods_predict_with_the_s_and_rule_they_name(one_thread):
    D, window = 4, 8
    cfg = {**TINY, "devices": D}
    for method in ("s-schedule", "s-paper", "s-code", "reference"):
        seen, pipe = _lent_s_per_stage(method, cfg, window)
        modes = {st.policy.predictor.mode for w in pipe.workers for st in w.stages.values()}
        assert modes == {"reference" if method == "reference" else "exact"}, method
        for k in range(D):
            if method == "s-schedule":     # PipeDream's async 1F1B: warm-up min(j, D-k-1), then D-k-1
                first = [min(j, D - k - 1) for j in range(window)]
                assert seen[k] == first * 2, (method, k, seen[k])
            else:                          # constant, warm-up included; the code's D-k also on the last stage
                assert seen[k] == [D - k - (1 if method == "s-paper" else 0)] * (2 * window), (method, k)


def test_schedule_rule_is_plain_pipeoptim_bit_for_bit(one_thread):
    rows = {}
    for m in ("pipeoptim-exact", "s-schedule"):
        row, curve = bc.run_one("tiny", m, 0, TINY, window=4)
        rows[m] = row
        assert curve[-1]["step"] == row["steps"] == 8 and len(curve) == 2
    assert rows["s-schedule"]["final_loss"] == rows["pipeoptim-exact"]["final_loss"]
    assert rows["pipeoptim-exact"]["extra_weight_frac_per_stage"].split()[0] == "1.00"


def test_runs_and_report(tmp_path, one_thread, capsys):
    for m, seeds in (("sync", (0, 1)), ("stash", (0, 1)), ("2bw", (0,))):
        for seed in seeds:
            row, curve = bc.run_one("digits4", m, seed, TINY, window=4)
            bc._append(str(tmp_path / "convergence_digits4.csv"), [row])
            bc._append(str(tmp_path / "convergence_digits4_curves.csv"), curve)
    bc.report(str(tmp_path))
    out = capsys.readouterr().out
    assert "| sync | 2 |" in out and "| 2bw | 1 |" in out
    with open(tmp_path / "convergence_summary.csv") as fh:
        summary = list(csv.DictReader(fh))
    assert {r["method"] for r in summary} == {"sync", "stash", "2bw"}
    stash = next(r for r in summary if r["method"] == "stash")
    assert stash["extra_weight_bytes_per_stage"].split()[1] == "0"  # last stage never stashes


def test_zero_bubble_methods_run_and_their_s_rules_differ(one_thread):
    """zb-pipeoptim predicts up to the W (the runtime's s), zb-pipeoptim-sI only up to the I; both predict, so
    both differ from zb-none, and from each other."""
    rows = {m: bc.run_one("tiny", m, 0, TINY, window=4)[0] for m in bc.ZB_METHODS}
    losses = {m: r["final_loss"] for m, r in rows.items()}
    assert len(set(losses.values())) == 3, losses
    assert rows["zb-pipeoptim"]["extra_weight_frac_per_stage"].split() == ["1.00", "1.00"]  # the last stage predicts too


def test_hf_gpt2_task_evaluates_like_the_unsplit_model_and_ties_its_embeddings(one_thread):
    """The hfgpt2 task's validation loss is Hugging Face's own loss of the same model; its tied embeddings stay one
    weight under a synchronous schedule and become two copies that start equal under an asynchronous one."""
    import torch
    pytest.importorskip("transformers")
    from pipeoptim.models.hf import byte_level_config
    cfg = dict(seq_len=8, d_model=16, n_heads=2, n_layers=2)
    task = bc.Task("hfgpt2", 3, cfg)
    config, cls = byte_level_config("gpt2", **cfg)
    torch.manual_seed(3)
    model = cls(config).eval()
    with torch.no_grad():
        want = sum(model(x, labels=y).loss.item() for x, y in task.val) / len(task.val)
    assert all(torch.equal(x, y) for x, y in task.val)                 # labels are the inputs: HF shifts them
    head, embedding = "3.lm_head.weight", "0.wte.weight"
    for method, tied in [("sync", True), ("pipeoptim-exact", False)]:
        pipe, mb, kw = bc.build_pipeline(method, bc.Task("hfgpt2", 3, cfg),
                                         dict(devices=2, mbs=4, optimizer="adamw", lr=1e-2), window=4)
        assert task.evaluate(pipe)["loss"] == pytest.approx(want, rel=1e-5)
        for _ in range(2):
            pipe.train_step(task.batch(mb * kw["microbatches"]))
        p = pipe.named_parameters()
        assert torch.equal(p[head], p[embedding]) is tied


def test_candidates_bring_their_schedule_policy_optimizer_and_delay_rules(one_thread):
    """Issue 20's candidates: each builds the pipeline it names (schedule, policy, optimizer kind and β1, delay
    rules and policy options), and the 2BW ones keep the samples per update of every other method."""
    import torch
    from pipeoptim.delay import DelayAwareHParams
    D, window = 2, 4
    expect = {  # the test's own statement of CANDIDATES
        "pipeoptim-2bw": ("2bw", "pipeoptim", torch.optim.SGD, 0.9, None),
        "pipeoptim-2bw-b99": ("2bw", "pipeoptim", torch.optim.SGD, 0.99, None),
        "nesterov": ("async-1f1b", "stash", torch.optim.NAdam, 0.99, ("pipemare", "nesterov")),
        "pipeoptim-nadam": ("async-1f1b", "pipeoptim", torch.optim.NAdam, 0.99, ("pipemare", "nesterov")),
        "stash-dc": ("async-1f1b", "stash", torch.optim.SGD, 0.9, None),
        "stash-dc10": ("async-1f1b", "stash", torch.optim.SGD, 0.9, None),
        "stash-dc100": ("async-1f1b", "stash", torch.optim.SGD, 0.9, None),
        "stash-dc1000": ("async-1f1b", "stash", torch.optim.SGD, 0.9, None),
        "stash-muon": ("async-1f1b", "stash", torch.optim.Muon, 0.95, None),
        "pipeoptim-muon": ("async-1f1b", "pipeoptim", torch.optim.Muon, 0.95, None),
        "sync-muon": ("1f1b", None, torch.optim.Muon, 0.95, None),
        "2bw-muon": ("2bw", "2bw", torch.optim.Muon, 0.95, None),
        "pipeoptim-2bw-muon": ("2bw", "pipeoptim", torch.optim.Muon, 0.95, None),
        "lookahead-2bw-muon": ("2bw", "pipeoptim", torch.optim.Muon, 0.95, None),
        "pipeoptim-muon-inflight2": ("async-1f1b", "pipeoptim", torch.optim.Muon, 0.95, None),
        "stash-2bw-muon-inflight4": ("2bw", "stash", torch.optim.Muon, 0.95, None),
    }
    dc = {"stash-dc": 1.0, "stash-dc10": 10.0, "stash-dc100": 100.0, "stash-dc1000": 1000.0}
    extrapolate = {"lookahead-2bw-muon": 2.0}
    in_flight = {"pipeoptim-muon-inflight2": 2, "stash-2bw-muon-inflight4": 4}
    assert set(expect) == set(bc.CANDIDATES)
    for method, (schedule, policy, opt_type, beta1, rules) in expect.items():
        kw, size = bc.method_config(method, D, 8, window)
        assert (kw["schedule"], kw["policy"]) == (schedule, policy), method
        assert size == (8 // D if schedule == "2bw" else 8), method
        per_call = 1 if policy is None else window // D if schedule == "2bw" else window   # sync: one per step
        assert bc.updates_per_call(kw, D) == per_call, method
        task = bc.Task("digits", 0)
        pipe, mb, kw = bc.build_pipeline(method, task, {**TINY, "devices": D}, window)
        pipe.train_step(task.batch(mb * kw["microbatches"]))
        assert pipe.schedule.params.get("in_flight", 1) == in_flight.get(method, 1), method
        for w in pipe.workers:
            for st in w.stages.values():
                if opt_type is torch.optim.Muon:   # Muon for the stage's 2-D weights, AdamW for the rest
                    kinds = {type(o): o for o in getattr(st.optimizer, "children", [st.optimizer])}
                    has_matrix = any(p.ndim == 2 for p in st.module.parameters())
                    assert (torch.optim.Muon in kinds) == has_matrix, method
                    assert torch.optim.AdamW in kinds, method       # biases (every stage has some)
                    if not has_matrix:
                        continue
                    group = kinds[torch.optim.Muon].param_groups[0]
                    assert group["adjust_lr_fn"] == "match_rms_adamw", method
                    if policy == "pipeoptim":
                        assert st.policy.delta == "last_update", method
                        assert st.policy.extrapolate == extrapolate.get(method, 1.0), method
                else:
                    assert type(st.optimizer) is opt_type, method
                    group = st.optimizer.param_groups[0]
                got = group["betas"][0] if "betas" in group else group["momentum"]
                assert got == pytest.approx(beta1), method
                assert type(st.policy).__name__ == {"pipeoptim": "PipeOptimPolicy", "stash": "StashPolicy",
                                                    "2bw": "TwoBWPolicy", None: "NoPolicy"}[policy], method
                assert isinstance(st.scheduler, DelayAwareHParams) == (rules is not None), method
                if rules:
                    assert (st.scheduler.rules.lr, st.scheduler.rules.momentum) == rules
                assert getattr(st.policy, "dc", 0.0) == dc.get(method, 0.0)
    with pytest.raises(ValueError, match="divisible by 4"):
        bc.method_config("pipeoptim-2bw", 4, 6, 8)


@pytest.mark.parametrize("shape", [(64, 64), (256, 64), (64, 256), (37, 91), (5, 3)])
def test_bf16_newton_schulz_in_fp32_matches_torchs_own(shape):
    """The fp32-computed orthogonalisation rounds where torch's bf16 one rounds: one iteration agrees with torch's
    to a bf16 ulp (summation order may differ between kernels), five stay within bf16's precision of it, with
    the same singular values."""
    import torch
    from torch.optim import _muon
    coefficients = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    for seed in range(3):
        grad = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        one = _muon._zeropower_via_newtonschulz(grad, coefficients, 1, 1e-7).float()
        ours = bc._bf16_newton_schulz_in_fp32(grad, coefficients, 1, 1e-7)
        assert ours.dtype == torch.bfloat16 and ours.shape == grad.shape
        ulp = one.abs().clamp(min=2.0 ** -126) * 2.0 ** -7      # one bf16 ulp (8 significant bits)
        assert bool(((ours.float() - one).abs() <= ulp).all())
        assert int((ours.float() != one).sum()) <= one.numel() // 100
        five = _muon._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7).float()
        ours5 = bc._bf16_newton_schulz_in_fp32(grad, coefficients, 5, 1e-7).float()
        assert float((ours5 - five).norm() / five.norm()) < 2e-2
        # the same orthogonalisation: singular values (float64) as torch's, its largest pulled into ~(0.5, 1.5)
        sv, sv_torch = torch.linalg.svdvals(ours5.double()), torch.linalg.svdvals(five.double())
        torch.testing.assert_close(sv, sv_torch, rtol=0, atol=2e-2)
        assert 0.5 < float(sv.max()) < 1.5


def test_newton_schulz_swaps_torchs_function_only_inside_the_block():
    import torch
    from torch.optim import _muon
    own = _muon._zeropower_via_newtonschulz
    with bc.newton_schulz("bf16-in-fp32"):
        assert _muon._zeropower_via_newtonschulz is bc._bf16_newton_schulz_in_fp32
        w = torch.nn.Parameter(torch.randn(8, 4))
        opt = torch.optim.Muon([w], lr=0.02)
        w.grad = torch.randn(8, 4)
        opt.step()                                   # Muon runs through it
        assert torch.isfinite(w).all()
    assert _muon._zeropower_via_newtonschulz is own
    with pytest.raises(RuntimeError, match="boom"), bc.newton_schulz("bf16-in-fp32"):
        raise RuntimeError("boom")
    assert _muon._zeropower_via_newtonschulz is own
    with bc.newton_schulz("torch"):
        assert _muon._zeropower_via_newtonschulz is own
    with pytest.raises(ValueError, match="torch, bf16-in-fp32"), bc.newton_schulz("fp64"):
        pass
