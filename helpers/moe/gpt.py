"""Mixture-of-experts in the course GPT: ``apply_moe``, ``apply_ep`` and the model's losses.

Follows Switch Transformer (Fedus et al. 2021, sec. 2.4 / App. A: an MoE
layer in every other block; sec. 2.2 for the aux-loss weight) and ST-MoE
(Zoph et al. 2022, sec. 3.1, the z-loss weight). The layer is
``helpers.moe.layer``.

In the course GPT, MoE is applied to a built model: ``apply_moe(model,
num_experts, top_k, every=n)`` turns every n-th block's MLP into an MoE layer
(experts always have biases and no dropout, whatever the config says for the
dense MLPs), and ``apply_ep(model, group)`` splits every MoE layer's experts
over a group.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from helpers.model import GPTConfig, init_weights
from helpers.moe.layer import MoEConfig, MoELayer, MoEMLP, MoEStats
from helpers.validate import positive_int

__all__ = ["apply_moe", "moe_n_params", "apply_ep", "moe_stats", "moe_aux_loss"]


def _moe_layer_ids(n_layer: int, every: int) -> list[int]:
    """Blocks every-1, 2 every-1, ...: every ``every``-th block, the last one included
    when ``every`` divides the depth (Switch Transformer: every=2, Fedus et al. 2021,
    sec. 2.4 / App. A)."""
    positive_int("every", every)  # 1: every block
    return [i for i in range(n_layer) if (i + 1) % every == 0]


def apply_moe(model: nn.Module, num_experts: int = 4, top_k: int = 1,
              capacity_factor: float | None = None, every: int = 1, seed: int = 0) -> nn.Module:
    """Turn every ``every``-th block's MLP of a course GPT into an MoE layer (in place).

    Blocks every-1, 2 every-1, ... get an ``MoEMLP``: a router and
    ``num_experts`` experts of the MLP's shape (n_embd -> mlp_ratio * n_embd ->
    n_embd), each token to its ``top_k`` best, ``capacity_factor`` as in
    ``MoELayer``. The other blocks and every other weight stay as they are.
    The new layers are initialized like the GPT's own MLPs
    (``helpers.model.init_weights``) from ``seed`` alone, not the global RNG,
    so every rank applying it to the same model gets the same experts (what
    ``apply_ep`` then splits). Everything is validated before the model is
    touched. Returns ``model``.
    """
    cfg: GPTConfig = model.config
    ids = _moe_layer_ids(cfg.n_layer, every)
    hidden, ffn_hidden = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
    MoEConfig(hidden, ffn_hidden, num_experts, top_k, capacity_factor)  # experts, top_k, cf
    for i in ids:
        if isinstance(model.blocks[i].mlp, MoELayer):
            raise ValueError(f"block {i}'s MLP is already an MoE layer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in ids:
            dense = model.blocks[i].mlp
            layer = MoEMLP(hidden, ffn_hidden, num_experts, top_k, capacity_factor)
            init_weights(layer, cfg.n_layer)  # experts' c_proj scaled as the MLPs' are
            model.blocks[i].mlp = layer.to(dense.c_fc.weight.device, dense.c_fc.weight.dtype)
    return model


def moe_n_params(cfg: GPTConfig, num_experts: int, every: int = 1) -> int:
    """Parameters of a GPT of config ``cfg`` after ``apply_moe(model, num_experts,
    every=every)`` (``cfg.n_params()`` counts the dense model): each MoE layer holds
    ``num_experts`` MLPs (with biases) and a router (H x E, no bias) in place of one MLP."""
    h, f, b = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, 1 if cfg.bias else 0
    mlp = h * f + b * f + f * h + b * h
    moe = num_experts * (h * f + f + f * h + h) + h * num_experts
    return cfg.n_params() + len(_moe_layer_ids(cfg.n_layer, every)) * (moe - mlp)


def apply_ep(model: nn.Module, ep_group) -> nn.Module:
    """Split the experts of every MoE layer of ``model`` over ``ep_group`` (in place).
    Call it on every rank, on models built with the same seed."""
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.shard_experts_(ep_group)
    return model


def moe_stats(model: nn.Module) -> list[MoEStats]:
    """The last forward's stats of every MoE layer in ``model``, in order."""
    return [m.last_stats for m in model.modules()
            if isinstance(m, MoELayer) and m.last_stats is not None]


def moe_aux_loss(model: nn.Module, aux_weight: float = 1e-2, z_weight: float = 1e-3):
    """alpha * sum L_aux + beta * sum L_z over the model's MoE layers (Switch sec. 2.2:
    alpha = 1e-2; ST-MoE sec. 3.1: beta = 1e-3). Add it to the language-model loss."""
    total = 0.0
    for s in moe_stats(model):
        total = total + aux_weight * s.aux_loss + z_weight * s.z_loss
    return total
