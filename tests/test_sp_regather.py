"""helpers.sp.regather: Megatron's re-gather in backward, against the dense block and the
plain SP block: same values, 2 sbh (t-1)/t fewer saved values, 2 more all-gathers."""

import copy

import pytest
import torch

from helpers import launch, rank_info
from helpers.memory import SavedTensorCounter
from helpers.model import Block, GPTConfig
from helpers.sp import allreduce_replicated_grads, sequence_parallel_block
from helpers.sp.regather import regather_block
from helpers.tp import count_collectives, gather_dense

B, T, H, HEADS = 2, 12, 48, 12    # T and the heads divide over 2, 3 and 4 ranks
SP_NAMES = {"c_attn": "attn.c_attn", "attn_proj": "attn.c_proj", "c_fc": "mlp.c_fc",
            "mlp_proj": "mlp.c_proj"}


def _dense_names(grads):
    out = {}
    for name, g in grads.items():
        head, _, leaf = name.rpartition(".")
        out[f"{SP_NAMES.get(head, head)}.{leaf}"] = g
    return out


def _run():
    r, t, dev = rank_info().rank, rank_info().world_size, rank_info().device
    torch.manual_seed(0)
    dense = Block(GPTConfig(n_head=HEADS, n_embd=H)).double().to(dev)
    x = torch.randn(B, T, H, dtype=torch.float64).to(dev)
    dy = torch.randn(B, T, H, dtype=torch.float64).to(dev)
    out = {}
    for name, make in (("plain", sequence_parallel_block), ("regather", regather_block)):
        blk = make(copy.deepcopy(dense))
        xs = x.chunk(t, dim=1)[r].clone().requires_grad_()
        with count_collectives() as c, SavedTensorCounter(blk) as saved:
            y = blk(xs)
        saved_bytes = saved.total_bytes
        with count_collectives() as cb:
            y.backward(dy.chunk(t, dim=1)[r])
        allreduce_replicated_grads(blk)
        out[name] = dict(y=y.detach(), dx=xs.grad, grads=_dense_names(gather_dense(blk, grads=True)),
                         saved=saved_bytes, fwd=[e.op for e in c.log],
                         bwd=[e.op for e in cb.log],
                         bwd_gather_bytes=sum(e.nbytes for e in cb.log if e.op == "all_gather"))
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    yd.backward(dy)
    out["dense"] = dict(y=yd.detach().chunk(t, dim=1)[r], dx=xd.grad.chunk(t, dim=1)[r],
                        grads={n: p.grad for n, p in dense.named_parameters()})
    return out


def test_regather_equals_dense_and_saves_the_shard_only():
    saved_times_t = {}
    for t in (2, 3):
        results = launch(_run, t)
        for r, out in enumerate(results):
            d = out["dense"]
            for name in ("plain", "regather"):
                o = out[name]
                # float64, only the summation order differs: 1e-12 of values of order 1
                assert (o["y"] - d["y"]).abs().max() < 1e-12, (name, r)
                assert (o["dx"] - d["dx"]).abs().max() < 1e-12, (name, r)
                for n, g in d["grads"].items():
                    assert (o["grads"][n] - g).abs().max() < 1e-11, (name, n, r)
            plain, regather = out["plain"], out["regather"]
            # two gathered LayerNorm outputs (B, T, H) no longer saved, two shards instead
            elem = 8
            assert plain["saved"] - regather["saved"] == 2 * B * T * H * elem * (t - 1) // t
            # the same forward collectives; backward has one more all-gather per
            # column-parallel layer, each moving the shard
            assert plain["fwd"] == regather["fwd"]
            assert regather["bwd"].count("all_gather") == plain["bwd"].count("all_gather") + 2
            assert (regather["bwd_gather_bytes"] - plain["bwd_gather_bytes"]
                    == 2 * B * T // t * H * elem)
        saved_times_t[t] = {k: results[0][k]["saved"] * t for k in ("plain", "regather")}
    # Korthikanti et al. 2022, sec. 4.2.2: with the re-gather every saved activation of
    # the block is divided by t (their 34 sbh / t), so saved x t does not depend on t;
    # the plain SP block keeps the two gathered inputs whole, so its saved x t grows
    assert saved_times_t[2]["regather"] == saved_times_t[3]["regather"]
    assert saved_times_t[3]["plain"] > saved_times_t[2]["plain"]
