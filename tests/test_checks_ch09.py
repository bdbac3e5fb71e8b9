"""Chapter 09's check passes on the solution, fails on the lab's stub and on plausible mistakes."""

import copy

import pytest

from helpers.checks import CheckFailed, ch09
from helpers.tp import ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear
from tools.nbtool import exercise

LAB, SOL = "labs/09_tp_in_transformer_lab.ipynb", "solutions/09_tp_in_transformer_solution.ipynb"


def test_solution_passes_and_stub_fails(capsys):
    ch09.check_parallelize_block(exercise(SOL, "parallelize_block"))
    assert capsys.readouterr().out.count("✓") == 1
    with pytest.raises(CheckFailed, match="not implemented"):
        ch09.check_parallelize_block(exercise(LAB, "parallelize_block"))


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


def test_qkv_split_contiguously_fails():
    with pytest.raises(CheckFailed, match="split by heads"):
        ch09.check_parallelize_block(_qkv_split_contiguously)


def test_mlp_left_dense_fails():
    with pytest.raises(CheckFailed, match="still dense"):
        ch09.check_parallelize_block(_mlp_left_dense)
