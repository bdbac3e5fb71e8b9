"""``ModelSpec``: a decoder-only transformer's shape, as the cost formulas need it.

Chapters 19 and 20 describe paper-scale models (GPT-3 175B, Llama 3 405B) that
are counted, never built: parameters, FLOPs per token, activation bytes. This
module holds that description alone, at the bottom of the house, so that the
cost library (``helpers.costs``), chapter 19's ``helpers.frameworks`` and
chapter 20's planner all read one definition without importing each other.
Parameter counts follow the papers' conventions (Narayanan et al. 2021 eq. 2
for GPT; SwiGLU's three matrices and grouped-query attention for Llama 3,
Dubey et al. 2024 Table 3).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from helpers.validate import int_at_least, positive_int

__all__ = ["ModelSpec"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: what the memory and FLOP formulas need.

    One description for chapters 19 and 20: ``estimate`` (chapter 19) and the
    layout planner (``helpers.planner``, chapter 20) both read it, so both
    count the same parameters and the same FLOPs.

    Not the course's ``helpers.model.GPTConfig``: that one builds an
    ``nn.Module`` that runs on the laptop (biases, learned positions, dropout,
    the attention kernel); this one is a paper-scale shape that is only
    counted, never built (grouped-query attention, SwiGLU, experts). The one
    conversion is ``ModelSpec.from_gpt_config``. ``helpers.memory``'s
    ``MODEL_PRESETS`` are the keyword arguments of ``training_memory`` for
    chapter 06's calculator, a third view that sits below this module.

    ``ffn``: MLP width (default 4 * hidden, GPT); ``gated_mlp``: three MLP
    matrices (SwiGLU, Llama) instead of two. ``kv_heads``: grouped-query
    attention's key/value heads (default ``heads``). ``tied_embeddings``: one
    vocab x hidden matrix for input and output (GPT-2/3, Megatron's GPT).
    ``experts`` > 0 makes every layer's MLP a mixture of ``experts`` experts,
    ``top_k`` of which each token visits (chapter 21). ``n_params``: the
    nominal count to use instead of the one computed from the shape (then
    treated as dense: no expert split, since the count does not say which part
    is experts).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: Optional[int] = None
    kv_heads: Optional[int] = None
    gated_mlp: bool = False
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 1
    n_params: Optional[float] = None
    name: str = ""

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "vocab", "seq", "top_k"):
            positive_int(f"ModelSpec.{f}", getattr(self, f))
        int_at_least("ModelSpec.experts", self.experts, 0)
        for f in ("ffn", "kv_heads"):
            if getattr(self, f) is not None:
                positive_int(f"ModelSpec.{f}", getattr(self, f))
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.n_kv_heads:
            raise ValueError(f"{self.heads} query heads do not group over "
                             f"{self.n_kv_heads} key/value heads")
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds the {self.experts} experts")

    @classmethod
    def from_gpt_config(cls, cfg, seq: Optional[int] = None, name: str = "") -> "ModelSpec":
        """The shape of the course's GPT (``helpers.model.GPTConfig``): a GeLU MLP of
        ``mlp_ratio * n_embd``, the head tied to the token embedding, ``seq``
        tokens per sequence (default ``block_size``). The shape counts weights
        only: ``total_params()`` is ``GPTConfig(bias=False).n_params()`` less the
        learned position embedding (``block_size * n_embd``), which the formulas
        of chapters 19-20 leave out as the papers do."""
        return cls(layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, vocab=cfg.vocab_size,
                   seq=cfg.block_size if seq is None else seq, ffn=cfg.mlp_ratio * cfg.n_embd,
                   tied_embeddings=True, name=name)

    @property
    def ffn_hidden(self) -> int:
        """The MLP width: ``ffn``, or GPT's 4 * hidden when not given."""
        return self.ffn or 4 * self.hidden

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` when not given (no grouping)."""
        return self.kv_heads or self.heads

    def attention_params(self) -> int:
        """Q and output projections h x h, K and V h x (h kv_heads / heads) (no biases)."""
        h = self.hidden
        return 2 * h * h + 2 * h * (h * self.n_kv_heads // self.heads)

    def mlp_params(self) -> int:
        """One MLP (one expert): 2 or 3 matrices of h x ffn."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    def layer_params(self) -> float:
        """One layer's weights: attention + MLP (all experts + router for MoE) + 2 norms."""
        mlp = self.mlp_params() * max(1, self.experts) + self.hidden * self.experts
        return self.attention_params() + mlp + 2 * self.hidden

    def expert_params(self) -> float:
        """Weights that expert parallelism splits: every layer's experts."""
        return self.layers * self.mlp_params() * self.experts

    def total_params(self) -> float:
        """``n_params`` if given, else layers + embedding (+ output layer unless tied)."""
        if self.n_params is not None:
            return float(self.n_params)
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return float(self.layers * self.layer_params() + embed + self.hidden)

    def dense_params(self) -> float:
        """Weights that every data-parallel replica holds in full (all but the
        experts): what tensor and pipeline parallelism split and ZeRO shards."""
        experts = self.expert_params() if self.n_params is None else 0.0
        return self.total_params() - experts

    def forward_flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward pass (Narayanan et al. 2021, sec. 5.1):
        2 per weight a token meets (only top_k experts of an MoE layer), plus the
        attention scores and their product with V (2 s h each per layer), plus the
        output layer (2 h V). For a GPT (12 h^2 per layer) this is their
        24 h^2 (1 + s/6h) per layer + 2 h V."""
        h, s = self.hidden, self.seq
        active_mlp = self.mlp_params() * (self.top_k if self.experts else 1)
        per_layer = 2 * (self.attention_params() + active_mlp) + 4 * s * h
        return self.layers * per_layer + 2 * h * self.vocab
