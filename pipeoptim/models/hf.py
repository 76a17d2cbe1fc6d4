"""Hugging Face causal language models (GPT-2, Llama and models laid out like them) as pipeline layers.

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from pipeoptim.models.hf import causal_lm_layers
    from pipeoptim.train import Pipeline

    with torch.device("meta"):                       # no memory: each rank materialises only its own stages
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, vocab_size=256))
    cut = causal_lm_layers(model)
    pipe = Pipeline(cut.layers, loss_fn=cut.loss_fn, init_fn=cut.init_fn, copies=cut.tied, devices=4,
                    schedule="async-1f1b", policy="pipeoptim", optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    loss = pipe.train_step((input_ids, input_ids))   # labels = input_ids: the HF loss shifts them itself

The cut is ``[embedding, decoder block × n, final norm + LM head]``; any contiguous run of these layers is a
stage. What crosses a boundary is a tuple of tensors: ``(hidden_states, position_ids)``, plus the 2-D padding
``attention_mask`` when the batch's inputs are ``(input_ids, attention_mask)``. Each block rebuilds the 4-D
causal mask (``transformers.masking_utils.create_causal_mask``) and, for Llama-style models, its rotary
``(cos, sin)`` from those, exactly as the unsplit model does once: small tensors cross the wire, not the
(B, T, head_dim) rotary tables or a (B, 1, T, T) mask.

Tied input/output embeddings (GPT-2, or ``tie_word_embeddings=True``) cannot be one tensor on two stages: the
head gets its own copy and ``cut.tied`` names the pair. Pass ``tied=cut.tied`` under a synchronous schedule
(the copies stay one weight: their gradients are summed before each step, as the shared parameter's would be)
or ``copies=cut.tied`` under an asynchronous one (the head starts as a copy of the embedding and then trains
as its own weight: the stages holding them step at different times, so there is no moment at which one tied
update could be made).

The loss is the model's own ``ForCausalLMLoss`` (labels shifted inside, ``-100`` ignored), averaged per
micro-batch. ``init_fn`` initialises a meta-built layer with the model's ``_init_weights`` (children first,
as ``post_init`` does), which also recomputes the rotary frequencies that ``to_empty`` wipes. Nothing here
downloads anything: build models from configs.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["HFCut", "byte_level_config", "causal_lm_layers", "causal_lm_loss", "require_transformers"]


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("Hugging Face models need the transformers package: pip install 'pipeoptim[hf]'") from None
    return transformers


def byte_level_config(arch: str, *, d_model: int, n_heads: int, n_layers: int, seq_len: int):
    """``(config, model class)`` of a small byte-level (vocabulary 256) GPT-2 (``arch="gpt2"``) or Llama
    (``"llama"``) without dropout: the Hugging Face models the CLI and the benchmarks train on the standard
    library's source. Build the model from it (on the meta device for a large one); nothing is downloaded."""
    transformers = require_transformers()
    common = dict(vocab_size=256, bos_token_id=0, eos_token_id=0)
    if arch == "gpt2":
        return (transformers.GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=n_heads, n_positions=seq_len,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common),
                transformers.GPT2LMHeadModel)
    if arch == "llama":
        return (transformers.LlamaConfig(num_hidden_layers=n_layers, hidden_size=d_model,
                                         intermediate_size=4 * d_model, num_attention_heads=n_heads,
                                         num_key_value_heads=n_heads, max_position_embeddings=seq_len, **common),
                transformers.LlamaForCausalLM)
    raise ValueError(f"unknown architecture {arch!r}; choose 'gpt2' or 'llama'")


@dataclass
class HFCut:
    """What ``Pipeline`` needs from a cut model: ``layers``, ``loss_fn``, ``init_fn`` (used for meta-built
    layers) and ``tied`` (pairs of global names that are one weight in the unsplit model)."""
    layers: list[nn.Module]
    loss_fn: Callable
    init_fn: Callable[[nn.Module], None]
    tied: list[tuple[str, str]] = field(default_factory=list)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Hugging Face's causal-LM loss: labels are the input ids (shifted here), -100 is ignored."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    return ForCausalLMLoss(logits, labels, vocab_size=vocab_size)


def _block_output(out):
    return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden_states, ...)


def _boundary(hidden, position_ids, attention_mask):
    return (hidden, position_ids) if attention_mask is None else (hidden, position_ids, attention_mask)


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)


class GPT2Embedding(nn.Module):
    """Token + position embeddings and dropout (GPT-2's ``wte``, ``wpe``, ``drop``)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids, attention_mask=None):
        position_ids = _positions(input_ids)
        hidden = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        return _boundary(hidden, position_ids, attention_mask)


class TokenEmbedding(nn.Module):
    """Llama-style token embedding (positions enter each block through rotary embeddings)."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids, attention_mask=None):
        return _boundary(self.embed_tokens(input_ids), _positions(input_ids), attention_mask)


class DecoderBlock(nn.Module):
    """One decoder layer; rebuilds the causal mask (and rotary cos/sin) from what crossed the boundary."""

    def __init__(self, block: nn.Module, config, rotary: nn.Module | None = None):
        super().__init__()
        self.block, self.rotary = block, rotary
        self.config = config

    def forward(self, hidden, position_ids, attention_mask=None):
        from transformers.masking_utils import create_causal_mask
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                                  position_ids=position_ids)
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids=position_ids)}
        out = _block_output(self.block(hidden, attention_mask=mask, position_ids=position_ids, **extra))
        return _boundary(out, position_ids, attention_mask)


class LMHead(nn.Module):
    """Final norm and the vocabulary projection; returns logits (B, T, vocab)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden, position_ids=None, attention_mask=None):
        return self.lm_head(self.norm(hidden))


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


class _HFInit:
    """init_fn: the model's own ``_init_weights`` on every submodule, children first."""

    def __init__(self, model):
        self.model = model

    def __call__(self, layer: nn.Module) -> None:
        for m in _post_order(layer):
            self.model._init_weights(m)


def _untied_head(lm_head: nn.Linear, embedding: nn.Embedding) -> nn.Linear:
    """An output projection with its own weight, equal to the embedding's (or meta, like it)."""
    w = embedding.weight
    head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
    head.weight = nn.Parameter(torch.empty_like(w, device="meta") if w.is_meta else w.detach().clone(),
                               requires_grad=w.requires_grad)
    return head


def causal_lm_layers(model: nn.Module) -> HFCut:
    """Cut a Hugging Face causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM`` or one laid out like them) into
    pipeline layers; see the module docstring. The layers hold the model's own submodules (no copy), so a
    pipeline built from a real model trains that model in place."""
    require_transformers()
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2 layout
        t = model.transformer
        embed = GPT2Embedding(t.wte, t.wpe, t.drop)
        embedding, embed_name = t.wte, "wte"
        blocks = [DecoderBlock(b, config) for b in t.h]
        norm = t.ln_f
    elif hasattr(model, "model") and hasattr(model.model, "layers") and hasattr(model.model, "embed_tokens"):
        m = model.model  # Llama layout (Mistral, Qwen2, ... share it)
        embed = TokenEmbedding(m.embed_tokens)
        embedding, embed_name = m.embed_tokens, "embed_tokens"
        rotary = getattr(m, "rotary_emb", None)
        blocks = [DecoderBlock(b, config, copy.deepcopy(rotary) if rotary is not None else None) for b in m.layers]
        norm = m.norm
    else:
        raise TypeError(f"causal_lm_layers does not know the layout of {type(model).__name__}: it cuts GPT-2-style "
                        "models (transformer.wte/wpe/h/ln_f + lm_head) and Llama-style ones (model.embed_tokens/"
                        "layers/norm/rotary_emb + lm_head); for another model write its layers as a list of modules "
                        "(each returning a tensor or a tuple of tensors)")
    if lm_head is None or config is None:
        raise TypeError(f"{type(model).__name__} has no lm_head; pass the *ForCausalLM / *LMHeadModel class")
    if getattr(config, "add_cross_attention", False):
        raise TypeError("cross-attention GPT-2 models are not supported (their blocks need encoder states)")
    tied = []
    if lm_head.weight is embedding.weight:
        lm_head = _untied_head(lm_head, embedding)
        tied = [(f"0.{embed_name}.weight", f"{len(blocks) + 1}.lm_head.weight")]
    layers = [embed, *blocks, LMHead(norm, lm_head)]
    return HFCut(layers=layers, loss_fn=functools.partial(causal_lm_loss, vocab_size=config.vocab_size),
                 init_fn=_HFInit(model), tied=tied)
