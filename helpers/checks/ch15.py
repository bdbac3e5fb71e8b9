"""Checks for chapter 15: an FSDP unit's gather and free, and the hooks that call them.

The harness (``Unit``, ``make_unit``) is given; the learner writes

* ``gather(unit)``: grow ``unit.full``'s storage back to full size and
  all-gather every rank's ``unit.shard`` into it (``unit.group``);
* ``free(unit)``: shrink ``unit.full``'s storage to 0 bytes;
* ``attach(module, unit, gather, free)``: hooks so that ``module``'s weights exist only while
  it runs: gather before forward, free after forward, gather again when
  backward reaches the module's output. (The check frees after backward.)

* ``post_backward(unit, free) -> grad_shard``: called once every gradient of
  the unit exists in backward: lay the gradients out as the unit's flat
  buffer is laid out (zero padding at the end), average over ranks with one
  reduce-scatter, drop the full gradients (``p.grad = None``), free the unit,
  and return this rank's averaged chunk.

The check trains the toy GPT on 2 ranks with one unit per block (plus a root
unit that the check keeps gathered), reduce-scatters the gradients itself,
and compares with one process; it also watches the storage of every unit.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from helpers.checks import CheckFailed, on_ranks, passed
from helpers.tolerance import within_fp32_noise


@dataclasses.dataclass
class Unit:
    """One FSDP unit: ``params`` are views into ``full`` (padded, flat);
    ``shard`` is this rank's chunk ``full[r * c:(r + 1) * c]``."""

    params: list
    full: torch.Tensor   # (padded,) fp32; its storage is 0 bytes while freed
    shard: torch.Tensor  # (padded / N,)
    group: object = None


def make_unit(params: list[nn.Parameter], world_size: int, rank: int, group=None) -> Unit:
    """Flatten ``params`` into one padded buffer, keep chunk ``rank``, free the rest."""
    numel = sum(p.numel() for p in params)
    padded = -(-numel // world_size) * world_size
    full = torch.zeros(padded)
    off = 0
    with torch.no_grad():
        for p in params:
            full[off:off + p.numel()].copy_(p.reshape(-1))
            p.data = full[off:off + p.numel()].view_as(p)
            off += p.numel()
    c = padded // world_size
    shard = full[rank * c:(rank + 1) * c].clone()
    full.untyped_storage().resize_(0)
    return Unit(list(params), full, shard, group)


# A rank error that means the learner used a weight while its storage was freed.
FREED_HINT = {"storage of size 0": "a weight was used while freed: gather before the module's "
              "forward, and again before its backward (a hook on the forward output)."}


def is_gathered(unit: Unit) -> bool:
    return unit.full.untyped_storage().nbytes() > 0


def _run_gather_free(gather, free):
    from helpers import rank_info
    r = rank_info()
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)  # 15 elements: padded to 16 on 2 ranks
    want = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()]).clone()
    unit = make_unit([lin.weight, lin.bias], r.world_size, r.rank)
    states = [is_gathered(unit)]
    gather(unit)
    states.append(is_gathered(unit))
    got = unit.full[:15].clone() if is_gathered(unit) else None
    # Read the Linear's own weight only if its storage has bytes (reading a
    # 0-byte storage through a view would crash the rank, not raise).
    weight_ok = (lin.weight.untyped_storage().nbytes() > 0
                 and torch.equal(lin.weight.detach().reshape(-1), want[:12]))
    free(unit)
    states.append(is_gathered(unit))
    return {"states": states, "got": got, "want": want, "weight_ok": weight_ok}


def check_gather_free(gather, free) -> None:
    """2 ranks: a Linear(4, 3), 15 elements padded to 16, 8 per rank."""
    res = on_ranks(_run_gather_free, 2, gather, free, what="gather/free",
                   probe=lambda: (gather(None), free(None)), hints=FREED_HINT)
    for rank, out in enumerate(res):
        if out["states"][1] is not True:
            raise CheckFailed(f"rank {rank}: after gather the storage is still 0 bytes; grow it "
                              f"with unit.full.untyped_storage().resize_(numel * 4) first")
        if out["got"] is None or not torch.equal(out["got"], out["want"]):
            raise CheckFailed(f"rank {rank}: after gather unit.full is not every rank's shard "
                              f"in rank order (all_gather(unit.full, unit.shard, group))")
        if not out["weight_ok"]:
            raise CheckFailed(f"rank {rank}: the Linear's weight does not see the gathered "
                              f"values: fill unit.full in place, do not replace it")
        if out["states"][2] is not False:
            raise CheckFailed(f"rank {rank}: after free the storage still holds "
                              f"bytes; shrink it to 0 with resize_(0)")
    passed("gather fills the full buffer in place from 2 padded shards; free returns it to 0 bytes")


def _run_attach(gather, free, attach, steps):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model
    from helpers.comm import reduce_scatter

    r = rank_info()
    N, B = r.world_size, 2
    data = make_dataset(num_sequences=64, seq_len=16)
    model = build_model("toy", seed=0)
    units = [make_unit(list(b.parameters()), N, r.rank) for b in model.blocks]
    for blk, u in zip(model.blocks, units):
        attach(blk, u, gather, free)
    gathered_after_own_forward, gathered_after_forward = [], []
    for blk, u in zip(model.blocks, units):  # runs after the learner's hooks
        blk.register_forward_hook(
            lambda m, a, o, u=u: gathered_after_own_forward.append(is_gathered(u)))
    blocks = {id(p) for u in units for p in u.params}
    root = [p for p in model.parameters() if id(p) not in blocks]  # kept replicated
    for s in range(steps):
        x, y = data.batch(range(s * B * N, (s + 1) * B * N))
        loss = model(x[r.rank * B:(r.rank + 1) * B], y[r.rank * B:(r.rank + 1) * B])[1]
        gathered_after_forward.append([is_gathered(u) for u in units])
        loss.backward()
        with torch.no_grad():
            for u in units:  # reduce-scatter the block grads, SGD on the shard, free
                g = torch.zeros(u.full.numel())
                off = 0
                for p in u.params:
                    g[off:off + p.numel()] = p.grad.reshape(-1) / N
                    off += p.numel()
                    p.grad = None
                out = torch.empty_like(u.shard)
                reduce_scatter(out, g)
                u.shard -= 0.1 * out
                free(u)
            for p in root:
                p.grad /= N
                dist.all_reduce(p.grad)
                p -= 0.1 * p.grad
                p.grad = None
    for u in units:
        gather(u)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"weights": weights, "own": gathered_after_own_forward,
            "after": gathered_after_forward}



def _sgd_reference(steps: int):
    """The toy GPT after `steps` SGD steps (lr 0.1, batches of 4) on one process, in
    float32 and in float64 (the exact answer, to ~1e-16): what the ranks must match."""
    from helpers.data import make_dataset
    from helpers.model import build_model

    data = make_dataset(num_sequences=64, seq_len=16)
    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    for s in range(steps):
        x, y = data.batch(range(s * 4, (s + 1) * 4))
        for model in (ref, ref64):
            model(x, y)[1].backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    return ref, ref64


def check_attach(gather, free, attach) -> None:
    """2 ranks, toy GPT, one unit per block, 2 SGD steps vs one process."""
    res = on_ranks(_run_attach, 2, gather, free, attach, 2, what="attach",
                   probe=lambda: attach(nn.Linear(1, 1), None, gather, free), hints=FREED_HINT)
    ref, ref64 = _sgd_reference(steps=2)
    want64 = dict(ref64.named_parameters())
    for rank, out in enumerate(res):
        if any(out["own"]):
            raise CheckFailed(f"rank {rank}: a block's weights were still gathered after its "
                              f"forward; free them in a forward hook")
        if any(any(a) for a in out["after"]):
            raise CheckFailed(f"rank {rank}: weights stayed gathered after the forward pass")
        for n, p in ref.named_parameters():
            # 2 ranks: the gradient sums differ from one process's only by fp32
            # rounding, so as close to float64 as the fp32 reference is
            if not within_fp32_noise(out["weights"][n], p.detach(), want64[n].detach())[0]:
                raise CheckFailed(f"rank {rank}: {n} differs from one process after 2 SGD "
                                  f"steps: are the gathered weights the current ones?")
    passed("each block's weights live only during its forward and backward; training equals "
           "one process")


def _ref_gather(unit: Unit) -> None:
    from helpers.comm import all_gather
    if not is_gathered(unit):
        unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
        all_gather(unit.full, unit.shard, group=unit.group)


def _ref_free(unit: Unit) -> None:
    unit.full.untyped_storage().resize_(0)


def _ref_attach(module: nn.Module, unit: Unit) -> None:
    def post_forward(mod, args, output):
        _ref_free(unit)
        if output.requires_grad:
            output.register_hook(lambda grad: _ref_gather(unit))

    module.register_forward_pre_hook(lambda mod, args: _ref_gather(unit))
    module.register_forward_hook(post_forward)


def _run_post_backward(post_backward, steps):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model

    r = rank_info()
    N, B = r.world_size, 2
    data = make_dataset(num_sequences=64, seq_len=16)
    model = build_model("toy", seed=0)
    units = [make_unit(list(b.parameters()), N, r.rank) for b in model.blocks]
    for blk, u in zip(model.blocks, units):
        _ref_attach(blk, u)
    all_reduce = dist.all_reduce

    def refuse(*args, **kwargs):
        raise RuntimeError("all_reduce refused: FSDP reduce-scatters a unit's gradients "
                           "(an all-reduce sends twice the bytes and leaves full gradients)")

    shards, calls, problems = {}, [], []

    def on_grad(p, u, i):
        if all(q.grad is not None for q in u.params):  # the unit's last gradient
            dist.all_reduce = refuse
            try:
                out = post_backward(u, _ref_free)
            finally:
                dist.all_reduce = all_reduce
            calls.append(i)
            if is_gathered(u):
                problems.append(f"unit {i} was still gathered after post_backward: free it")
            if any(q.grad is not None for q in u.params):
                problems.append(f"unit {i}'s full gradients were still in p.grad after "
                                f"post_backward: drop them once they are reduce-scattered")
            shards[i] = out

    for i, u in enumerate(units):
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: on_grad(p, u, i))
    blocks = {id(p) for u in units for p in u.params}
    root = [p for p in model.parameters() if id(p) not in blocks]  # kept replicated
    for s in range(steps):
        x, y = data.batch(range(s * B * N, (s + 1) * B * N))
        model(x[r.rank * B:(r.rank + 1) * B], y[r.rank * B:(r.rank + 1) * B])[1].backward()
        if problems:
            return {"problems": problems}
        with torch.no_grad():
            for i, u in enumerate(units):
                g = shards.pop(i, None)
                if not torch.is_tensor(g) or g.shape != u.shard.shape:
                    return {"problems": [f"post_backward returned "
                                         f"{None if not torch.is_tensor(g) else tuple(g.shape)}"
                                         f" for unit {i}, not its chunk of shape "
                                         f"{tuple(u.shard.shape)}"]}
                u.shard -= 0.1 * g  # SGD on the shard
            for p in root:
                p.grad /= N
                dist.all_reduce(p.grad)
                p -= 0.1 * p.grad
                p.grad = None
    for u in units:
        _ref_gather(u)
    return {"problems": [], "calls": calls,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check_post_backward(post_backward) -> None:
    """2 ranks, toy GPT, one unit per block, 2 SGD steps vs one process; your
    post_backward is called from inside backward, when a unit's last gradient
    has been accumulated."""
    res = on_ranks(_run_post_backward, 2, post_backward, 2, what="post_backward",
                   probe=lambda: post_backward(None, _ref_free), hints=FREED_HINT)
    ref, ref64 = _sgd_reference(steps=2)
    want64 = dict(ref64.named_parameters())
    for rank, out in enumerate(res):
        if out["problems"]:
            raise CheckFailed(f"rank {rank}: {out['problems'][0]}")
        if out["calls"] != [1, 0, 1, 0]:  # backward reaches the last block first
            raise CheckFailed(f"rank {rank}: post_backward ran for units {out['calls']}, "
                              f"expected [1, 0, 1, 0] (once per unit per backward)")
        for n, p in ref.named_parameters():
            # 2 ranks: the gradient sums differ from one process's only by fp32
            # rounding, so as close to float64 as the fp32 reference is
            ok, _, _ = within_fp32_noise(out["weights"][n], p.detach(), want64[n].detach())
            if not ok:
                diff = (out["weights"][n] - p.detach()).abs().max().item()
                raise CheckFailed(f"rank {rank}: {n} differs from one process after 2 SGD steps "
                                  f"by {diff:.2e}: is the chunk the *average* over ranks, laid "
                                  f"out in the unit's parameter order with the padding at the "
                                  f"end?")
    passed("each unit's gradients reduce-scattered and dropped inside backward, the unit freed; "
           "training equals one process")
