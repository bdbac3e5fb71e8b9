"""Chapter 10's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import torch

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch10
from helpers.sp import block_attention, merge_partials


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


class TestChapter10(ChapterChecks):
    lab = "labs/10_sequence_parallel_lab.ipynb"
    sol = "solutions/10_sequence_parallel_solution.ipynb"
    checks = {
        "merge": Check(ch10.check_merge),
        "ring": Check(ch10.check_ring, "ring_forward"),
    }
    wrong = [
        Wrong("merge", lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)),
              "averages the partial outputs", says="averages"),
        Wrong("ring", _ring_without_mask, "no causal mask", says="causal_mask"),
    ]
