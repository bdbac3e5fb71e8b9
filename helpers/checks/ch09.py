"""Checks for chapter 09: parallelize one transformer block; the vocab-parallel loss.

The learner writes ``parallelize_block(block, group)``, returning a copy of a
course ``Block`` whose attention and MLP are split over ``group`` with
``helpers.tp``'s layers (QKV column-parallel by heads, attention output and
MLP down projection row-parallel, MLP up projection column-parallel) and the
LayerNorms left whole.

The check runs it on 2 ranks in float64 against the dense block in the same
process: output, input gradient, every parameter gradient (gathered with
``helpers.tp.gather_dense``), the bytes of parameters each rank holds, and the
collectives issued (2 all-reduces forward, 2 backward: Shoeybi et al. 2019,
sec. 3). Float64 on both sides differs only by summation order (~1e-16
relative); the check allows 1e-9, every named mistake is off by O(1).
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, on_ranks, passed

REL = 1e-9  # float64, only the summation order differs


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and \
        (a - b).abs().max().item() <= REL * max(b.abs().max().item(), 1.0)


def _run_block(parallelize_block):
    import copy

    import torch.distributed as dist

    from helpers import rank_info
    from helpers.model import GPTConfig, build_model
    from helpers.tp import count_collectives, gather_dense

    t = rank_info().world_size
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_embd=16)
    block = build_model(cfg, seed=0).blocks[0].double()
    with torch.no_grad():  # non-zero biases and LayerNorm affines
        gen = torch.Generator().manual_seed(1)
        for p in block.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    dense = copy.deepcopy(block)
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=gen)
    dy = torch.randn(2, 8, 16, dtype=torch.float64, generator=gen)
    tp = parallelize_block(block, dist.group.WORLD)
    xi = x.clone().requires_grad_()
    with count_collectives() as counter:
        y = tp(xi)
        y.backward(dy)
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    yd.backward(dy)
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.parameters())
    split = sum(p.numel() * p.element_size() for n, p in dense.named_parameters()
                if n.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias"))
                or n.endswith("c_proj.weight"))
    return dict(y=y.detach(), dx=xi.grad, grads=gather_dense(tp, grads=True),
                want=dict(y=yd.detach(), dx=xd.grad,
                          grads={n: p.grad for n, p in dense.named_parameters()}),
                bytes=sum(p.numel() * p.element_size() for p in tp.parameters()),
                want_bytes=dense_bytes - split + split // t,
                counts=(counter.count("all_reduce", "forward"),
                        counter.count("all_reduce", "backward")),
                untouched=all(torch.equal(a, b) for a, b in
                              zip(block.parameters(), dense.parameters())))


_SHAPES = ("the shards' shapes do not chain: in Megatron's pairs the first layer is "
           "column-parallel (its output features split over ranks: QKV, MLP up) and the "
           "second row-parallel (its input features split: attention out, MLP down). "
           "Swapped, each rank's output does not fit the next layer's input")


def check_parallelize_block(parallelize_block) -> None:
    """2 ranks: a block with 4 heads, hidden 16, MLP 64, float64, vs the dense block.
    Mistakes it catches: q, k, v cut contiguously instead of by heads; a layer left
    dense (more parameter bytes than the split); the dense block modified; extra or
    missing all-reduces; column- and row-parallel swapped in a pair (the shapes do not
    chain: named)."""
    from helpers.model import Block, GPTConfig
    res = on_ranks(_run_block, 2, parallelize_block, what="parallelize_block",
                   probe=lambda: parallelize_block(Block(GPTConfig()), None),
                   hints={"cannot be multiplied": _SHAPES})
    for rank, out in enumerate(res):
        w = out["want"]
        if not out["untouched"]:
            raise CheckFailed(f"rank {rank}: the dense block's weights changed; build the split "
                              f"layers from copies (from_dense copies) and leave `block` as it was")
        if out["bytes"] > out["want_bytes"]:
            raise CheckFailed(f"rank {rank}: the block holds {out['bytes']:,} bytes of parameters; "
                              f"split, it should hold {out['want_bytes']:,} (1/2 of QKV, of both "
                              f"MLP matrices and of the output projection's weight). Is a layer "
                              f"still dense?")
        if not _close(out["y"], w["y"]):
            raise CheckFailed(f"rank {rank}: the block's output differs from the dense block's. "
                              f"QKV must be split by heads: each of q, k, v in t slices "
                              f"(ColumnParallelLinear.from_dense(..., parts=3)), and attention "
                              f"must run on this rank's n_head / t heads")
        if not _close(out["dx"], w["dx"]):
            raise CheckFailed(f"rank {rank}: the input gradient differs from the dense block's")
        for name, g in w["grads"].items():
            if not _close(out["grads"].get(name), g):
                raise CheckFailed(f"rank {rank}: the gradient of {name} (gathered) differs from "
                                  f"the dense block's")
        if out["counts"] != (2, 2):
            raise CheckFailed(f"rank {rank}: {out['counts'][0]} all-reduces in forward and "
                              f"{out['counts'][1]} in backward; a TP block has 2 and 2 "
                              f"(one g and one f each for attention and MLP)")
    passed("the split block equals the dense block on 2 ranks (output, input and weight "
           "gradients, float64), holds its share of the weights, and issues 2 + 2 all-reduces")


# ---- exercise 2: the vocab-parallel cross-entropy ------------------------------------------

LOSS_WORLDS = (3, 4)     # 12 vocabulary entries split 4 or 3 per rank
LOSS_REL = 1e-9          # float64; the shifted log-sum-exp differs from torch's by rounding
_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather",
            "broadcast", "all_to_all", "all_to_all_single")


def _run_loss(vocab_parallel_loss):
    """On every rank: this rank's slice of the logits, the learner's loss (gathers
    recorded and passed through), the reference on the whole logits."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from helpers import rank_info
    t, r = rank_info().world_size, rank_info().rank
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 12, dtype=torch.float64, generator=gen)
    logits[1] += 1000.0          # exp overflows float64 (above ~709) unless shifted
    logits[2, 11] = 900.0        # the largest logit on the last rank's slice only
    logits[5] -= 1000.0          # underflows to 0 unless shifted
    targets = torch.tensor([3, 11, 0, -100, 7, 11, -100, 5])
    want = F.cross_entropy(logits, targets, ignore_index=-100)
    n = 12 // t
    shard = logits[:, r * n:(r + 1) * n].clone()
    calls, saved = [], {}
    for name in _GATHERS:
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, (lambda nm, fn: lambda *a, **k: (calls.append(nm), fn(*a, **k))[1])
                    (name, saved[name]))
    try:
        got = vocab_parallel_loss(shard, targets.clone(), dist.group.WORLD)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return got, want, calls


def check_vocab_parallel_loss(vocab_parallel_loss) -> None:
    """On 3 and 4 ranks, 8 tokens over a 12-entry vocabulary in float64, against
    ``F.cross_entropy(whole logits, targets, ignore_index=-100)``. Mistakes it catches:

    * no max subtracted (a row of logits near 1000 overflows exp: inf or nan);
    * each rank subtracting its own max (the shifts disagree: wrong sum);
    * the target's logit looked up with the global id instead of the id minus this
      rank's first vocabulary entry (or on every rank instead of its owner's);
    * ignored tokens (-100) counted in the mean, or their logit looked up;
    * gathering the whole logits (all-gather) and computing the dense loss: refused,
      since the exercise is to never build the whole vocabulary on one rank;
    * a result that is not a scalar tensor, or differs between ranks.
    """
    probe_logits = torch.zeros(2, 4, dtype=torch.float64)
    probe_targets = torch.zeros(2, dtype=torch.long)
    for world in LOSS_WORLDS:
        res = on_ranks(_run_loss, world, vocab_parallel_loss,
                       what=f"vocab_parallel_loss on {world} ranks",
                       probe=lambda: vocab_parallel_loss(probe_logits, probe_targets, None))
        for rank, (got, want, calls) in enumerate(res):
            case = f"{world} ranks, rank {rank}"
            if calls:
                raise CheckFailed(f"{case}: vocab_parallel_loss called {sorted(set(calls))}: "
                                  f"that rebuilds the whole vocabulary on a rank. Reduce the "
                                  f"three per-token numbers instead (max, sum of exp, the "
                                  f"target's logit) with all_reduce")
            if not isinstance(got, torch.Tensor) or got.numel() != 1:
                raise CheckFailed(f"{case}: return the mean loss as a one-element tensor, got "
                                  f"{got!r}")
            if not torch.isfinite(got).all():
                raise CheckFailed(f"{case}: the loss is {got.item()}: a row of logits near "
                                  f"1000 overflows exp. Subtract the max over the *whole* "
                                  f"vocabulary (all-reduce with MAX) before exp")
            if abs(got.item() - want.item()) > LOSS_REL * max(abs(want.item()), 1.0):
                raise CheckFailed(
                    f"{case}: loss {got.item():.12g}, expected {want.item():.12g}. Check: the "
                    f"max is the global one (the same shift on every rank); the target's "
                    f"logit comes from the rank whose slice holds it, at id minus that "
                    f"slice's start, and is summed over ranks; tokens with target -100 are "
                    f"left out of the mean")
    passed(f"vocab-parallel cross-entropy equals F.cross_entropy on {' and '.join(map(str, LOSS_WORLDS))}"
           f" ranks, with logits near ±1000 and ignored tokens, without gathering the logits")
