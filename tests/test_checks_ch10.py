"""Chapter 10's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import pytest
import torch

from helpers.checks import CheckFailed, ch10
from helpers.sp import block_attention, merge_partials
from tools.nbtool import exercise

LAB, SOL = "labs/10_sequence_parallel_lab.ipynb", "solutions/10_sequence_parallel_solution.ipynb"


def test_merge_solution_passes_stub_and_average_fail(capsys):
    ch10.check_merge(exercise(SOL, "merge"))
    assert capsys.readouterr().out.count("✓") == 1
    with pytest.raises(CheckFailed, match="not implemented"):
        ch10.check_merge(exercise(LAB, "merge"))
    with pytest.raises(CheckFailed, match="averages"):  # the plausible wrong rule
        ch10.check_merge(lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)))


def _ring_without_mask(q, k, v, group=None):
    # Plausible mistake: every block attended in full (no causal mask).
    import torch.distributed as dist
    cp, rank = dist.get_world_size(), dist.get_rank()
    kv, out = torch.stack([k, v]), None
    for step in range(cp):
        o, l = block_attention(q, kv[0], kv[1])
        out, lse = (o, l) if out is None else merge_partials(out, lse, o, l)
        if step < cp - 1:
            nxt = torch.empty_like(kv)
            reqs = [dist.isend(kv, (rank + 1) % cp), dist.irecv(nxt, (rank - 1) % cp)]
            for r in reqs:
                r.wait()
            kv = nxt
    return out


def test_ring_solution_passes_stub_and_unmasked_fail(capsys):
    ch10.check_ring(exercise(SOL, "ring_forward"))
    assert capsys.readouterr().out.count("✓") == 1
    with pytest.raises(CheckFailed, match="not implemented"):
        ch10.check_ring(exercise(LAB, "ring_forward"))
    with pytest.raises(CheckFailed, match="causal_mask"):
        ch10.check_ring(_ring_without_mask)
