"""What a resume needs, captured and restored: RNG streams, ZeRO shards, a loss scaler.

Weights and optimizer moments are the obvious part. A run resumes *bitwise*
only if every source of change continues where it stopped:

* the RNG streams of every rank: torch's CPU generator (dropout masks, random
  init of anything built later), each CUDA device's, Python's ``random`` and
  NumPy's. A resume that forgets them redraws the dropout masks of step 0;
* the data position (``ShardedSampler.state_dict()``: epoch and step), or the
  resumed run sees the first batches of the epoch again and never sees others;
* the optimizer (Adam's moments *and* its step count, which sets the bias
  correction), the LR schedule's position, the loss scaler's scale and its
  count of clean steps.

``zero_state`` / ``load_zero_state`` express a ``helpers.zero.ZeroOptimizer``
(stages 0-3) as per-parameter ``Shard``s: the flat range of each parameter that
this rank owns in its chunk. That is independent of the world size (the padded
flat buffer is not), so a checkpoint written by 4 ranks loads on 2 or 3, each
new rank asking for the ranges of *its* chunks. DCP does the same per
parameter with its chunk metadata (``torch.distributed.checkpoint.metadata``).
Stages 0-2 keep the full weights on every rank, so a resume asks for whole
parameters; stage 3 keeps only its chunk of the weights (the fp32 master or
the shard itself), saved and asked for by range like the moments.

``fsdp_state`` / ``load_fsdp_state`` do the same for ``helpers.fsdp.FSDP``
trained by a ``torch.optim`` optimizer over ``fsdp.parameters()``: each unit's
flat shard is cut back into per-parameter ranges (weights, ``exp_avg``,
``exp_avg_sq``), with each parameter's step count and the optimizer's
hyperparameters (the LR a schedule has set). Ranges and global shapes are the
layout metadata: the units, the padding and the world size can all differ at
load time. Under hybrid sharding only the first replica saves (the others
hold the same chunks); ignored (replicated) parameters are saved by rank 0.
"""

from __future__ import annotations

import random
from typing import Any

import torch

import torch.distributed as dist

from helpers.checkpoint.store import CheckpointMismatch, Shard
from helpers.comm import group_rank

__all__ = ["rng_state", "set_rng_state", "scaler_state", "load_scaler_state", "zero_state",
           "zero_request", "load_zero_state", "zero_ranges", "fsdp_ranges", "fsdp_state",
           "fsdp_request", "load_fsdp_state", "training_state", "resume_request",
           "restore_training_state"]


def rng_state() -> dict:
    """Every RNG stream of this process, as tensors and plain values."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        # the (624,) uint32 key array as int64: weights_only loads take tensors, not ndarrays
        out["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    return out


def set_rng_state(state: dict) -> None:
    """Put every stream back where ``rng_state()`` found it."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"],
                             s["has_gauss"], s["cached"]))


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def scaler_state(scaler) -> dict:
    """A loss scaler's state: ``torch.amp.GradScaler.state_dict()``, or the scale and
    clean-step count of ``helpers.precision.DynamicLossScaler``."""
    if hasattr(scaler, "state_dict"):
        return scaler.state_dict()
    return {"scale": float(scaler.scale_value), "clean_steps": int(scaler.clean_steps)}


def load_scaler_state(scaler, state: dict) -> None:
    if hasattr(scaler, "load_state_dict"):
        scaler.load_state_dict(state)
    else:
        scaler.scale_value, scaler.clean_steps = float(state["scale"]), int(state["clean_steps"])


# --------------------------------------------------------------------------
# ZeRO stages 0-2 as per-parameter Shards.
# --------------------------------------------------------------------------

def zero_ranges(opt) -> list[tuple[str, torch.Size, int, int, int]]:
    """(name, shape, lo, hi, at) for each parameter piece this rank owns: elements
    [lo, hi) of the flattened parameter sit at ``at`` in the rank's shard
    (``opt.exp_avg``, ``opt.master``): ``FlatPartition.owned_ranges``, by name.
    Empty pieces are left out; padding is in no parameter's range, so it is
    never saved."""
    names = {id(p): n for n, p in opt.model.named_parameters()}
    return [(names[id(opt.params[o.index])], o.shape, o.lo, o.hi, o.at)
            for o in opt.partition.owned_ranges(opt.shard_rank)]


def _zero_weights(opt, name: str, lo: int, hi: int, at: int) -> torch.Tensor:
    """The fp32 weights of elements [lo, hi) of parameter ``name`` (at ``at`` in the shard)."""
    if opt.master is not None:  # bf16/fp16 working copy: the fp32 master is the truth
        return opt.master[at:at + hi - lo]
    if opt.stage == 3:  # the weights live only in the shard
        return opt.param_shard[at:at + hi - lo]
    return dict(opt.model.named_parameters())[name].detach().reshape(-1)[lo:hi]


def zero_state(opt) -> dict:
    """This rank's part of a ZeroOptimizer's state: the fp32 weights (the master
    copy in bf16/fp16 mode), both Adam moments, per parameter, plus the step counts."""
    # param_steps: AdamW's bias correction counts the steps each parameter took (one
    # no rank gave a gradient is skipped), so a resume needs them, not only step_count.
    state: dict[str, Any] = {"kind": f"zero{opt.stage}", "step_count": opt.step_count,
                             "param_steps": list(opt.param_steps),
                             "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    if opt.shards == 1 and opt.rank != 0:
        return state  # stage 0 replicates everything: rank 0's copy is enough
    for name, shape, lo, hi, at in zero_ranges(opt):
        n = hi - lo
        state["weights"][name] = Shard(_zero_weights(opt, name, lo, hi, at).clone(), shape, lo)
        state["exp_avg"][name] = Shard(opt.exp_avg[at:at + n].clone(), shape, lo)
        state["exp_avg_sq"][name] = Shard(opt.exp_avg_sq[at:at + n].clone(), shape, lo)
    return state


def zero_request(opt) -> dict:
    """The template ``load_latest(like=...)`` needs: this rank's ranges of the
    moments, and the weights: whole for stages 0-2 (every rank holds them),
    this rank's ranges for stage 3."""
    named = dict(opt.model.named_parameters())
    like: dict[str, Any] = {"kind": f"zero{opt.stage}", "step_count": 0,
                            "param_steps": [0] * len(opt.param_steps),
                            "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape, lo, hi, at in zero_ranges(opt):
        like["exp_avg"][name] = Shard.empty_like(shape, lo, hi - lo)
        like["exp_avg_sq"][name] = Shard.empty_like(shape, lo, hi - lo)
        if opt.stage == 3:
            like["weights"][name] = Shard.empty_like(shape, lo, hi - lo)
    if opt.stage != 3:
        for i, p in enumerate(opt.params):
            name = [n for n, q in named.items() if q is p][0]
            like["weights"][name] = Shard.empty_like(p.shape, 0, p.numel())
    return like


def _check_kind(state: dict, want: str) -> None:
    """Refuse a state written by another sharding scheme. Any ZeRO stage loads
    into any other (the same per-parameter ranges; a request for whole weights
    is assembled from stage 3's pieces), FSDP's into FSDP."""
    got = state.get("kind", "zero")  # written before kinds were recorded: stages 0-2
    if got.startswith("zero") != want.startswith("zero"):
        raise CheckpointMismatch(f"the checkpoint holds {got} state and this run is {want}: "
                                 f"load it into the same kind of optimizer")


@torch.no_grad()
def load_zero_state(opt, state: dict) -> None:
    """Write a loaded ``zero_request``-shaped state into ``opt`` (any world size)."""
    _check_kind(state, f"zero{opt.stage}")
    if len(state["param_steps"]) != len(opt.param_steps):
        raise CheckpointMismatch(f"the checkpoint counts steps for {len(state['param_steps'])} "
                                 f"parameters, this model has {len(opt.param_steps)}")
    named = dict(opt.model.named_parameters())
    if opt.stage != 3:
        for name, shard in state["weights"].items():
            p = named[name]
            p.data.copy_(shard.data.view(p.shape).to(p.dtype))  # p is a view of the flat buffer
    for name, shape, lo, hi, at in zero_ranges(opt):
        n = hi - lo
        opt.exp_avg[at:at + n].copy_(state["exp_avg"][name].data)
        opt.exp_avg_sq[at:at + n].copy_(state["exp_avg_sq"][name].data)
        w = state["weights"][name]
        w = w.data[lo - w.offset:hi - w.offset]  # whole parameter (stages 0-2) or my range
        if opt.master is not None:
            opt.master[at:at + n].copy_(w)
        if opt.stage == 3:
            opt.param_shard[at:at + n].copy_(w)  # (rounded to bf16/fp16 in those modes)
    if opt.stage == 3:
        for bi in range(len(opt.units)):
            opt.units[bi].free()  # a unit gathered before the load holds the old weights
    opt.step_count = int(state["step_count"])
    opt.param_steps[:] = [int(n) for n in state["param_steps"]]


# --------------------------------------------------------------------------
# helpers.fsdp.FSDP with a torch.optim optimizer, as per-parameter Shards.
# --------------------------------------------------------------------------

def fsdp_ranges(fsdp, saving: bool = False):
    """(name, shape, lo, hi, tensor, at) for each parameter piece this rank holds:
    elements [lo, hi) of the flattened parameter are elements [at, at + hi - lo)
    of ``tensor``, the unit's 1-D shard (an ``nn.Parameter`` the optimizer
    updates) or an ignored parameter itself. ``saving``: only the pieces this
    rank writes (first replica; ignored parameters on rank 0 only). Each
    unit's pieces are its ``FlatPartition.owned_ranges``, by name."""
    names = {id(p): n for n, p in fsdp.module.named_parameters()}
    rank = group_rank()
    replica = dist.get_rank(fsdp.replicate_group) if fsdp.replicate_size > 1 else 0
    out = []
    for p in fsdp.ignored_params:
        if not saving or rank == 0:
            out.append((names[id(p)], p.shape, 0, p.numel(), p, 0))
    if saving and replica != 0:
        return out
    for u in fsdp.all_units:
        for o in u.part.owned_ranges(u.rank):  # o.shape: the parameter's, not its piece's
            out.append((names[id(u.params[o.index])], o.shape, o.lo, o.hi, u.shard, o.at))
    return out


def _group_settings(optimizer) -> list[dict]:
    """Each param group's hyperparameters (the LR a schedule has set, its
    ``initial_lr``), tuples as lists (what a checkpoint stores)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _fsdp_steps(fsdp, optimizer) -> dict[str, float]:
    """Every parameter's step count (that of the shard it lives in: the same on every rank)."""
    names = {id(p): n for n, p in fsdp.module.named_parameters()}

    def step(t):
        s = optimizer.state.get(t, {}).get("step", 0)
        return float(s)
    out = {names[id(p)]: step(p) for p in fsdp.ignored_params}
    for u in fsdp.all_units:
        out.update({names[id(p)]: step(u.shard) for p in u.params})
    return out


def fsdp_state(fsdp, optimizer) -> dict:
    """This rank's part of an FSDP job: per parameter, its range of the fp32
    weights (the shards are the master weights under a mixed-precision policy)
    and of Adam's two moments; every parameter's step count; the optimizer's
    hyperparameters."""
    state: dict[str, Any] = {"kind": "fsdp", "steps": _fsdp_steps(fsdp, optimizer),
                             "param_groups": _group_settings(optimizer),
                             "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape, lo, hi, tensor, at in fsdp_ranges(fsdp, saving=True):
        n = hi - lo
        st = optimizer.state.get(tensor, {})
        state["weights"][name] = Shard(tensor.detach().reshape(-1)[at:at + n].clone(), shape, lo)
        for m in ("exp_avg", "exp_avg_sq"):
            # before the first step there are no moments yet: zeros are what Adam starts from
            moment = st[m].reshape(-1)[at:at + n].clone() if m in st else torch.zeros(n)
            state[m][name] = Shard(moment, shape, lo)
    return state


def fsdp_request(fsdp, optimizer) -> dict:
    """The ``like=`` template: this rank's ranges of weights and moments (any world size)."""
    like: dict[str, Any] = {"kind": "fsdp", "steps": _fsdp_steps(fsdp, optimizer),
                            "param_groups": _group_settings(optimizer),
                            "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape, lo, hi, tensor, at in fsdp_ranges(fsdp):
        for part in ("weights", "exp_avg", "exp_avg_sq"):
            like[part][name] = Shard.empty_like(shape, lo, hi - lo)
    return like


@torch.no_grad()
def load_fsdp_state(fsdp, optimizer, state: dict) -> None:
    """Write a loaded ``fsdp_request``-shaped state into the shards and the optimizer."""
    _check_kind(state, "fsdp")
    groups = state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointMismatch(f"the checkpoint has {len(groups)} parameter groups, this "
                                 f"optimizer {len(optimizer.param_groups)}")
    for g, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    steps = state["steps"]
    fresh = set()
    for name, shape, lo, hi, tensor, at in fsdp_ranges(fsdp):
        if name not in steps:
            raise CheckpointMismatch(f"the checkpoint has no step count for parameter {name}")
        if id(tensor) not in fresh:  # this shard's optimizer state, rebuilt from the pieces
            fresh.add(id(tensor))
            # torch's AdamW keeps the step as a float32 scalar tensor (its default)
            optimizer.state[tensor] = {
                "step": torch.tensor(float(steps[name]), dtype=torch.float32),
                "exp_avg": torch.zeros_like(tensor), "exp_avg_sq": torch.zeros_like(tensor)}
        n = hi - lo
        tensor.data.view(-1)[at:at + n].copy_(state["weights"][name].data)
        for m in ("exp_avg", "exp_avg_sq"):
            optimizer.state[tensor][m].view(-1)[at:at + n].copy_(state[m][name].data)
    for u in fsdp.all_units:
        fsdp.free(u)  # a unit gathered before the load holds the old weights


# --------------------------------------------------------------------------
# Everything together.
# --------------------------------------------------------------------------

def _is_zero(opt) -> bool:
    return hasattr(opt, "partition") and hasattr(opt, "exp_avg_sq")


def _is_fsdp(model) -> bool:
    from helpers.fsdp import FSDP
    return isinstance(model, FSDP)


def training_state(model, optimizer, *, step: int, sampler=None, scheduler=None, scaler=None,
                   rng: bool = True) -> dict:
    """This rank's resume state. ``optimizer``: a ``torch.optim`` optimizer (the
    model's weights saved whole, as with DDP) or a ZeroOptimizer (weights and
    moments as per-parameter Shards). ``model`` may be a ``helpers.fsdp.FSDP``
    (its shards and the optimizer's moments as per-parameter Shards)."""
    state: dict[str, Any] = {"step": step}
    if _is_zero(optimizer):
        state["zero"] = zero_state(optimizer)
    elif _is_fsdp(model):
        state["fsdp"] = fsdp_state(model, optimizer)
    else:
        state["model"] = model.state_dict()
        state["optimizer"] = optimizer.state_dict()
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler_state(scaler)
    if rng:
        state["rng"] = rng_state()
    return state


def resume_request(model, optimizer, rng: bool = True, **parts) -> dict:
    """The ``like=`` template for ``load_latest``: the current state, with ZeRO's
    Shards replaced by the ranges this rank needs (any world size)."""
    state = training_state(model, optimizer, step=0, rng=rng, **parts)
    if _is_zero(optimizer):
        state["zero"] = zero_request(optimizer)
    elif _is_fsdp(model):
        state["fsdp"] = fsdp_request(model, optimizer)
    return state


def restore_training_state(state: dict, model, optimizer, *, sampler=None, scheduler=None,
                           scaler=None) -> int:
    """Put a loaded state back; returns the step to continue from. Parts left
    out of the call (or missing from the state) are not restored."""
    if _is_zero(optimizer):
        _need(state, "zero")
        load_zero_state(optimizer, state["zero"])
    elif _is_fsdp(model):
        _need(state, "fsdp")
        load_fsdp_state(model, optimizer, state["fsdp"])
    else:
        _need(state, "model")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if sampler is not None and "sampler" in state:
        sampler.load_state_dict(state["sampler"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and "scaler" in state:
        load_scaler_state(scaler, state["scaler"])
    if "rng" in state:
        set_rng_state(state["rng"])
    return int(state["step"])


def _need(state: dict, part: str) -> None:
    kinds = {"zero": "a ZeroOptimizer's", "fsdp": "helpers.fsdp's", "model": "a whole model's"}
    if part not in state:
        have = [kinds[k] for k in kinds if k in state] or ["no model"]
        raise CheckpointMismatch(f"this run needs {kinds[part]} state and the checkpoint holds "
                                 f"{have[0]} state")
