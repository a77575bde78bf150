"""GPT-2 in one file, after nanoGPT's ``model.py`` (same interface, same module names).

The module names matter: TAGC's selection (:func:`tagc.hooks.core.selection.non_attention_linear`) picks the
parameters to compress by name and module type.

References: Radford et al. 2019 (GPT-2); Karpathy's nanoGPT.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    """Model shape. ``vocab_size`` 50304 is GPT-2's 50257 padded to a multiple of 64 (faster)."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50304
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2
    tie_weights: bool = True  # lm_head shares its weight with transformer.wte, like GPT-2

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """A named configuration from :data:`PRESETS`, with fields replaced by ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    # GPT-2 small as released: 124M parameters with the tied LM head.
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    # The TAGC paper's ~162M model: GPT-2 small with its own (untied) LM head.
    "gpt2-untied": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024, tie_weights=False),
    # CPU-sized models for tests and smoke runs (vocab padded, like nanoGPT trains).
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
}


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (``nn.LayerNorm`` has no ``bias=False`` before torch 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection, then an output projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # Q, K, V
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward block: 4x expansion, GELU (tanh approximation, as GPT-2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: token + position embeddings, ``n_layer`` blocks, a final LayerNorm and the LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.vocab_size is not None and config.block_size is not None
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout), h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # One Parameter, two modules; named_parameters() reports it once, as transformer.wte.weight.
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections: std 0.02 / sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of (distinct) parameters; ``non_embedding`` leaves out the position embedding,
        as nanoGPT reports it (the token embedding stays: tied, it is also the LM head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits for token ids ``idx`` (B, T) and, given ``targets`` (B, T), the mean cross-entropy.

        Without targets only the last position's logits are computed (B, 1, vocab), as nanoGPT does
        for generation; targets equal to -1 are ignored.
        """
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {t}, block size is {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss
