"""Chapter 09's check passes on the solution, fails on the lab's stub and on plausible mistakes."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch09
from helpers.tp import ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear


def _qkv_split_contiguously(block, group=None):
    # Plausible mistake: parts=1, so rank 0 gets all of q and half of k.
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(block.attn, group,
                                    c_attn=ColumnParallelLinear.from_dense(block.attn.c_attn, group),
                                    c_proj=RowParallelLinear.from_dense(block.attn.c_proj, group))
    tp.mlp.c_fc = ColumnParallelLinear.from_dense(block.mlp.c_fc, group)
    tp.mlp.c_proj = RowParallelLinear.from_dense(block.mlp.c_proj, group)
    return tp


def _mlp_left_dense(block, group=None):
    # Plausible mistake: only attention split. Correct outputs, but no memory saved.
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(
        block.attn, group, c_attn=ColumnParallelLinear.from_dense(block.attn.c_attn, group, parts=3),
        c_proj=RowParallelLinear.from_dense(block.attn.c_proj, group))
    return tp


def _mlp_swapped(block, group=None):
    # Plausible mistake: the MLP's pair the wrong way round (row first, column second).
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(
        block.attn, group, c_attn=ColumnParallelLinear.from_dense(block.attn.c_attn, group, parts=3),
        c_proj=RowParallelLinear.from_dense(block.attn.c_proj, group))
    tp.mlp.c_fc = RowParallelLinear.from_dense(block.mlp.c_fc, group)
    tp.mlp.c_proj = ColumnParallelLinear.from_dense(block.mlp.c_proj, group)
    return tp


def _mlp_gathers_and_splits(block, group=None):
    # Plausible detour: the MLP's 4h activation gathered whole (gather_output=True) and
    # split again by the row layer (input_is_parallel=False): right numbers, 2 extra
    # collectives of the largest activation.
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(
        block.attn, group, c_attn=ColumnParallelLinear.from_dense(block.attn.c_attn, group, parts=3),
        c_proj=RowParallelLinear.from_dense(block.attn.c_proj, group))
    tp.mlp.c_fc = ColumnParallelLinear.from_dense(block.mlp.c_fc, group, gather_output=True)
    tp.mlp.c_proj = RowParallelLinear.from_dense(block.mlp.c_proj, group, input_is_parallel=False)
    return tp


def _attention_defaults(block, group=None):
    # Plausible shortcut: ParallelSelfAttention's own defaults split QKV by heads and the
    # output projection by input: the exercise's second question, answered for the learner.
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(block.attn, group)
    tp.mlp.c_fc = ColumnParallelLinear.from_dense(block.mlp.c_fc, group)
    tp.mlp.c_proj = RowParallelLinear.from_dense(block.mlp.c_proj, group)
    return tp


def _block_ignores_group(block, group=None):
    # Plausible mistake: the layers built without the group (split over the whole job).
    return _qkv_by_heads(block, None)


def _qkv_by_heads(block, group):
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(
        block.attn, group, c_attn=ColumnParallelLinear.from_dense(block.attn.c_attn, group, parts=3),
        c_proj=RowParallelLinear.from_dense(block.attn.c_proj, group))
    tp.mlp.c_fc = ColumnParallelLinear.from_dense(block.mlp.c_fc, group)
    tp.mlp.c_proj = RowParallelLinear.from_dense(block.mlp.c_proj, group)
    return tp


def _block_from_course(block, group=None):
    # Plausible shortcut: the chapter's one-line helper.
    from helpers.tp import tensor_parallel_block
    return tensor_parallel_block(block, group)


def _loss(logits, targets, group=None, ignore_index=-100, *, shift="global", offset=True,
          drop_ignored=True):
    """The vocab-parallel loss with one of its steps varied, for the wrong answers."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = logits.size(-1)
    start = r * n if offset else 0
    m = logits.max(-1).values.clone()
    if shift == "global":
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    elif shift == "none":
        m = torch.zeros_like(m)
    shifted = logits - m[:, None]
    s = shifted.exp().sum(-1)
    dist.all_reduce(s, group=group)
    local = targets - start
    mine = (local >= 0) & (local < n) & (targets != ignore_index)
    z = torch.zeros_like(s)
    z[mine] = shifted[mine, local[mine]]
    dist.all_reduce(z, group=group)
    loss = s.log() - z
    return loss[targets != ignore_index].mean() if drop_ignored else loss.mean()


def _loss_no_shift(logits, targets, group=None, ignore_index=-100):
    # Plausible mistake: exp of the raw logits (overflows near 1000).
    return _loss(logits, targets, group, ignore_index, shift="none")


def _loss_local_max(logits, targets, group=None, ignore_index=-100):
    # Plausible mistake: each rank shifts by its own max.
    return _loss(logits, targets, group, ignore_index, shift="local")


def _loss_global_id(logits, targets, group=None, ignore_index=-100):
    # Plausible mistake: the target looked up at its global id on every rank's slice.
    return _loss(logits, targets, group, ignore_index, offset=False)


def _loss_counts_ignored(logits, targets, group=None, ignore_index=-100):
    # Plausible mistake: ignored tokens kept in the mean.
    return _loss(logits, targets, group, ignore_index, drop_ignored=False)


def _loss_gathered(logits, targets, group=None, ignore_index=-100):
    # Plausible shortcut: gather the whole vocabulary, then the dense loss (right value).
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return F.cross_entropy(torch.cat(parts, -1), targets, ignore_index=ignore_index)


def _loss_ignores_group(logits, targets, group=None, ignore_index=-100):
    # Plausible mistake: every collective in the default group, the rank from the job.
    return _loss(logits, targets, None, ignore_index)


def _loss_all_reduce_gather(logits, targets, group=None, ignore_index=-100):
    # Plausible detour: the whole logits rebuilt by an all-reduce of a zero-padded copy
    # (no all_gather called), then the dense loss.
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = logits.size(-1)
    whole = logits.new_zeros(logits.size(0), n * t)
    whole[:, r * n:(r + 1) * n] = logits
    dist.all_reduce(whole, group=group)
    return F.cross_entropy(whole, targets, ignore_index=ignore_index)


def _loss_from_course(logits, targets, group=None, ignore_index=-100):
    # Plausible shortcut: the chapter's own vocab-parallel loss.
    from helpers.tp import vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy(logits, targets, group, ignore_index)


class TestChapter09(ChapterChecks):
    lab = "labs/09_tp_in_transformer_lab.ipynb"
    sol = "solutions/09_tp_in_transformer_solution.ipynb"
    checks = {"parallelize_block": Check(ch09.check_parallelize_block, slow=True, wire=True),
              "vocab_parallel_loss": Check(ch09.check_vocab_parallel_loss, slow=True, wire=True)}
    wrong = [
        Wrong("parallelize_block", _qkv_split_contiguously, "q, k, v split contiguously",
              says="split by heads"),
        Wrong("parallelize_block", _mlp_left_dense, "the MLP left dense", says="still dense"),
        Wrong("parallelize_block", _mlp_swapped, "the MLP's column and row layers swapped",
              says="shapes do not chain"),
        Wrong("vocab_parallel_loss", _loss_no_shift, "no max subtracted", says="overflows"),
        Wrong("vocab_parallel_loss", _loss_local_max, "each rank's own max", says="global one"),
        Wrong("vocab_parallel_loss", _loss_global_id, "target at its global id",
              says="slice's start"),
        Wrong("vocab_parallel_loss", _loss_counts_ignored, "ignored tokens in the mean",
              says="-100"),
        Wrong("vocab_parallel_loss", _loss_gathered, "all-gather then the dense loss",
              says="all_gather"),
        Wrong("parallelize_block", _mlp_gathers_and_splits,
              "MLP gathers its 4h activation and splits it again", says="all_gather"),
        Wrong("parallelize_block", _block_ignores_group, "layers built without the group",
              says="Pass `group` to every split layer"),
        Wrong("parallelize_block", _block_from_course, "the chapter's tensor_parallel_block",
              says="course's own answer"),
        Wrong("parallelize_block", _attention_defaults,
              "ParallelSelfAttention's default projections", says="without c_attn= and c_proj="),
        Wrong("vocab_parallel_loss", _loss_ignores_group, "collectives without group=",
              says="pass group=group"),
        Wrong("vocab_parallel_loss", _loss_all_reduce_gather,
              "the whole logits rebuilt by an all-reduce", says="rebuilds the whole logits"),
        Wrong("vocab_parallel_loss", _loss_from_course, "the chapter's own loss",
              says="course's own answer"),
    ]
