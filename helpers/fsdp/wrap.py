"""The FSDP wrapper: cut the model into units, shard each, hook them in, undo it all.

Chapter 15, section "Units" (and its yardstick, PyTorch's FSDP2, in "Why
units" and "Same training as DDP and as PyTorch's FSDP2"). This module builds
the state; what a unit does during a step is ``helpers.fsdp.unit``, what
happens to its gradients ``helpers.fsdp.grads``.

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
registering it is not detected.) Parameters named in ``ignored_params`` join
no unit: they stay full on every rank (``helpers.fsdp.grads`` says how they
train).

Wrapping changes the model in place: its parameters become views into the
units' (mostly freed) buffers and it carries FSDP's hooks. ``unwrap()`` removes
every hook and gives each parameter its own tensor with the trained weights.
Wrapping a model that is still wrapped (a notebook cell run twice) is refused:
the old hooks would keep firing on the new wrapper's weights.

How production differs: FSDP2's ``fully_shard`` is applied module by module,
bottom-up (``torch_fsdp2`` below does it), rather than by one wrapper walking
a policy, and it shards each parameter on its own (``helpers.fsdp`` says
more). Here units live on the parameters' device (CPU with gloo, the rank's
GPU with nccl); nothing is offloaded.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.comm import all_gather, group_rank, ring_bytes_sent, world_size
from helpers.fsdp.grads import ShardedGrads
from helpers.fsdp.unit import Unit, UnitLife, next_unit_prefetch
from helpers.unit_gather import register_unit_hooks

__all__ = ["FSDP", "block_policy", "torch_fsdp2"]


def block_policy(module: nn.Module) -> bool:
    """Wrap each transformer block of ``helpers.model`` as a unit."""
    from helpers.model import Block
    return isinstance(module, Block)


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


class FSDP(UnitLife, ShardedGrads, nn.Module):
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

    The methods come in three parts, one file each: this one builds the units
    and registers the hooks; ``UnitLife`` (``helpers.fsdp.unit``) gathers and
    frees them; ``ShardedGrads`` (``helpers.fsdp.grads``) reduces, clips and
    shows their gradients.
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
        self._comm: dict[str, float] = {}       # bytes sent in this step, by collective
        self._comm_last: dict[str, float] = {}  # ... in the last finished step
        self._gathered_now = 0                  # bytes of full weights held now
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
        self.units: list[Unit] = []
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
        for u in self.all_units:  # count the unit's gradients; the last one reduces them
            for p in u.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate(u)))
        for m in [model] + [u.module for u in self.units]:  # refuse a second wrap (see unwrap)
            m.__dict__[_WRAPPED] = weakref.ref(self)
        self._callback_queued = False  # _finish_backward queued for this backward
        self._rs_in_flight = None  # (unit name, work, full-size input) of the last reduce-scatter

    def _make_unit(self, name, module, params) -> Unit:
        u = Unit(name, module, params, self.shard_size, self.shard_rank)
        if world_size() > 1:
            dist.broadcast(u.full, src=0)  # same start on every rank
        c = u.bucket.chunk
        u.shard.data.copy_(u.full[u.rank * c:(u.rank + 1) * c])
        if self.param_dtype not in (None, u.shard.dtype):
            # the gathered buffer in param_dtype (each gather makes the windows into it)
            u.full = torch.empty(u.full.numel(), dtype=self.param_dtype, device=u.full.device)
        u.free()  # gathered only while the unit runs
        u.shard_views()
        return u

    @property
    def all_units(self) -> list[Unit]:
        """Every unit: the policy's (``units``, in forward order, the indices the
        prefetch callback gets) and then the root, if any parameter was left to
        it. Each is a ``helpers.fsdp.unit.Unit``: ``params``, ``shapes``,
        ``shard``, ``part``, ``rank``."""
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

    # ------------------------------------------------------------ inspection
    def _count(self, op, nbytes, n):
        self._comm[op] = self._comm.get(op, 0.0) + ring_bytes_sent(op, nbytes, n)

    def comm_bytes(self) -> dict[str, float]:
        """Bytes this rank sent in the last forward + backward, by collective (ring model)."""
        out = dict(self._comm_last)
        out["total"] = sum(self._comm_last.values())
        return out

    def sharded_numel(self) -> int:
        return sum(u.shard.numel() for u in self.all_units)

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
