"""The mixture-of-experts layer, with its experts on one rank or split over ranks (EP).

Follows Switch Transformer (Fedus et al. 2021) and GShard (Lepikhin et al.
2020, sec. 2.2 and Alg. 1 for the padded dispatch; sec. 3.2 for expert
parallelism). The routing is ``helpers.moe.router``, the communication
``helpers.moe.dispatch``.

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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.moe.dispatch import all_to_all, alltoall_bytes, exchange_splits
from helpers.moe.router import (capacity_slots, expert_capacity, load_balancing_loss, route,
                                router_z_loss)
from helpers.validate import positive_int

__all__ = ["MoEConfig", "Expert", "MoEStats", "MoELayer", "MoEMLP"]


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
            positive_int(f"MoE {name}", v)
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
    aux_loss: torch.Tensor           # Switch eq. 4, scalar with grad
    z_loss: torch.Tensor             # ST-MoE eq. 5, scalar with grad
    capacity: int | None             # slots per expert (None: unlimited)
    dispatch_bytes: int = 0          # sent to other ranks by the dispatch all-to-all
    combine_bytes: int = 0           # sent to other ranks by the combine all-to-all
    split_bytes: int = 0             # the split-size exchange
    send_splits: list = dataclasses.field(default_factory=list)  # rows to each rank
    recv_splits: list = dataclasses.field(default_factory=list)  # rows from each rank
    remote_rows: torch.Tensor | None = None  # padded mode: kept rows sent to other ranks
    row_bytes: int = 0                        # padded mode: bytes of one row
    experts: torch.Tensor | None = None       # (T, k) the router's choices, best first

    # Counts read on the host are properties, computed when read: inside the step they
    # would make the CPU wait for the GPU once per layer (reading them afterwards costs
    # that wait once, outside the step).
    @property
    def dropped(self) -> int:
        """Routing choices over capacity."""
        return int((~self.kept).sum())

    @property
    def padding_bytes(self) -> int:
        """Padded mode: bytes of empty slots in the dispatch all-to-all (0 otherwise)."""
        if self.remote_rows is None:
            return 0
        return self.dispatch_bytes - int(self.remote_rows) * self.row_bytes


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
            kept=kept, capacity=C, experts=experts.detach(),
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
            stats.remote_rows = ((exp // El) != self.ep_rank).sum()     # kept rows leaving
            stats.row_bytes = row_bytes
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
        # The one host read a dropless dispatch cannot avoid: all_to_all takes its split
        # sizes as Python ints (production dispatchers copy them to the host too, and
        # choose where in the step to wait for that copy).
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
