"""Chapter 09's check passes on the solution, fails on the lab's stub and on plausible mistakes."""

import copy

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


class TestChapter09(ChapterChecks):
    lab = "labs/09_tp_in_transformer_lab.ipynb"
    sol = "solutions/09_tp_in_transformer_solution.ipynb"
    checks = {"parallelize_block": Check(ch09.check_parallelize_block)}
    wrong = [
        Wrong("parallelize_block", _qkv_split_contiguously, "q, k, v split contiguously",
              says="split by heads"),
        Wrong("parallelize_block", _mlp_left_dense, "the MLP left dense", says="still dense"),
    ]
