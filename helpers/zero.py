"""ZeRO: shard the optimizer state, then the gradients, then the weights.

Plain data parallelism (DP) keeps a full copy of the *model state* on every
rank: weights, gradients and Adam's state. With mixed precision that is 16
bytes per parameter (2 bf16 weights + 2 bf16 grads + 12 for the fp32 master
copy and the two Adam moments), and N_d ranks hold N_d identical copies.
ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", sec. 5) removes the copies one part at a time:

    stage 0 (DP)  every rank: all 16 bytes/param           16 Psi
    stage 1       optimizer state sharded (P_os)            4 Psi + 12 Psi / N_d
    stage 2       + gradients sharded     (P_os+g)          2 Psi + 14 Psi / N_d
    stage 3       + weights sharded       (P_os+g+p)        16 Psi / N_d

(sec. 5.1, Figure 1; ``helpers.memory.model_state_bytes`` is the formula and
``ZeroOptimizer.state_bytes()`` measures the tensors this module really holds.)

How each stage works here
-------------------------
All trainable parameters are laid out in **flat buffers**. The buffer is cut
into buckets (stage 0-2: by size, in reverse registration order, about the
order backward produces gradients; stage 3: one bucket per module that owns
parameters). Each bucket is padded to a multiple of N_d so it splits into N_d
equal chunks, and rank r owns chunk r of every bucket. Padding is zeros and
stays zero under AdamW; it costs at most N_d - 1 elements per bucket. Every
buffer lives on the parameters' device (CPU with gloo, the rank's GPU with
nccl), so the same code runs on both. This layout (buckets padded, chunk r of
each) is PyTorch FSDP1's flat parameter. DeepSpeed lays it out otherwise:
ZeRO-1/2 flatten each parameter group once and give rank r one contiguous
1/N_d of the whole of it (one partition boundary per rank, not per bucket),
and ZeRO-3 partitions each parameter on its own. The bytes per rank and the
communication volume are the same; what differs is which elements a rank
owns and how many pieces a collective moves.

* stage 0: gradients all-reduced (averaged), every rank runs AdamW on all of
  it. This is DP, kept for comparison.
* stages 0-1 average the gradients inside ``step()`` (or
  ``clip_grad_norm_()``), not during backward: between ``backward()`` and
  ``step()`` each ``p.grad`` holds this rank's *local* gradient, where DDP's
  would already hold the average. Read gradients after ``step()``'s
  reduction, or use stage 2-3's shards, if you need the average.
* stage 1: every rank still computes the full gradient. ``step()``
  reduce-scatters it (rank r receives the average of chunk r), updates its
  chunk of the fp32 master weights with Adam moments it alone holds, then
  all-gathers the updated chunks so every rank has the new full weights.
  Reduce-scatter + all-gather move the same bytes as one all-reduce
  (sec. 7.2.1), so stage 1 is free in communication.
* stage 2: the same, but each bucket is reduce-scattered *during backward*,
  as soon as its gradients exist (like DDP's buckets), and the full-size
  gradients are dropped right after: a rank keeps only its gradient chunk.
* stage 3: a rank keeps only its chunk of the weights too. A forward
  pre-hook on each module all-gathers that module's parameters just before it
  runs, a forward hook frees them after; a hook on the module's output
  gathers them again when backward reaches the module, and once all of the
  module's gradients have been accumulated they are reduce-scattered and the
  parameters freed. Each parameter is gathered twice per step and its
  gradient reduce-scattered once: 1.5x DP's volume (sec. 7.2.2).

"Freeing" keeps the parameter tensors (autograd saved them, some as views)
and shrinks their shared storage to 0 bytes; gathering grows it back and
fills it. That is how PyTorch's first FSDP did it.

Gradients: accumulation and who clears them
-------------------------------------------
Several ``backward()`` calls before one ``step()`` accumulate, as with any
PyTorch optimizer (chapter 05's micro-batches; scale each loss by 1/accum).
In stages 0-1 autograd adds into the flat gradient buffer. In stages 2-3
every backward reduce-scatters its own buckets and *adds* the result into
the rank's gradient shard (the full gradients are gone by then); the end of
each backward waits for those reduce-scatters (a callback queued on the
autograd engine, as DDP does). This is what DeepSpeed's stages 2-3 do: one
reduce-scatter per micro-batch, no ``no_sync``.

``step()`` consumes the gradients it applies: afterwards every stage's
gradient buffer or shard is zero. A stage-2/3 rank cannot notice
``model.zero_grad()`` (its ``.grad`` fields are already None; the shard is
not a ``.grad``), so clearing in ``step()`` is the only rule that makes
``opt.zero_grad()``, ``model.zero_grad()`` and no zero_grad at all train the
same in every stage. DeepSpeed's engine does the same (its ``step()`` zeroes
the gradients). In stages 0-1 ``model.zero_grad()`` sets each ``p.grad``
to None, which cuts it off from the flat buffer; the next backward then
writes a fresh tensor, and a post-accumulate hook copies it back into the
buffer and re-links ``p.grad`` (``step()`` checks the links once more).

Precision: ``precision="fp32"`` (default) keeps weights, gradients and
moments in fp32 with no separate master copy (8 optimizer bytes/param), so a
run can be compared with ``torch.optim.AdamW`` op for op. Equal to what? To
DDP's recipe on the same ranks, bitwise on 2 ranks. Not to one process on
the global batch: that process sums the per-example gradients in one
reduction, N ranks sum B examples each and then the N partial sums, and fp32
addition is not associative. The two agree to fp32 rounding carried through
AdamW, not bit for bit (FSDP2 behaves the same way); ``tests/test_zero.py``
derives that bound against a float64 run. ``"bf16"`` or
``"fp16"`` is the paper's setting: 16-bit working weights and gradients
(also communicated in 16 bits), fp32 master weights and moments (12
bytes/param). There is no loss scaling here; fp16 in production needs it.

``comm_bytes()`` counts, per collective, the bytes one rank *sends* in the
last step under the ring algorithm's cost (reduce-scatter or all-gather of B
bytes: (N-1)/N * B; all-reduce: 2 (N-1)/N * B; Patarasuk & Yuan 2009). Gloo
does not report what it sends; the tensor sizes are real, the algorithm is
the model.

Stage 3 with fewer, larger collectives
--------------------------------------
One collective per module is what makes plain stage 3 slow on small modules:
a GPT block has six (two LayerNorms, four Linears), and each collective pays a
fixed latency. DeepSpeed's stage 3 has two knobs against that, kept here
under the same meaning (both off by default, so chapter 14 sees one
collective per module):

* ``prefetch_bucket_numel`` (DeepSpeed's ``stage3_prefetch_bucket_size``):
  the first step records the order in which modules ask for their weights
  (the *trace*). In later steps, when a module asks, the units the trace says
  come next are all-gathered too, in one coalesced, asynchronous collective,
  until that many elements are in flight. The next module then usually finds
  its weights already there. More elements in flight: fewer collectives,
  more overlap, more memory held. A step that leaves the trace (a different
  forward) simply stops prefetching until the next ``step()``.
* ``max_reuse_numel`` (DeepSpeed's ``stage3_max_reuse_distance``): a module
  done with its weights does not free them if the trace says they are needed
  again within that many elements of other units' requests (a tied
  embedding, or the last blocks, whose backward comes right after their
  forward). Without it, prefetch would gather a unit, free it, and gather it
  again one module later.
* ``reduce_bucket_numel`` (DeepSpeed's ``reduce_bucket_size``): gradients of
  finished units wait in a bucket until it holds that many elements, then
  one reduce-scatter handles them all.

A coalesced collective over several units lays their chunks out rank by
rank: ``[rank 0: chunk of A, chunk of B | rank 1: chunk of A, chunk of B]``,
so rank r's piece is again "its chunk of every unit".

How production differs: DeepSpeed's ZeRO adds CPU/NVMe offload, contiguous memory defragmentation, keeping
small parameters unpartitioned (``stage3_param_persistence_threshold``),
and dynamic loss scaling. ``ZeroOptimizer`` applies one set of AdamW
hyperparameters to every parameter, as ``torch.optim.AdamW(model.parameters())``
does; ``ShardedOptimizer`` (stages 1-2) takes parameter groups and any
elementwise ``torch.optim`` optimizer, as ``ZeroRedundancyOptimizer`` does, and frozen parameters and buffers are replicated, never sharded (rank
0's copies are broadcast at construction, as DDP does).

Unused parameters, as DDP: a trainable parameter that got a gradient on some
rank but not on another is averaged with zeros from the others; one that got
no gradient on any rank is skipped by AdamW (no weight decay, no momentum, its
step count not advanced), as ``torch.optim`` skips a ``.grad`` that DDP left
None. Each ``step()`` all-reduces one flag per parameter to know (DDP
all-reduces the same "used" bitmap with ``find_unused_parameters=True``).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from helpers.memory import ModelStateBytes
from helpers.overlap import record_comm, wait_comm

__all__ = ["ZeroOptimizer", "ShardedOptimizer", "FlatPartition", "Bucket", "size_buckets", "ring_bytes_sent",
           "adamw_update", "reduce_scatter", "all_gather", "PRECISIONS"]

# torch >= 2.11 renamed the flat collectives; older releases have only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reduce_scatter(output, input, group=None, async_op=False):
    """Sum ``input`` (N * k elements) over the group; rank r gets elements [r k, (r+1) k)."""
    return _reduce_scatter(output, input, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False):
    """Concatenate every rank's ``input`` (k elements) in rank order into ``output`` (N k)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def ring_bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective on a buffer of ``nbytes`` (ring algorithm).

    ``nbytes`` is the full buffer: the input of a reduce-scatter, the output
    of an all-gather, the tensor of an all-reduce (Patarasuk & Yuan 2009).
    """
    if world_size == 1:
        return 0.0
    share = (world_size - 1) / world_size * nbytes
    if op == "all_reduce":
        return 2 * share
    if op in ("reduce_scatter", "all_gather", "broadcast"):
        return share
    raise ValueError(f"unknown collective {op!r}")


# --------------------------------------------------------------------------
# The partition: pure bookkeeping, no process group needed (unit-tested alone).
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bucket:
    params: tuple[int, ...]   # indices into the managed parameter list
    offsets: tuple[int, ...]  # where each parameter starts inside the bucket
    numel: int                # sum of the parameters' sizes
    padded: int               # numel rounded up to a multiple of world_size
    start: int                # where the bucket starts in the full flat buffer
    shard_start: int          # where this bucket's chunk starts in a rank's shard
    world_size: int

    @property
    def chunk(self) -> int:
        """Elements of this bucket each rank owns."""
        return self.padded // self.world_size


class FlatPartition:
    """Buckets of parameters in one flat buffer, each padded to split N ways.

    ``numels[i]`` is the size of parameter i; ``groups`` lists which
    parameters share a bucket (every index exactly once). Rank r owns chunk r
    of every bucket; its shard is those chunks back to back.
    """

    def __init__(self, numels: list[int], world_size: int, groups: list[list[int]]):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        seen = sorted(i for g in groups for i in g)
        if seen != list(range(len(numels))):
            raise ValueError("groups must list every parameter index exactly once")
        self.world_size = world_size
        self.numels = list(numels)
        self.buckets: list[Bucket] = []
        start = shard_start = 0
        for g in groups:
            offsets, n = [], 0
            for i in g:
                offsets.append(n)
                n += numels[i]
            padded = -(-n // world_size) * world_size  # ceil to a multiple of N
            b = Bucket(tuple(g), tuple(offsets), n, padded, start, shard_start, world_size)
            self.buckets.append(b)
            start += padded
            shard_start += b.chunk
        self.total = start             # full flat buffer, padding included
        self.shard_numel = shard_start  # one rank's shard
        self.padding = self.total - sum(numels)

    def shard_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """[lo, hi) of rank's chunk of ``bucket`` in the full flat buffer."""
        lo = bucket.start + rank * bucket.chunk
        return lo, lo + bucket.chunk


def size_buckets(numels: list[int], cap_numel: int) -> list[list[int]]:
    """Group parameter indices in reverse order into buckets of <= cap_numel
    elements (a bigger parameter gets a bucket of its own)."""
    groups, cur, size = [], [], 0
    for i in reversed(range(len(numels))):
        if cur and size + numels[i] > cap_numel:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += numels[i]
    if cur:
        groups.append(cur)
    return groups


def adamw_update(param, grad, exp_avg, exp_avg_sq, step: int, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step in place on flat fp32 tensors (Loshchilov & Hutter 2019, Alg. 2).

    The same elementwise operations, in the same order, as
    ``torch.optim.AdamW(foreach=False)``, so a shard updated here is bitwise
    equal to the same elements updated by PyTorch.
    """
    param.mul_(1 - lr * weight_decay)                    # decoupled weight decay
    exp_avg.lerp_(grad, 1 - beta1)                       # m = b1 m + (1 - b1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = b2 v + (1 - b2) g^2
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def _check_betas(betas) -> None:
    """AdamW's (beta1, beta2): two numbers in [0, 1), or a clear error."""
    ok = (isinstance(betas, (tuple, list)) and len(betas) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)
          and all(0 <= b < 1 for b in betas))
    if not ok:
        raise ValueError(f"betas must be two floats in [0, 1) (beta1 for the mean, beta2 for "
                         f"the mean square of the gradient), got {betas!r}")


# Modules whose forward reads their children's parameters without calling the
# children (nn.MultiheadAttention passes out_proj.weight to a functional): one
# stage-3 unit for the whole subtree. DeepSpeed's set_z3_leaf_modules does the same.
LEAF_MODULES: tuple[type, ...] = (nn.MultiheadAttention,)


def _unit_modules(model: nn.Module):
    """The model's modules in pre-order, each once, without descending into a
    module of ``LEAF_MODULES``."""
    seen: set[int] = set()

    def walk(module):
        if id(module) in seen:
            return
        seen.add(id(module))
        yield module
        if not isinstance(module, LEAF_MODULES):
            for child in module.children():
                yield from walk(child)
    return walk(model)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _is_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


# --------------------------------------------------------------------------
# The optimizer wrapper.
# --------------------------------------------------------------------------

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
    """

    def __init__(self, model: nn.Module, stage: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, process_group=None, precision: str = "fp32",
                 bucket_cap_mb: float = 25.0, timeline=None, prefetch_bucket_numel: int = 0,
                 max_reuse_numel: int = 0, reduce_bucket_numel: int = 0):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0 (DP), 1, 2 or 3, got {stage!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        _check_betas(betas)
        if not lr > 0 or not eps > 0 or not weight_decay >= 0:
            raise ValueError(f"invalid AdamW hyperparameters lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay}: need lr > 0, eps > 0, "
                             f"weight_decay >= 0")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        for name, value in (("prefetch_bucket_numel", prefetch_bucket_numel),
                            ("max_reuse_numel", max_reuse_numel),
                            ("reduce_bucket_numel", reduce_bucket_numel)):
            if not isinstance(value, int) or value < 0:
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
        self._hooks: list = []  # every hook handle: remove_hooks() takes them all out
        self._grad_chunks = None  # this step's averaged gradient chunks, once reduced
        self._inner = None  # ShardedOptimizer: the wrapped torch optimizer
        self.timeline = timeline  # a helpers.overlap.Timeline: comm spans and waits
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.dtype = PRECISIONS[precision]
        self.precision = precision
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        # Stage 0 replicates everything: a "partition" into one piece.
        self.shards = 1 if stage == 0 else self.world
        self.shard_rank = 0 if stage == 0 else self.rank  # which chunk this rank owns
        self.step_count = 0
        self._comm: dict[str, float] = {}
        self._comm_last: dict[str, float] = {}
        self._handles: list = []  # (work, bucket indices, output, name) of in-flight reduce-scatters
        self._pending: list = []  # stage 3: (bucket index, averaged full gradient) not yet sent
        self._callback_queued = False  # stages 2-3: end-of-backward callback queued
        # stage 3 prefetch: the recorded order of weight requests, and where we are in it
        self._trace: list[int] = []
        self._recording, self._pos = True, 0
        self._inflight: dict[int, tuple] = {}  # unit -> its (work, units, output) all-gather

        # Distinct trainable parameters (a tied weight appears once).
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._used = [False] * len(self.params)  # got a gradient here since the last step
        self._param_steps = [0] * len(self.params)  # AdamW steps taken by each parameter
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"all trainable parameters must be on one device (the flat buffers "
                             f"live there), found {sorted(map(str, devices))}: move the model "
                             f"with model.to(device) first")
        self.device = self.params[0].device
        numels = [p.numel() for p in self.params]
        if stage < 3:
            elem_bytes = torch.finfo(self.dtype).bits // 8
            cap = max(1, int(bucket_cap_mb * 2**20) // elem_bytes)
            # stage 2 reduces during backward, so it buckets; stages 0-1 reduce
            # once in step(), so one bucket (one collective) is enough.
            groups = size_buckets(numels, cap) if stage == 2 else [list(range(len(numels)))]
        else:
            groups = self._module_groups()
        self.partition = FlatPartition(numels, self.shards, groups)

        with torch.no_grad():
            self._broadcast_replicated()
            if stage < 3:
                self._setup_flat()
            else:
                self._setup_stage3()
        self._comm = {}
        # A weak reference: the model does not keep a removed optimizer alive.
        model._zero_optimizer = weakref.ref(self)

    @torch.no_grad()
    def remove_hooks(self) -> None:
        """Unwrap the model: take out every hook this optimizer registered, so the
        model can be trained plainly or wrapped again. Stage 3 first gathers the
        full weights and gives each parameter its own storage again (a
        collective: call on every rank). Gradients not yet stepped are dropped."""
        if self.stage == 3 and self._hooks:
            for bi in range(len(self.partition.buckets)):
                self._ensure_gathered(bi)
            for p in self.params:
                p.data = p.detach().clone()  # out of the unit's storage, which is freed
            for bi in range(len(self.partition.buckets)):
                _free(self.unit_full[bi])
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            p.grad = None

    # ---------------------------------------------------------------- setup
    def _module_groups(self) -> list[list[int]]:
        """Stage 3: one bucket per module that directly owns trainable params (a
        module of ``LEAF_MODULES`` owns its whole subtree's)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups, seen = [], set()
        self._module_units: list[tuple[nn.Module, list[int]]] = []
        for module in _unit_modules(self.model):
            mine = []
            units_needed = []
            for p in module.parameters(recurse=isinstance(module, LEAF_MODULES)):
                if id(p) not in index:
                    continue
                if id(p) not in seen:
                    seen.add(id(p))
                    mine.append(index[id(p)])
                else:  # a tied weight owned by an earlier module
                    units_needed.append(id(p))
            if mine:
                groups.append(mine)
            if mine or units_needed:
                self._module_units.append((module, mine and [len(groups) - 1] or [], units_needed))
        return groups

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

    def _setup_flat(self) -> None:
        """Stages 0-2: weights live in one flat buffer, params are views into it."""
        part, r = self.partition, self.shard_rank
        self.flat_param = self._zeros(part.total)
        for b in part.buckets:
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                seg = self.flat_param[b.start + off:b.start + off + p.numel()]
                seg.copy_(p.detach().reshape(-1))
                p.data = seg.view_as(p)
        self._broadcast(self.flat_param)
        # Stages 0-1 keep full gradients: p.grad is a view into one flat buffer,
        # so autograd accumulates straight into it and step() reduces it in place.
        if self.stage < 2:
            self.flat_grad = self._zeros(part.total)
            self._grad_views = [None] * len(self.params)
            for b in part.buckets:
                for i, off in zip(b.params, b.offsets):
                    p = self.params[i]
                    view = self.flat_grad[b.start + off:b.start + off + p.numel()].view_as(p)
                    self._grad_views[i] = p.grad = view
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._relink_grad(i)))
        else:
            self.grad_shard = self._zeros(part.shard_numel)
            self._install_grad_hooks()
        # fp32 master weights of this rank's chunks (a view of the weights in fp32 mode)
        chunks = [self.flat_param[slice(*part.shard_range(b, r))] for b in part.buckets]
        self._param_chunks = chunks
        self._init_optimizer_state(chunks)

    def _init_optimizer_state(self, chunks: list[torch.Tensor]) -> None:
        n = self.partition.shard_numel
        self.exp_avg = self._zeros(n, torch.float32)
        self.exp_avg_sq = self._zeros(n, torch.float32)
        if self.dtype == torch.float32:
            self.master = None
            self._master_chunks = chunks  # update the weights in place
        else:
            self.master = torch.cat([c.float() for c in chunks])
            self._master_chunks = [self.master[b.shard_start:b.shard_start + b.chunk]
                                   for b in self.partition.buckets]

    def _setup_stage3(self) -> None:
        part, r = self.partition, self.rank
        self.param_shard = self._zeros(part.shard_numel)
        self.grad_shard = self._zeros(part.shard_numel)
        self.unit_full: list[torch.Tensor] = []
        for b in part.buckets:
            full = self._zeros(b.padded)
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                seg = full[off:off + p.numel()]
                seg.copy_(p.detach().reshape(-1))
                p.data = seg.view_as(p)  # from now on p is a window into `full`
            self._broadcast(full)
            self.param_shard[b.shard_start:b.shard_start + b.chunk].copy_(
                full[r * b.chunk:(r + 1) * b.chunk])
            _free(full)  # the full weights exist only while a module runs
            self.unit_full.append(full)
        self._param_chunks = [self.param_shard[b.shard_start:b.shard_start + b.chunk]
                              for b in part.buckets]
        self._init_optimizer_state(self._param_chunks)
        owner = {}
        for bi, b in enumerate(part.buckets):
            for i in b.params:
                owner[id(self.params[i])] = bi
        for module, own, tied in self._module_units:
            units = sorted(set(own) | {owner[t] for t in tied})
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(units)))
            self._hooks.append(module.register_forward_hook(self._post_forward(units)))
        self._install_grad_hooks()

    # ------------------------------------------------------- stage 3 gather/free
    def gather_unit(self, bi: int) -> None:
        """A module needs unit ``bi``'s full weights: make sure they are there,
        then (with prefetch on) start gathering the units the trace says come next."""
        upcoming = self._follow_trace(bi)
        self._ensure_gathered(bi)
        if self.prefetch_bucket_numel and upcoming:
            self._prefetch(upcoming)

    def _ensure_gathered(self, bi: int) -> None:
        if bi in self._inflight:
            self._complete(self._inflight[bi])  # prefetched: usually already arrived
        elif not _is_allocated(self.unit_full[bi]):
            self._complete(self._start_gather([bi]))

    def _follow_trace(self, bi: int) -> range | list:
        """Record (first step) or follow (later steps) the order of weight requests;
        return the positions in the trace of the requests expected next."""
        if self._recording:
            self._trace.append(bi)
            return []
        if self._pos < len(self._trace) and self._trace[self._pos] == bi:
            self._pos += 1
        elif self._trace and self._trace[0] == bi:
            self._pos = 1  # a new forward from the top (e.g. after an evaluation pass)
        else:
            self._pos = len(self._trace) + 1  # off the trace: no prefetch until step()
            return []
        return range(self._pos, len(self._trace))

    def _prefetch(self, upcoming) -> None:
        """Gather upcoming units, in one collective, until prefetch_bucket_numel
        elements are in flight (DeepSpeed counts the same way)."""
        in_flight = sum(self.partition.buckets[j].padded for j in self._inflight)
        group: list[int] = []
        for pos in upcoming:
            if in_flight >= self.prefetch_bucket_numel:
                break
            j = self._trace[pos]
            if j in group or j in self._inflight or _is_allocated(self.unit_full[j]):
                continue
            group.append(j)
            in_flight += self.partition.buckets[j].padded
        if group:
            self._start_gather(group)

    def _start_gather(self, units: list[int]) -> tuple:
        """One asynchronous all-gather of ``units`` (coalesced if several)."""
        buckets = self.partition.buckets
        for j in units:
            _alloc(self.unit_full[j])
        name = f"all-gather {units[0]}" + (f"..{units[-1]}" if len(units) > 1 else "")
        if len(units) == 1:  # straight into the unit's storage
            inp, out = self._param_chunks[units[0]], self.unit_full[units[0]]
        else:  # rank-major layout: [rank 0: A, B, ... | rank 1: A, B, ... | ...]
            inp = torch.cat([self._param_chunks[j] for j in units])
            out = self._empty(self.world * inp.numel())
        work = self._issue(all_gather, out, inp, name)
        self._count("all_gather", sum(buckets[j].padded for j in units) * out.element_size())
        pending = (work, units, out, name)
        for j in units:
            self._inflight[j] = pending
        return pending

    def _complete(self, pending: tuple) -> None:
        """Wait for a gather and move coalesced results into each unit's storage."""
        work, units, out, name = pending
        if work is not None:
            self._wait(work, name)
        if len(units) > 1:
            columns, col = out.view(self.world, -1), 0
            for j in units:
                c = self.partition.buckets[j].chunk
                self.unit_full[j].view(self.world, c).copy_(columns[:, col:col + c])
                col += c
        for j in units:
            self._inflight.pop(j, None)

    def _issue(self, collective, out: torch.Tensor, inp: torch.Tensor, name: str):
        """Start ``collective(out, inp)`` asynchronously (None on one rank, where
        out is inp); recorded on the timeline."""
        if self.world == 1:
            out.copy_(inp)
            return None
        t0 = time.perf_counter()
        work = collective(out, inp, group=self.group, async_op=True)
        record_comm(self.timeline, work, name, t0)
        return work

    def _wait(self, work, name: str) -> None:
        wait_comm(self.timeline, work, name)

    def _release(self, bi: int) -> None:
        """A module is done with unit bi: free it, unless it is needed again soon."""
        if not self._reused_soon(bi):
            self.free_unit(bi)

    def _reused_soon(self, bi: int) -> bool:
        """Does the trace request bi again within max_reuse_numel elements?"""
        if not self.max_reuse_numel or self._recording or self._pos > len(self._trace):
            return False
        distance = 0
        for j in self._trace[self._pos:]:
            if j == bi:
                return True
            distance += self.partition.buckets[j].padded
            if distance > self.max_reuse_numel:
                return False
        return False  # not again in this step

    def free_unit(self, bi: int) -> None:
        if bi in self._inflight:  # never free storage a collective is writing into
            self._complete(self._inflight[bi])
        _free(self.unit_full[bi])

    def _pre_forward(self, units):
        def hook(module, args):
            for bi in units:
                self.gather_unit(bi)
        return hook

    def _post_forward(self, units):
        def hook(module, args, out):
            for bi in units:
                self._release(bi)
            # The output may be any pytree (nn.MultiheadAttention returns a tuple):
            # one hook over all its tensors that need a gradient, fired by the first
            # gradient that reaches any of them (FSDP2 does the same).
            outputs = [t for t in tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and outputs:
                register_multi_grad_hook(outputs, pre_backward, mode="any")
            return None

        def pre_backward(grad):
            # Fires when backward reaches this module's output: gather again.
            for bi in units:
                self.gather_unit(bi)
        return hook

    # ------------------------------------------------------- stage 2/3 gradients
    def _install_grad_hooks(self) -> None:
        self._bucket_of = {}
        for bi, b in enumerate(self.partition.buckets):
            for i in b.params:
                self._bucket_of[id(self.params[i])] = bi
        self._ready = [0] * len(self.partition.buckets)
        self._launched = [False] * len(self.partition.buckets)
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        self._used[self._index[id(p)]] = True
        if not self._callback_queued:
            # Runs once this backward has finished: reduce what is left, wait, add
            # into the gradient shard, and get the counters ready for the next one.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        bi = self._bucket_of[id(p)]
        self._ready[bi] += 1
        if self._ready[bi] == len(self.partition.buckets[bi].params):
            self._launch_bucket(bi)

    def _launch_bucket(self, bi: int) -> None:
        """Bucket bi's gradients are complete: average them into one flat buffer,
        drop the full ones, and reduce-scatter (now, or once the reduce bucket fills)."""
        b = self.partition.buckets[bi]
        buf = self._zeros(b.padded)  # padding stays 0
        for i, off in zip(b.params, b.offsets):
            p = self.params[i]
            if p.grad is not None:
                buf[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None  # a rank keeps only its chunk (stage >= 2)
        buf.div_(self.world)  # average, not sum, of the ranks' gradients
        self._launched[bi] = True
        if self.stage == 3:
            self._release(bi)
        self._pending.append((bi, buf))
        if sum(g.numel() for _, g in self._pending) >= self.reduce_bucket_numel:
            self._reduce_pending()

    def _reduce_pending(self) -> None:
        """One asynchronous reduce-scatter of every pending bucket (coalesced if several)."""
        if not self._pending:
            return
        units = [bi for bi, _ in self._pending]
        if len(units) == 1:
            inp = self._pending[0][1]
        else:  # rank-major layout, as in _start_gather: rank r receives its chunk of each
            inp = torch.cat([g.view(self.world, -1) for _, g in self._pending], dim=1).reshape(-1)
        self._pending = []
        out = self._empty(inp.numel() // self.world)
        name = f"reduce-scatter {units[0]}" + (f"..{units[-1]}" if len(units) > 1 else "")
        work = self._issue(reduce_scatter, out, inp, name)
        self._count("reduce_scatter", inp.numel() * inp.element_size())
        self._handles.append((work, units, out, name))

    def _end_backward(self) -> None:
        """End of one backward: every bucket reduce-scattered once, the results
        *added* into the gradient shard (so several backwards accumulate)."""
        self._callback_queued = False
        # Buckets whose gradients never arrived (an unused module) are reduced
        # now with zeros, in bucket order, identically on every rank.
        for bi, done in enumerate(self._launched):
            if not done:
                self._launch_bucket(bi)
        self._reduce_pending()
        with torch.no_grad():
            for work, units, out, name in self._handles:
                if work is not None:
                    self._wait(work, name)
                col = 0
                for bi in units:
                    b = self.partition.buckets[bi]
                    self.grad_shard[b.shard_start:b.shard_start + b.chunk].add_(
                        out[col:col + b.chunk])
                    col += b.chunk
        self._handles = []
        # A parameter's hook fires once per backward: reset the counts, or the
        # next micro-batch's buckets would never fill (and never be sent).
        self._ready = [0] * len(self.partition.buckets)
        self._launched = [False] * len(self.partition.buckets)

    # ------------------------------------------------------- stage 0/1 gradients
    def _relink_grad(self, i: int):
        """Stages 0-1: after p's gradient is accumulated, make sure it lives in the
        flat buffer (``model.zero_grad()`` or an assignment may have replaced it)."""
        def hook(p):
            self._used[i] = True
            self._link_grad(i)
        return hook

    @torch.no_grad()
    def _link_grad(self, i: int) -> None:
        p, view = self.params[i], self._grad_views[i]
        g = p.grad
        if g is None:
            view.zero_()  # no gradient since the last zero_grad(set_to_none=True)
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)  # a fresh tensor holds this backward's gradient: adopt it
        if p.grad is not view:
            p.grad = view

    # ------------------------------------------------------------------ step
    def _count(self, op: str, nbytes: int) -> None:
        self._comm[op] = self._comm.get(op, 0.0) + ring_bytes_sent(op, nbytes, self.world)

    @torch.no_grad()
    def _averaged_grad_chunks(self) -> list[torch.Tensor]:
        """This rank's chunk of the averaged gradient, one per bucket. Stages 2-3
        have it since backward; stages 0-1 reduce now (once per step: the result
        is kept for ``step()``, so clipping first costs no second reduction)."""
        if self._grad_chunks is not None:
            return self._grad_chunks
        part = self.partition
        if self.stage < 2:
            for i in range(len(self.params)):
                self._link_grad(i)  # every p.grad a view of flat_grad again
        if self.stage == 0:
            if self.world > 1:
                self.flat_grad.div_(self.world)
                dist.all_reduce(self.flat_grad, group=self.group)
            self._count("all_reduce", self.flat_grad.numel() * self.flat_grad.element_size())
            grad_chunks = [self.flat_grad[slice(*part.shard_range(b, 0))] for b in part.buckets]
        elif self.stage == 1:
            grad_chunks = []
            for b in part.buckets:
                src = self.flat_grad[b.start:b.start + b.padded].div(self.world)
                out = self._empty(b.chunk)
                if self.world > 1:
                    reduce_scatter(out, src, group=self.group)
                else:
                    out.copy_(src)
                self._count("reduce_scatter", src.numel() * src.element_size())
                grad_chunks.append(out)
        else:  # stages 2-3: reduce-scattered and summed into the shard during backward
            grad_chunks = [self.grad_shard[b.shard_start:b.shard_start + b.chunk]
                           for b in part.buckets]
        self._grad_chunks = grad_chunks
        return grad_chunks

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
            self._param_steps[i] += flag
        return [n if flag else None for n, flag in zip(self._param_steps, used)]

    def _update_segments(self, b: Bucket, steps: list[int | None]):
        """[lo, hi) ranges of this rank's chunk of bucket b, in chunk coordinates,
        with the AdamW step count of the parameters there: one range when every
        parameter of the bucket is at the same step (the usual case), else one
        per parameter, leaving out unused parameters and padding."""
        if len({steps[i] for i in b.params}) == 1 and steps[b.params[0]] is not None:
            return [(0, b.chunk, steps[b.params[0]])]
        base = self.shard_rank * b.chunk  # where this chunk starts inside the bucket
        out = []
        for i, off in zip(b.params, b.offsets):
            lo, hi = max(off, base), min(off + self.params[i].numel(), base + b.chunk)
            if lo < hi and steps[i] is not None:
                out.append((lo - base, hi - base, steps[i]))
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient so its global L2 norm is at most ``max_norm``;
        return the norm before clipping (fp32). Call between backward and step().

        Each rank holds only its chunks, so the norm is sqrt of the all-reduced
        sum of every rank's squared chunk norms (padding is zero and adds
        nothing); every rank then scales by the same factor
        ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
        does. ``clip_grad_norm_`` on ``model.parameters()`` would see only this
        rank's local (stages 0-1) or missing (stages 2-3) gradients, so ranks
        would clip by different factors. Stages 0-1 average here rather than in
        ``step()``; the all-reduce of one number is the only extra traffic."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        chunks = self._averaged_grad_chunks()
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for c in chunks:
            squares += c.float().pow(2).sum()
        if self.shards > 1:
            dist.all_reduce(squares, group=self.group)  # sum over ranks' chunks
            self._count("all_reduce", squares.element_size())
        norm = squares.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for c in chunks:
            c.mul_(coef.to(c.dtype))
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shard with the gradients accumulated since the last
        step, then zero those gradients (see "Gradients" in the module docstring)."""
        part = self.partition
        self.step_count += 1
        # 1. Averaged gradient of this rank's chunks, per bucket.
        grad_chunks = self._averaged_grad_chunks()
        self._grad_chunks = None  # consumed by this step
        if self.stage == 3:
            # Weights gathered ahead of a request that never came would be stale
            # after this update: drop them. The trace is complete after step 1.
            for bi in range(len(part.buckets)):
                self.free_unit(bi)
            self._recording, self._pos = False, 0
        # 2. AdamW on the chunks this rank owns, in fp32, skipping parameters that
        #    got no gradient on any rank (as torch.optim does after DDP).
        steps = self._count_param_steps()
        if self._inner is not None:  # ShardedOptimizer: any optimizer on the segments
            self._inner_step(grad_chunks, steps)
        else:
            for b, master, g in zip(part.buckets, self._master_chunks, grad_chunks):
                s = b.shard_start
                for lo, hi, step in self._update_segments(b, steps):
                    adamw_update(master[lo:hi], g[lo:hi].float(), self.exp_avg[s + lo:s + hi],
                                 self.exp_avg_sq[s + lo:s + hi], step, self.lr, self.beta1,
                                 self.beta2, self.eps, self.weight_decay)
        # 3. New weights where the forward pass will read them.
        if self.master is not None:
            for chunk, master in zip(self._param_chunks, self._master_chunks):
                chunk.copy_(master)  # fp32 -> bf16/fp16 working copy
        if self.stage in (1, 2):
            for b, chunk in zip(part.buckets, self._param_chunks):
                full = self.flat_param[b.start:b.start + b.padded]
                if self.world > 1:
                    all_gather(full, chunk.clone(), group=self.group)
                self._count("all_gather", full.numel() * full.element_size())
        # 4. The gradients are used up (stage 0's flat_grad now holds the average).
        self.zero_grad()
        self._comm_last, self._comm = self._comm, {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last ``step()``.

        Stages 0-1 keep ``p.grad`` as views of their flat buffer and zero it
        (``set_to_none`` is ignored: the buffer is reused); stages 2-3 zero the
        gradient shard (``p.grad`` is already None there)."""
        self._grad_chunks = None
        self._used = [False] * len(self.params)
        if self.stage < 2:
            self.flat_grad.zero_()
            for p, view in zip(self.params, self._grad_views):
                p.grad = view  # (re-)link: the next backward accumulates into the buffer
        else:
            self.grad_shard.zero_()
            for p in self.params:
                p.grad = None

    # ---------------------------------------------------------- measurements
    def comm_bytes(self) -> dict[str, float]:
        """Bytes this rank sent in the last step, by collective (ring model), plus 'total'."""
        out = dict(self._comm_last)
        out["total"] = sum(self._comm_last.values())
        return out

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

        if self.stage < 3:
            params = size([self.flat_param])
        else:
            params = size([self.param_shard] + self.unit_full)
        grads = size([p.grad for p in self.params]
                     + [getattr(self, "flat_grad", None), getattr(self, "grad_shard", None)])
        inner = [] if self._inner is None else [
            t for st in self._inner.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.numel() > 1]
        optimizer = size([self.master, self.exp_avg, self.exp_avg_sq] + inner)
        return ModelStateBytes(params=float(params), grads=float(grads),
                               optimizer=float(optimizer))

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full, in fp32, on the parameters' device: the
        weights the optimizer holds (in bf16/fp16 mode the fp32 master weights,
        not their 16-bit working copy). Collective: call on every rank (stages 1-3
        all-gather the shards; not counted in ``comm_bytes()``)."""
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
        if stage == 3:
            raise ValueError("stage 3 needs the model, not only its parameters: it gathers each "
                             "module's weights around that module's forward. Use "
                             "ZeroOptimizer(model, 3)")
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer takes stage 1 or 2, got {stage!r}")
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
        for k, (b, master) in enumerate(zip(self.partition.buckets, self._master_chunks)):
            base = self.shard_rank * b.chunk
            for i, off in zip(b.params, b.offsets):
                lo, hi = max(off, base), min(off + self.params[i].numel(), base + b.chunk)
                if lo < hi:
                    seg = master[lo - base:hi - base]
                    self._segments.append((k, lo - base, hi - base, i, seg))
                    inner_groups[group_of[id(self.params[i])]]["params"].append(seg)
        if not self._segments:
            raise ValueError(f"rank {self.rank} owns no element of any parameter: "
                             f"{self.partition.total} elements over {self.world} ranks")
        self._inner = optimizer_class(inner_groups, **defaults)

    @property
    def param_groups(self):
        """The wrapped optimizer's groups (of this rank's segments): set ``lr`` here."""
        return self._inner.param_groups

    def _inner_step(self, grad_chunks, steps) -> None:
        for k, lo, hi, i, seg in self._segments:
            # None: no gradient on any rank, the optimizer skips it (as after DDP)
            seg.grad = None if steps[i] is None else grad_chunks[k][lo:hi].to(seg.dtype)
        self._inner.step()
        for *_, seg in self._segments:
            seg.grad = None
