"""Mixture-of-experts MLP and expert parallelism (EP) on real ranks (chapter 21).

A mixture-of-experts (MoE) layer replaces one MLP by ``E`` MLPs ("experts")
and a *router* that sends each token to its ``k`` best experts only, so the
layer holds E times the MLP's parameters while each token pays for k MLPs'
FLOPs (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; GShard,
Lepikhin et al. 2020; Mixtral, Jiang et al. 2024). Expert parallelism splits
the experts over ranks and moves tokens to them with all-to-alls. One
mechanism per module, each opening with what it implements and its source:

* ``router``: top-k gating, expert capacity and which choices it drops, the
  load-balancing loss (Switch eq. 4) and the router z-loss (ST-MoE eq. 5);
* ``dispatch``: the split-size exchange and the differentiable token
  all-to-all (``helpers.collectives.alltoall``, shared with Ulysses), and the
  bytes they send;
* ``layer``: ``MoELayer`` / ``MoEMLP``, local or expert-parallel, dropless
  (variable splits) or padded to capacity (GShard's fixed (E, C, H) buffers);
* ``gpt``: ``apply_moe`` / ``apply_ep`` on the course GPT, ``moe_stats``,
  ``moe_aux_loss``, ``moe_n_params``.

How production differs
----------------------
GShard/Switch on TPUs pad every expert's slot to C (fixed shapes, a dense
einsum dispatch; the ``padded`` mode here); Megatron-LM and DeepSpeed on GPUs send variable splits
like here, with fused permute kernels and grouped GEMMs instead of a Python
loop over experts; DeepSeek-V3 routes with sigmoid scores and bias-based
balancing instead of an aux loss. Here all E experts are built (same seed on
every rank) and the non-local ones discarded, which wastes memory at init
but makes the EP layer start from exactly the single-process weights.

Everything is re-exported here: ``from helpers.moe import MoELayer`` works as before.
"""

from helpers.moe.dispatch import all_to_all, alltoall_bytes, exchange_splits
from helpers.moe.gpt import apply_ep, apply_moe, moe_aux_loss, moe_n_params, moe_stats
from helpers.moe.layer import Expert, MoEConfig, MoELayer, MoEMLP, MoEStats
from helpers.moe.router import (capacity_keep, capacity_slots, expert_capacity,
                                load_balancing_loss, route, router_z_loss)

__all__ = ["MoEConfig", "MoELayer", "MoEMLP", "MoEStats", "Expert", "load_balancing_loss",
           "router_z_loss", "route", "capacity_keep", "capacity_slots", "expert_capacity",
           "exchange_splits", "all_to_all", "alltoall_bytes", "apply_moe", "moe_n_params",
           "apply_ep", "moe_aux_loss", "moe_stats"]
