"""Chapter 10's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import torch

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch10
from helpers.sp import block_attention, causal_mask, merge_partials, positions


def _merge_unguarded(o1, l1, o2, l2):
    # Plausible mistake: the rule without the guard: two empty blocks give NaN.
    lse = torch.logaddexp(l1, l2)
    return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse


def _merge_lse_max(o1, l1, o2, l2):
    # Plausible mistake: the merged lse taken as the larger of the two.
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    o = torch.exp(l1 - safe)[..., None] * o1 + torch.exp(l2 - safe)[..., None] * o2
    return o, torch.maximum(l1, l2)


def _merge_course(o1, l1, o2, l2):
    # Plausible shortcut: the course's own helper, imported by the lab's first cell.
    return merge_partials(o1, l1, o2, l2)


def _ring(q, k, v, *, to, frm, owner_of, mask=True, group=None, batched=True):
    """A ring forward whose direction, bookkeeping, masking and way of posting the
    transfer (one batch_isend_irecv, or a lone isend and irecv) the answers vary."""
    import torch.distributed as dist
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    seq, kv = q.size(-2) * cp, torch.stack([k, v])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for step in range(cp):
        reqs = []
        if step < cp - 1:
            nxt = torch.empty_like(kv)
            dst, src = glob(to(rank, cp)), glob(frm(rank, cp))
            if batched:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, dst, group),
                                               dist.P2POp(dist.irecv, nxt, src, group)])
            else:
                reqs = [dist.isend(kv, dst, group), dist.irecv(nxt, src, group)]
        m = causal_mask(positions(seq, cp, rank), positions(seq, cp, owner_of(rank, step, cp)))
        if mask is False:
            m = torch.ones_like(m)
        if m.any():
            o, l = block_attention(q, kv[0], kv[1], m)
            out, lse = merge_partials(out, lse, o, l)
        for r in reqs:
            r.wait()
        if reqs:
            kv = nxt
    return out


def _ring_batched(q, k, v, group=None):
    # Right: each step's send and receive as one batch_isend_irecv (the form chapter 03
    # teaches, nccl's): the sends inside the batch are counted like lone ones.
    return _ring(q, k, v, to=lambda r, p: (r + 1) % p, frm=lambda r, p: (r - 1) % p,
                 owner_of=lambda r, s, p: (r - s) % p, group=group)


def _ring_lone(q, k, v, group=None):
    # Right on gloo: a lone isend and irecv per step (under nccl's rules, a hang).
    return _ring(q, k, v, to=lambda r, p: (r + 1) % p, frm=lambda r, p: (r - 1) % p,
                 owner_of=lambda r, s, p: (r - s) % p, batched=False, group=group)


def _ring_without_mask(q, k, v, group=None):
    # Plausible mistake: every block attended in full (no causal mask).
    return _ring(q, k, v, to=lambda r, p: (r + 1) % p, frm=lambda r, p: (r - 1) % p,
                 owner_of=lambda r, s, p: (r - s) % p, mask=False, group=group)


def _ring_backwards(q, k, v, group=None):
    # Plausible mistake: blocks sent to rank - 1 (received from rank + 1) but their
    # owner still taken as rank - s: right at 2 ranks only.
    return _ring(q, k, v, to=lambda r, p: (r - 1) % p, frm=lambda r, p: (r + 1) % p,
                 owner_of=lambda r, s, p: (r - s) % p, group=group)


def _ring_ignores_group(q, k, v, group=None):
    # Plausible mistake: the ring run over the whole job, whatever group it is given.
    return _ring(q, k, v, to=lambda r, p: (r + 1) % p, frm=lambda r, p: (r - 1) % p,
                 owner_of=lambda r, s, p: (r - s) % p, group=None)


def _ring_group_ranks_posted_globally(q, k, v, group=None):
    # Plausible mistake: neighbours numbered inside the group, posted as if they were
    # ranks of the job (no get_global_rank, no group=).
    import torch.distributed as dist
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq, kv = q.size(-2) * cp, torch.stack([k, v])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for step in range(cp):
        reqs = []
        if step < cp - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % cp),
                                           dist.P2POp(dist.irecv, nxt, (rank - 1) % cp)])
        m = causal_mask(positions(seq, cp, rank), positions(seq, cp, (rank - step) % cp))
        if m.any():
            o, l = block_attention(q, kv[0], kv[1], m)
            out, lse = merge_partials(out, lse, o, l)
        for r in reqs:
            r.wait()
        if reqs:
            kv = nxt
    return out


def _ring_from_course(q, k, v, group=None):
    # Plausible shortcut: the course's own ring forward.
    from helpers.sp import ring_forward
    return ring_forward(q, k, v, group)[0]


def _gather_then_attend(q, k, v, group=None):
    # Plausible shortcut: all-gather K/V, then one masked attention (right output, no ring).
    import torch.distributed as dist
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    ks, vs = [torch.empty_like(k) for _ in range(cp)], [torch.empty_like(v) for _ in range(cp)]
    dist.all_gather(ks, k, group=group)
    dist.all_gather(vs, v, group=group)
    seq = q.size(-2) * cp
    m = causal_mask(positions(seq, cp, rank), torch.arange(seq))
    return block_attention(q, torch.cat(ks, -2), torch.cat(vs, -2), m)[0]


def _send_to_everyone(q, k, v, group=None):
    # Plausible non-ring: every rank sends its block straight to every other rank
    # (cp - 1 sends, the same bytes as the ring), then attends block by block.
    import torch.distributed as dist
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    seq, kv = q.size(-2) * cp, torch.stack([k, v])
    blocks, reqs = {rank: kv}, []
    for other in range(cp):
        if other != rank:
            blocks[other] = torch.empty_like(kv)
            reqs += [dist.P2POp(dist.isend, kv, glob(other), group),
                     dist.P2POp(dist.irecv, blocks[other], glob(other), group)]
    for r in (dist.batch_isend_irecv(reqs) if reqs else []):
        r.wait()
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for owner, blk in blocks.items():
        m = causal_mask(positions(seq, cp, rank), positions(seq, cp, owner))
        if m.any():
            o, l = block_attention(q, blk[0], blk[1], m)
            out, lse = merge_partials(out, lse, o, l)
    return out


class TestChapter10(ChapterChecks):
    lab = "labs/10_sequence_parallel_lab.ipynb"
    sol = "solutions/10_sequence_parallel_solution.ipynb"
    checks = {
        "merge": Check(ch10.check_merge),
        "ring": Check(ch10.check_ring, "ring_forward", slow=True, wire="p2p"),
    }
    wrong = [
        Wrong("merge", lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)),
              "averages the partial outputs", says="averages"),
        Wrong("merge", _merge_unguarded, "no guard for two empty blocks", says="NaN"),
        Wrong("merge", _merge_lse_max, "lse taken as the max", says="logaddexp"),
        Wrong("merge", _merge_course, "calls merge_partials", says="merge_partials"),
        Wrong("ring", _ring_without_mask, "no causal mask", says="causal_mask"),
        Wrong("ring", _ring_backwards, "backwards ring, owner rank - s", says="differs"),
        Wrong("ring", _gather_then_attend, "all-gather then attend", says="all_gather"),
        Wrong("ring", _send_to_everyone, "each block sent straight to every rank",
              says="same neighbour"),
        Wrong("ring", _ring_ignores_group, "the ring over the whole job, group ignored",
              says="outside this ring"),
        Wrong("ring", _ring_group_ranks_posted_globally,
              "group ranks posted as ranks of the job", says="get_global_rank",
              kwargs={"timeout": 4}),
        Wrong("ring", _ring_from_course, "the course's own ring_forward",
              says="course's own answer"),
        Wrong("ring", _ring_lone, "lone isend + irecv under NCCL's rules",
              says=r"(?s)hung: .*two-rank communicator", kwargs={"timeout": 3}, rules=True),
    ]
    right = [
        Right("ring", _ring_batched, "each step as one batch_isend_irecv: sends counted"),
        Right("ring", _ring_lone, "a lone isend and irecv per step, on gloo", rules=False),
    ]
