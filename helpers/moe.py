"""Mixture-of-experts MLP and expert parallelism (EP) on real ranks.

What
----
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

Expert parallelism
------------------
With ``ep_group`` of size P, rank r keeps experts ``[r*E/P, (r+1)*E/P)`` and
its own batch of tokens (EP usually reuses the data-parallel ranks). A step:

1. route locally; sort the kept (token, expert) pairs by expert;
2. **exchange split sizes**: an all-to-all of the per-expert counts, so each
   rank learns how many rows it will receive from every other rank (the
   counts depend on the data, no rank can guess them);
3. **dispatch**: ``all_to_all_single`` of the token rows, variable splits;
4. each local expert runs on the rows it received from all ranks;
5. **combine**: the reverse all-to-all (splits swapped) returns the results;
   the source rank scales them by the gates and sums per token.

Two dispatch modes:

* **dropless / variable splits** (default): only the kept rows travel, so
  the split sizes must be exchanged first (step 2);
* **padded** (``padded=True``, needs a capacity): every expert gets a
  fixed buffer of C slots, the (E, C, H) tensor holds kept rows at their
  slot and zeros elsewhere (GShard sec. 2.2 and Alg. 1: the dispatch mask
  einsum "GSEC,GSM->EGCM"; Switch sec. 2.1; here an ``index_put`` does the
  same placement without the one-hot tensor). The all-to-all is then
  equal-sized, E/P * C rows to every rank whatever the routing: no split
  exchange, static shapes (what TPUs and CUDA graphs need), but the empty
  slots travel and get computed too. Bytes sent per all-to-all per rank:
  (P-1)/P * E * C * H * bytes, of which the padding is that minus the kept
  rows bound for other ranks (``MoEStats.padding_bytes``).

Backward runs the same two all-to-alls in reverse (``_AllToAll``): the
gradient of "send rows i..j to rank q" is "receive those rows' gradients back
from q". Router weights are replicated: their gradients are partial per rank
and must be summed/averaged over the data-parallel ranks like any DP weight.

Cost. Each all-to-all moves ``T_kept_remote * H * bytes`` from a rank, where
T_kept_remote is the number of kept (token, expert) pairs whose expert lives
elsewhere: with uniform routing a fraction (P-1)/P of k*T. Twice per layer in
forward (dispatch, combine) and twice in backward. Unlike an all-reduce, every
byte crosses to a distinct peer, so across nodes it runs at the slow link's
speed: EP groups are kept inside a node when possible.

How production differs
----------------------
GShard/Switch on TPUs pad every expert's slot to C (fixed shapes, a dense
einsum dispatch; the ``padded`` mode here); Megatron-LM and DeepSpeed on GPUs send variable splits
like here, with fused permute kernels and grouped GEMMs instead of a Python
loop over experts; DeepSeek-V3 routes with sigmoid scores and bias-based
balancing instead of an aux loss. Here all E experts are built (same seed on
every rank) and the non-local ones discarded, which wastes memory at init
but makes the EP layer start from exactly the single-process weights.
In the course GPT, MoE is applied to a built model: ``apply_moe(model,
num_experts, top_k, every=n)`` turns every n-th block's MLP into an MoE layer
(experts always have biases and no dropout, whatever the config says for the
dense MLPs), and ``apply_ep(model, group)`` splits every MoE layer's experts
over a group.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.model import GPTConfig, init_weights

__all__ = ["MoEConfig", "MoELayer", "MoEMLP", "MoEStats", "Expert", "load_balancing_loss",
           "router_z_loss", "route", "capacity_keep", "capacity_slots", "expert_capacity",
           "exchange_splits", "all_to_all", "alltoall_bytes", "apply_moe", "moe_n_params",
           "apply_ep", "moe_aux_loss", "moe_stats"]


@dataclasses.dataclass
class MoEConfig:
    """Sizes of one MoE layer; validated before any rank starts."""
    hidden: int
    ffn_hidden: int
    num_experts: int
    top_k: int = 1
    capacity_factor: float | None = None  # None: no capacity, no token dropped
    ep_size: int = 1                      # ranks the experts are split over
    padded: bool = False                  # fixed (E, C, H) buffers instead of variable splits

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn_hidden", "num_experts", "top_k", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoE {name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} is larger than num_experts="
                             f"{self.num_experts}: a token cannot pick more experts than exist")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None for no capacity), "
                             f"got {self.capacity_factor}")
        if self.padded and self.capacity_factor is None:
            raise ValueError("padded dispatch needs a capacity_factor: each expert's buffer "
                             "holds C = ceil(cf * tokens * k / E) slots")
        if self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts do not divide over expert-parallel "
                             f"size {self.ep_size}: each rank must hold the same number")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size


# --------------------------------------------------------------------------- routing

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


# --------------------------------------------------------------------------- communication

def exchange_splits(send_counts: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's per-expert counts for my experts: (E,) -> (P, E/P).

    ``send_counts[e]``: rows this rank sends to expert e. Row q of the result:
    rows rank q will send to each of my local experts. One all-to-all of
    P*(E/P) integers, before the token all-to-all can size its buffers.
    """
    P = dist.get_world_size(group)
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv.view(P, -1)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward is the reverse all-to-all.

    Forward: rows [sum(in_splits[:q]), +in_splits[q]) go to rank q. Backward:
    the gradient rows come back from q, so out/in splits swap (the all-to-all
    is a permutation of rows across ranks; its adjoint is the inverse
    permutation). Used twice per MoE layer, as in GShard (sec. 3.2).
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None):
    """Differentiable all_to_all_single of rows of ``x`` (see ``_AllToAll``)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def alltoall_bytes(in_splits: list[int], rank: int, row_bytes: int) -> int:
    """Bytes this rank sends to *other* ranks in one all-to-all (its own part stays)."""
    return sum(n for q, n in enumerate(in_splits) if q != rank) * row_bytes


# --------------------------------------------------------------------------- the layer

class Expert(nn.Module):
    """One expert: the course GPT's MLP (Linear -> GELU -> Linear)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(hidden, ffn_hidden)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(ffn_hidden, hidden)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


@dataclasses.dataclass
class MoEStats:
    """What one forward of a MoE layer did on this rank."""
    tokens_per_expert: torch.Tensor  # (E,) routing choices per expert, before capacity
    kept: torch.Tensor               # (T, k) bool: choice fit in its expert's capacity
    dropped: int                     # routing choices over capacity
    aux_loss: torch.Tensor           # Switch eq. 4, scalar with grad
    z_loss: torch.Tensor             # ST-MoE eq. 5, scalar with grad
    capacity: int | None             # slots per expert (None: unlimited)
    dispatch_bytes: int = 0          # sent to other ranks by the dispatch all-to-all
    combine_bytes: int = 0           # sent to other ranks by the combine all-to-all
    split_bytes: int = 0             # the split-size exchange
    padding_bytes: int = 0           # padded mode: empty slots in the dispatch all-to-all
    send_splits: list = dataclasses.field(default_factory=list)  # rows to each rank
    recv_splits: list = dataclasses.field(default_factory=list)  # rows from each rank


class MoELayer(nn.Module):
    """``MoELayer(hidden, ffn_hidden, num_experts, top_k=1, capacity_factor=None,
    ep_group=None, padded=False)``: ``layer(x) -> (y, MoEStats)`` for x of shape
    (..., hidden).

    ``ep_group``: a process group to split the experts over (None: all experts
    here, no communication). Every rank must build the layer with the same
    seed; rank r keeps its E/P experts (``self.expert_ids``). ``padded``: fixed
    (E, C, H) expert buffers and equal-sized all-to-alls (module docstring).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, ep_group=None, padded: bool = False):
        super().__init__()
        self.cfg = MoEConfig(hidden, ffn_hidden, num_experts, top_k, capacity_factor,
                             padded=padded)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn_hidden) for _ in range(num_experts))
        self.expert_ids = list(range(num_experts))
        self.ep_group, self.ep_rank = None, 0
        self.last_stats: MoEStats | None = None
        if ep_group is not None:
            self.shard_experts_(ep_group)

    def shard_experts_(self, ep_group) -> "MoELayer":
        """Keep only this rank's E/P experts; later forwards dispatch over ``ep_group``."""
        if self.ep_group is not None:
            raise ValueError("the experts of this layer are already split over a group")
        self.cfg = dataclasses.replace(self.cfg, ep_size=dist.get_world_size(ep_group))
        self.ep_group, self.ep_rank = ep_group, dist.get_rank(ep_group)
        lo = self.ep_rank * self.cfg.experts_per_rank
        self.expert_ids = list(range(lo, lo + self.cfg.experts_per_rank))
        self.experts = nn.ModuleList(self.experts[e] for e in self.expert_ids)
        return self

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # (T, H)
        cfg, T = self.cfg, x.size(0)
        logits = self.router(x)                                        # (T, E)
        probs, gates, experts = route(logits, cfg.top_k)               # (T, E), (T, k), (T, k)
        C = (None if cfg.capacity_factor is None
             else expert_capacity(T, cfg.num_experts, cfg.top_k, cfg.capacity_factor))
        slots = capacity_slots(experts, cfg.num_experts)               # (T, k)
        kept = slots < C if C is not None else torch.ones_like(slots, dtype=torch.bool)
        stats = MoEStats(
            tokens_per_expert=torch.bincount(experts.reshape(-1), minlength=cfg.num_experts),
            kept=kept, dropped=int((~kept).sum()), capacity=C,
            aux_loss=load_balancing_loss(probs, experts, cfg.num_experts),
            z_loss=router_z_loss(logits))

        # The kept (token, expert, gate) triples, sorted by expert (stable: token order).
        tok = torch.arange(T, device=x.device).unsqueeze(1).expand_as(experts)[kept]
        exp, gate = experts[kept], gates[kept]
        if cfg.padded:
            out = self._padded(x, tok, exp, slots[kept], C, stats)     # (N_kept, H)
            y = torch.zeros_like(x).index_add_(0, tok, out * gate.unsqueeze(1).to(out.dtype))
            self.last_stats = stats
            return y.reshape(shape), stats
        order = torch.argsort(exp, stable=True)
        tok, exp, gate = tok[order], exp[order], gate[order]
        rows = x[tok]                                                  # (N_kept, H)
        counts = torch.bincount(exp, minlength=cfg.num_experts)       # (E,)

        out = self._experts_ep(rows, counts, stats) if self.ep_group is not None \
            else self._run_local(rows, counts.view(1, -1))
        y = torch.zeros_like(x).index_add_(0, tok, out * gate.unsqueeze(1).to(out.dtype))
        self.last_stats = stats
        return y.reshape(shape), stats

    def _run_local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows grouped (source rank, local expert) with counts (P, E/P) -> expert outputs,
        same order. Each expert runs once on all its rows, from every source."""
        P, El = counts.shape
        pieces = list(rows.split(counts.reshape(-1).tolist()))   # pieces[q * El + j]
        outs = list(pieces)
        for j, expert in enumerate(self.experts):
            mine = [pieces[q * El + j] for q in range(P)]         # expert j's rows, by source
            sizes = [m.size(0) for m in mine]
            if sum(sizes):
                for q, o in enumerate(expert(torch.cat(mine)).split(sizes)):
                    outs[q * El + j] = o
        # empty pieces stay views of ``rows`` (times 0): ``out`` remains in the graph of
        # ``rows`` even when no expert runs here, so every rank's backward reaches both
        # all-to-alls.
        return torch.cat([o if o is not p else p * 0 for o, p in zip(outs, pieces)])

    def _padded(self, x, tok, exp, slot, C, stats: MoEStats) -> torch.Tensor:
        """Fixed-capacity dispatch: (E, C, H) buffers, equal all-to-alls, every slot computed.

        Returns the expert outputs of the kept (token, expert) pairs, in their order.
        """
        E, H, P, El = self.cfg.num_experts, x.size(1), self.cfg.ep_size, self.cfg.experts_per_rank
        buf = x.new_zeros(E, C, H).index_put((exp, slot), x[tok])      # zeros in empty slots
        if self.ep_group is not None:
            n = [El * C] * P                                           # the same to every rank
            row_bytes = H * x.element_size()
            stats.send_splits, stats.recv_splits = n, n
            stats.dispatch_bytes = stats.combine_bytes = alltoall_bytes(n, self.ep_rank,
                                                                        row_bytes)
            remote = int(((exp // El) != self.ep_rank).sum())          # kept rows leaving
            stats.padding_bytes = stats.dispatch_bytes - remote * row_bytes
            buf = all_to_all(buf.reshape(E * C, H), n, n, self.ep_group)  # (P * El * C, H)
            buf = buf.view(P, El, C, H).transpose(0, 1)                # (El, P, C, H)
        else:
            buf = buf.view(E, 1, C, H)                                 # (E, 1, C, H)
        # each local expert on all its slots, padding included (what fixed shapes cost)
        done = torch.stack([e(buf[j].reshape(-1, H)) for j, e in enumerate(self.experts)])
        done = done.view(buf.shape)
        if self.ep_group is not None:
            done = done.transpose(0, 1).reshape(E * C, H)              # source-rank order
            done = all_to_all(done, [El * C] * P, [El * C] * P, self.ep_group)
        return done.reshape(E, C, H)[exp, slot]                        # (N_kept, H)

    def _experts_ep(self, rows, counts, stats: MoEStats) -> torch.Tensor:
        P, El = self.cfg.ep_size, self.cfg.experts_per_rank
        recv_counts = exchange_splits(counts, self.ep_group)            # (P, E/P)
        send = counts.view(P, El).sum(1).tolist()                      # rows to each rank
        recv = recv_counts.sum(1).tolist()                             # rows from each rank
        row_bytes = rows.size(1) * rows.element_size()
        stats.send_splits, stats.recv_splits = send, recv
        stats.split_bytes = alltoall_bytes([El] * P, self.ep_rank, counts.element_size())
        stats.dispatch_bytes = alltoall_bytes(send, self.ep_rank, row_bytes)
        stats.combine_bytes = alltoall_bytes(recv, self.ep_rank, row_bytes)
        received = all_to_all(rows, recv, send, self.ep_group)         # (sum recv, H)
        done = self._run_local(received, recv_counts)
        return all_to_all(done, send, recv, self.ep_group)             # back, (N_kept, H)


class MoEMLP(MoELayer):
    """An ``MoELayer`` in a transformer block's MLP slot: ``forward(x) -> y`` like the
    MLP it replaces, so the block's ``x + mlp(ln(x))`` is unchanged (a token dropped
    by every expert passes through on the residual). The stats stay in
    ``.last_stats`` (``moe_stats(model)``, ``moe_aux_loss(model)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


# --------------------------------------------------------------------------- in a model

def _moe_layer_ids(n_layer: int, every: int) -> list[int]:
    """Blocks every-1, 2 every-1, ...: every ``every``-th block, the last one included
    when ``every`` divides the depth (Switch Transformer: every=2, Fedus et al. 2021,
    sec. 2.4 / App. A)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int (1: every block), got {every!r}")
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
