"""What every ZeRO stage shares: the optimizer's interface, its state, one step.

A stage is a subclass that says four things (read them in ``stages.py`` and
``stage3.py``):

* ``_bucket_groups``: which parameters share a bucket of the flat partition;
* ``_setup``: where weights and gradients live (flat buffers, shards, units);
* ``_reduce_grads``: how this rank gets its chunks of the *averaged* gradient;
* ``_publish_weights``: how the updated chunks reach the forward pass.

``step()`` is the same for all of them: averaged gradient chunks, one AdamW
update of the chunks this rank owns (``adamw.adamw_update``), publish the new
weights, clear the gradients. ``ZeroOptimizer(model, stage)`` picks the class
from ``STAGE_CLASSES``, which ``helpers/zero/__init__.py`` fills, so this
module imports no stage. Follows ZeRO (Rajbhandari et al. 2020, sec. 5).
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.clip import sharded_clip_grad_norm_
from helpers.comm import group_rank, ring_bytes_sent, world_size
from helpers.memory import ModelStateBytes
from helpers.validate import is_int
from helpers.zero.adamw import adamw_update, check_betas
from helpers.zero.partition import FlatPartition

__all__ = ["ZeroOptimizer", "PRECISION_DTYPES", "STAGE_CLASSES"]

# ``precision=`` name -> the dtype of the working weights and gradients (and of
# what is communicated); the master weights and Adam's moments stay fp32.
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# stage -> its class, for ``ZeroOptimizer(model, stage)``. This module knows no
# stage: ``helpers/zero/__init__.py`` imports the stage classes (``stages.py``,
# ``stage3.py``, which import this module) and fills the table.
STAGE_CLASSES: dict[int, type] = {}


class ZeroOptimizer:
    """AdamW with its state sharded over the data-parallel group, ZeRO stage 0-3.

    Use it like an optimizer: ``opt.zero_grad(); loss.backward(); opt.step()``,
    with one or several ``backward()`` calls per step (they accumulate);
    ``step()`` leaves the gradients zeroed, so ``model.zero_grad()`` or no
    zero_grad at all work too.
    ``timeline`` (a ``helpers.overlap.Timeline``) records the stage 2-3
    collectives issued during forward/backward and the time spent waiting.
    Each rank passes the loss of its own micro-batch; gradients are averaged
    over the group, so N ranks on N slices equal one process on the global
    batch. Construction broadcasts rank 0's weights (and frozen parameters and
    buffers), so ranks may start from different initializations.
    ``remove_hooks()`` unwraps the model; wrapping a model that is still
    wrapped is refused (its old hooks would keep firing).

    ``ZeroOptimizer(model, stage, ...)`` returns the stage's class
    (``ZeroStage0`` ... ``ZeroStage3``), each a ``ZeroOptimizer``.
    """

    def __new__(cls, model=None, stage=None, *args, **kwargs):
        if cls is ZeroOptimizer:  # the factory: one class per stage, from STAGE_CLASSES
            if stage not in STAGE_CLASSES:
                raise ValueError(f"stage must be 0 (DP), 1, 2 or 3, got {stage!r}")
            cls = STAGE_CLASSES[stage]
        return super().__new__(cls)

    def __init__(self, model: nn.Module, stage: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, process_group=None, precision: str = "fp32",
                 bucket_cap_mb: float = 25.0, timeline=None, prefetch_bucket_numel: int = 0,
                 max_reuse_numel: int = 0, reduce_bucket_numel: int = 0):
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"precision must be one of {sorted(PRECISION_DTYPES)}, "
                             f"got {precision!r}")
        check_betas(betas)
        if not lr > 0 or not eps > 0 or not weight_decay >= 0:
            raise ValueError(f"invalid AdamW hyperparameters lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay}: need lr > 0, eps > 0, "
                             f"weight_decay >= 0")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        for name, value in (("prefetch_bucket_numel", prefetch_bucket_numel),
                            ("max_reuse_numel", max_reuse_numel),
                            ("reduce_bucket_numel", reduce_bucket_numel)):
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (elements; 0 = off), got {value!r}")
            if value and stage != 3:
                raise ValueError(f"{name} is a stage-3 knob; stage {stage} got {value}")
        wrapped_by = getattr(model, "_zero_optimizer", lambda: None)()
        if wrapped_by is not None and wrapped_by._hooks:
            raise ValueError(
                f"this model is still wrapped by a ZeroOptimizer (stage {wrapped_by.stage}), whose "
                f"hooks would keep firing on every backward and corrupt training (re-running a "
                f"notebook cell wraps the model again): call remove_hooks() on that optimizer "
                f"first")
        self.prefetch_bucket_numel, self.max_reuse_numel = prefetch_bucket_numel, max_reuse_numel
        self.reduce_bucket_numel = reduce_bucket_numel
        self.model, self.stage, self.group = model, stage, process_group
        self.timeline = timeline  # a helpers.overlap.Timeline: comm spans and waits
        self.lr, self.eps, self.weight_decay = lr, eps, weight_decay
        self.beta1, self.beta2 = betas
        self.dtype = PRECISION_DTYPES[precision]
        self.precision = precision
        self.world = world_size(process_group)
        self.rank = group_rank(process_group)
        # Stage 0 replicates everything: a "partition" into one piece.
        self.shards = 1 if stage == 0 else self.world
        self.shard_rank = 0 if stage == 0 else self.rank  # which chunk this rank owns
        self.step_count = 0
        self._comm: dict[str, float] = {}
        self._comm_last: dict[str, float] = {}
        self._calls: dict[str, int] = {}       # collectives issued, by kind (this step)
        self._calls_last: dict[str, int] = {}
        self._hooks: list = []  # every hook handle: remove_hooks() takes them all out
        self._grad_chunks = None  # this step's averaged gradient chunks, once reduced

        # Distinct trainable parameters (a tied weight appears once).
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._used = [False] * len(self.params)  # got a gradient here since the last step
        self.param_steps = [0] * len(self.params)  # AdamW steps per parameter (checkpoints save them)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"all trainable parameters must be on one device (the flat buffers "
                             f"live there), found {sorted(map(str, devices))}: move the model "
                             f"with model.to(device) first")
        self.device = self.params[0].device
        numels = [p.numel() for p in self.params]
        elem_bytes = torch.finfo(self.dtype).bits // 8
        cap = max(1, int(bucket_cap_mb * 2**20) // elem_bytes)  # elements per bucket
        self.partition = FlatPartition(numels, self.shards, self._bucket_groups(numels, cap),
                                       shapes=[p.shape for p in self.params])
        with torch.no_grad():
            self._broadcast_replicated()
            self._setup()
        self._comm, self._calls = {}, {}
        # A weak reference: the model does not keep a removed optimizer alive.
        model._zero_optimizer = weakref.ref(self)

    # ------------------------------------------------------- what a stage says
    def _bucket_groups(self, numels: list[int], cap: int) -> list[list[int]]:
        """Which parameter indices share a bucket (``cap``: elements per bucket)."""
        raise NotImplementedError

    def _setup(self) -> None:
        """Lay out weights and gradients; set ``_param_chunks`` (this rank's weights
        per bucket) and call ``_init_optimizer_state``."""
        raise NotImplementedError

    def _reduce_grads(self) -> list[torch.Tensor]:
        """This rank's chunk of the averaged gradient, one per bucket."""
        raise NotImplementedError

    def _publish_weights(self) -> None:
        """After the update: put the new weights where the forward pass reads them."""

    def _before_update(self) -> None:
        """Called by step() once the gradients are reduced, before the update."""

    def _weight_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold this rank's weights (for ``state_bytes``)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- setup
    def _broadcast(self, t: torch.Tensor) -> None:
        if self.world > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                           group=self.group)

    def _broadcast_replicated(self) -> None:
        """Frozen parameters and buffers are not sharded, so each rank keeps its own
        copy: start every rank from rank 0's, as DDP does (a frozen embedding or a
        BatchNorm statistic that differed per rank would make the ranks compute
        different functions)."""
        trainable = {id(p) for p in self.params}
        for t in [p for p in self.model.parameters() if id(p) not in trainable] \
                + list(self.model.buffers()):
            self._broadcast(t.data)

    def _zeros(self, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A flat buffer of n elements on the parameters' device."""
        return torch.zeros(n, dtype=dtype or self.dtype, device=self.device)

    def _empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self.dtype, device=self.device)

    def _init_optimizer_state(self, chunks: list[torch.Tensor]) -> None:
        """Adam's moments for this rank's shard, and fp32 master weights of its
        chunks (in fp32 mode the chunks themselves: updated in place)."""
        n = self.partition.shard_numel
        self._param_chunks = chunks
        self.exp_avg = self._zeros(n, torch.float32)
        self.exp_avg_sq = self._zeros(n, torch.float32)
        if self.dtype == torch.float32:
            self.master = None
            self._master_chunks = chunks
        else:
            self.master = torch.cat([c.float() for c in chunks])
            self._master_chunks = [self.master[b.shard_start:b.shard_start + b.chunk]
                                   for b in self.partition.buckets]

    @torch.no_grad()
    def remove_hooks(self) -> None:
        """Unwrap the model: take out every hook this optimizer registered, so the
        model can be trained plainly or wrapped again. Gradients not yet stepped
        are dropped. (Stage 3 first gives the parameters their full weights.)"""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ step
    def _count(self, op: str, nbytes: int) -> None:
        self._comm[op] = self._comm.get(op, 0.0) + ring_bytes_sent(op, nbytes, self.world)
        self._calls[op] = self._calls.get(op, 0) + 1

    def _averaged_grad_chunks(self) -> list[torch.Tensor]:
        """``_reduce_grads()`` once per step: ``clip_grad_norm_`` and ``step`` share it."""
        if self._grad_chunks is None:
            self._grad_chunks = self._reduce_grads()
        return self._grad_chunks

    def _count_param_steps(self) -> list[int | None]:
        """Which parameters got a gradient on some rank since the last step: one
        all-reduce of a flag per parameter (DDP all-reduces the same "local used
        map" to find globally unused parameters and leaves their ``.grad`` None).
        Returns each parameter's AdamW step count, None for one to skip."""
        used = list(self._used)
        if self.world > 1:
            flags = torch.tensor(used, dtype=torch.float32, device=self.device)
            dist.all_reduce(flags, group=self.group)  # > 0: used on some rank
            used = [f > 0 for f in flags.tolist()]
        for i, flag in enumerate(used):
            self.param_steps[i] += flag
        return [n if flag else None for n, flag in zip(self.param_steps, used)]

    def _update_segments(self, bi: int, steps: list[int | None]):
        """[lo, hi) ranges of this rank's chunk of bucket bi, in chunk coordinates,
        with the AdamW step count of the parameters there: one range when every
        parameter of the bucket is at the same step (the usual case), else one
        per parameter (``FlatPartition.owned_ranges``), leaving out unused
        parameters and padding."""
        b = self.partition.buckets[bi]
        if len({steps[i] for i in b.params}) == 1 and steps[b.params[0]] is not None:
            return [(0, b.chunk, steps[b.params[0]])]
        out = []
        for o in self.partition.owned_ranges(self.shard_rank, buckets=[bi]):
            if steps[o.index] is not None:
                at = o.at - b.shard_start  # in chunk coordinates
                out.append((at, at + o.hi - o.lo, steps[o.index]))
        return out

    def _update(self, grad_chunks: list[torch.Tensor], steps: list[int | None]) -> None:
        """AdamW on the chunks this rank owns, in fp32, skipping parameters that got
        no gradient on any rank (as torch.optim does after DDP)."""
        for bi, (b, master, g) in enumerate(zip(self.partition.buckets, self._master_chunks,
                                                 grad_chunks)):
            s = b.shard_start
            for lo, hi, step in self._update_segments(bi, steps):
                adamw_update(master[lo:hi], g[lo:hi].float(), self.exp_avg[s + lo:s + hi],
                             self.exp_avg_sq[s + lo:s + hi], step, self.lr, self.beta1,
                             self.beta2, self.eps, self.weight_decay)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient so its global L2 norm is at most ``max_norm``;
        return the norm before clipping (fp32). Call between backward and step().

        Each rank holds only its chunks, so the norm is sqrt of the all-reduced
        sum of every rank's squared chunk norms (padding is zero and adds
        nothing); every rank then scales by the same factor
        ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
        does: ``helpers.clip.sharded_clip_grad_norm_``, which FSDP calls too.
        ``clip_grad_norm_`` on ``model.parameters()`` would see only this
        rank's local (stages 0-1) or missing (stages 2-3) gradients, so ranks
        would clip by different factors. Stages 0-1 average here rather than in
        ``step()``; the all-reduce of one number is the only extra traffic
        (stage 0: none, every rank holds the whole averaged gradient)."""
        if not max_norm > 0:  # before the gradients are reduced
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        norm = sharded_clip_grad_norm_(self._averaged_grad_chunks(), max_norm, group=self.group,
                                       shards=self.shards, device=self.device)
        if self.shards > 1:
            self._count("all_reduce", norm.element_size())
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shard with the gradients accumulated since the last
        step, then zero those gradients (see "Gradients" in ``helpers.zero``)."""
        self.step_count += 1
        grad_chunks = self._averaged_grad_chunks()  # 1. averaged gradient, my chunks
        self._grad_chunks = None  # consumed by this step
        self._before_update()
        self._update(grad_chunks, self._count_param_steps())  # 2. AdamW on them
        if self.master is not None:  # 3. new weights where the forward reads them
            for chunk, master in zip(self._param_chunks, self._master_chunks):
                chunk.copy_(master)  # fp32 -> bf16/fp16 working copy
        self._publish_weights()
        self.zero_grad()  # 4. the gradients are used up
        self._comm_last, self._comm = self._comm, {}
        self._calls_last, self._calls = self._calls, {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last ``step()``."""
        self._grad_chunks = None
        self._used = [False] * len(self.params)

    # ---------------------------------------------------------- measurements
    def comm_bytes(self) -> dict[str, float]:
        """Bytes this rank sent in the last step, by collective (ring model), plus 'total'.

        Not counted: the all-reduce of one 4-byte "used" flag per parameter tensor
        (unused parameters, see ``helpers.zero``), bookkeeping rather than model state."""
        out = dict(self._comm_last)
        out["total"] = sum(self._comm_last.values())
        return out

    def comm_calls(self) -> dict[str, int]:
        """Collectives this rank issued in the last step, by kind, plus 'total' (the
        ones ``comm_bytes`` counts: a stage-3 gather of several units, coalesced, is one).
        Each pays a collective's fixed latency whatever its size (chapter 03's alpha)."""
        out = dict(self._calls_last)
        out["total"] = sum(self._calls_last.values())
        return out

    def _optimizer_tensors(self) -> list[torch.Tensor | None]:
        return [self.master, self.exp_avg, self.exp_avg_sq]

    def state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds now in weights, gradients and optimizer state,
        measured from the storages of the tensors (each storage counted once)."""
        seen: set[int] = set()

        def size(tensors: Iterable[torch.Tensor | None]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.nbytes() == 0 or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            return total

        params = size(self._weight_tensors())
        grads = size([p.grad for p in self.params]
                     + [getattr(self, "flat_grad", None), getattr(self, "grad_shard", None)])
        optimizer = size(self._optimizer_tensors())
        return ModelStateBytes(params=float(params), grads=float(grads),
                               optimizer=float(optimizer))

    def holdings(self) -> dict[str, list[tuple[int, int]]]:
        """Which elements of the flat layout (``partition``'s index space, padding included)
        this rank holds *now*, per state: ``{"weights" | "grads" | "optimizer": [(lo, hi),
        ...]}``, sorted, merged. Read from the tensors themselves: a flat buffer whose
        storage has bytes holds every element, a shard this rank's chunk of every bucket,
        a stage-3 unit its bucket while gathered (its storage is 0 bytes when freed).
        The picture of chapter 14 (``helpers.drawing.zero``) draws these."""
        part = self.partition
        full = [(0, part.total)]
        mine = [part.shard_range(b, self.shard_rank) for b in part.buckets]

        def held(t):
            return t is not None and t.untyped_storage().nbytes() > 0

        weights: list[tuple[int, int]] = []
        if held(getattr(self, "flat_param", None)):
            weights += full
        if held(getattr(self, "param_shard", None)):
            weights += mine
        for b, u in zip(part.buckets, getattr(self, "units", [])):
            if held(u.full):
                weights.append((b.start, b.start + b.padded))
        grads: list[tuple[int, int]] = []
        if held(getattr(self, "flat_grad", None)):
            grads += full
        if held(getattr(self, "grad_shard", None)):
            grads += mine
        optimizer = mine if held(self.exp_avg) else []
        return {"weights": _merged(weights), "grads": _merged(grads),
                "optimizer": _merged(optimizer)}

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full, in fp32, on the parameters' device: the
        weights the optimizer holds (in bf16/fp16 mode the fp32 master weights,
        not their 16-bit working copy). Collective: call on every rank (stages 1-3
        all-gather the shards; not counted in ``comm_bytes()``)."""
        from helpers.comm import all_gather
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for b, master in zip(self.partition.buckets, self._master_chunks):
            full = torch.empty(b.padded, dtype=torch.float32, device=self.device)
            if self.shards > 1:
                all_gather(full, master.float().contiguous(), group=self.group)
            else:
                full.copy_(master)
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                out[names[id(p)]] = full[off:off + p.numel()].view(p.shape).clone()
        return out


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching [lo, hi) ranges joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out
