"""ZeRO stages 1-2 around any torch optimizer, as ZeroRedundancyOptimizer is built.

``ZeroOptimizer`` hard-codes AdamW (``adamw.adamw_update``) with one set of
hyperparameters. ``ShardedOptimizer`` keeps its layout, reductions and hooks
and replaces only the update: the optimizer you name runs on this rank's
piece of each parameter, with that parameter's group options.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from helpers.zero.base import ZeroOptimizer
from helpers.zero.stages import ZeroStage1, ZeroStage2

__all__ = ["ShardedOptimizer"]

_NEEDS_MODEL = ("stage 3 needs the model, not only its parameters: it gathers each module's "
                "weights around that module's forward. Use ZeroOptimizer(model, 3)")


class ShardedOptimizer(ZeroOptimizer):
    """ZeRO stage 1 or 2 around any elementwise ``torch.optim`` optimizer, built
    like ``torch.distributed.optim.ZeroRedundancyOptimizer``::

        opt = ShardedOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                               lr=1e-3, weight_decay=0.1)
        opt = ShardedOptimizer([{"params": decay}, {"params": no_decay, "weight_decay": 0}],
                               torch.optim.AdamW, stage=2, lr=1e-3)

    The layout, reductions and hooks are ``ZeroOptimizer``'s; only the update
    differs: ``optimizer_class(groups, **defaults)`` runs on this rank's
    segments of each parameter (views of its fp32 chunk), so each group's
    options apply to its parameters' elements. That equals the optimizer on the
    full parameters only for optimizers that work element by element (SGD,
    Adam, AdamW, ...); one that uses a whole tensor's norm (LAMB, Adafactor)
    would see only a segment. torch's ``ZeroRedundancyOptimizer`` instead gives
    each rank whole parameters and broadcasts them after the step.

    Stage 3 needs the model (it gathers each module's weights around its
    forward): use ``ZeroOptimizer(model, 3)``. Unlike ``ZeroOptimizer`` nothing
    but the given parameters is broadcast at construction (no frozen weights or
    buffers are known); ``full_parameters()`` is keyed by each parameter's
    position, "0", "1", ....
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, stage: int = 1,
                 process_group=None, precision: str = "fp32", bucket_cap_mb: float = 25.0,
                 timeline=None, **defaults):
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        flat: list[nn.Parameter] = []
        for g in groups:
            g["params"] = list(g["params"]) if not isinstance(g["params"], torch.Tensor) \
                else [g["params"]]
            for p in g["params"]:
                if not isinstance(p, nn.Parameter):
                    raise ValueError(f"ShardedOptimizer shards nn.Parameter objects in place, got "
                                     f"a {type(p).__name__}")
                if any(p is q for q in flat):
                    raise ValueError("a parameter appears in more than one parameter group")
                flat.append(p)
        # Bad hyperparameters: the optimizer's own message, before anything is sharded.
        optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        holder = nn.ParameterList(flat)  # a module whose parameters() are exactly these
        super().__init__(holder, stage, process_group=process_group, precision=precision,
                         bucket_cap_mb=bucket_cap_mb, timeline=timeline)
        self.exp_avg = self.exp_avg_sq = None  # the wrapped optimizer keeps its own state
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        # (bucket, lo, hi, parameter index, segment): this rank's piece of each parameter
        self._segments = []
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                        for g in groups]
        for o in self.partition.owned_ranges(self.shard_rank):
            k = o.bucket
            lo = o.at - self.partition.buckets[k].shard_start  # in the bucket's chunk
            hi = lo + o.hi - o.lo
            seg = self._master_chunks[k][lo:hi]
            self._segments.append((k, lo, hi, o.index, seg))
            inner_groups[group_of[id(self.params[o.index])]]["params"].append(seg)
        if not self._segments:
            raise ValueError(f"rank {self.rank} owns no element of any parameter: "
                             f"{self.partition.total} elements over {self.world} ranks")
        self._inner = optimizer_class(inner_groups, **defaults)

    def __new__(cls, params=None, optimizer_class=None, stage: int = 1, *args, **kwargs):
        if cls is ShardedOptimizer:  # the factory: stage 1 or 2's layout and reductions
            if stage == 3:
                raise ValueError(_NEEDS_MODEL)
            if stage not in (1, 2):
                raise ValueError(f"ShardedOptimizer takes stage 1 or 2, got {stage!r}")
            cls = _ShardedStage1 if stage == 1 else _ShardedStage2
        return object.__new__(cls)

    @property
    def param_groups(self):
        """The wrapped optimizer's groups (of this rank's segments): set ``lr`` here."""
        return self._inner.param_groups

    def _optimizer_tensors(self):
        return [self.master] + [t for st in self._inner.state.values() for t in st.values()
                                if isinstance(t, torch.Tensor) and t.numel() > 1]

    def _update(self, grad_chunks, steps) -> None:
        """The wrapped optimizer on this rank's segments, with their averaged gradients."""
        for k, lo, hi, i, seg in self._segments:
            # None: no gradient on any rank, the optimizer skips it (as after DDP)
            seg.grad = None if steps[i] is None else grad_chunks[k][lo:hi].to(seg.dtype)
        self._inner.step()
        for *_, seg in self._segments:
            seg.grad = None


class _ShardedStage1(ShardedOptimizer, ZeroStage1):
    pass


class _ShardedStage2(ShardedOptimizer, ZeroStage2):
    pass
