"""A small GPT that every chapter trains, splits and shards.

The architecture is GPT-2's: token + position embeddings, ``n_layer`` pre-LN
blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), a final LayerNorm and a language-model head that shares its weight
with the token embedding ("tied embeddings", Press & Wolf 2017).

Why write it here instead of importing one: the later chapters cut this model
apart. Tensor parallelism (ch. 08-09) splits ``attn.c_attn`` by heads and the
MLP by columns/rows; pipeline parallelism (ch. 11-12) hands ``blocks[i:j]`` to
a stage; recompute (ch. 13) wraps a block or only ``attn.core``; FSDP (ch. 15)
wraps each block as a unit. So the pieces are plain attributes with names from
the field, and the forward pass is split into ``embed`` -> ``blocks`` ->
``head`` so a stage can run just its part.

Attention is written out (scores, mask, softmax, dropout, weighted sum) by
default, because chapter 06 counts the bytes each of those steps saves for
backward. ``attention="sdpa"`` uses PyTorch's fused kernel instead (faster on
GPU; saves far less memory, which chapter 06 also shows).

Sizes go from ``toy`` (trains a few hundred steps in seconds on a laptop CPU)
to GPT-2 sizes for GPU workshops; see ``GPTConfig.from_name``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.launch.info import rank_device
from helpers.validate import positive_int

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "build_model",
           "count_parameters", "init_weights", "MODEL_SIZES"]


@dataclasses.dataclass
class GPTConfig:
    """The course's GPT as an ``nn.Module`` config: what ``GPT(cfg)`` builds and
    trains on real ranks. The paper-scale shape that chapters 19-20
    count without building is ``helpers.frameworks.ModelSpec``; the one
    conversion is ``ModelSpec.from_gpt_config(cfg)``."""

    vocab_size: int = 64
    block_size: int = 32       # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    mlp_ratio: int = 4         # MLP hidden = mlp_ratio * n_embd, as in GPT-2
    dropout: float = 0.0       # 0 keeps reference comparisons exact; ch. 13 turns it on
    bias: bool = True
    attention: str = "manual"  # "manual" (every step visible) or "sdpa" (fused)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            positive_int(f"GPTConfig.{name}", getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                             f"each head needs n_embd / n_head features")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ("manual", "sdpa"):
            raise ValueError(f"attention must be 'manual' or 'sdpa', got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTConfig":
        """A named size, e.g. ``GPTConfig.from_name("toy", dropout=0.1)``."""
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}; choose from {sorted(MODEL_SIZES)}")
        return cls(**{**MODEL_SIZES[name], **overrides})

    def n_params(self) -> int:
        """Parameter count from the config (tied head counted once)."""
        h, v, L, f = self.n_embd, self.vocab_size, self.n_layer, self.mlp_ratio * self.n_embd
        b = 1 if self.bias else 0
        attn = h * 3 * h + b * 3 * h + h * h + b * h
        mlp = h * f + b * f + f * h + b * h
        norms = 2 * (h + b * h)
        return v * h + self.block_size * h + L * (attn + mlp + norms) + (h + b * h)


# Named sizes. "toy" and "tiny" run on a laptop CPU; the GPT-2 ones are for GPU
# nodes (GPT-2 sizes from Radford et al. 2019, Table 2; vocab padded to a
# multiple of 64 as nanoGPT does, which speeds up GPU matmuls).
MODEL_SIZES: dict[str, dict] = {
    "toy": dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32),
    "tiny": dict(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64),
    "small": dict(vocab_size=64, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v stacked
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.use_sdpa = cfg.attention == "sdpa"

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v, per head. (B, nh, T, hd) -> same.

        This is the part selective recompute (Korthikanti et al. 2022, sec. 5)
        recomputes: its saved tensors grow with T^2 but it has few FLOPs.
        """
        if self.use_sdpa:
            p = self.attn_dropout.p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        att = self.attn_dropout(F.softmax(scores, dim=-1))
        return att @ v  # (B, nh, T, hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hd): heads become a batch dimension
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # token embedding, shared with head
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # learned positions
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, two uses
        init_weights(self, cfg.n_layer)

    # The forward pass in three parts, so a pipeline stage can run just one.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) token ids -> logits (B, T, V); with targets also the mean loss."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, lm_loss(logits, targets)


def init_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2's initialization of every parameter of ``module`` (a GPT or a part of one).

    N(0, 0.02) for every matrix; residual output projections (``c_proj``)
    scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not
    grow with depth (Radford et al. 2019, sec. 2.3); biases zero; LayerNorm
    weights keep their 1. Draws from the global RNG in ``named_parameters``
    order. A layer swapped into a built model (e.g. ``helpers.moe.apply_moe``)
    uses it to start like the layers around it.
    """
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_model(cfg: GPTConfig | str = "toy", seed: int = 0,
                device: str | torch.device | None = None, **overrides) -> GPT:
    """A GPT whose initial weights depend only on ``seed`` (not on global RNG state).

    ``device=None`` is the calling rank's device (``rank_info().device``:
    "cuda:<local_rank>" in an nccl launch, else "cpu"; "cpu" outside a
    launch). The weights are drawn on the CPU and then moved, so they are the
    same numbers on every device.
    """
    if isinstance(cfg, str):
        cfg = GPTConfig.from_name(cfg, **overrides)
    elif overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    return model.to(rank_device(device))


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (a tied weight counts once)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in params.values())
