"""FSDP: fully sharded data parallelism, one unit of modules at a time.

FSDP is ZeRO stage 3 organised around *units* (Zhao et al. 2023, "PyTorch
FSDP: Experiences on Scaling Fully Sharded Data Parallel", sec. 3). A wrap
policy picks modules (here: each transformer ``Block``); each becomes a unit
whose parameters are flattened into one buffer, padded to a multiple of the
shard group size, and sharded: rank r keeps chunk r. Whatever the policy did
not pick forms the *root* unit (embeddings, final LayerNorm, head). A weight
shared between two units, or between a unit and the root's own modules (a
tied embedding and head under a policy that picks the embedding), is given to
the root, their common ancestor, as FSDP does: the root stays gathered for
the whole step, so no user of the weight finds it freed. (Sharing is seen
through registration: a module that reads another's weight without
registering it is not detected.)

A unit's life in one training step (sec. 3.2, Figure 3):

    forward:   all-gather its weights -> run its forward -> free them
               (``reshard_after_forward=True``; False keeps them until backward,
               trading memory for one all-gather less)
    backward:  all-gather again -> run its backward -> reduce-scatter the
               gradients (rank r gets the average of chunk r) -> free them

"Its backward starts" is seen as the first gradient arriving at any of the
unit's outputs: one multi-grad hook (``register_multi_grad_hook``, mode
"any") over every tensor of the output pytree, so a unit may return a tuple,
as ``nn.MultiheadAttention`` does, or any nesting of tensors.
These hooks and the unit's buffer (gather into it asynchronously, never
free it under a gather in flight) are ``helpers.unit_gather``, the same code
ZeRO stage 3 runs (``helpers.zero.stage3``): FSDP is ZeRO-3 with units chosen
by a policy.

Only one or two units are ever full at a time, so the peak weight memory is a
shard of everything plus the largest units, not the whole model. The root
unit is gathered when the model's forward starts and kept until its
gradients are reduced (its embedding is used first in forward and last in
backward, as FSDP2 does for the root). A reduce-scatter needs a full-size
gradient buffer as input; at most one is kept in flight, and it is retired
when the next unit's starts, so those buffers do not add up over the depth.

FSDP never sees ``optimizer.step()``, so it cannot free the units there as
ZeRO-3 does. A unit still gathered when a new forward starts from the root
is a leftover from a forward that had no backward (an evaluation pass
between ``backward()`` and ``step()``); its weights may be older than the
shards the optimizer has just updated, so the root's pre-forward hook frees
every leftover and the forward gathers afresh. A forward under
``torch.no_grad()`` frees the root (and, with ``reshard_after_forward=False``,
every unit) as soon as it ends: no backward will need them.

**Prefetch** (sec. 3.3.2): while unit i computes, the all-gather of the unit
that runs next (i+1 in forward, i-1 in backward) is already issued
asynchronously, so its communication hides under unit i's compute. Without
prefetch each gather starts only when its unit is about to run, and the
rank waits: that wait is *exposed communication* (chapter 16 measures it
with ``helpers.overlap``).

**Hybrid sharding** (HSDP, sec. 3.4): shard inside a group of ranks (a node,
fast links) and replicate across groups. Gradients are reduce-scattered in
the shard group, then all-reduced across the replicate group (only 1/S of
the bytes cross the slow links). ``hybrid_groups`` builds both kinds of
groups from one rank grid of shape (replicate, shard).

The optimizer is PyTorch's own: each unit's shard is an ``nn.Parameter``
(``FSDP.parameters()``) whose ``.grad`` is the averaged gradient chunk when
``loss.backward()`` returns, so ``torch.optim.AdamW(fsdp.parameters())``
updates exactly the elements this rank owns. Padding stays zero. Clip with
``fsdp.clip_grad_norm_(max_norm)``, not torch's: the norm of the whole
gradient needs every rank's chunks (one all-reduce of the squared norms).

**The model's own parameters** (FSDP1's ``use_orig_params=True``): while its
unit is gathered (its forward and backward), a parameter is its full-shape
window into the gathered buffer, in ``param_dtype``, with no ``.grad`` (the
gradient autograd accumulates there is full-size and is reduce-scattered
away). Otherwise, from the wrap on and whenever ``backward()`` has returned,
it is *this rank's piece*: ``p.data`` a 1-D view of the elements of the
flattened parameter that fall in this rank's chunk of the unit's shard (the
fp32 master weights, updated in place by the optimizer; maybe 0 elements),
and ``p.grad`` the matching view of ``shard.grad`` (fp32 under mixed
precision), so ``p.grad.shape == p.data.shape``. Hence ``p.shape`` outside
a unit's run is the piece's, not the parameter's: ``u.shapes`` keeps the
real ones. FSDP2 gives a DTensor instead, of full logical shape, whose
local part is a dim-0 shard. Writing into a ``.grad`` view changes what the
optimizer sees; dropping every ``.grad`` (``model.zero_grad()``) drops the
gradient at the unit's next gather, as FSDP1 writes back its parameters'
gradients; ``optimizer.zero_grad()`` clears the shards, and the views
follow at the next forward. ``sharded_grads()`` gives the same views, by
name with their offsets; ``full_grads()`` all-gathers them into full
shapes, for inspection.

**Mixed precision** (FSDP2's ``MixedPrecisionPolicy``; Micikevicius et al.
2018, "Mixed Precision Training", sec. 3.1): with ``param_dtype=torch.bfloat16``
the shards stay fp32, the master weights the optimizer updates, and each
gather first rounds this rank's chunk to bf16: half the bytes on the wire,
and the unit's forward and backward run in bf16 (floating-point inputs of the
root and of each unit are cast to bf16, as FSDP2's ``cast_forward_inputs``).
``reduce_dtype=torch.float32`` reduce-scatters the bf16 gradients in fp32, so
the sum over ranks loses nothing more; None reduces in bf16. The reduced
chunk becomes the fp32 shard's gradient.

**Ignored parameters** (``ignored_params``): left out of every unit, so they
stay full and replicated on every rank. Here, and this is the course's own
choice, they are then trained as under DDP: rank 0's values are broadcast at
construction, their gradients all-reduced and averaged when backward ends, and
``fsdp.parameters()`` yields them next to the shards. FSDP2's ``ignored_params``
only shares the first half: ``fully_shard`` neither shards them nor reduces
their gradients (its docstring, PyTorch 2.13: "They will not be sharded, nor
moved to the device during init, nor have their gradients reduced in
backward"), so keeping the replicas equal is left to the caller. Meant for a
few small tensors (norms) or anything that must not be sharded; they keep
their own dtype under a mixed-precision policy.

Wrapping changes the model in place: its parameters become views into the
units' (mostly freed) buffers and it carries FSDP's hooks. ``unwrap()`` removes
every hook and gives each parameter its own tensor with the trained weights.
Wrapping a model that is still wrapped (a notebook cell run twice) is refused:
the old hooks would keep firing on the new wrapper's weights.

How production differs: PyTorch's FSDP2 (``fully_shard``) shards each
parameter separately as a DTensor along dim 0 (no flat buffer, so per-
parameter optimizers and state dicts are easy), uses CUDA streams and events
so gathers really run beside compute, offloads to CPU, and copies in and
out with fused kernels. FSDP1 used flat parameters like this module. Here:
units live on the parameters' device (CPU with gloo, the rank's GPU with
nccl), one process group per role, no offload, no ``output_dtype``; ignored
parameters are averaged synchronously at the end of backward, unbucketed.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from helpers.clip import sharded_clip_grad_norm_
from helpers.comm import all_gather, group_rank, reduce_scatter, ring_bytes_sent, world_size
from helpers.mesh import axis_groups
from helpers.overlap import issue_mark, record_comm, wait_comm
from helpers.unit_gather import UnitBuffer, register_unit_hooks, start_gather
from helpers.zero import FlatPartition

__all__ = ["FSDP", "GradShard", "hybrid_grid", "hybrid_groups", "block_policy",
           "next_unit_prefetch", "torch_fsdp2"]


def block_policy(module: nn.Module) -> bool:
    """Wrap each transformer block of ``helpers.model`` as a unit."""
    from helpers.model import Block
    return isinstance(module, Block)


def next_unit_prefetch(fsdp: "FSDP", i: int, phase: str) -> None:
    """Default prefetch: after unit i is gathered, start gathering the unit that
    runs next: i + 1 in forward (i = -1 is the root, before block 0), i - 1 in
    backward (Zhao et al. 2023, sec. 3.3.2: forward and backward prefetch)."""
    j = i + 1 if phase == "forward" else i - 1
    if 0 <= j < len(fsdp.units):
        fsdp.gather_async(fsdp.units[j])


def hybrid_grid(world_size: int, shard_size: int) -> list[list[int]]:
    """Ranks as a (replicate, shard) grid: row i is shard group i.

    Column j (``[row[j] for row in grid]``) is replicate group j.
    ``hybrid_grid(4, 2) -> [[0, 1], [2, 3]]``.
    """
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide world_size={world_size}")
    sizes = {"replicate": world_size // shard_size, "shard": shard_size}
    return axis_groups("shard", ("replicate", "shard"), sizes)


def hybrid_groups(shard_size: int):
    """(shard_group, replicate_group) of the calling rank. Collective: every
    rank must call it (every rank takes part in creating every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = hybrid_grid(world, shard_size)
    mine_shard = mine_rep = None
    for row in grid:  # same creation order on every rank
        g = dist.new_group(row)
        if rank in row:
            mine_shard = g
    for j in range(shard_size):
        col = [row[j] for row in grid]
        g = dist.new_group(col)
        if rank in col:
            mine_rep = g
    return mine_shard, mine_rep


def torch_fsdp2(model: nn.Module, **fully_shard_kwargs) -> nn.Module:
    """PyTorch's FSDP2, the course's yardstick: ``fully_shard`` on each block,
    then on the root (the same units as ``FSDP`` with ``block_policy``).
    Keyword arguments go to every ``fully_shard`` call (e.g. ``mp_policy=
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``).

    The mesh is built on the device type of this rank's tensors. Left to
    itself FSDP2 takes the machine's accelerator, so on a GPU node whose ranks
    run gloo on the CPU (more ranks than GPUs) every rank crashed with a
    segmentation fault (seen on an H100 node).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, **fully_shard_kwargs)
    return fully_shard(model, mesh=mesh, **fully_shard_kwargs)


class GradShard(NamedTuple):
    """This rank's part of one parameter's gradient (``FSDP.sharded_grads``):
    elements ``[start, start + grad.numel())`` of the flattened gradient."""
    start: int
    grad: torch.Tensor | None


_WRAPPED = "_helpers_fsdp_wrapper"  # set on a wrapped model: a weak reference to its FSDP


def _refuse_if_wrapped(model: nn.Module) -> None:
    """A second FSDP over a wrapped model (a re-run notebook cell) would stack
    a second set of hooks on weights that are views into the first wrapper's
    freed buffers: refuse, and say how to undo the first wrap."""
    for name, m in model.named_modules():
        ref = m.__dict__.get(_WRAPPED)
        if ref is not None and ref() is not None:
            what = f"its submodule {name!r}" if name else "this model"
            raise ValueError(f"{what} is still wrapped by an earlier FSDP (its hooks and sharded "
                             f"weights are in place, e.g. from an earlier run of this cell): call "
                             f"unwrap() on that FSDP first, or build a fresh model")


class _Unit(UnitBuffer):
    """One FSDP unit: its parameters, a flat full buffer (``UnitBuffer``, gathered
    and freed as ZeRO-3's units are) and this rank's shard."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter],
                 shard_world: int, shard_rank: int):
        self.name, self.module, self.params = name, module, params
        # the parameters' own shapes: outside the unit's run p.shape is this rank's piece
        self.shapes = [p.shape for p in params]
        self.part = FlatPartition([p.numel() for p in params], shard_world,
                                  [list(range(len(params)))], shapes=self.shapes)
        b = self.part.buckets[0]
        self.bucket = b
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"unit {name!r}: its parameters must share one dtype and device "
                             f"(they share one flat buffer), found {sorted(map(str, kinds))}")
        dtype, device = params[0].dtype, params[0].device
        # (padded,): every rank's chunk back to back
        super().__init__(torch.zeros(b.padded, dtype=dtype, device=device))
        for p, off in zip(params, b.offsets):
            seg = self.full[off:off + p.numel()]
            seg.copy_(p.detach().reshape(-1))
            p.data = seg.view_as(p)  # p is now a window into `full`
        self.shard = nn.Parameter(torch.zeros(b.chunk, dtype=dtype, device=device))  # (padded / S,)
        self.rank = shard_rank
        # This rank's piece of each parameter (one entry per parameter, in order):
        # owned[i].lo:hi of the flattened parameter are shard[pieces[i][0]:pieces[i][1]]
        # (empty: the parameter lies wholly in other ranks' chunks).
        self.owned = self.part.owned_ranges(shard_rank, empty=True)
        self.pieces = [(o.at, o.at + o.hi - o.lo) for o in self.owned]
        self.views_of = None  # the shard.grad the parameters' .grad are views of
        self.ready = 0       # parameters whose gradient arrived in this backward
        self.reduced = False
        self.grad_chunk = None  # this rank's averaged gradient chunk, once reduced


class FSDP(nn.Module):
    """Shard ``model`` into units chosen by ``policy``; train with
    ``torch.optim.AdamW(fsdp.parameters())``.

    ``shard_group``: ranks that split each unit (default: all). With
    ``replicate_group`` as well (see ``hybrid_groups``) it is hybrid sharding.
    ``timeline``: a ``helpers.overlap.Timeline`` that records compute and
    communication spans, and on its lane "held" each unit from the launch of its
    gather to its free (the time its full weights take memory). ``prefetch``: True (``next_unit_prefetch``), False, or
    your own ``fn(fsdp, i, phase)`` called right after unit i is gathered
    (``phase`` "forward" or "backward"; i = -1: the root, before block 0).
    ``param_dtype`` / ``reduce_dtype``: the mixed-precision policy (None: the
    parameters' own dtype). ``ignored_params``: parameters left unsharded and
    replicated, their gradients averaged as DDP does (the course's choice;
    FSDP2 leaves ignored parameters' gradients unreduced).

    What other code may read (checkpointing does): ``shard_size`` (ranks in
    the shard group, S), ``replicate_size`` (replicas of each shard, R; 1
    without hybrid sharding), ``shard_rank``; ``units`` (the policy's units)
    and ``root``, ``all_units`` (both), ``ignored_params``; ``free(unit)``
    after writing into the shards; ``gather_async(unit)`` for a prefetch.
    """

    def __init__(self, model: nn.Module, policy: Callable[[nn.Module], bool] = block_policy,
                 reshard_after_forward: bool = True, prefetch=True,
                 shard_group=None, replicate_group=None, timeline=None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 ignored_params=None):
        super().__init__()
        for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise ValueError(f"{what} must be a floating-point torch.dtype or None, got {dt!r}")
        _refuse_if_wrapped(model)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters")
        if replicate_group is not None and shard_group is None:
            raise ValueError("hybrid sharding needs both shard_group and replicate_group "
                             "(build them with hybrid_groups(shard_size))")
        # Not registered as a submodule: fsdp.parameters() must yield only the
        # shards (what the optimizer updates), not the model's gathered views.
        self.__dict__["module"] = model
        if not (isinstance(prefetch, bool) or callable(prefetch)):
            raise ValueError(f"prefetch must be True, False or fn(fsdp, i, phase), got {prefetch!r}")
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = next_unit_prefetch if prefetch is True else prefetch or None
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.timeline = timeline
        # Mixed precision (FSDP2's MixedPrecisionPolicy): units are gathered and
        # computed in param_dtype, gradients reduced in reduce_dtype (None: in
        # the gradient's own dtype, param_dtype), shards stay in the parameters'
        # dtype: the fp32 master weights the optimizer updates.
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        # ranks that split each unit (S), ranks that hold the same shards (R, hybrid)
        self.shard_size = world_size(shard_group)
        self.replicate_size = world_size(replicate_group) if replicate_group else 1
        self.shard_rank = group_rank(shard_group)
        self._comm: dict[str, float] = {}
        self._comm_last: dict[str, float] = {}
        self._gathered_now = 0
        self.peak_gathered_bytes = 0

        # Units: policy-picked modules (outermost first, in registration order =
        # forward order for a GPT), then the root with everything left over.
        picked, taken = [], set()
        owned = {id(p) for p in model.parameters()}
        ignored = list({id(p): p for p in ignored_params or []}.values())
        for p in ignored:
            if id(p) not in owned:
                raise ValueError(f"ignored_params: a parameter of shape {tuple(p.shape)} is not "
                                 f"a parameter of the model")
        taken.update(id(p) for p in ignored)  # never sharded (see _average_ignored)
        for name, m in model.named_modules():
            if m is model or not policy(m):
                continue
            if any(name.startswith(n + ".") for n, _ in picked):
                continue  # nested inside an already picked unit
            picked.append((name, m))
        # A parameter registered under several names (a tied embedding and head)
        # belongs to a unit only if every name lies inside it; one shared by two
        # units, or by a unit and the root's own modules, goes to their common
        # ancestor, the root (as FSDP does): the root stays gathered for the
        # whole step, so neither user reads it freed.
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        self.units: list[_Unit] = []
        with torch.no_grad():
            for name, m in picked:
                ps = [p for p in m.parameters() if p.requires_grad and id(p) not in taken
                      and all(n.startswith(name + ".") for n in names[id(p)])]
                taken.update(id(p) for p in ps)
                if ps:
                    self.units.append(self._make_unit(name, m, ps))
            rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
            self.root = self._make_unit("root", model, rest) if rest else None
        self._shards = nn.ParameterList([u.shard for u in self.all_units])
        # Ignored parameters: the model's own full tensors, replicated as in DDP
        # (rank 0's values to start, gradients averaged after backward).
        self._ignored = nn.ParameterList(ignored)
        if world_size() > 1:
            with torch.no_grad():
                for p in ignored:
                    dist.broadcast(p.data, src=0)

        # The model's own hooks first: its pre-forward runs before block 0's.
        # Every handle is kept: unwrap() removes them all.
        self._handles = [model.register_forward_pre_hook(self._root_pre_forward,
                                                         with_kwargs=True),
                         model.register_forward_hook(self._root_post_forward)]
        for i, u in enumerate(self.units):  # gather before forward and backward, free after
            self._handles += register_unit_hooks(u.module, self._pre_forward(i),
                                                 self._post_forward(i),
                                                 lambda i=i: self._pre_backward(i))
        for u in self.all_units:
            for p in u.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate(u)))
        for m in [model] + [u.module for u in self.units]:  # refuse a second wrap (see unwrap)
            m.__dict__[_WRAPPED] = weakref.ref(self)
        self._callback_queued = False
        self._rs_in_flight = None  # (unit name, work, full-size input) of the last reduce-scatter
        self._comm = {}

    # ------------------------------------------------------------ set-up
    def _make_unit(self, name, module, params) -> _Unit:
        u = _Unit(name, module, params, self.shard_size, self.shard_rank)
        if world_size() > 1:
            dist.broadcast(u.full, src=0)  # same start on every rank
        c = u.bucket.chunk
        u.shard.data.copy_(u.full[u.rank * c:(u.rank + 1) * c])
        if self.param_dtype not in (None, u.shard.dtype):
            # the gathered buffer in param_dtype (each gather makes the windows into it)
            u.full = torch.empty(u.full.numel(), dtype=self.param_dtype, device=u.full.device)
        u.free()  # gathered only while the unit runs
        self._shard_views(u)
        return u

    @property
    def all_units(self) -> list[_Unit]:
        """Every unit: the policy's (``units``, in forward order, the indices the
        prefetch callback gets) and then the root, if any parameter was left to
        it. Each holds ``params`` (the model's parameters in it), ``shapes``
        (their real shapes), ``shard`` (this rank's chunk, an ``nn.Parameter``),
        ``part`` (its ``FlatPartition``, one bucket) and ``rank`` (this rank's
        place in the shard group)."""
        return self.units + ([self.root] if self.root is not None else [])

    @property
    def ignored_params(self) -> list[nn.Parameter]:
        """The parameters left out of every unit (``ignored_params=`` at
        construction): full and replicated on every rank, averaged as DDP does."""
        return list(self._ignored)

    def forward(self, *args, **kwargs):
        if not self._handles:
            raise RuntimeError("this FSDP was unwrapped: call the model itself")
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def unwrap(self) -> nn.Module:
        """Undo the wrap: remove every hook and give each parameter of the model
        its own tensor again, holding the current (trained) weights, with no
        gradient. Returns the model, which trains on its own or can be wrapped
        again. Collective (it all-gathers the shards)."""
        full = self.full_parameters()
        for h in self._handles:
            h.remove()
        self._handles = []
        for u in self.all_units:
            self.free(u)
        for name, p in self.module.named_parameters():
            if name in full:
                p.grad = None
                p.data = full[name]
        for m in [self.module] + [u.module for u in self.units]:
            m.__dict__.pop(_WRAPPED, None)
        return self.module

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    # ------------------------------------------------------------ gather/free
    def _gather(self, u: _Unit, async_op: bool = False) -> None:
        if u.pending is not None:  # prefetched
            if not async_op:  # someone needs it now: wait for it
                u.wait()
            return
        if u.gathered:
            return
        nbytes = u.full.numel() * u.full.element_size()
        self._gathered_now += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_now)
        self._count("all_gather", nbytes, self.shard_size)
        if self.timeline is not None:  # the unit's full weights exist from now until free
            u.held_since = self.timeline.now()
        # (padded / S,) this rank's chunk, cast to param_dtype first: half the
        # bytes on the wire in bf16.
        chunk = u.shard.detach().to(u.full.dtype)
        start_gather([u], [chunk], self.shard_group, self.shard_size, self.timeline,
                     f"all-gather {u.name}")
        self._full_views(u)  # (its storage is allocated now; the weights land later)
        if not async_op:
            u.wait()

    def gather_async(self, u: _Unit) -> None:
        """Start gathering unit ``u`` without waiting (a no-op if it is full or on its way)."""
        self._gather(u, async_op=True)

    def free(self, u: _Unit) -> None:
        """Free unit ``u``'s gathered weights (a no-op if they are not there; waits
        first for a gather still writing into them): its parameters become this
        rank's pieces of the shard again. The hooks call it after each use; call
        it yourself after writing into the shards outside a step (a checkpoint
        load), or a unit still gathered would go on computing with the old
        weights. Not collective."""
        held = u.gathered
        if held:
            self._gathered_now -= u.full.numel() * u.full.element_size()
        u.free()  # (waits first for a gather still writing into it)
        self._shard_views(u)
        since = getattr(u, "held_since", None)
        if held and self.timeline is not None and since is not None:
            # lane "held": from the gather's launch to this free, the unit's full weights
            # take memory on this rank (chapter 15's picture of units' lives)
            self.timeline.add("held", u.name, since, self.timeline.now())
            u.held_since = None

    # ------------------------------------------------------------ the parameters' views
    # What a parameter of the model is (see "The model's own parameters" above):
    # a window into the gathered buffer while its unit runs, else this rank's
    # piece of the shard, with the matching piece of shard.grad as its .grad.

    def _full_views(self, u: _Unit) -> None:
        """The unit is about to be gathered: each parameter becomes its full-shape
        window into ``u.full``, with no ``.grad`` (backward accumulates a full one)."""
        self._write_back_grads(u)
        for p, off, shape in zip(u.params, u.bucket.offsets, u.shapes):
            p.grad = None  # the gradient lives on in u.shard.grad
            p.data = u.full[off:off + shape.numel()].view(shape)
        u.views_of = None

    def _shard_views(self, u: _Unit) -> None:
        """The unit is freed: each parameter becomes this rank's piece of the shard,
        its ``.grad`` the same piece of ``shard.grad`` (None if that is None)."""
        self._write_back_grads(u)
        g = u.shard.grad
        for p, (a, e) in zip(u.params, u.pieces):
            p.grad = None  # first: .grad must match .data's shape and dtype when set
            p.data = u.shard.detach()[a:e]
            p.grad = None if g is None else g[a:e]
        u.views_of = g

    @staticmethod
    def _write_back_grads(u: _Unit) -> None:
        """A user who set the parameters' ``.grad`` to None (``model.zero_grad()``)
        meant to drop those gradients: zero their pieces of ``shard.grad``, or drop
        it whole if every piece went. Only if ``shard.grad`` is still the tensor the
        views were made of: once the optimizer or backward replaced it, it wins."""
        g = u.shard.grad
        if g is None or g is not u.views_of:
            return
        dropped = [(a, e) for p, (a, e) in zip(u.params, u.pieces) if p.grad is None]
        if len(dropped) == len(u.params):
            u.shard.grad = None
        else:
            for a, e in dropped:
                g[a:e].zero_()

    def _wait(self, work, name) -> None:
        wait_comm(self.timeline, work, name)

    def _record_comm(self, work, name, t0):
        record_comm(self.timeline, work, name, t0)

    # ------------------------------------------------------------ hooks
    def _cast_inputs(self, args, kwargs):
        """Floating-point inputs to param_dtype, as FSDP2's cast_forward_inputs."""
        if self.param_dtype is None:
            return None

        def cast(t):
            floating = isinstance(t, torch.Tensor) and t.is_floating_point()
            return t.to(self.param_dtype) if floating else t
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_pre_forward(self, module, args, kwargs):
        # Whatever is still gathered is left over from a forward without backward
        # (see the module docstring): possibly older than the shards. Start clean.
        for u in self.all_units:
            self.free(u)
        if self.root is not None:
            self._gather(self.root)
        if self.prefetch is not None:
            self.prefetch(self, -1, "forward")
        return self._cast_inputs(args, kwargs)

    def _root_post_forward(self, module, args, out):
        if not torch.is_grad_enabled():  # no backward will follow: nothing stays gathered
            for u in self.all_units:
                self.free(u)

    def _pre_forward(self, i):
        def hook(args, kwargs):
            u = self.units[i]
            self._gather(u)
            if self.prefetch is not None:
                self.prefetch(self, i, "forward")
            if self.timeline is not None:
                u.t_fwd = self.timeline.now()
            return self._cast_inputs(args, kwargs)
        return hook

    def _post_forward(self, i):
        def hook():
            u = self.units[i]
            if self.timeline is not None:
                self.timeline.add("compute", f"forward {u.name}", u.t_fwd, self.timeline.now())
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self.free(u)
        return hook

    def _pre_backward(self, i) -> None:
        if not self._callback_queued:
            # Runs once backward has finished: wait for every reduce-scatter.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        u = self.units[i]
        self._gather(u)
        if self.prefetch is not None:
            self.prefetch(self, i, "backward")
        if self.timeline is not None:
            u.t_bwd = self.timeline.now()

    def _post_accumulate(self, u: _Unit):
        def hook(p):
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
                self._callback_queued = True
            u.ready += 1
            if u.ready == len(u.params):
                self._reduce(u)
        return hook

    def _reduce(self, u: _Unit) -> None:
        """Average this unit's gradients: reduce-scatter in the shard group,
        then (hybrid) all-reduce the chunk across the replicate group."""
        if self.timeline is not None and hasattr(u, "t_bwd"):
            self.timeline.add("compute", f"backward {u.name}", u.t_bwd, self.timeline.now())
        b = u.bucket
        # (padded,) on the unit's device, in reduce_dtype (default: the
        # gradients' dtype, that of the gathered weights); padding stays 0
        buf = torch.zeros(b.padded, dtype=self.reduce_dtype or u.full.dtype,
                          device=u.shard.device)
        for p, off, shape in zip(u.params, b.offsets, u.shapes):
            if p.grad is not None:
                buf[off:off + shape.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        buf.div_(self.shard_size * self.replicate_size)  # mean over every data-parallel rank
        out = torch.empty(b.chunk, dtype=buf.dtype, device=buf.device)  # (padded / S,)
        self._count("reduce_scatter", buf.numel() * buf.element_size(), self.shard_size)
        self._retire_reduce_scatter()
        if self.shard_size > 1:
            t0 = issue_mark(self.timeline)
            work = reduce_scatter(out, buf, group=self.shard_group, async_op=True)
            self._record_comm(work, f"reduce-scatter {u.name}", t0)
            self._rs_in_flight = (u.name, work, buf)
        else:
            out.copy_(buf)
        u.grad_chunk = out  # filled once the reduce-scatter has finished
        u.reduced = True
        self.free(u)

    def _retire_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter still in flight (it had a whole unit's
        backward to finish, so usually it has) and drop its full-size input.
        Keeping every unit's input to the end of backward would hold the
        whole model's gradients again; with one in flight at a time the
        extra is one unit's, whatever the depth (FSDP2 does the same)."""
        if self._rs_in_flight is not None:
            name, work, _ = self._rs_in_flight
            self._wait(work, f"reduce-scatter {name}")
            self._rs_in_flight = None  # the input buffer goes with it

    def _finish_backward(self) -> None:
        for u in self.all_units:
            if not u.reduced:  # parameters that got no gradient: reduce zeros
                self._reduce(u)
        self._retire_reduce_scatter()
        for u in self.all_units:
            out = u.grad_chunk  # every reduce-scatter has finished
            if self.replicate_size > 1:
                t0 = issue_mark(self.timeline)
                work = dist.all_reduce(out, group=self.replicate_group, async_op=True)
                self._record_comm(work, f"all-reduce {u.name}", t0)
                self._wait(work, f"all-reduce {u.name}")
                self._count("all_reduce", out.numel() * out.element_size(), self.replicate_size)
            out = out.to(u.shard.dtype)  # the master weights' dtype (a no-op in fp32)
            if u.shard.grad is None:
                u.shard.grad = out
            else:
                u.shard.grad.add_(out)  # gradient accumulation over backwards
            u.ready, u.reduced, u.grad_chunk = 0, False, None
            self.free(u)  # (waits first for a prefetch nobody used)
        self._average_ignored()
        self._callback_queued = False
        self._comm_last, self._comm = self._comm, {}

    def _average_ignored(self) -> None:
        """DDP for the ignored parameters: all-reduce each full gradient and
        divide by the number of data-parallel ranks (no bucketing or overlap:
        they are meant to be few and small). A parameter that got no gradient
        on this rank contributes zeros, so every rank calls every all-reduce."""
        for p in self._ignored:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.shard_size * self.replicate_size)
            for group, n in ((self.shard_group, self.shard_size),
                             (self.replicate_group, self.replicate_size)):
                if n > 1:
                    dist.all_reduce(p.grad, group=group)
                    self._count("all_reduce", p.grad.numel() * p.grad.element_size(), n)

    def _count(self, op, nbytes, n):
        self._comm[op] = self._comm.get(op, 0.0) + ring_bytes_sent(op, nbytes, n)

    # ------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the whole model's gradient has L2 norm
        at most ``max_norm``; return the norm before clipping. The same as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on
        one process; call it between ``backward()`` and ``optimizer.step()``.
        Collective.

        Rank r holds only chunk r of each unit's gradient, so torch's version
        over ``fsdp.parameters()`` would clip each rank by the norm of its own
        chunks: ranks would clip by different factors. Here each rank sums the
        squares of its chunks, one all-reduce over the shard group adds them
        (replicate groups hold copies of the same chunks: counted once), and
        every rank takes the same factor, ``max_norm / (norm + 1e-6)`` capped
        at 1 (torch's formula; the 1e-6 keeps a zero gradient finite).
        Padding is zero, so it adds nothing. The arithmetic is
        ``helpers.clip.sharded_clip_grad_norm_``, which ZeRO calls too.
        """
        # ignored parameters are replicated, their averaged gradient the same on
        # every rank: counted once, after the all-reduce
        return sharded_clip_grad_norm_(
            [u.shard.grad for u in self.all_units], max_norm, group=self.shard_group,
            shards=self.shard_size, replicated=[p.grad for p in self._ignored],
            device=next(self.parameters()).device)

    # ------------------------------------------------------------ inspection
    def comm_bytes(self) -> dict[str, float]:
        """Bytes this rank sent in the last forward + backward, by collective (ring model)."""
        out = dict(self._comm_last)
        out["total"] = sum(self._comm_last.values())
        return out

    def sharded_numel(self) -> int:
        return sum(u.shard.numel() for u in self.all_units)

    def sharded_grads(self) -> dict[str, "GradShard"]:
        """Each parameter's gradient as this rank holds it after backward: the
        slice ``[start, start + grad.numel())`` of the flattened parameter that
        falls in this rank's chunk, as a 1-D *view* into its unit's
        ``shard.grad`` (in the shards' dtype: fp32 master gradients under mixed
        precision). Writing into a view changes what the optimizer sees. This
        is FSDP1's ``use_orig_params=True`` view, the same piece that each
        parameter's own ``.grad`` is after backward (see the module docstring);
        FSDP2 gives each parameter a DTensor gradient sharded along dim 0
        instead. A slice may be empty (the parameter lies in other ranks'
        chunks); ignored parameters give their whole (averaged, replicated)
        gradient. ``grad`` is None before the first backward and after
        ``zero_grad()``. Not collective."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for p in self._ignored:
            g = None if p.grad is None else p.grad.view(-1)
            out[names[id(p)]] = GradShard(0, g)
        for u in self.all_units:
            g = u.shard.grad
            for o in u.owned:  # (FlatPartition.owned_ranges: one per parameter)
                out[names[id(u.params[o.index])]] = GradShard(
                    o.lo, None if g is None else g[o.shard_slice])
        return out

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient, full shape, in the shards' dtype:
        an all-gather of each unit's ``shard.grad`` into fresh tensors (for
        inspection and tests; the training state is not touched). Collective."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {names[id(p)]: p.grad.detach().clone() for p in self._ignored
               if p.grad is not None}
        for u in self.all_units:
            if u.shard.grad is None:
                continue
            full = torch.empty(u.full.numel(), dtype=u.shard.dtype, device=u.shard.device)
            if self.shard_size > 1:
                all_gather(full, u.shard.grad.detach(), group=self.shard_group)
            else:
                full.copy_(u.shard.grad)
            for p, off, shape in zip(u.params, u.bucket.offsets, u.shapes):
                out[names[id(p)]] = full[off:off + shape.numel()].view(shape).clone()
        return out

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, from the current shards (an all-gather of each
        unit into a fresh buffer; the units' own buffers are not touched, and
        ``comm_bytes()`` does not count it). Collective."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for p in self._ignored:
            out[names[id(p)]] = p.detach().clone()
        for u in self.all_units:
            # (padded,) in the shards' (master) dtype, whatever param_dtype is
            full = torch.empty(u.full.numel(), dtype=u.shard.dtype, device=u.shard.device)
            if self.shard_size > 1:
                all_gather(full, u.shard.detach(), group=self.shard_group)
            else:
                full.copy_(u.shard.detach())
            for p, off, shape in zip(u.params, u.bucket.offsets, u.shapes):
                out[names[id(p)]] = full[off:off + shape.numel()].view(shape).clone()
        return out
