"""Activation recomputation under every weight policy (pipeoptim.stages.recompute, WeightPolicy.recompute_context).

What the recomputed forward reads, checked against references written here (float64 copies of the stage):
- stash / 2bw: the forward's version, so the gradients equal those without recomputation bit for bit, also in a
  pipeline (async-1f1b, 2bw, async-zb) after several steps;
- pipeoptim: the real weights at backward time (the gradient at the real weights, which the prediction aimed
  at), or with recompute_on="forward" the forward's kept prediction (the gradient at ŵ);
- spectrain: the backward's own prediction;
- the split backward (input part, an optimizer step, weight part) and layer-wise selection;
- bad checkpoint_stages name the stage or layer.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.stages.model_cut import StageModule
from pipeoptim.policies import make_policy
from pipeoptim.stages.recompute import ALL, parse_checkpoint_stages, run_stage
from pipeoptim.runtime.plan import ConfigError
from pipeoptim.runtime.split_backward import input_pass, weight_pass
from pipeoptim.train import Pipeline

S = 2        # optimizer steps between the forward and the backward of the micro-batch under test
LR = 0.05


def _stage(seed: int = 0) -> StageModule:
    torch.manual_seed(seed)
    return StageModule([nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 8)), nn.LayerNorm(8),
                        nn.Linear(8, 5)])


def _reference_grads(module: StageModule, weights: dict[str, torch.Tensor], x, dy):
    """float64 gradients of the stage's parameters at `weights`, written without the policies."""
    ref = copy.deepcopy(module).double()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(weights[n].double())
    xr = x.double().requires_grad_(True)
    out = ref(xr)
    dws = torch.autograd.grad(out, [xr] + list(ref.parameters()), dy.double())
    return dws[0], dict(zip([n for n, _ in ref.named_parameters()], dws[1:]))


def _weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _setup(policy: str, **options):
    m = _stage()
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
    pol = make_policy(policy, m, opt, **options)
    pol.recompute = True
    g = torch.Generator().manual_seed(1)
    for i in range(3):  # a few steps, so that predictions and momenta are non-trivial
        with pol.forward(("warm", i)):
            y = m(torch.randn(4, 6, generator=g))
        with pol.backward(("warm", i)):
            y.square().sum().backward()
        pol.step()
    return m, pol, g


def _forward(m, pol, mb, x, layers, s=S, lookahead=0.0):
    with pol.forward(mb, s=s, lookahead=lookahead):
        return run_stage(m, (x,), layers, lambda: pol.recompute_context(mb)) if layers else m(x)


def _steps_in_between(m, pol, g, n=S):
    """n optimizer steps on other micro-batches while the one under test is in flight."""
    for i in range(n):
        with pol.forward(("other", i)):
            y = m(torch.randn(4, 6, generator=g))
        with pol.backward(("other", i)):
            y.square().sum().backward()
        pol.step()


def _run(policy, layers, **options):
    """(grads, dx, the weights the forward read, the real weights at backward) of a micro-batch forwarded with
    s = S, with S steps before its backward."""
    m, pol, g = _setup(policy, **options)
    x = torch.randn(4, 6, generator=g).requires_grad_(True)
    dy = torch.randn(4, 5, generator=g)
    seen = {}
    hook = [m.register_forward_pre_hook(lambda mod, args: seen.update(_weights(mod)))]
    y = _forward(m, pol, "mb", x, layers)
    hook[0].remove()
    _steps_in_between(m, pol, g)
    real = _weights(m)
    with pol.backward("mb"):
        torch.autograd.backward(y, dy)
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    return grads, x.grad.clone(), seen, real, (m, x.detach(), dy)


@pytest.mark.parametrize("policy", ["stash", "2bw"])
@pytest.mark.parametrize("layers", [ALL, (0, 2)])
def test_stash_recomputes_on_the_forward_version_bit_for_bit(policy, layers):
    opts = dict(update_every=1) if policy == "2bw" else {}
    base, dx0, seen, real, _ = _run(policy, None, **opts)
    got, dx, _, _, (m, x, dy) = _run(policy, layers, **opts)
    assert any(not torch.equal(seen[n], real[n]) for n in seen)  # the version really went stale
    for n in base:
        assert torch.equal(got[n], base[n]), n
    assert torch.equal(dx, dx0)
    ref_dx, ref = _reference_grads(m, seen, x, dy)  # and that is the gradient at the forward's version
    assert max(_rel(got[n], ref[n]) for n in ref) < 1e-5
    assert _rel(dx, ref_dx) < 1e-5


@pytest.mark.parametrize("mechanism", ["swap", "pointer", "inplace"])
def test_pipeoptim_recomputes_on_the_real_weights_at_backward(mechanism):
    got, dx, seen, real, (m, x, dy) = _run("pipeoptim", ALL, mechanism=mechanism)
    assert any(not torch.equal(seen[n], real[n]) for n in seen)  # the forward read a prediction
    ref_dx, ref = _reference_grads(m, real, x, dy)
    assert max(_rel(got[n], ref[n]) for n in ref) < 1e-5
    assert _rel(dx, ref_dx) < 1e-5
    plain, _, _, _, _ = _run("pipeoptim", None, mechanism=mechanism)   # without recomputation: a mixed gradient
    assert max(_rel(plain[n], ref[n]) for n in ref) > 1e-3


def test_none_recomputes_on_the_real_weights_at_backward():
    got, dx, seen, real, (m, x, dy) = _run("none", ALL)
    assert any(not torch.equal(seen[n], real[n]) for n in seen)
    ref_dx, ref = _reference_grads(m, real, x, dy)
    assert max(_rel(got[n], ref[n]) for n in ref) < 1e-5 and _rel(dx, ref_dx) < 1e-5


def test_pipeoptim_recompute_on_forward_reads_the_kept_prediction():
    got, dx, seen, real, (m, x, dy) = _run("pipeoptim", ALL, recompute_on="forward")
    ref_dx, ref = _reference_grads(m, seen, x, dy)   # the gradient at ŵ
    assert max(_rel(got[n], ref[n]) for n in ref) < 1e-5
    m2, pol, g = _setup("pipeoptim", recompute_on="forward")
    y = _forward(m2, pol, "mb", torch.randn(4, 6, generator=g), ALL)
    assert pol.memory_report()["recompute_kept"] == sum(p.numel() * 4 for p in m2.parameters())
    with pol.backward("mb"):
        y.sum().backward()
    assert not pol._kept   # released with the backward (pooled for the next forward)


def test_spectrain_recomputes_on_its_backward_prediction():
    m, pol, g = _setup("spectrain")
    x = torch.randn(4, 6, generator=g).requires_grad_(True)
    dy = torch.randn(4, 5, generator=g)
    y = _forward(m, pol, "mb", x, ALL, s=S, lookahead=1.0)
    _steps_in_between(m, pol, g)
    opt_state = pol.optimizer.state
    predicted = {n: (p - 1.0 * LR * opt_state[p]["momentum_buffer"]).detach()  # ŵ = w − s·lr·v, s = 1
                 for n, p in m.named_parameters()}
    with pol.backward("mb", s=1.0):
        torch.autograd.backward(y, dy)
    _, ref = _reference_grads(m, predicted, x.detach(), dy)
    assert max(_rel(p.grad, ref[n]) for n, p in m.named_parameters()) < 1e-5


@pytest.mark.parametrize("policy", ["stash", "pipeoptim"])
def test_split_backward_with_a_step_between_its_parts(policy):
    """I, then an optimizer step (another micro-batch), then W: stash reads the forward's version in both parts
    (equal to its unsplit backward without recomputation); pipeoptim reads the real weights of each part's time."""
    results = {}
    for layers in (None, ALL):
        m, pol, g = _setup(policy)
        x = torch.randn(4, 6, generator=g).requires_grad_(True)
        dy = torch.randn(4, 5, generator=g)
        seen = _weights(m)
        y = _forward(m, pol, "mb", x, layers, s=1)
        params = [p for p in m.parameters()]
        with pol.backward("mb", part="input"):
            (dx,), work = input_pass([y], [dy], (x,), params)
        at_input = _weights(m)
        _steps_in_between(m, pol, g, n=1)
        with pol.backward("mb", part="weight"):
            weight_pass(work)
        results[layers] = ({n: p.grad.clone() for n, p in m.named_parameters()}, dx, seen, at_input, m, x, dy)
    grads, dx, seen, at_input, m, x, dy = results[ALL]
    if policy == "stash":
        plain, plain_dx = results[None][:2]
        assert torch.equal(dx, plain_dx)
        assert all(torch.equal(grads[n], plain[n]) for n in plain)
        ref_dx, ref = _reference_grads(m, seen, x.detach(), dy)
        assert max(_rel(grads[n], ref[n]) for n in ref) < 1e-5
    else:
        ref_dx, _ = _reference_grads(m, at_input, x.detach(), dy)   # the input part: the real weights then
        assert _rel(dx, ref_dx) < 1e-5
        assert all(torch.isfinite(v).all() for v in grads.values())


def test_weight_pass_recomputes_once_whatever_its_groups():
    m, pol, g = _setup("none")
    calls = []
    real_ctx = pol.recompute_context

    def counting(mb):
        calls.append(mb)
        return real_ctx(mb)
    pol.recompute_context = counting
    x = torch.randn(4, 6, generator=g).requires_grad_(True)
    y = _forward(m, pol, "mb", x, ALL)
    with pol.backward("mb", part="input"):
        _, work = input_pass([y], [torch.ones_like(y)], (x,), list(m.parameters()))
    assert len(work.groups) >= 3 and len(calls) == 1
    with pol.backward("mb", part="weight"):
        weight_pass(work)
    assert len(calls) == 2    # one recomputation per part, not one per parameter group


def test_layer_selection_keeps_only_the_chosen_layers_inputs():
    m, pol, g = _setup("none")
    pol.measure_activations = True
    x = torch.randn(64, 6, generator=g)
    peaks = {}
    for layers in (None, ALL, (0,), (0, 2)):
        pol.peak_activation_bytes = 0
        y = _forward(m, pol, layers, x, layers)
        with pol.backward(layers):
            y.sum().backward()
        peaks[layers] = pol.peak_activation_bytes
    row = 64 * 4
    assert peaks[ALL] == 6 * row                        # the stage's input only
    assert peaks[(0,)] == peaks[None] - 32 * row        # layer 0's hidden activation (tanh's output) not kept
    assert peaks[(0, 2)] == peaks[(0,)]                 # layer 2 keeps its input, which layer norm keeps anyway


def test_parse_checkpoint_stages():
    assert parse_checkpoint_stages(True, [2, 3]) == {0: ALL, 1: ALL}
    assert parse_checkpoint_stages([1], [2, 3]) == {1: ALL}
    assert parse_checkpoint_stages({0: "all", 1: [2, 0]}, [2, 3]) == {0: ALL, 1: (0, 2)}
    assert parse_checkpoint_stages((), [2]) == {} and parse_checkpoint_stages(False, [2]) == {}


@pytest.mark.parametrize("value,words", [
    ([4], "the pipeline has no stage 4: it has 4 (stages 0 to 3)"),
    ({1: [5]}, "stage 1 has no layer 5: it has 2 (layers 0 to 1)"),
    ({0: "some"}, "stage 0: 'some' is neither 'all' nor a list of layer indices"),
    ("0", "'0' has no known form; checkpoint_stages is True"),
    ([True], "not an integer index"),
])
def test_bad_checkpoint_stages_name_the_problem(value, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.adamw, devices=4, schedule="async-1f1b",
                 policy="stash", microbatches=4, emulate=True, checkpoint_stages=value)


def _pipe(**kw):
    opts = dict(loss_fn=lm_loss, optimizer=rc.adamw, devices=4, schedule="async-1f1b", microbatches=4, emulate=True)
    opts.update(kw)
    return Pipeline(gpt_layers(rc.CFG, seed=1), **opts)


@pytest.mark.parametrize("schedule,policy,n,precision", [
    ("async-1f1b", "stash", 4, "fp32"), ("2bw", "2bw", 8, "fp32"), ("async-zb", "stash", 4, "fp32"),
    ("async-zb", "stash", 4, "bf16")])
def test_stash_pipelines_train_the_same_with_and_without_recomputation(schedule, policy, n, precision, one_thread):
    a = _pipe(schedule=schedule, policy=policy, microbatches=n, precision=precision, measure_activations=True)
    b = _pipe(schedule=schedule, policy=policy, microbatches=n, precision=precision,
              checkpoint_stages={0: ALL, 1: [0], 2: [1]}, measure_activations=True)
    assert [a.train_step(rc.batch(i)) for i in range(3)] == [b.train_step(rc.batch(i)) for i in range(3)]
    pa, pb = a.named_parameters(), b.named_parameters()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    first = lambda p: p.workers[0].stages[next(iter(p.workers[0].stages))].policy.peak_activation_bytes  # noqa: E731
    assert first(b) < first(a) / 10


@pytest.mark.parametrize("policy", ["none", "pipeoptim", "spectrain"])
def test_every_policy_trains_with_recomputation_under_the_split_backward(policy, one_thread):
    p = _pipe(schedule="async-zb", policy=policy, checkpoint_stages=True)
    losses = [p.train_step(rc.batch(0)) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_cli_checkpoint_stages_spec(capsys):
    from pipeoptim.cli import build_parser
    parse = lambda *a: build_parser().parse_args(["train", *a]).checkpoint_stages  # noqa: E731
    assert parse() is None
    assert parse("--checkpoint-stages", "all") is True
    assert parse("--checkpoint-stages", "0,1:0-2,1:5") == {0: "all", 1: [0, 1, 2, 5]}
    assert parse("--checkpoint-stages", "2") == {2: "all"}
    with pytest.raises(SystemExit):
        parse("--checkpoint-stages", "1:x")
    assert "give 'all', stage indices '0,1', or layers within a stage" in capsys.readouterr().err


def test_cli_refuses_a_stage_or_layer_that_does_not_exist_before_torch_is_loaded(tmp_path):
    import subprocess
    import sys

    import fault_harness as fh
    probe = ("import sys; from pipeoptim.cli import main; "
             f"print([main(['train', '--checkpoint-stages', spec, '--run-dir', {str(tmp_path / 'r')!r}]) "
             "for spec in ('0,9', '1:1', '3:2')], 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=fh.env())
    assert proc.stdout.strip() == "[2, 2, 2] False", proc.stderr
    where = "(--model small, --stages 4, --schedule async-1f1b)"      # 6 layers cut 1, 1, 2, 2
    assert f"--checkpoint-stages: the pipeline has no stage 9: it has 4 (stages 0 to 3) {where}" in proc.stderr
    assert f"--checkpoint-stages: stage 1 has no layer 1: it has 1 (layers 0 to 0) {where}" in proc.stderr
    assert f"--checkpoint-stages: stage 3 has no layer 2: it has 2 (layers 0 to 1) {where}" in proc.stderr


@pytest.mark.slow
def test_distributed_executor_equals_emulator_with_recomputation(one_thread):
    """2 processes over gloo give the emulator's weights bit for bit with recomputation: async-zb + stash (whole
    stages, split backward) and async-1f1b + pipeoptim (chosen layers of stage 0)."""
    from pipeoptim.runtime.launcher import launch
    cases = [("async-zb", "stash", 2, 4, 1, {"checkpoint_stages": True}),
             ("async-1f1b", "pipeoptim", 2, 4, 1, {"checkpoint_stages": {0: [0, 1], 1: "all"}})]
    results = launch(rc.run_cases, 2, cases, timeout_s=200)
    for i, case in enumerate(cases):
        params = {}
        for r in results:
            params.update(r[i]["params"])
        emu = rc.train(rc.make_pipeline(case, emulate=True))
        assert set(params) == set(emu["params"]), case
        for name, value in emu["params"].items():
            assert torch.equal(params[name], value), (case, name)
        assert results[0][i]["losses"] == pytest.approx(emu["losses"], rel=1e-6), case
