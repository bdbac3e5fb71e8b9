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
(stages 0-2) as per-parameter ``Shard``s: the flat range of each parameter that
this rank owns in its chunk. That is independent of the world size (the padded
flat buffer is not), so a checkpoint written by 4 ranks loads on 2 or 3, each
new rank asking for the ranges of *its* chunks. DCP does the same per
parameter with its chunk metadata (``torch.distributed.checkpoint.metadata``).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from helpers.checkpoint.store import Shard

__all__ = ["rng_state", "set_rng_state", "scaler_state", "load_scaler_state", "zero_state",
           "zero_request", "load_zero_state", "zero_ranges", "training_state", "resume_request",
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
    (``opt.exp_avg``, ``opt.master``). Empty pieces are left out; padding is in
    no parameter's range, so it is never saved."""
    names = {id(p): n for n, p in opt.model.named_parameters()}
    out = []
    for b in opt.partition.buckets:
        c_lo, c_hi = opt.partition.shard_range(b, opt.shard_rank)  # in the flat buffer
        for i, off in zip(b.params, b.offsets):
            p = opt.params[i]
            p_lo = b.start + off  # where the parameter starts in the flat buffer
            lo, hi = max(c_lo, p_lo), min(c_hi, p_lo + p.numel())
            if lo < hi:
                out.append((names[id(p)], p.shape, lo - p_lo, hi - p_lo,
                            b.shard_start + lo - c_lo))
    return out


def zero_state(opt) -> dict:
    """This rank's part of a ZeroOptimizer's state: the fp32 weights (the master
    copy in bf16/fp16 mode), both Adam moments, per parameter, plus the step counts."""
    if opt.stage == 3:
        raise NotImplementedError("zero_state covers stages 0-2; for stage 3 save "
                                  "opt.full_parameters() or use FSDP's per-rank state")
    # param_steps: AdamW's bias correction counts the steps each parameter took (one
    # no rank gave a gradient is skipped), so a resume needs them, not only step_count.
    state: dict[str, Any] = {"step_count": opt.step_count, "param_steps": list(opt.param_steps),
                             "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    if opt.shards == 1 and opt.rank != 0:
        return state  # stage 0 replicates everything: rank 0's copy is enough
    for name, shape, lo, hi, at in zero_ranges(opt):
        n = hi - lo
        if opt.master is not None:
            w = opt.master[at:at + n]
        else:  # fp32: the weights are the master copy
            w = dict(opt.model.named_parameters())[name].detach().reshape(-1)[lo:hi]
        state["weights"][name] = Shard(w.clone(), shape, lo)
        state["exp_avg"][name] = Shard(opt.exp_avg[at:at + n].clone(), shape, lo)
        state["exp_avg_sq"][name] = Shard(opt.exp_avg_sq[at:at + n].clone(), shape, lo)
    return state


def zero_request(opt) -> dict:
    """The template ``load_latest(like=...)`` needs: the full weights (stages 0-2
    keep them on every rank) and this rank's ranges of the moments."""
    named = dict(opt.model.named_parameters())
    like: dict[str, Any] = {"step_count": 0, "param_steps": [0] * len(opt.param_steps),
                            "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape, lo, hi, at in zero_ranges(opt):
        like["exp_avg"][name] = Shard.empty_like(shape, lo, hi - lo)
        like["exp_avg_sq"][name] = Shard.empty_like(shape, lo, hi - lo)
    for i, p in enumerate(opt.params):
        name = [n for n, q in named.items() if q is p][0]
        like["weights"][name] = Shard.empty_like(p.shape, 0, p.numel())
    return like


@torch.no_grad()
def load_zero_state(opt, state: dict) -> None:
    """Write a loaded ``zero_request``-shaped state into ``opt`` (any world size)."""
    named = dict(opt.model.named_parameters())
    for name, shard in state["weights"].items():
        p = named[name]
        p.data.copy_(shard.data.view(p.shape).to(p.dtype))  # p is a view of the flat buffer
    for name, shape, lo, hi, at in zero_ranges(opt):
        n = hi - lo
        opt.exp_avg[at:at + n].copy_(state["exp_avg"][name].data)
        opt.exp_avg_sq[at:at + n].copy_(state["exp_avg_sq"][name].data)
        if opt.master is not None:
            opt.master[at:at + n].copy_(state["weights"][name].data[lo:hi])
    opt.step_count = int(state["step_count"])
    opt.param_steps[:] = [int(n) for n in state["param_steps"]]


# --------------------------------------------------------------------------
# Everything together.
# --------------------------------------------------------------------------

def _is_zero(opt) -> bool:
    return hasattr(opt, "partition") and hasattr(opt, "exp_avg_sq")


def training_state(model, optimizer, *, step: int, sampler=None, scheduler=None, scaler=None,
                   rng: bool = True) -> dict:
    """This rank's resume state. ``optimizer``: a ``torch.optim`` optimizer (the
    model's weights saved whole, as with DDP) or a ZeroOptimizer (weights and
    moments as per-parameter Shards)."""
    state: dict[str, Any] = {"step": step}
    if _is_zero(optimizer):
        state["zero"] = zero_state(optimizer)
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
    return state


def restore_training_state(state: dict, model, optimizer, *, sampler=None, scheduler=None,
                           scaler=None) -> int:
    """Put a loaded state back; returns the step to continue from. Parts left
    out of the call (or missing from the state) are not restored."""
    if "zero" in state:
        load_zero_state(optimizer, state["zero"])
    else:
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
