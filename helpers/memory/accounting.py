"""Hand accounting: every tensor our GPT saves for backward, derived term by term.

``explain_saved_bytes`` lists what ``helpers.model``'s GPT (manual attention)
hands autograd in one forward, in forward order, each with the matching term
of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4.1 and Table 2: 34 sbh + 5 as^2b per layer; sec.
4.3 for the embedding and the output layer), or the reason the paper has none.
The sum predicts ``meter.SavedTensorCounter.total_bytes`` exactly; every
difference from the paper's layer is named in the function's docstring.
"""

from __future__ import annotations

import dataclasses

import torch

from helpers.validate import positive_int

__all__ = ["ExplainedTerm", "explain_saved_bytes"]


@dataclasses.dataclass(frozen=True)
class ExplainedTerm:
    module: str      # where our GPT saves it (matches SavedTensorCounter.by_module())
    tensor: str      # what it is
    paper: str       # the matching term of Korthikanti et al.'s count, or why it has none
    nbytes: int


def explain_saved_bytes(cfg, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16,
                        device_type: str = "cpu", with_loss: bool = True) -> list[ExplainedTerm]:
    """Every tensor our GPT (``helpers.model``, manual attention) saves for backward,
    derived by hand, in forward order; sum the ``nbytes`` to predict
    ``SavedTensorCounter.total_bytes`` exactly.

    Differences from the paper's layer (Korthikanti et al. 2022, sec. 4.1):

    * dropout masks: a CUDA build keeps a 1-byte bool mask (as the paper
      assumes); PyTorch's CPU dropout multiplies by a scaled noise tensor of the
      activation's dtype and keeps that (2 bytes in bf16). With dropout = 0
      there is no mask at all, and the dropped-out attention probabilities are
      the softmax output itself (one buffer, not two).
    * LayerNorm also keeps its per-row mean and 1/std: 2 * s * b numbers
      (activation dtype on CPU, fp32 on CUDA). The paper drops these small terms.
    * our causal mask is a fresh s x s bool tensor per layer (``masked_fill``
      keeps it); Megatron's fused softmax builds the mask inside the kernel.
    * q, k, v are copied into contiguous per-head buffers for the batched
      matmuls (3 x 2sbh, exactly the paper's Q, K and V terms).

    ``device_type="cuda"`` gives the CUDA variant (bool masks, fp32 LN
    statistics); it is what we expect there, tested only where a GPU is lent.
    """
    if getattr(cfg, "attention", "manual") != "manual":
        raise ValueError("explain_saved_bytes covers attention='manual' only; the fused sdpa "
                         "kernel saves its own, smaller set of tensors")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    positive_int("batch", batch)
    positive_int("seq", seq)
    if seq > cfg.block_size:
        raise ValueError(f"seq={seq} exceeds the model's block_size={cfg.block_size}")
    e = torch.empty((), dtype=dtype).element_size()
    dropout = cfg.dropout > 0
    mask_b = (1 if device_type == "cuda" else e) if dropout else 0
    stat_b = 4 if device_type == "cuda" else e
    s, b, h, a, v = seq, batch, cfg.n_embd, cfg.n_head, cfg.vocab_size
    f = cfg.mlp_ratio * h
    sbh = s * b * h
    rows: list[ExplainedTerm] = []
    add = lambda *t: rows.append(ExplainedTerm(*t))  # noqa: E731

    def layer_norm(name: str) -> None:
        add(name, "input", "LayerNorm input: 2sbh", sbh * e)
        add(name, "mean and 1/std per row", "not counted by the paper", 2 * s * b * stat_b)

    def dropout_mask(name: str, numel: int, paper: str) -> None:
        if dropout:
            add(name, "dropout mask" + (" (scaled noise, activation dtype)"
                                        if device_type == "cpu" else " (bool)"), paper,
                numel * mask_b)

    add("wte", "token ids (int64)", "not counted (sec. 4.3 keeps only the dropout mask)",
        b * s * 8)
    add("wpe", "positions (int64)", "not counted", s * 8)
    dropout_mask("drop", sbh, "embedding dropout mask: sbh (sec. 4.3)")
    for i in range(cfg.n_layer):
        p = f"blocks.{i}"
        layer_norm(f"{p}.ln_1")
        add(f"{p}.attn.c_attn", "input", "QKV matmul input: 2sbh", sbh * e)
        add(f"{p}.attn", "k^T, contiguous copy", "Q and K: 4sbh (half)", sbh * e)
        add(f"{p}.attn", "q, contiguous copy", "Q and K: 4sbh (half)", sbh * e)
        add(f"{p}.attn", "causal mask s x s (bool)", "not counted (fused into the kernel)", s * s)
        add(f"{p}.attn", "softmax output", "softmax output: 2as^2b", a * s * s * b * e)
        dropout_mask(f"{p}.attn.attn_dropout", a * s * s * b, "softmax dropout mask: as^2b")
        add(f"{p}.attn", "v, contiguous copy", "V: 2sbh", sbh * e)
        if dropout:
            add(f"{p}.attn", "dropped-out probabilities", "dropout output: 2as^2b",
                a * s * s * b * e)
        add(f"{p}.attn.c_proj", "input", "projection input: 2sbh", sbh * e)
        dropout_mask(f"{p}.attn.resid_dropout", sbh, "attention dropout mask: sbh")
        layer_norm(f"{p}.ln_2")
        add(f"{p}.mlp.c_fc", "input", "first MLP matmul input: 2sbh", sbh * e)
        add(f"{p}.mlp.gelu", "input (4h wide)", "GeLU input: 8sbh", s * b * f * e)
        add(f"{p}.mlp.c_proj", "input (4h wide)", "second MLP matmul input: 8sbh", s * b * f * e)
        dropout_mask(f"{p}.mlp.dropout", sbh, "MLP dropout mask: sbh")
    layer_norm("ln_f")
    add("lm_head", "input", "output layer input (sec. 4.3)", sbh * e)
    if with_loss:
        add("<top>", "log-softmax of the logits",
            "cross-entropy logits: 4sbv in fp32 (sec. 4.3); here in the run's dtype",
            s * b * v * e)
        add("<top>", "targets (int64)", "not counted", s * b * 8)
        add("<top>", "total weight (1 element)", "not counted", e)
    return rows
