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
* ``attach_zero2(model, group=None) -> shards``: register hooks so that, during
  every backward, each parameter's gradient is reduce-scattered (averaged,
  padded to a multiple of N) the moment it is ready, this rank's chunk is
  *added* into ``shards[name]`` (a dict the function returns, filled by the
  hooks) and the full gradient is dropped (``p.grad = None``).
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


def _run_zero2(attach_zero2):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model

    r = rank_info()
    N = r.world_size
    data = make_dataset(num_sequences=16, seq_len=16)
    micro = [data.batch(range(4 * m + 2 * r.rank, 4 * m + 2 * r.rank + 2)) for m in range(2)]
    # reference first (it uses all_reduce, refused below): the averaged gradient
    # of two micro-batches, and sum |terms| for the rounding bound
    ref_model = build_model("toy", seed=0)
    local, local_abs = {}, {}  # sum and sum |.| of the micro-batches' gradients
    for x, y in micro:
        ref_model.zero_grad()
        ref_model(x, y)[1].backward()
        for n, p in ref_model.named_parameters():
            g = p.grad.reshape(-1)
            local[n] = local[n] + g if n in local else g.clone()
            local_abs[n] = local_abs[n] + g.abs() if n in local_abs else g.abs()
    ref, ref_abs = {}, {}
    for n, g in local.items():
        summed, absum = g.clone(), local_abs[n].clone()
        dist.all_reduce(summed)
        dist.all_reduce(absum)
        pad = -(-g.numel() // N) * N
        chunk = pad // N
        full, full_abs = torch.zeros(pad), torch.zeros(pad)
        full[:g.numel()], full_abs[:g.numel()] = summed / N, absum / N
        ref[n] = full[r.rank * chunk:(r.rank + 1) * chunk]
        ref_abs[n] = full_abs[r.rank * chunk:(r.rank + 1) * chunk]

    def refuse(*args, **kwargs):
        raise RuntimeError("all_reduce refused: stage 2 reduce-scatters each gradient "
                           "(an all-reduce sends twice the bytes and leaves the full "
                           "gradient on every rank)")

    dist.all_reduce = refuse  # in this rank only: a fresh process
    model = build_model("toy", seed=0)
    params = dict(model.named_parameters())
    live = {"now": 0, "peak": 0}

    def meter(p):  # registered first, so it runs before the learner's hook
        live["now"] = sum(q.grad.numel() * 4 for q in params.values() if q.grad is not None)
        live["peak"] = max(live["peak"], live["now"])

    for p in params.values():
        p.register_post_accumulate_grad_hook(meter)
    shards = attach_zero2(model)
    if not isinstance(shards, dict):
        raise TypeError(f"attach_zero2 must return the dict of shards, got "
                        f"{type(shards).__name__}")
    for x, y in micro:
        model(x, y)[1].backward()
    left = sum(p.grad.numel() * 4 for p in params.values() if p.grad is not None)
    return {"shards": {n: (t.clone() if torch.is_tensor(t) else t) for n, t in shards.items()},
            "ref": ref, "ref_abs": ref_abs, "peak": live["peak"], "left": left,
            "largest": max(p.numel() * 4 for p in params.values()),
            "all": sum(p.numel() * 4 for p in params.values())}


def check_attach_zero2(attach_zero2) -> None:
    """2 ranks, the toy GPT, two micro-batches (two backwards) per rank."""
    res = on_ranks(_run_zero2, 2, attach_zero2, what="attach_zero2",
                   probe=lambda: attach_zero2(torch.nn.Linear(2, 2)))
    for rank, out in enumerate(res):
        # memory first: a gradient left in p.grad also adds into the next backward's
        # gradient, so its shards are wrong too, for this reason
        if out["left"]:
            raise CheckFailed(f"rank {rank}: {out['left']:,} bytes of full gradients are still "
                              f"in p.grad after backward; stage 2 drops each one once it is "
                              f"reduce-scattered")
        if out["peak"] > out["largest"]:
            raise CheckFailed(f"rank {rank}: up to {out['peak']:,} bytes of full gradients were "
                              f"alive at once during backward (all of them: {out['all']:,}); "
                              f"drop each gradient in the hook that sends it, so at most one "
                              f"({out['largest']:,} bytes for the largest) exists at a time")
        for n, want in out["ref"].items():
            got = out["shards"].get(n)
            if not torch.is_tensor(got) or got.shape != want.shape:
                raise CheckFailed(f"rank {rank}: shards[{n!r}] should be this rank's chunk of "
                                  f"{want.numel()} elements, got "
                                  f"{None if not torch.is_tensor(got) else tuple(got.shape)}")
            # two ranks and two micro-batches: 4 terms added in some order,
            # the halving exact; Higham's bound on two orders of a 4-term sum
            if not ((got - want).abs() <= reorder_bound(out["ref_abs"][n], 4)).all():
                ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                hint = (" It is 2x the average: divide by the number of ranks." if
                        abs(ratio - 2) < 0.01 else
                        " Only one micro-batch's gradient is there? Add into the shard, "
                        "do not overwrite it: backward runs once per micro-batch."
                        if 0.2 < ratio < 0.8 else
                        " Lay the gradient out flat, zero-pad it to a multiple of N, and "
                        "keep chunk r.")
                raise CheckFailed(f"rank {rank}: shards[{n!r}] is not the average over ranks "
                                  f"of this rank's chunk, summed over both backwards.{hint}")
    peak = res[0]["peak"]
    passed(f"stage 2 from hooks: every shard right after two micro-batches; full gradients "
           f"alive at once peaked at {peak:,} bytes, against {res[0]['all']:,} for all of "
           f"them ({peak / res[0]['all']:.0%})")
