"""Hugging Face causal LMs through the pipeline (pipeoptim.models.hf): the cut pipeline computes the unsplit
model's loss and gradients (emulated and on 4 processes, synchronous schedule, tied embeddings, padding
masks); meta-built stages are deterministic; async-1f1b + pipeoptim trains one on the stdlib text."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import model_cases as mc  # noqa: E402
from pipeoptim.stages.materialize import initialize  # noqa: E402
from pipeoptim.models.hf import causal_lm_layers  # noqa: E402
from pipeoptim.runtime import launch  # noqa: E402
from pipeoptim.train import Pipeline  # noqa: E402

T, V, N = 12, 256, 4


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=T, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama_config():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=V, max_position_embeddings=T, bos_token_id=0,
                                    eos_token_id=0, pad_token_id=None)


MODELS = {"gpt2": (transformers.GPT2LMHeadModel, gpt2_config),
          "llama": (transformers.LlamaForCausalLM, llama_config)}


def build(kind: str, meta: bool = False, seed: int = 0):
    cls, cfg = MODELS[kind]
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls(cfg())
    return cls(cfg())


def batch(step: int = 0, masked: bool = False):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randint(0, V, (8, T), generator=g)
    if not masked:
        return (x,), x
    mask = torch.ones_like(x)
    for i in range(0, 8, 2):  # left padding of varying length on every other sequence
        mask[i, :1 + i // 2] = 0
    return (x, mask), x.masked_fill(mask == 0, -100)


def model_loss(model, mb):
    inputs, labels = mb
    kw = {"attention_mask": inputs[1]} if len(inputs) == 2 else {}
    return model(input_ids=inputs[0], labels=labels, **kw).loss


def micro_batches(inputs, labels):
    parts = [x.chunk(N) for x in inputs]
    return [(tuple(p[i] for p in parts), labels.chunk(N)[i]) for i in range(N)]


def global_to_model_names(model, cut, pipe) -> dict[str, str]:
    """Pipeline global name -> the unsplit model's name for the same weight (the untied head -> lm_head)."""
    by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for name, p in pipe.named_parameters().items():
        out[name] = by_id.get(id(p), "lm_head.weight" if cut.tied and name == cut.tied[0][1] else None)
    assert None not in out.values(), out
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "padded"])
def test_four_stages_give_the_unsplit_models_loss_and_gradients(kind, masked):
    model = build(kind)
    reference = copy.deepcopy(model)
    cut = causal_lm_layers(model)
    assert len(cut.layers) == 4
    rec = mc.GradRecorder()
    pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, optimizer=rec, devices=4, schedule="1f1b", microbatches=N,
                    emulate=True, tied=cut.tied)
    inputs, labels = batch(0, masked)
    loss = pipe.train_step((inputs, labels))
    want_loss, want = mc.reference_grads(reference, model_loss, micro_batches(inputs, labels))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    names = global_to_model_names(model, cut, pipe)
    mc.assert_grads_match(rec.by_name(pipe), want, names)
    if kind == "gpt2":  # tied: both copies got the shared weight's whole gradient
        assert cut.tied == [("0.wte.weight", "3.lm_head.weight")]
        torch.testing.assert_close(rec.by_name(pipe)["3.lm_head.weight"], want["transformer.wte.weight"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_meta_built_stages_are_the_same_whatever_the_balance(kind):
    def params(devices, balance=None):
        cut = causal_lm_layers(build(kind, meta=True))
        pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, optimizer=mc.GradRecorder(), devices=devices,
                        balance=balance, schedule="1f1b", microbatches=4, emulate=True, tied=cut.tied,
                        init_fn=cut.init_fn, seed=7)
        return {k: v.detach().clone() for k, v in pipe.named_parameters().items()}

    four, two, uneven = params(4), params(2), params(2, [3, 1])
    assert four.keys() == two.keys() == uneven.keys()
    for k in four:
        assert torch.equal(four[k], two[k]) and torch.equal(four[k], uneven[k]), k
    # and equal to the model built normally, then initialised layer by layer with the same seed
    model = build(kind, seed=123)
    cut = causal_lm_layers(model)
    for i, layer in enumerate(cut.layers):
        initialize(layer, str(i), 7, cut.init_fn)
    normal = {f"{i}.{n}": p for i, layer in enumerate(cut.layers) for n, p in layer.named_parameters()}
    for k, v in four.items():
        if cut.tied and k == cut.tied[0][1]:
            assert torch.equal(v, four[cut.tied[0][0]])  # the head copy starts from the embedding
        else:
            assert torch.equal(v, normal[k]), k
    stds = {k: float(v.float().std()) for k, v in four.items() if v.dim() == 2}
    assert all(0.005 < s < 0.05 for s in stds.values()), stds  # the model's own init, not garbage from to_empty


def test_unsupported_layout_is_a_clear_error():
    with pytest.raises(TypeError, match="Linear is not a Hugging Face model .* write its layers as a list"):
        causal_lm_layers(torch.nn.Linear(2, 2))


def test_balance_by_time_on_hf_layers():
    cut = causal_lm_layers(build("llama", meta=True))
    pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, optimizer=mc.GradRecorder(), devices=2, schedule="1f1b",
                    microbatches=2, emulate=True, init_fn=cut.init_fn, balance="time", sample=batch(0)[0][0][:2])
    assert len(pipe.balance) == 2 and sum(pipe.balance) == 4
    assert pipe.train_step(batch(0)) > 0


def test_async_pipeoptim_trains_gpt2_on_the_stdlib_text(one_thread):
    from pipeoptim.data import stdlib_corpus
    cut = causal_lm_layers(build("gpt2", meta=True))
    pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, init_fn=cut.init_fn, copies=cut.tied, devices=4,
                    schedule="async-1f1b", policy="pipeoptim", microbatches=4, emulate=True,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    params = pipe.named_parameters()
    assert torch.equal(params["0.wte.weight"], params["3.lm_head.weight"])  # the untied copy starts equal
    corpus = stdlib_corpus(max_bytes=1 << 20)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(20):
        x, _ = corpus.batch("train", 8, T, gen)
        losses.append(pipe.train_step(((x,), x)))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert not torch.equal(params["0.wte.weight"], params["3.lm_head.weight"])  # then trains as its own weight


# ---- 4 real processes ---------------------------------------------------------------------------------------
def _rank_job(kinds, seed: int):
    out = {}
    for kind in kinds:
        rec = mc.GradRecorder()
        cut = causal_lm_layers(build(kind, meta=True))
        pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, optimizer=rec, schedule="1f1b", microbatches=N,
                        tied=cut.tied, init_fn=cut.init_fn, seed=seed)
        start = {k: v.detach().clone() for k, v in pipe.named_parameters().items()}
        loss = pipe.train_step(batch(0))
        out[kind] = {"loss": loss, "start": start, "grads": rec.by_name(pipe)}
    return out


@pytest.mark.slow
def test_four_processes_give_the_unsplit_models_loss_and_gradients():
    kinds, seed = ("gpt2", "llama"), 5
    results = launch(_rank_job, 4, kinds, seed, timeout_s=180)
    for kind in kinds:
        model = build(kind)
        cut = causal_lm_layers(model)
        for i, layer in enumerate(cut.layers):
            initialize(layer, str(i), seed, cut.init_fn)
        by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        names = {f"{i}.{n}": by_id.get(id(p), "lm_head.weight")  # the untied head copy <- the tied lm_head
                 for i, layer in enumerate(cut.layers) for n, p in layer.named_parameters()}
        start, grads = {}, {}
        for r in results:
            start.update(r[kind]["start"])
            grads.update(r[kind]["grads"])
        model_params = dict(model.named_parameters(remove_duplicate=False))
        for g, m in names.items():  # each rank built only its own stage, to the same bits as one process
            assert torch.equal(start[g], model_params[m].detach()), (kind, g)
        inputs, labels = batch(0)
        want_loss, want = mc.reference_grads(model, model_loss, micro_batches(inputs, labels))
        assert all(r[kind]["loss"] == pytest.approx(want_loss, rel=1e-5) for r in results), kind
        mc.assert_grads_match(grads, want, names)


def test_byte_level_configs_build_dropout_free_models_of_the_asked_size():
    from pipeoptim.models.hf import byte_level_config
    config, cls = byte_level_config("gpt2", d_model=16, n_heads=2, n_layers=3, seq_len=8)
    assert (cls, config.n_layer, config.n_embd, config.n_positions, config.vocab_size) == \
        (transformers.GPT2LMHeadModel, 3, 16, 8, 256)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.0
    config, cls = byte_level_config("llama", d_model=16, n_heads=2, n_layers=3, seq_len=8)
    assert (cls, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == \
        (transformers.LlamaForCausalLM, 3, 16, 64)
    with pytest.raises(ValueError, match="choose 'gpt2' or 'llama'"):
        byte_level_config("bert", d_model=16, n_heads=2, n_layers=3, seq_len=8)


def test_layers_written_by_hand_need_only_public_helpers():
    # issue 45: cutting GPT-NeoX by hand needed the private _HFInit; the hand-written layers, initialised by the
    # public HFInit, are the automatic cut's to the bit (same seed per layer, same init order)
    from pipeoptim.models.hf import HFInit, causal_lm_loss
    config = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=V,
                                        num_attention_heads=4, max_position_embeddings=T)

    class Embed(torch.nn.Module):
        def __init__(self, embed_in):
            super().__init__()
            self.embed_in = embed_in

        def forward(self, ids):
            return self.embed_in(ids)

    class Layer(torch.nn.Module):
        def __init__(self, block, rotary):
            super().__init__()
            self.block, self.rotary = block, copy.deepcopy(rotary)  # each layer its own rotary (buffers)

        def forward(self, hidden):
            positions = torch.arange(hidden.shape[1]).unsqueeze(0)
            return self.block(hidden, attention_mask=None, position_ids=positions,
                              position_embeddings=self.rotary(hidden, position_ids=positions))

    class Head(torch.nn.Module):
        def __init__(self, norm, out):
            super().__init__()
            self.final_layer_norm, self.lm_head = norm, out

        def forward(self, hidden):
            return self.lm_head(self.final_layer_norm(hidden))

    def pipeline(layers, init_fn, loss_fn):
        return Pipeline(layers, loss_fn=loss_fn, optimizer=mc.GradRecorder(), devices=2, schedule="1f1b",
                        microbatches=2, emulate=True, init_fn=init_fn, seed=3)
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(config)
    m = model.gpt_neox
    by_hand = [Embed(m.embed_in), *(Layer(b, m.rotary_emb) for b in m.layers), Head(m.final_layer_norm, model.lm_head)]
    hand = pipeline(by_hand, HFInit(model), lambda logits, labels: causal_lm_loss(logits, labels, vocab_size=V))
    with torch.device("meta"):
        cut = causal_lm_layers(transformers.GPTNeoXForCausalLM(config))
    auto = pipeline(cut.layers, cut.init_fn, cut.loss_fn)
    x = batch(0)[0][0]
    assert hand.train_step((x, x)) == auto.train_step((x, x))


def test_an_encoder_is_not_cut_as_a_causal_lm_nor_the_other_way_round():
    # issue 45: BERT got "causal_lm_layers does not know the layout"; now the masked LM has its own cut
    from pipeoptim.models.hf import UnsupportedModel, masked_lm_layers
    bert = transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=2, hidden_size=32,
                                                                intermediate_size=64, num_attention_heads=4,
                                                                vocab_size=V))
    with pytest.raises(UnsupportedModel, match="BertForMaskedLM is not a causal LM .* use masked_lm_layers"):
        causal_lm_layers(bert)
    assert len(masked_lm_layers(bert).layers) == 4
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM is a causal LM; use causal_lm_layers"):
        masked_lm_layers(build("llama"))
