"""pipeoptim.stages.copies: a parameter that starts as a copy of another stage's (tied embeddings, or their untied
copies under an asynchronous schedule), locally and, for meta-built stages, sent between processes."""
from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from pipeoptim.models import gpt_init_fn, gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.runtime import launch
from pipeoptim.runtime.plan import ConfigError
from pipeoptim.train import Pipeline

PAIR = ("0.tok.weight", "7.lm.weight")  # rc.CFG: embedding, 6 blocks, head


def _pipe(schedule="async-1f1b", **kw):
    opts = dict(loss_fn=lm_loss, optimizer=rc.sgd, devices=2, schedule=schedule, microbatches=2, emulate=True)
    opts.update(kw)
    return Pipeline(gpt_layers(rc.CFG, device="meta"), init_fn=gpt_init_fn(rc.CFG), **opts)


@pytest.mark.parametrize("copies,words", [
    ([("0.tok.weight", "7.lm.wieght")], "not in the model"),
    ([("0.tok.weight",)], "a pair"),
    ([("0.tok.weight", "0.pos.weight")], "a copy must have its source's shape"),
])
def test_bad_copies_fail_with_the_rule(copies, words):
    with pytest.raises(ConfigError, match=words):
        _pipe(copies=copies)


def test_tied_under_an_asynchronous_schedule_points_to_copies():
    with pytest.raises(ConfigError, match="synchronous schedule.*copies="):
        _pipe(tied=[PAIR])


def test_a_copy_starts_equal_and_then_trains_on_its_own():
    p = _pipe(copies=[PAIR], policy="pipeoptim")
    params = p.named_parameters()
    assert torch.equal(params[PAIR[0]], params[PAIR[1]])
    p.train_step(rc.batch(0))
    assert not torch.equal(params[PAIR[0]], params[PAIR[1]])


def _rank_job(cases):
    out = []
    for schedule, kw in cases:
        p = Pipeline(gpt_layers(rc.CFG, device="meta"), init_fn=gpt_init_fn(rc.CFG), loss_fn=lm_loss,
                     optimizer=rc.sgd, schedule=schedule, microbatches=2, **kw)
        out.append({k: v.detach().clone() for k, v in p.named_parameters().items()})
    return out


@pytest.mark.slow
def test_meta_built_copies_travel_between_processes(one_thread):
    cases = [("async-1f1b", {"copies": [PAIR], "policy": "pipeoptim"}), ("1f1b", {"tied": [PAIR]})]
    results = launch(_rank_job, 2, cases, timeout_s=90)
    for i, (schedule, kw) in enumerate(cases):
        got = {}
        for r in results:
            got.update(r[i])
        assert PAIR[0] in results[0][i] and PAIR[1] in results[1][i]  # on different ranks
        assert torch.equal(got[PAIR[0]], got[PAIR[1]])
        emulated = _pipe(schedule, **kw).named_parameters()
        for k, v in emulated.items():
            assert torch.equal(got[k], v), (schedule, k)
