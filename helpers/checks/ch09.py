"""Checks for chapter 09: parallelize one transformer block.

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


def check_parallelize_block(parallelize_block) -> None:
    """2 ranks: a block with 4 heads, hidden 16, MLP 64, float64, vs the dense block."""
    from helpers.model import Block, GPTConfig
    res = on_ranks(_run_block, 2, parallelize_block, what="parallelize_block",
                   probe=lambda: parallelize_block(Block(GPTConfig()), None))
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
