"""The production twin: PyTorch's ``torch.distributed.checkpoint`` (DCP) on an FSDP2 job.

FSDP2 (``fully_shard``) keeps every parameter, and AdamW every moment, as a
DTensor sharded along dim 0: rank r holds rows ``[r c, (r+1) c)`` with
``c = ceil(rows / N)`` (``torch.chunk``'s rule). DCP saves such a state with
``dcp.save``: one ``__r_0.distcp`` file per rank plus a ``.metadata`` file that
lists every chunk (offsets and sizes per dimension); ``dcp.load`` into a job of
another size reads, for each local chunk, the overlapping saved chunks:
resharding, as ``helpers.checkpoint`` does with its flat ranges.

``fsdp2_state`` turns the same DTensors into our ``Shard``s (dim-0 rows are a
contiguous flat range), so one FSDP2 state can be written by both and the
restored tensors compared element for element. To compare, ``full_state``
gathers every tensor on every rank (one all-gather per tensor);
``local_state`` on each rank and ``join_local`` on the caller's side build
the same full tensors without a collective.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from helpers.checkpoint.store import Shard

__all__ = ["fsdp2_job", "dcp_save", "dcp_load", "fsdp2_state", "fsdp2_request",
           "load_fsdp2_state", "full_state", "local_state", "join_local", "Rows"]


def fsdp2_job(lr: float = 1e-2, seed: int = 0):
    """The toy GPT under FSDP2 with AdamW (weights from ``seed``, same on every rank)."""
    from helpers.fsdp import torch_fsdp2
    from helpers.model import build_model
    model = torch_fsdp2(build_model("toy", seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    return model, opt


def _dcp():
    """torch.distributed.checkpoint and its state-dict helpers, imported when first used:
    a notebook that only ships these functions to its ranks does not pay for them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    return dcp, get_state_dict, set_state_dict


def dcp_save(directory: str, model, opt) -> None:
    dcp, get_state_dict, _ = _dcp()
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=directory)


def dcp_load(directory: str, model, opt) -> None:
    dcp, get_state_dict, set_state_dict = _dcp()
    model_sd, opt_sd = get_state_dict(model, opt)  # DTensors of *this* job's layout
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=directory)       # filled in place, resharded
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _rows(dt) -> tuple[int, int]:
    """[lo, hi) rows of dim 0 this rank holds of a DTensor sharded Shard(0) (torch.chunk)."""
    n, rank = dt.device_mesh.size(), dt.device_mesh.get_local_rank()
    rows = dt.shape[0]
    c = -(-rows // n)
    return min(rank * c, rows), min((rank + 1) * c, rows)


def _as_shard(dt) -> Shard:
    from torch.distributed.tensor import Shard as Dim
    if dt.placements != (Dim(0),):
        raise ValueError(f"expected a DTensor sharded on dim 0, got {dt.placements}")
    lo, hi = _rows(dt)
    # Elements per row, from the shape: indexing the DTensor (dt[0]) would dispatch
    # through DTensor's sharding propagation, about half a millisecond per tensor.
    row = math.prod(dt.shape[1:])
    local = dt.to_local().reshape(-1)
    return Shard(local[:(hi - lo) * row], tuple(dt.shape), lo * row)


def _walk(tree, fn):
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _walk(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_walk(v, fn) for v in tree)
    return tree


def fsdp2_state(model, opt) -> dict:
    """The FSDP2 job's state, DTensors as our Shards (for ``helpers.checkpoint.save``)."""
    get_state_dict = _dcp()[1]
    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": _walk(model_sd, _as_shard), "optim": _walk(opt_sd, _as_shard)}


def fsdp2_request(model, opt) -> dict:
    """The ``like=`` template: this job's Shards (any world size)."""
    return fsdp2_state(model, opt)


def load_fsdp2_state(model, opt, state: dict) -> None:
    """Copy loaded Shards into this job's DTensors, then hand them to the model and optimizer."""
    _, get_state_dict, set_state_dict = _dcp()
    model_sd, opt_sd = get_state_dict(model, opt)
    cur = {"model": model_sd, "optim": opt_sd}

    def put(dst, src):
        from torch.distributed.tensor import DTensor
        if isinstance(dst, DTensor):
            local = dst.to_local().reshape(-1)
            local[:src.data.numel()].copy_(src.data)
            return dst
        if isinstance(dst, dict):
            return {k: put(v, src[k]) for k, v in dst.items()}
        return src if not isinstance(dst, (list, tuple)) else type(dst)(
            put(a, b) for a, b in zip(dst, src))

    filled = put(cur, state)
    set_state_dict(model, opt, model_state_dict=filled["model"], optim_state_dict=filled["optim"])


def full_state(model, opt) -> dict:
    """Every tensor of the job's state, full (DTensors gathered). Collective."""
    get_state_dict = _dcp()[1]
    model_sd, opt_sd = get_state_dict(model, opt)
    return _walk({"model": model_sd, "optim": opt_sd}, lambda dt: dt.full_tensor())


class Rows(NamedTuple):
    """Rows ``[lo, lo + len(data))`` of dim 0 of a tensor of ``shape``: one rank's part."""
    lo: int
    data: torch.Tensor
    shape: tuple


def local_state(model, opt) -> dict:
    """This rank's part of the job's state, no collective: every DTensor as the ``Rows``
    it holds (a CPU copy), every other entry (a step count) as it is. ``join_local``
    of every rank's part is what ``full_state`` returns."""
    get_state_dict = _dcp()[1]
    model_sd, opt_sd = get_state_dict(model, opt)

    def rows(dt):
        lo, hi = _rows(dt)
        return Rows(lo, dt.to_local()[:hi - lo].detach().cpu().clone(), tuple(dt.shape))

    return _walk({"model": model_sd, "optim": opt_sd}, rows)


def join_local(parts: list) -> dict:
    """The full state from every rank's ``local_state`` (a list, any order): each
    tensor assembled from its ranks' rows, which must cover every row exactly once;
    other entries from the first part (they are the same on every rank)."""
    if not parts:
        raise ValueError("join_local needs the local_state of every rank, got none")

    def join(first, path, others):
        if isinstance(first, Rows):
            out = torch.empty(first.shape, dtype=first.data.dtype)
            covered = 0
            for part in [first, *others]:
                if not isinstance(part, Rows) or part.shape != first.shape:
                    raise ValueError(f"{path}: the ranks' parts do not match ({part!r:.80})")
                out[part.lo:part.lo + len(part.data)] = part.data
                covered += len(part.data)
            if covered != first.shape[0]:
                raise ValueError(f"{path}: the ranks hold {covered} rows of {first.shape[0]}; "
                                 f"pass the local_state of every rank, each once")
            return out
        if isinstance(first, dict):
            return {k: join(v, f"{path}/{k}", [o[k] for o in others]) for k, v in first.items()}
        if isinstance(first, (list, tuple)):
            return type(first)(join(v, f"{path}/{i}", [o[i] for o in others])
                               for i, v in enumerate(first))
        return first

    return join(parts[0], "", list(parts[1:]))
