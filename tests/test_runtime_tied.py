"""Tied parameters across stages (tied input/output embeddings): the pipeline matches a single-process model
that shares one Parameter, in weights and in the global gradient norm (the tied weight counted once)."""
from __future__ import annotations

import pytest
import torch

import runtime_cases as rc
from pipeoptim.models import gpt_layers
from pipeoptim.models.gpt import lm_loss
from pipeoptim.runtime import launch
from pipeoptim.runtime.plan import ConfigError
from pipeoptim.train import Pipeline

TIE = ("0.tok.weight", "7.lm.weight")  # rc.CFG: embedding, 6 blocks, head


def _shared_reference(N: int):
    layers = gpt_layers(rc.CFG, seed=1)
    layers[7].lm.weight = layers[0].tok.weight  # one Parameter, as a single-process model ties them
    return rc.single_process_reference(layers, N)


def _tied_pipeline(schedule: str, D: int, N: int, emulate: bool = True):
    return Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.sgd, devices=D, schedule=schedule,
                    microbatches=N, emulate=emulate, tied=[TIE])


def run_tied_cases(cases):
    """Rank side of the multi-process test."""
    return [rc.train(_tied_pipeline(s, D, N, emulate=False)) for s, D, N in cases]


def _check(got, N):
    ref, norms = _shared_reference(N)
    assert set(got["params"]) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("schedule,D,N", [("1f1b", 2, 2), ("1f1b", 4, 4), ("bitpipe", 2, 2)])
def test_tied_embeddings_match_a_shared_parameter(schedule, D, N):
    # bitpipe: each replica's first and last stage share a device, so the tie is summed locally
    _check(rc.train(_tied_pipeline(schedule, D, N)), N)


def test_untied_copies_would_drift_apart():
    # without tied= the two copies are separate weights: the test above would fail
    p = Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.sgd, devices=2, schedule="1f1b",
                 microbatches=2, emulate=True)
    got = rc.train(p)
    assert not torch.equal(got["params"][TIE[0]], got["params"][TIE[1]])


def test_tied_copies_start_from_the_first_name():
    p = _tied_pipeline("1f1b", 2, 2)
    params = p.named_parameters()
    assert torch.equal(params[TIE[0]], params[TIE[1]])
    assert torch.equal(params[TIE[0]], gpt_layers(rc.CFG, seed=1)[0].tok.weight)


def test_distributed_tied_embeddings_equal_the_emulator(one_thread):
    # one_thread: the ranks run one thread each; the emulator must add in the same order
    cases = [("1f1b", 2, 2), ("bitpipe", 2, 2)]
    results = launch(run_tied_cases, 2, cases, timeout_s=90)
    for i, (s, D, N) in enumerate(cases):
        params = {}
        for r in results:
            params.update(r[i]["params"])
        emu = rc.train(_tied_pipeline(s, D, N))
        for name, value in emu["params"].items():
            assert torch.equal(params[name], value), (s, name)
        assert results[0][i]["norms"] == pytest.approx(emu["norms"], rel=1e-12)


@pytest.mark.parametrize("tied,words", [
    ([("0.tok.weight", "7.lm.wieght")], "not in the model"),
    ([("0.tok.weight",)], "two or more"),
    ([("0.tok.weight", "0.pos.weight")], "different shapes"),
    ([TIE, ("7.lm.weight", "0.tok.weight")], "two ties"),
])
def test_bad_ties_fail_with_the_rule(tied, words):
    with pytest.raises(ConfigError, match=words):
        Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.sgd, devices=2, schedule="1f1b",
                 microbatches=2, emulate=True, tied=tied)


def test_tied_needs_a_synchronous_schedule():
    with pytest.raises(ConfigError, match="synchronous schedule"):
        Pipeline(gpt_layers(rc.CFG, seed=1), loss_fn=lm_loss, optimizer=rc.sgd, devices=2, schedule="async-1f1b",
                 microbatches=2, emulate=True, tied=[TIE])
