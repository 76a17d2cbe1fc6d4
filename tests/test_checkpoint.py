"""Pipeline checkpoints meeting faults: a rank SIGKILLed while the checkpoint is being written (for real, on
two processes), damaged files, and resuming into another schedule, stage count or optimizer."""
from __future__ import annotations

import os

import pytest
import torch

import fault_jobs as fj
import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.runtime import PipelineError, launch
from pipeoptim.runtime.checkpoint_files import CheckpointError, CheckpointWarning
from pipeoptim.train import Pipeline


def _emulated_small():
    return fj.small_pipeline(2, microbatches=2, emulate=True, devices=2)


@pytest.mark.parametrize("crash_rank,where", [(1, "part"), (0, "manifest")])
def test_a_rank_killed_while_checkpointing_leaves_the_previous_checkpoint_the_newest(tmp_path, crash_rank, where,
                                                                                     one_thread):
    root = str(tmp_path / "ck")
    with pytest.raises(PipelineError, match=f"rank {crash_rank} of 2 .* was killed by SIGKILL"):
        launch(fj.crash_in_checkpoint_job, 2, root, crash_rank, where, timeout_s=240)
    step3 = os.path.join(root, "step-00000003")
    assert os.path.isdir(step3) and not os.path.exists(os.path.join(step3, "manifest.json"))
    resumed = _emulated_small()
    with pytest.warns(CheckpointWarning, match="step-00000003 is incomplete"):
        resumed.load(root)
    assert resumed.loaded_from == os.path.join(root, "step-00000002") and resumed.step_count == 2
    clean = _emulated_small()
    for step in range(2):
        clean.train_step(fj.batch(step))
    for name, value in clean.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[name], value), name
    # the run goes on and writes step 3 again over the debris: a complete checkpoint, no stray files
    resumed.train_step(fj.batch(2))
    resumed.save(root, keep=1)
    assert sorted(os.listdir(root)) == ["step-00000003", "step-00000003.incomplete"]  # keep=1: step 2 went
    assert sorted(os.listdir(step3)) == ["manifest.json", "meta.pt", "part-0.pt"]


def _gpt(**kw):
    opts = dict(loss_fn=lm_loss, optimizer=rc.adamw, devices=4, schedule="async-1f1b", policy="pipeoptim",
                microbatches=4, emulate=True)
    opts.update(kw)
    return Pipeline(gpt_layers(rc.CFG, seed=1), **opts)


def _opt_state(pipe):
    out = {}
    for w in pipe.workers:
        for c, st in w.stages.items():
            if c.replica:
                continue
            names = {id(p): st.names[n] for n, p in st.module.named_parameters()}
            for p, s in st.optimizer.state.items():
                out.update({(names[id(p)], k): v for k, v in s.items()})
    return out


def test_resume_into_another_schedule_and_stage_count(tmp_path):
    a = _gpt()
    for i in range(2):
        a.train_step(rc.batch(i))
    a.save(str(tmp_path))
    b = _gpt(devices=2, schedule="bitpipe", policy=None)  # 2 devices, 4 stages, two replicas; synchronous
    b.load(str(tmp_path))
    for name, value in a.named_parameters().items():
        assert torch.equal(b.named_parameters()[name], value), name
    mine, theirs = _opt_state(a), _opt_state(b)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    b.train_step(rc.batch(2))  # and it trains on


def test_missing_ok_loads_nothing_where_nothing_was_committed_and_loads_a_checkpoint_where_one_was(tmp_path):
    a = _gpt()
    a.train_step(rc.batch(0))
    before = {k: v.clone() for k, v in a.named_parameters().items()}
    with pytest.raises(FileNotFoundError):
        a.load(str(tmp_path))
    assert a.load(str(tmp_path), missing_ok=True) is None and a.loaded_from is None  # a first start
    (tmp_path / "step-00000005").mkdir()  # what a run stopped while writing its first checkpoint left
    assert a.load(str(tmp_path), missing_ok=True) is None and a.step_count == 1
    assert all(torch.equal(v, before[k]) for k, v in a.named_parameters().items())
    a.save(str(tmp_path), extra={"epoch": 3})
    b = _gpt()
    with pytest.warns(CheckpointWarning, match="step-00000005 is incomplete"):  # (newer, never committed)
        assert b.load(str(tmp_path), missing_ok=True) == {"epoch": 3} and b.step_count == 1
    assert b.loaded_from == str(tmp_path / "step-00000001")
    assert all(torch.equal(b.named_parameters()[k], v) for k, v in before.items())


def test_resume_into_another_optimizer_fails_with_the_reason_unless_weights_only(tmp_path):
    a = _gpt()
    a.train_step(rc.batch(0))
    a.save(str(tmp_path))
    b = _gpt(optimizer=rc.sgd)
    with pytest.raises(CheckpointError, match="written with optimizer AdamW but this pipeline uses SGD"):
        b.load(str(tmp_path))
    b.load(str(tmp_path), weights_only=True)
    for name, value in a.named_parameters().items():
        assert torch.equal(b.named_parameters()[name], value), name
    assert b.step_count == 0 and not any(st.optimizer.state for w in b.workers for st in w.stages.values())


def test_a_muon_checkpoint_resumes_into_another_cut(tmp_path):
    # regression: Muon + AdamW is a ChainedOptimizer where a stage holds matrices and vectors, but Muon alone on a
    # stage of matrices only (the embeddings, on 4 devices); the load compared the optimizers' names and refused
    # a 2-stage checkpoint in 4 stages ("written with ChainedOptimizer(Muon, AdamW) but this pipeline uses
    # ChainedOptimizer(Muon, AdamW), Muon"), which the CLI's default (Muon) met on every resume with more stages
    from pipeoptim.optim import muon_at_adamw_scale
    muon = muon_at_adamw_scale(1e-2)
    from pipeoptim.models import GPTConfig

    def pipe(devices, optimizer=muon):  # 4 blocks: on 4 devices the embeddings are a stage of their own
        config = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=4)
        warmup = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / 10)  # noqa: E731
        return Pipeline(gpt_layers(config, seed=1), loss_fn=lm_loss, optimizer=optimizer, devices=devices,
                        schedule="async-1f1b", policy="pipeoptim", policy_options={"delta": "last_update"},
                        microbatches=4, emulate=True, lr_scheduler=warmup)
    a = pipe(2)
    a.train_step(rc.batch(0))
    a.save(str(tmp_path))
    b = pipe(4)
    kinds = {type(st.optimizer).__name__ for w in b.workers for st in w.stages.values()}
    assert kinds == {"ChainedOptimizer", "Muon"}, kinds  # the case itself: one stage of matrices only
    b.load(str(tmp_path))
    assert b.step_count == 1
    for name, value in a.named_parameters().items():
        assert torch.equal(b.named_parameters()[name], value), name
    saved, loaded = _opt_state(a), _opt_state(b)  # Muon's momentum and AdamW's moments, by parameter
    assert saved and saved.keys() == loaded.keys()
    assert all(torch.equal(torch.as_tensor(saved[k]), torch.as_tensor(loaded[k])) for k in saved)
    # every stage's scheduler goes on from a's step (4 updates per window), whatever its groups: the lr of
    # update 5 of the warm-up, and the schedule's next step after it
    for w in b.workers:
        for st in w.stages.values():
            assert st.scheduler.last_epoch == 4
            assert [g["lr"] for g in st.optimizer.param_groups] == pytest.approx([1e-2 * 5 / 10] *
                                                                                 len(st.optimizer.param_groups))
    assert torch.isfinite(torch.tensor(b.train_step(rc.batch(1))))
    assert all(st.scheduler.last_epoch == 8 for w in b.workers for st in w.stages.values())
    with pytest.raises(CheckpointError, match="written with optimizer ChainedOptimizer\\(Muon, AdamW\\) but this "
                                              "pipeline uses SGD"):
        pipe(4, rc.sgd).load(str(tmp_path))


def test_a_damaged_part_is_named_and_the_root_falls_back(tmp_path):
    a = _gpt()
    for i in range(2):
        a.train_step(rc.batch(i))
        a.save(str(tmp_path))
    part = tmp_path / "step-00000002" / "part-0.pt"
    part.write_bytes(part.read_bytes()[:-10])
    b = _gpt()
    with pytest.raises(CheckpointError, match=r"step-00000002/part-0\.pt is truncated"):
        b.load(str(tmp_path / "step-00000002"))  # that checkpoint, exactly: no fallback
    with pytest.warns(CheckpointWarning, match=r"step-00000002/part-0\.pt is truncated"):
        b.load(str(tmp_path))
    assert b.loaded_from == str(tmp_path / "step-00000001") and b.step_count == 1
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002.damaged"]
