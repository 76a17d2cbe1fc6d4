"""The Pipeline API: configuration errors before anything runs, eval, mixed precision, clipping, activation
checkpointing, checkpoints (resume equals uninterrupted; load into another balance)."""
from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.runtime.checkpoint_files import CheckpointWarning
from pipeoptim.runtime.plan import ConfigError, PipelineError
from pipeoptim.train import Pipeline


def _pipe(**kw):
    opts = dict(loss_fn=lm_loss, optimizer=rc.adamw, devices=4, schedule="async-1f1b", policy="pipeoptim",
                microbatches=4, emulate=True)
    opts.update(kw)
    return Pipeline(gpt_layers(rc.CFG, seed=1), **opts)


@pytest.mark.parametrize("kw,words", [
    (dict(schedule="zigzag"), "unknown schedule"),
    (dict(policy="magic"), "unknown weight policy"),
    (dict(schedule="1f1b", policy="pipeoptim"), "synchronous"),
    (dict(schedule="bitpipe", devices=3, policy=None), "even number"),
    (dict(schedule="bitpipe", devices=4, microbatches=6, policy=None), "multiple"),
    (dict(devices=16), "layers"),
    (dict(balance=[1, 1, 1]), "entries"),
    (dict(checkpoint_stages=[4]), "checkpoint_stages: the pipeline has no stage 4"),
    (dict(checkpoint_stages={0: [2]}), "checkpoint_stages: stage 0 has no layer 2: it has 2"),
])
def test_invalid_configurations_fail_with_the_rule(kw, words):
    with pytest.raises(ConfigError, match=words):
        _pipe(**kw)


def test_eval_then_train_and_eval_uses_real_weights():
    p = _pipe()
    before = {k: v.clone() for k, v in p.named_parameters().items()}
    e1 = p.eval_step(rc.batch(0))
    assert all(torch.equal(before[k], v) for k, v in p.named_parameters().items())
    assert p.eval_step(rc.batch(0)) == e1
    p.train_step(rc.batch(0))
    assert p.eval_step(rc.batch(0)) != e1


def test_microbatches_fewer_than_stages_trains_as_the_unsplit_model(one_thread):
    """2 micro-batches on 4 stages (some stages idle in every slot): the same losses, gradient norms and weights
    as the unsplit model trained on the same 2 micro-batches per step."""
    p = _pipe(schedule="1f1b", policy=None, microbatches=2, optimizer=rc.sgd)
    got = rc.train(p)
    ref, norms = rc.single_process_reference(gpt_layers(rc.CFG, seed=1), 2)
    assert set(got["params"]) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    model = torch.nn.Sequential(*gpt_layers(rc.CFG, seed=1))
    x, y = rc.batch(0)
    with torch.no_grad():
        first = sum(float(lm_loss(model(xm), ym)) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
    assert got["losses"][0] == pytest.approx(first, rel=1e-5)


def test_bf16_trains_with_fp32_masters():
    p = _pipe(schedule="1f1b", policy=None, precision="bf16")
    losses = [p.train_step(rc.batch(0)) for _ in range(5)]
    assert losses[-1] < losses[0]
    st = next(iter(p.workers[0].stages.values()))
    assert next(st.module.parameters()).dtype == torch.bfloat16
    assert all(g.w.dtype == torch.float32 for g in st.policy.binding.groups)


def test_global_clipping_limits_the_pipeline_norm():
    p = _pipe(schedule="1f1b", policy=None, optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), clip_norm=1e-3)
    before = {k: v.detach().clone() for k, v in p.named_parameters().items()}
    p.train_step(rc.batch(0))
    delta = torch.sqrt(sum((v.detach() - before[k]).double().pow(2).sum() for k, v in p.named_parameters().items()))
    assert p.last_stats["grad_norm"] > 1e-2
    assert float(delta) == pytest.approx(1e-3, rel=1e-3)  # lr 1 x clipped norm


def test_activation_checkpointing_gives_the_same_gradients():
    """Synchronous: bit for bit. Every policy recomputes too (refused before issue 24): tests/test_recompute.py."""
    a = _pipe(schedule="1f1b", policy=None)
    b = _pipe(schedule="1f1b", policy=None, checkpoint_stages=True)
    for i in range(2):
        assert a.train_step(rc.batch(i)) == b.train_step(rc.batch(i))
    for k, v in a.named_parameters().items():
        torch.testing.assert_close(b.named_parameters()[k], v)


def test_stage_modules_and_time_balance():
    layers = gpt_layers(rc.CFG, seed=1)
    p = Pipeline(layers, loss_fn=lm_loss, optimizer=rc.adamw, devices=2, schedule="1f1b", microbatches=2,
                 balance="time", sample=rc.batch(0)[0], emulate=True)
    assert sum(p.balance) == len(layers) and len(p.balance) == 2
    layers = gpt_layers(rc.CFG, seed=1)  # p trains its layers in place: q gets its own
    q = Pipeline(stages=[torch.nn.Sequential(*layers[:3]), torch.nn.Sequential(*layers[3:])], loss_fn=lm_loss,
                 optimizer=rc.adamw, devices=2, schedule="1f1b", microbatches=2, emulate=True)
    assert q.train_step(rc.batch(0)) == pytest.approx(p.train_step(rc.batch(0)), rel=1e-6)


def test_resume_equals_uninterrupted(tmp_path):
    straight = _pipe()
    for i in range(4):
        straight.train_step(rc.batch(i))
    first = _pipe()
    for i in range(2):
        first.train_step(rc.batch(i))
    first.save(str(tmp_path / "ck"))
    resumed = _pipe()
    resumed.load(str(tmp_path / "ck"))
    assert resumed.step_count == 2
    for i in range(2, 4):
        resumed.train_step(rc.batch(i))
    for k, v in straight.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[k], v), k


def test_checkpoint_loads_into_another_balance(tmp_path):
    a = _pipe(schedule="1f1b", policy=None)
    a.train_step(rc.batch(0))
    a.save(str(tmp_path / "ck"))
    b = _pipe(schedule="1f1b", policy=None, devices=2, balance=[5, 3])
    b.load(str(tmp_path / "ck"))
    for k, v in a.named_parameters().items():
        assert torch.equal(b.named_parameters()[k], v), k
    # and the optimizer state came along: the next step is the same
    assert a.train_step(rc.batch(1)) == pytest.approx(b.train_step(rc.batch(1)), rel=1e-6)
    for k, v in a.named_parameters().items():
        torch.testing.assert_close(b.named_parameters()[k], v, rtol=1e-5, atol=1e-6)


def test_stage_error_names_device_stage_and_action():
    p = _pipe(schedule="1f1b", policy=None)
    with pytest.raises(PipelineError, match=r"device 0, stage 0, action F0s0"):
        p.train_step((torch.full((8, rc.CFG.seq_len), 999), rc.batch(0)[1]))  # token id out of range


def test_batch_not_divisible_by_microbatches():
    with pytest.raises(ValueError, match="divisible"):
        _pipe().train_step((torch.zeros(6, 8, dtype=torch.long), torch.zeros(6, 8, dtype=torch.long)))


# ---- policy state in checkpoints -------------------------------------------------------------------------
def _sgd_plain(params):
    return torch.optim.SGD(params, lr=0.5)  # no smoothed gradient: SpecTrain keeps its own average


def _sgd_nesterov(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, nesterov=True)  # the prediction reads the last gradient


def _resume_run(tmp_path, policy, optimizer, strip_policy_state=False):
    kw = dict(policy=policy, optimizer=optimizer)
    straight = _pipe(**kw)
    for i in range(4):
        straight.train_step(rc.batch(i))
    first = _pipe(**kw)
    for i in range(2):
        first.train_step(rc.batch(i))
    ck = tmp_path / f"ck-{policy}"
    first.save(str(ck))
    if strip_policy_state:  # what a checkpoint written before policy state (and manifests) looks like
        for f in (ck / "step-00000002").iterdir():
            if f.name != "manifest.json":
                f.rename(ck / f.name)
        (ck / "step-00000002" / "manifest.json").unlink()
        (ck / "step-00000002").rmdir()
        for part in ck.glob("part-*.pt"):
            d = torch.load(part, weights_only=True)  # a checkpoint holds data only
            del d["policy_state"]
            torch.save(d, part)
    resumed = _pipe(**kw)
    if strip_policy_state:
        with pytest.warns(CheckpointWarning, match="no manifest"):
            resumed.load(str(ck))
    else:
        resumed.load(str(ck))
    for i in range(2, 4):
        resumed.train_step(rc.batch(i))
    return straight.named_parameters(), resumed.named_parameters()


@pytest.mark.parametrize("policy,optimizer", [("spectrain", _sgd_plain), ("pipeoptim", _sgd_nesterov)])
def test_resume_with_policy_state_equals_uninterrupted(tmp_path, policy, optimizer):
    """SpecTrain's own gradient average and the last gradient that SGD-Nesterov's prediction reads live in the
    policy, not the optimizer: they used to be lost on resume, so the first predictions after it differed."""
    straight, resumed = _resume_run(tmp_path, policy, optimizer)
    for k, v in straight.items():
        assert torch.equal(resumed[k], v), k


@pytest.mark.parametrize("policy,optimizer", [("spectrain", _sgd_plain), ("pipeoptim", _sgd_nesterov)])
def test_checkpoint_without_policy_state_loads_but_resumes_differently(tmp_path, policy, optimizer):
    # old checkpoints stay loadable; and the state matters (so the test above can fail)
    straight, resumed = _resume_run(tmp_path, policy, optimizer, strip_policy_state=True)
    assert not all(torch.equal(resumed[k], v) for k, v in straight.items())


def test_policy_state_is_keyed_by_global_names_and_loads_into_another_balance(tmp_path):
    a = _pipe(policy="spectrain", optimizer=_sgd_plain)
    for i in range(2):
        a.train_step(rc.batch(i))
    a.save(str(tmp_path / "ck"))
    saved = a.state_dict()["policy_state"]
    assert "0.tok.weight" in saved and "7.lm.weight" in saved
    assert set(saved["3.fc.weight"]) == {"steps_taken", "smoothed_grad"}  # its direction reads no last gradient
    assert saved["3.fc.weight"]["smoothed_grad"].abs().sum() > 0
    b = _pipe(policy="spectrain", optimizer=_sgd_plain, devices=2, balance=[5, 3])
    b.load(str(tmp_path / "ck"))
    got = b.state_dict()["policy_state"]
    assert set(got) == set(saved)
    for name, entry in saved.items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert torch.equal(got[name][key], value), (name, key)
            else:
                assert got[name][key] == value, (name, key)
