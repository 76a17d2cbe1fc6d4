"""Every Hugging Face language-model family transformers ships, cut by pipeoptim.models.hf and compared with the
unsplit model: tiny (2 layers, hidden 32, vocabulary 96), random init, float32, a sequence of 24 tokens (past
every sliding window of 8) with a padded row; the cut's loss and every parameter's gradient equal the model's to
float32 round-off, or the cut refuses by name. The same results write docs/models/support-matrix.md:

    PIPEOPTIM_WRITE_DOCS=1 python3 -m pytest -q tests/test_models_hf_families.py -k page

and ``test_the_support_matrix_page_is_what_the_families_give`` fails when the committed page differs."""
from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import model_cases as mc  # noqa: E402
from pipeoptim.models.hf import UnsupportedModel, causal_lm_layers, masked_lm_layers  # noqa: E402
from pipeoptim.train import Pipeline  # noqa: E402

PAGE = Path(__file__).resolve().parent.parent / "docs" / "models" / "support-matrix.md"
T, V, WINDOW = 24, 96, 8
BASE = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
HEAD8 = dict(BASE, head_dim=8)
SLIDING = dict(sliding_window=WINDOW)
GPT2_LIKE = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=64, bos_token_id=1, eos_token_id=2)
ENCODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=V,
               max_position_embeddings=64, pad_token_id=1)

# model_type -> config of the tiny model; the cut must equal the model unless REFUSED says otherwise
FAMILIES = {
    "llama": BASE,
    "mistral": dict(BASE, **SLIDING),
    "qwen2": dict(BASE, use_sliding_window=True, max_window_layers=1, **SLIDING),
    "qwen3": dict(HEAD8, use_sliding_window=True, max_window_layers=1, **SLIDING),
    "phi3": dict(BASE, **SLIDING),
    "gemma": HEAD8,
    "gemma2": dict(HEAD8, **SLIDING),  # layer_types: sliding, full; final_logit_softcapping 30
    "gpt2": GPT2_LIKE,
    "gpt_neox": BASE,
    "opt": dict(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=V,
                max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "falcon": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, bos_token_id=1,
                   eos_token_id=2),
    "falcon-alibi": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, alibi=True,
                         bos_token_id=1, eos_token_id=2),
    "bloom": dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "mpt": dict(n_layers=2, d_model=32, n_heads=4, vocab_size=V, max_seq_len=64),
    "gemma3_text": dict(HEAD8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "cohere": dict(BASE, logit_scale=0.5),
    "cohere2": dict(HEAD8, **SLIDING),
    "granite": dict(BASE, embedding_multiplier=2.0, logits_scaling=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.3),
    "olmo": BASE,
    "olmo2": BASE,
    "phi": BASE,
    "stablelm": BASE,
    "starcoder2": dict(BASE, **SLIDING),
    "gptj": dict(GPT2_LIKE, rotary_dim=4),
    "codegen": dict(GPT2_LIKE, rotary_dim=4, n_ctx=64),
    "gpt_bigcode": GPT2_LIKE,
    "gpt_neo": dict(num_layers=2, hidden_size=32, num_heads=4, vocab_size=V, max_position_embeddings=64,
                    attention_types=[[["global", "local"], 1]], window_size=WINDOW, bos_token_id=1, eos_token_id=2),
    "mixtral": dict(BASE, num_local_experts=4, num_experts_per_tok=2, **SLIDING),
    "qwen3_moe": dict(HEAD8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "helium": HEAD8,
    "glm": HEAD8,
    "nemotron": HEAD8,
    "persimmon": BASE,
    "exaone4": dict(HEAD8, **SLIDING),
    "smollm3": BASE,
    "biogpt": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=V,
                   max_position_embeddings=64, pad_token_id=0),
    "xglm": dict(num_layers=2, d_model=32, ffn_dim=64, attention_heads=4, vocab_size=V, max_position_embeddings=64),
    "recurrent_gemma": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            vocab_size=V, lru_width=32, attention_window_size=WINDOW,
                            block_types=["recurrent", "attention"], pad_token_id=0),
    "mamba": dict(num_hidden_layers=2, hidden_size=32, vocab_size=V, state_size=4, expand=2),
    # refused, by name
    "gemma3n_text": dict(HEAD8, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8,
                         layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                         activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4, altup_num_inputs=2, **SLIDING),
    "opt-layerdrop": dict(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=V,
                          max_position_embeddings=64, word_embed_proj_dim=32, layerdrop=0.1, pad_token_id=0),
    "mixtral-router-loss": dict(BASE, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "gpt2-cross-attention": dict(GPT2_LIKE, add_cross_attention=True),
    # encoders (masked LM)
    "bert": ENCODER,
    "roberta": ENCODER,
}
REFUSED = {
    "gemma3n_text": r"Gemma3nForCausalLM: .* failed right after model.embed_tokens_per_layer "
                    r"\(Gemma3nTextScaledWordEmbedding\) ran, whose output the model uses in a way a stand-in "
                    r"cannot imitate",
    "opt-layerdrop": r"OPTForCausalLM: layerdrop=0.1 skips layers at random in training",
    "mixtral-router-loss": r"MixtralForCausalLM: output_router_logits=True adds the routers' auxiliary loss",
    "gpt2-cross-attention": r"GPT2LMHeadModel: cross-attention",
}
ENCODERS = {"bert", "roberta"}


def _build(family: str):
    model_type = family.split("-")[0]
    config = transformers.AutoConfig.for_model(model_type, **FAMILIES[family])
    for key, value in list(vars(config).items()):  # no dropout: the comparison is of one deterministic function
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    auto = transformers.AutoModelForMaskedLM if family in ENCODERS else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    return auto.from_config(config).float()


def _batch(family: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, V, (2, T), generator=g)
    mask = torch.ones_like(x)
    mask[1, T - 5:] = 0  # a padded row
    if family in ENCODERS:
        labels = torch.full_like(x, -100)
        labels[:, ::3] = x[:, ::3]
        labels[mask == 0] = -100
    else:
        labels = x.masked_fill(mask == 0, -100)
    return x, mask, labels


def _notes(model, cut) -> str:
    c = model.config.get_text_config()
    notes = []
    if getattr(c, "layer_types", None) and len(set(c.layer_types)) > 1:
        notes.append("layer types " + "/".join(c.layer_types))
    window = getattr(c, "sliding_window", None) or getattr(c, "window_size", None) or \
        getattr(c, "attention_window_size", None)
    if window and (getattr(c, "use_sliding_window", True) or getattr(c, "layer_types", None)):
        notes.append(f"sliding window {window} < {T} tokens")
    if cut is not None and any("inv_freq" in n for n, _ in cut.layers[1].named_buffers()):
        notes.append("rotary")
    if getattr(c, "alibi", False) or model.config.model_type in ("bloom", "mpt"):
        notes.append("ALiBi")
    for key, label in (("final_logit_softcapping", "logit softcapping"), ("logit_scale", "logit scale"),
                       ("logits_scaling", "logits scaling"), ("embedding_multiplier", "embedding multiplier")):
        if getattr(c, key, None) not in (None, 1.0):
            notes.append(f"{label} {getattr(c, key):g}")
    if model.get_input_embeddings().__class__.__name__.endswith("ScaledWordEmbedding"):
        notes.append("scaled embedding")
    if getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None):
        notes.append("mixture of experts")
    if cut is not None and cut.tied:
        notes.append("tied embeddings")
    return ", ".join(notes)


@functools.cache
def result(family: str) -> dict:
    """The cut against the unsplit model: loss and gradient differences, or the refusal's message."""
    model = _build(family)
    reference = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    row = {"family": family, "class": type(model).__name__}
    try:
        cut = (masked_lm_layers if family in ENCODERS else causal_lm_layers)(model)
    except UnsupportedModel as e:
        return dict(row, refused=str(e), notes=_notes(model, None))
    x, mask, labels = _batch(family)
    out = (x, mask)
    for layer in cut.layers:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    loss = cut.loss_fn(out, labels)
    loss.backward()
    want = reference(input_ids=x, attention_mask=mask, labels=labels).loss
    want.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    got = {}
    for layer in cut.layers:
        for p in layer.parameters():
            name = names.get(id(p))
            if name is None:  # the head's own copy of a tied embedding: its gradient adds to the embedding's
                name = names[id(model.get_input_embeddings().weight)]
            got[name] = got[name] + p.grad if name in got else p.grad
    assert set(got) == set(ref_grads), sorted(set(got) ^ set(ref_grads))
    worst = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)).item()
                for n, g in got.items())
    return dict(row, loss=loss.item(), want=want.item(), grads=got, ref_grads=ref_grads, worst=worst,
                params=len(got), notes=_notes(model, cut))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cut_equals_the_model_or_refuses_by_name(family, one_thread):
    r = result(family)
    if family in REFUSED:
        assert "refused" in r, f"{family} was expected to be refused and was cut"
        assert re.search(REFUSED[family], r["refused"]), r["refused"]
        return
    assert "refused" not in r, r.get("refused")
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(r["want"]))  # float32 round-off
    for name, grad in r["grads"].items():
        torch.testing.assert_close(grad, r["ref_grads"][name], msg=lambda s: f"{family} {name}: {s}")


def render_page(rows: list[dict]) -> str:
    lines = [
        "# Model support matrix",
        "",
        "Which Hugging Face model families `pipeoptim.models.hf` cuts into pipeline layers, checked against the",
        "unsplit model. **Generated** by `tests/test_models_hf_families.py` (which fails when this page differs",
        "from what it computes); regenerate it with",
        "",
        "```",
        "PIPEOPTIM_WRITE_DOCS=1 python3 -m pytest -q tests/test_models_hf_families.py -k page",
        "```",
        "",
        f"Each family is built tiny from its config (2 layers, hidden 32, vocabulary {V}, random init, float32,",
        f"transformers {transformers.__version__}) and run on a batch of 2 × {T} tokens, one row padded, longer than",
        f"every sliding window ({WINDOW}). *Equal* means the cut's loss and the gradient of every parameter equal the",
        "unsplit model's to float32 round-off (`torch.testing.assert_close`); *refused* means `causal_lm_layers` /",
        "`masked_lm_layers` raises `UnsupportedModel` with the message shown, before anything runs. A family not",
        "listed may well work: run the same comparison on it ([Hugging Face models](hugging-face.md)).",
        "",
        "| family | model class | cut equals model | notes |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            verdict = "refused: " + r["refused"].split(";")[0].replace("|", "\\|")
        else:
            verdict = f"equal (loss, {r['params']} parameter gradients)"
        lines.append(f"| {r['family']} | `{r['class']}` | {verdict} | {r['notes']} |")
    return "\n".join(lines) + "\n"


def test_the_support_matrix_page_is_what_the_families_give(one_thread):
    page = render_page([result(f) for f in FAMILIES])
    if os.environ.get("PIPEOPTIM_WRITE_DOCS"):
        PAGE.write_text(page)
    assert PAGE.read_text() == page, ("docs/models/support-matrix.md differs from what the families give; "
                                      "regenerate it: PIPEOPTIM_WRITE_DOCS=1 python3 -m pytest -q "
                                      "tests/test_models_hf_families.py -k page")


@pytest.mark.parametrize("family", ["gemma2", "falcon", "bert"])
def test_two_emulated_stages_give_the_unsplit_models_loss_and_gradients(family, one_thread):
    model = _build(family)
    reference = copy.deepcopy(model)
    cut = (masked_lm_layers if family in ENCODERS else causal_lm_layers)(model)
    rec = mc.GradRecorder()
    pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, optimizer=rec, devices=2, schedule="1f1b", microbatches=2,
                    emulate=True, tied=cut.tied)
    x, mask, labels = _batch(family)
    loss = pipe.train_step(((x, mask), labels))
    micro = [((x[i:i + 1], mask[i:i + 1]), labels[i:i + 1]) for i in range(2)]
    want_loss, want = mc.reference_grads(
        reference, lambda m, mb: m(input_ids=mb[0][0], attention_mask=mb[0][1], labels=mb[1]).loss, micro)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = {g: by_id.get(id(p), "lm_head.weight") for g, p in pipe.named_parameters().items()}
    if cut.tied:  # the unsplit model has one tied weight: each copy got its whole gradient (tied= sums them)
        names[cut.tied[0][1]] = by_id[id(model.get_input_embeddings().weight)]
    mc.assert_grads_match(rec.by_name(pipe), want, names)


@pytest.mark.parametrize("family", ["gpt_bigcode", "recurrent_gemma", "gemma2", "falcon-alibi", "bert"])
def test_a_meta_built_cut_is_the_real_models_cut_initialised_alike(family, one_thread):
    # what meta-building must rebuild: buffers a backbone holds itself (GPTBigCode's mask, RecurrentGemma's
    # normalizer), rotary and embedding scales, wiped by to_empty and filled again by the model's _init_weights
    cutter = masked_lm_layers if family in ENCODERS else causal_lm_layers
    with torch.device("meta"):
        meta_model = _build(family)
    meta_cut = cutter(meta_model)
    pipe = Pipeline(meta_cut.layers, loss_fn=meta_cut.loss_fn, optimizer=mc.GradRecorder(), devices=2,
                    schedule="1f1b", microbatches=2, emulate=True, init_fn=meta_cut.init_fn, tied=meta_cut.tied,
                    seed=7)
    x, mask, labels = _batch(family)
    loss = pipe.train_step(((x, mask), labels))
    from pipeoptim.stages.materialize import initialize
    model = _build(family)
    cut = cutter(model)
    for i, layer in enumerate(cut.layers):
        initialize(layer, str(i), 7, cut.init_fn)
    if cut.tied:  # the head's copy starts as the embedding, as the pipeline's does
        with torch.no_grad():
            dict(cut.layers[-1].named_parameters())[cut.tied[0][1].split(".", 1)[1]].copy_(
                dict(cut.layers[0].named_parameters())[cut.tied[0][0].split(".", 1)[1]])
    losses = []
    for i in range(2):
        out = (x[i:i + 1], mask[i:i + 1])
        for layer in cut.layers:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        losses.append(cut.loss_fn(out, labels[i:i + 1]).item())
    assert loss == pytest.approx(sum(losses) / 2, rel=1e-6)
