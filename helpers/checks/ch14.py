"""Checks for chapter 14: the shard layout, a ZeRO stage-1 step, stage 2's reduce-scatter.

Learner contracts (the lab's docstrings say the same):

* ``shard_bounds(numel, world_size, rank) -> (lo, hi, padded)``: pad ``numel``
  up to a multiple of ``world_size``; rank r owns ``[lo, hi)`` of the padded
  flat buffer.
* ``zero1_step(flat_param, flat_grad, m, v, step, group=None) -> grad_chunk``:
  on every rank, ``flat_param`` (padded, identical on all ranks) and this
  rank's local ``flat_grad``; reduce-scatter the *averaged* gradient, AdamW
  on this rank's chunk (with ``helpers.zero.adamw_update`` and the module's
  LR etc.), all-gather the updated chunks back into ``flat_param``; return
  the averaged gradient chunk used.
* ``reduce_scatter_bucket(grads, group=None) -> chunk``: flatten a bucket's
  gradients into one zero-padded buffer, average over ranks with one
  reduce-scatter, return this rank's chunk.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.tolerance import gamma, reorder_bound

# The lab's AdamW hyperparameters (the check's reference uses the same).
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01

SHARD_CASES = [  # (numel, world_size)
    (10, 2), (10, 3), (7, 4), (12, 4), (5, 1), (1, 4), (0, 3),
]


def check_shard_bounds(shard_bounds) -> None:
    for numel, n in SHARD_CASES:
        padded = -(-numel // n) * n
        chunk = padded // n
        for r in range(n):
            got = attempt(shard_bounds, numel, n, r, what="shard_bounds")
            want = (r * chunk, (r + 1) * chunk, padded)
            if tuple(got) != want:
                hint = ""
                if numel % n and got and got[-1] == numel:
                    hint = (" Pad to a multiple of world_size so every rank gets the same "
                            "chunk size (collectives need equal chunks).")
                raise CheckFailed(f"shard_bounds({numel}, {n}, {r}) = {tuple(got)}, expected "
                                  f"{want}.{hint}")
    passed("shard bounds right, padding included (10 elements on 3 ranks: chunks of 4, "
           "2 zeros of padding)")


def _flat_setup(numel, seed):
    from helpers import rank_info
    r = rank_info()
    padded = -(-numel // r.world_size) * r.world_size
    g = torch.Generator().manual_seed(seed)
    param = torch.zeros(padded)
    param[:numel] = torch.randn(numel, generator=g)
    grads = []
    for step in range(3):
        gr = torch.zeros(padded)
        gen = torch.Generator().manual_seed(seed + 1000 * (step + 1) + r.rank)
        gr[:numel] = torch.randn(numel, generator=gen) * (r.rank + 1)
        grads.append(gr)
    return param, grads


def _run_zero1(zero1_step, numel):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.zero import adamw_update
    r = rank_info()
    N = r.world_size
    param, grads = _flat_setup(numel, seed=7)
    chunk = param.numel() // N
    lo, hi = r.rank * chunk, (r.rank + 1) * chunk
    ref = param.clone()
    m, v = torch.zeros(chunk), torch.zeros(chunk)
    rm, rv = torch.zeros_like(ref), torch.zeros_like(ref)
    chunks, ref_chunks, abs_chunks = [], [], []
    for step, g in enumerate(grads, start=1):
        got = zero1_step(param, g.clone(), m, v, step)
        chunks.append(None if got is None else torch.as_tensor(got).clone())
        # reference gradient: DDP's recipe on the full buffer, and sum |g_r| / N
        # for the bound on the summation order
        avg, abs_avg = g.clone() / N, g.abs() / N
        dist.all_reduce(avg)
        dist.all_reduce(abs_avg)
        ref_chunks.append(avg[lo:hi].clone())
        abs_chunks.append(abs_avg[lo:hi].clone())
        # reference weights: AdamW on the full buffer from the averaged chunks
        # the learner's ranks returned, so that the weights are compared for the
        # update and the all-gather alone (the chunks are checked on their own).
        # A wrong-shaped chunk still joins the all-gather (as zeros), so no rank
        # waits on a collective the others skipped; its check fails anyway.
        mine = chunks[-1] if chunks[-1] is not None and chunks[-1].shape == (chunk,) \
            else torch.zeros(chunk)
        parts = [torch.empty(chunk) for _ in range(N)]
        dist.all_gather(parts, mine.float())
        adamw_update(ref, torch.cat(parts), rm, rv, step, LR, BETAS[0], BETAS[1], EPS, WD)
    return {"param": param, "ref": ref, "chunks": chunks, "ref_chunks": ref_chunks,
            "abs_chunks": abs_chunks}


def check_zero1_step(zero1_step) -> None:
    """Three AdamW steps on 3 ranks, a buffer of 10 elements (2 of padding)."""
    res = on_ranks(_run_zero1, 3, zero1_step, 10, what="zero1_step",
                   probe=lambda: zero1_step(torch.zeros(6), torch.zeros(6),
                                            torch.zeros(2), torch.zeros(2), 1))
    for rank, out in enumerate(res):
        for step, (got, want, abs_sum) in enumerate(
                zip(out["chunks"], out["ref_chunks"], out["abs_chunks"]), start=1):
            if got is None or got.shape != want.shape:
                raise CheckFailed(f"rank {rank}, step {step}: return this rank's averaged "
                                  f"gradient chunk ({want.numel()} elements), got "
                                  f"{None if got is None else tuple(got.shape)}")
            # reduce-scatter and all-reduce may add the 3 ranks in other orders,
            # and divide before or after: Higham's bound on two orders of a
            # 3-term sum, one more rounding for the division
            if not ((got - want).abs() <= reorder_bound(abs_sum, 3 + 1)).all():
                ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                hint = ""
                if abs(ratio - 1 / 3) < 1e-3:
                    hint = " It is 1/3 of the right one: averaged twice?"
                elif abs(ratio - 3) < 1e-3:
                    hint = " It is 3x the right one: divide the sum by world_size."
                raise CheckFailed(f"rank {rank}, step {step}: the gradient chunk is not the "
                                  f"average over ranks of this rank's chunk.{hint}")
        # The same AdamW arithmetic on the same gradients: equal up to how the
        # elementwise kernels round (fused multiply-add or not, vector or
        # scalar loop): an ulp or so per operation, ~10 operations per step,
        # 3 steps, on weights of size |w| and updates of at most ~3.2 lr
        # (Kingma & Ba 2015, sec. 2.1: |step| <= lr (1 - b1) / sqrt(1 - b2)).
        # A chunk left stale or never updated is off by a whole step, ~lr.
        bound = gamma(30) * (out["ref"].abs() + 3 * 3.2 * LR)
        bad = (out["param"] - out["ref"]).abs() > bound
        diff = (out["param"] - out["ref"]).abs().max().item()
        if bad.any():
            chunk = out["param"].numel() // 3
            stale = [r for r in range(3) if r != rank and bad[r * chunk:(r + 1) * chunk].any()]
            hint = (f" Chunks owned by ranks {stale} are out of date: all-gather the updated "
                    f"chunks into flat_param." if stale else "")
            raise CheckFailed(f"rank {rank}: weights after 3 steps differ from all-reduce + "
                              f"AdamW by {diff:.2e}.{hint}")
    passed("stage 1 equals all-reduce + AdamW on 3 ranks, each rank holding 1/3 of Adam's state")


def _run_rs(reduce_scatter_bucket):
    from helpers import rank_info
    r = rank_info()
    g = torch.Generator().manual_seed(3 + r.rank)
    grads = [torch.randn(3, 2, generator=g), torch.randn(5, generator=g)]  # 11 elements
    got = reduce_scatter_bucket([t.clone() for t in grads])
    return {"got": None if got is None else torch.as_tensor(got).clone(), "grads": grads}


def check_reduce_scatter_bucket(reduce_scatter_bucket) -> None:
    """3 ranks, a bucket of a (3, 2) and a (5,) gradient: 11 elements, padded to 12."""
    res = on_ranks(_run_rs, 3, reduce_scatter_bucket, what="reduce_scatter_bucket",
                   probe=lambda: reduce_scatter_bucket([torch.zeros(3)]))
    flat = [torch.cat([t.reshape(-1) for t in out["grads"]]) for out in res]
    avg, abs_avg = torch.zeros(12), torch.zeros(12)
    avg[:11] = sum(flat) / 3
    abs_avg[:11] = sum(f.abs() for f in flat) / 3  # sum |terms|, for the bound
    for rank, out in enumerate(res):
        want, got = avg[4 * rank:4 * (rank + 1)], out["got"]
        if got is None or got.numel() != 4:
            raise CheckFailed(f"rank {rank}: expected a chunk of 4 elements (11 padded to 12, "
                              f"over 3 ranks), got {None if got is None else tuple(got.shape)}")
        # 3 ranks' terms summed in some order, divided before or after:
        # Higham's bound on two orders of a 3-term sum plus the division
        if not ((got.reshape(-1) - want).abs() <= reorder_bound(abs_avg[4 * rank:4 * (rank + 1)],
                                                               3 + 1)).all():
            ratio = (got.norm() / want.norm()).item()
            hint = (" averaged twice?" if abs(ratio - 1 / 3) < 1e-3 else
                    " summed, not averaged?" if abs(ratio - 3) < 1e-3 else
                    " is the buffer laid out in the order of `grads`, padding at the end?")
            raise CheckFailed(f"rank {rank}: chunk {got.reshape(-1).tolist()} differs from the "
                              f"average {want.tolist()};{hint}")
    passed("bucket reduce-scattered: each rank holds the averaged 1/3 of it, nothing more")
