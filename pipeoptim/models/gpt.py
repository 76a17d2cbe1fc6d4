"""A small GPT-style decoder as a flat list of layers (embedding, blocks, head) for pipeline stages.

Each layer maps one tensor to one tensor, so any contiguous slice is a valid stage: the embedding takes
token ids (B, T), blocks take and return hidden states (B, T, d), the head returns logits (B, T, V).

``gpt_layers(cfg, device="meta")`` builds the layers without memory, for a pipeline that materialises only
its own stages; pass ``init_fn=gpt_init_fn(cfg)`` so they get the same initialisation scheme.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    dropout: float = 0.0


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def gpt_init(layer: nn.Module, n_layers: int) -> None:
    """GPT-2's scheme for one layer: N(0, 0.02) matrices, residual projections scaled by 1/√(2·n_layers),
    zero biases, LayerNorm weights 1."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 if not name.endswith(("proj.weight", "out.weight"))
                                else 0.02 / math.sqrt(2 * n_layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)


def gpt_init_fn(cfg: GPTConfig):
    """``init_fn`` for ``Pipeline`` with meta-built ``gpt_layers``."""
    return functools.partial(gpt_init, n_layers=cfg.n_layers)


def _build(cfg: GPTConfig) -> list[nn.Module]:
    return [Embedding(cfg)] + [Block(cfg) for _ in range(cfg.n_layers)] + [Head(cfg)]


def gpt_layers(cfg: GPTConfig, seed: int = 0, device=None) -> list[nn.Module]:
    """[Embedding, Block × n_layers, Head], initialised deterministically from `seed` (one random stream over
    the whole model). ``device="meta"``: no memory and no initialisation (a pipeline initialises each layer
    it materialises; see ``gpt_init_fn``)."""
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return _build(cfg)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        layers = _build(cfg)
        for layer in layers:
            gpt_init(layer, cfg.n_layers)
    finally:
        torch.random.set_rng_state(gen_state)
    return layers


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
