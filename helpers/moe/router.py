"""The router of a mixture-of-experts layer: top-k gating, capacity, balance losses.

Follows Switch Transformer, GShard and Mixtral for the gates and the capacity,
Switch and ST-MoE for the two auxiliary losses, each cited below where its
rule is used. ``helpers.moe.layer`` runs the experts the router picks.

A mixture-of-experts (MoE) layer replaces one MLP by ``E`` MLPs ("experts")
and a *router*: a linear layer that scores each token against every expert.
Each token goes to its ``k`` best experts only, so the layer holds E times
the MLP's parameters while each token pays for k MLPs' FLOPs (Shazeer et al.
2017; Switch Transformer, Fedus et al. 2021, k = 1; GShard, Lepikhin et al.
2020, and Mixtral, Jiang et al. 2024, k = 2). Per token (x: (H,)):

    p      = softmax(x W_r)                    router probabilities, (E,)
    S      = top-k indices of p                the chosen experts
    g_e    = p_e                               k = 1 (Switch, sec. 2.1)
    g_e    = p_e / sum_{j in S} p_j            k > 1 (GShard Alg. 1; Mixtral eq. 1)
    y      = sum_{e in S} g_e * expert_e(x)

Capacity. Hardware wants fixed shapes, so each expert takes at most
``C = ceil(capacity_factor * tokens * k / E)`` tokens per batch (Switch eq. 3,
times k as GShard's 2N/E). Slots are handed out first choice first (every
token's first choice before any second choice), in token order (GShard
Alg. 1). A token over capacity is *dropped* by that expert: it contributes 0,
and the block's residual connection ``x + moe(x)`` passes it through
unchanged. Capacity counts the tokens of one call, i.e. of one rank's batch
(GShard's "group"), so the same tokens are dropped with or without EP.

Load balance. Left alone, a router collapses: the experts that happen to win
early get trained, win more, and the rest idle. Two auxiliary losses:

    load-balancing   L_aux = E * sum_i f_i P_i        (Switch, eq. 4)
        f_i = fraction of the k*T routing choices that picked expert i
        P_i = mean router probability of expert i over the T tokens
        Minimal, = 1, when routing is uniform; added as alpha * L_aux
        with alpha = 1e-2 (Switch sec. 2.2). Only P carries a gradient.
    router z-loss    L_z = (1/T) sum_t (logsumexp_e logits_te)^2
        (ST-MoE, Zoph et al. 2022, eq. 5; weight 1e-3): keeps router logits
        small so the fp32 softmax stays accurate.

Balance without a loss (DeepSeek-V3, DeepSeek-AI 2024, sec. 2.1.2; Wang et al.
2024, "Auxiliary-Loss-Free Load Balancing", arXiv 2408.15664). A loss that
pushes the router towards balance also pushes it away from the experts it
would choose. DeepSeek-V3 instead adds a per-expert bias ``b`` to the
affinities *only where experts are chosen*, and leaves the gates unbiased:

    s      = sigmoid(x W_r)                    affinities, (E,)
    S      = top-k indices of s + b            the bias moves the choice ...
    g_e    = s_e / sum_{j in S} s_j            ... not the weights
    b_i   += gamma * sign(mean load - load_i)  after each step: overloaded
                                               experts lose gamma, idle ones gain it

``b`` is not a parameter (no gradient); gamma is the bias update speed (1e-3
in DeepSeek-V3 and as Megatron-Core's ``moe_router_bias_update_rate``
default, ``--moe-router-enable-expert-bias``, Megatron-Core main of 2026-08-22, d98e8a6;
torchtitan main of 2026-08-21 (b5bcd76) also subtracts the mean of the update,
``components/optimizer/optimizer.py``). ``route_with_bias`` and
``update_expert_bias`` below.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["route", "expert_capacity", "capacity_slots", "capacity_keep", "load_balancing_loss",
           "router_z_loss", "route_with_bias", "expert_load", "update_expert_bias"]


def route(logits: torch.Tensor, top_k: int):
    """Router logits (T, E) -> probs (T, E) fp32, gates (T, k), experts (T, k).

    Softmax in at least fp32 (Switch sec. 2.4, "selective precision"; fp64
    stays fp64, which the tests use). k = 1 keeps the
    raw probability as the gate (Switch sec. 2.1), so the router gets a
    gradient; k > 1 renormalizes over the chosen k (GShard Alg. 1, Mixtral).
    """
    probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top_p, experts = probs.topk(top_k, dim=-1)          # (T, k), best first
    gates = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    return probs, gates, experts


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(cf * tokens * k / E) (Switch eq. 3, times k as in GShard)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_slots(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T, k) long: the slot each routing choice takes in its expert's buffer.

    Priority: choice 0 of every token, then choice 1, ..., each in token
    order (GShard Alg. 1: position in expert = cumulative count).
    """
    T, k = experts.shape
    order = experts.t().reshape(-1)                                 # (k*T,) choice-major
    one_hot = F.one_hot(order, num_experts)                         # (k*T, E)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1            # slot taken in its expert
    return position.reshape(k, T).t()


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) bool: which routing choices fit in their expert's ``capacity`` (slot < C)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    return capacity_slots(experts, num_experts) < capacity


def load_balancing_loss(router_probs: torch.Tensor, expert_indices: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """Switch's auxiliary loss E * sum_i f_i P_i (Fedus et al. 2021, eq. 4).

    router_probs (T, E); expert_indices (T, k). f_i is the fraction of the
    T*k choices that went to expert i (for k = 1 exactly Switch's eq. 5), P_i
    the mean probability (eq. 6). f is a count: no gradient flows through it.
    Uniform routing gives f_i = P_i = 1/E and the minimum, 1.
    """
    f = torch.bincount(expert_indices.reshape(-1), minlength=num_experts).to(router_probs.dtype)
    f = f / expert_indices.numel()
    P = router_probs.mean(dim=0)
    return num_experts * (f * P).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits, dim=-1).square().mean()


def route_with_bias(logits: torch.Tensor, top_k: int, bias: torch.Tensor):
    """DeepSeek-V3's routing (sec. 2.1.2): sigmoid affinities (T, E) fp32, experts
    (T, k) chosen by affinity + ``bias`` (E,), gates (T, k) from the affinities
    alone, normalized over the k chosen. Returns (scores, gates, experts)."""
    if bias.shape != logits.shape[-1:]:
        raise ValueError(f"bias must have one value per expert, shape {tuple(logits.shape[-1:])}, "
                         f"got {tuple(bias.shape)}")
    scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    experts = (scores + bias.to(scores.dtype)).topk(top_k, dim=-1).indices   # (T, k)
    chosen = scores.gather(-1, experts)                  # the unbiased affinities
    return scores, chosen / chosen.sum(dim=-1, keepdim=True), experts


def expert_load(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) long: routing choices each expert received, from experts (T, k)."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts)


def update_expert_bias(bias: torch.Tensor, experts: torch.Tensor, rate: float) -> torch.Tensor:
    """One step of DeepSeek-V3's bias update: b_i + rate * sign(mean load - load_i).
    An overloaded expert's bias drops by ``rate``, an underloaded one's rises, an
    expert exactly at the mean keeps its bias. Returns a new tensor."""
    load = expert_load(experts, bias.numel()).to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)
