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
from helpers.checks.groups import GroupWatch as _Watched
from helpers.checks.course_answers import refusing
from helpers.tolerance import gamma, reorder_bound

# The lab's AdamW hyperparameters (the check's reference uses the same).
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01

# the course's own answers to the exercises, switched off while the learner's code runs
_PARTITION = {"helpers.zero.partition.FlatPartition": "it is the course's answer to this "
              "exercise: compute the bounds yourself"}
_ZERO = {"helpers.zero.base.ZeroOptimizer": "", "helpers.zero.stages.ZeroStage2": "",
         "helpers.zero.sharded.ShardedOptimizer": ""}

SHARD_CASES = [  # (numel, world_size)
    (10, 2), (10, 3), (7, 4), (12, 4), (5, 1), (1, 4), (0, 3), (13, 3),
]


def check_shard_bounds(shard_bounds) -> None:
    """Catches:
    * no padding (chunks of numel // N, the tail dropped or given to the last rank):
      (10, 3) and (7, 4) (named);
    * rounding the chunk to nearest instead of up: (13, 3) (4.33 -> 4);
    * float bounds (``/`` where ``//`` belongs; 4.0 == 4 would pass a loose compare,
      slicing with it fails): named as a type error;
    * returns None, a list of the wrong length, or raises: named with the case;
    * ``helpers.zero.FlatPartition`` asked instead: switched off while it runs.
    """
    for numel, n in SHARD_CASES:
        padded = -(-numel // n) * n
        chunk = padded // n
        for r in range(n):
            with refusing(exercise="shard_bounds", paths=_PARTITION):
                got = attempt(shard_bounds, numel, n, r, what=f"shard_bounds({numel}, {n}, {r})")
            want = (r * chunk, (r + 1) * chunk, padded)
            try:
                got = tuple(got)
            except TypeError:
                raise CheckFailed(f"shard_bounds({numel}, {n}, {r}) should return a tuple "
                                  f"(lo, hi, padded), got {got!r}") from None
            if len(got) == 3 and not all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in got):
                raise CheckFailed(f"shard_bounds({numel}, {n}, {r}) = {got}: bounds must be "
                                  f"ints (they slice tensors); use // for whole-number "
                                  f"division, not /")
            if got != want:
                hint = ""
                if numel % n and got and got[-1] == numel:
                    hint = (" Pad to a multiple of world_size so every rank gets the same "
                            "chunk size (collectives need equal chunks).")
                raise CheckFailed(f"shard_bounds({numel}, {n}, {r}) = {tuple(got)}, expected "
                                  f"{want}.{hint}")
    passed("shard bounds right, padding included (10 elements on 3 ranks: chunks of 4, "
           "2 zeros of padding)")


# The rank-parallel checks run twice: on 3 ranks with the default group (padding is
# needed, a hard-coded N = 2 or 4 fails), and on 4 ranks split into two groups of 2,
# each doing its own ZeRO and passed as ``group=``: code that ignores ``group`` (a
# collective without it, dist.get_rank() of the world) then mixes the two groups.
RUNS = ((3, False), (4, True))


def _groups(split: bool):
    """(group to pass, its size, this rank's index in it); every rank creates every group."""
    import torch.distributed as dist

    from helpers import rank_info
    r = rank_info()
    if not split:
        return None, r.world_size, r.rank
    pairs = [dist.new_group(members) for members in SPLIT]
    members, index = _place(r.rank, True, 4)
    return pairs[SPLIT.index(members)], 2, index


# Two groups of 2 out of 4 ranks, strided as a data x tensor mesh lays them out: a rank's
# place in its group is not dist.get_rank() % 2, so code that takes the rank in the job
# for the rank in the group shows (contiguous groups [0, 1], [2, 3] would hide it).
SPLIT = [[0, 2], [1, 3]]


def _place(rank: int, split: bool, world: int) -> tuple[list[int], int]:
    """(the members of ``rank``'s group, its index in it)."""
    if not split:
        return list(range(world)), rank
    members = next(m for m in SPLIT if rank in m)
    return members, members.index(rank)


_NO_ALL_REDUCE = {"all_reduce": "ZeRO reduce-scatters the gradient: an all-reduce sends "
                                "twice the bytes and leaves the whole average on every rank",
                  "broadcast": "every rank's chunk comes back with one all-gather"}


def _group_advice(split: bool) -> str:
    return (" (4 ranks in two groups of 2: pass group=group to every collective and use "
            "dist.get_rank(group), dist.get_world_size(group): the groups are strided, [0, 2] "
            "and [1, 3], so the rank in the job is not the rank in the group)" if split else "")


def _flat_setup(numel, seed, n, rank):
    padded = -(-numel // n) * n
    g = torch.Generator().manual_seed(seed)
    param = torch.zeros(padded)
    param[:numel] = torch.randn(numel, generator=g)
    grads = []
    for step in range(3):
        gr = torch.zeros(padded)
        gen = torch.Generator().manual_seed(seed + 1000 * (step + 1) + rank)
        gr[:numel] = torch.randn(numel, generator=gen) * (rank + 1)
        grads.append(gr)
    return param, grads


def _run_zero1(zero1_step, numel, split):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.zero import adamw_update
    group, N, rank = _groups(split)
    dev = rank_info().device
    param, grads = _flat_setup(numel, 7, N, rank)
    param, grads = param.to(dev), [g.to(dev) for g in grads]
    chunk = param.numel() // N
    lo, hi = rank * chunk, (rank + 1) * chunk
    ref = param.clone()
    m, v = torch.zeros(chunk, device=dev), torch.zeros(chunk, device=dev)
    rm, rv = torch.zeros_like(ref), torch.zeros_like(ref)
    chunks, ref_chunks, abs_chunks = [], [], []
    for step, g in enumerate(grads, start=1):
        with _Watched(group, _NO_ALL_REDUCE):
            got = zero1_step(param, g.clone(), m, v, step, **({"group": group} if split else {}))
        chunks.append(got.detach().clone() if isinstance(got, torch.Tensor) else repr(got)[:60])
        # reference gradient: DDP's recipe on the full buffer, and sum |g_r| / N
        # for the bound on the summation order
        avg, abs_avg = g.clone() / N, g.abs() / N
        dist.all_reduce(avg, group=group)
        dist.all_reduce(abs_avg, group=group)
        ref_chunks.append(avg[lo:hi].clone())
        abs_chunks.append(abs_avg[lo:hi].clone())
        # reference weights: AdamW on the full buffer from the averaged chunks
        # the learner's ranks returned, so that the weights are compared for the
        # update and the all-gather alone (the chunks are checked on their own).
        # A wrong-shaped chunk still joins the all-gather (as zeros), so no rank
        # waits on a collective the others skipped; its check fails anyway.
        mine = chunks[-1] if isinstance(chunks[-1], torch.Tensor) \
            and chunks[-1].shape == (chunk,) else torch.zeros(chunk, device=dev)
        parts = [torch.empty(chunk, device=dev) for _ in range(N)]
        dist.all_gather(parts, mine.float(), group=group)
        adamw_update(ref, torch.cat(parts), rm, rv, step, LR, BETAS[0], BETAS[1], EPS, WD)
    return {"param": param, "ref": ref, "chunks": chunks, "ref_chunks": ref_chunks,
            "abs_chunks": abs_chunks, "N": N, "m": m.clone(), "ref_m": rm[lo:hi].clone()}


def check_zero1_step(zero1_step) -> None:
    """Three AdamW steps on a buffer of 10 elements: 3 ranks (2 of padding), then 4 ranks
    in two groups of 2 passed as ``group``.

    Catches:
    * forgets the all-gather: other ranks' chunks stale (named);
    * averages twice, or sums: the gradient chunk 1/N or N times the average (named);
    * an all-reduce (then a slice) instead of the reduce-scatter: refused (named);
    * ignores ``group`` (a collective without it, or dist.get_rank() of the world):
      a collective without group= is refused before it runs (named);
    * N hard-coded: wrong at 3 or at 2 (the groups); the rank in the job taken for the
      rank in the group (the groups are strided);
    * AdamW given the summed chunk, ``/ N`` only in the value returned: Adam's m (named);
    * returns None or a non-tensor: named;
    * any exception: the rank's error, as CheckFailed.
    """
    for world, split in RUNS:
        res = on_ranks(_run_zero1, world, zero1_step, 10, split,
                       what=f"zero1_step on {world} ranks" + (" in two groups" if split else ""),
                       probe=lambda: zero1_step(torch.zeros(6), torch.zeros(6),
                                                torch.zeros(2), torch.zeros(2), 1))
        _compare_zero1(res, world, split)
    passed("stage 1 equals all-reduce + AdamW on 3 ranks and in two groups of 2, each rank "
           "holding 1/N of Adam's state")


def _compare_zero1(res: list, world: int, split: bool) -> None:
    where = f"{world} ranks" + (" in two groups of 2" if split else "")
    for rank, out in enumerate(res):
        N = out["N"]
        for step, (got, want, abs_sum) in enumerate(
                zip(out["chunks"], out["ref_chunks"], out["abs_chunks"]), start=1):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise CheckFailed(f"{where}, rank {rank}, step {step}: return this rank's "
                                  f"averaged gradient chunk (a tensor of {want.numel()} "
                                  f"elements), got "
                                  f"{got if isinstance(got, str) else tuple(got.shape)}")
            # reduce-scatter and all-reduce may add the N ranks in other orders,
            # and divide before or after: Higham's bound on two orders of an
            # N-term sum, one more rounding for the division
            if not ((got - want).abs() <= reorder_bound(abs_sum, N + 1)).all():
                ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                hint = ""
                if abs(ratio - 1 / N) < 1e-3:
                    hint = " It is 1/N of the right one: averaged twice?"
                elif abs(ratio - N) < 1e-3:
                    hint = " It is N x the right one: divide the sum by world_size."
                raise CheckFailed(f"{where}, rank {rank}, step {step}: the gradient chunk is "
                                  f"not the average over ranks of this rank's chunk.{hint}"
                                  f"{_group_advice(split)}")
        # Adam's first moment of this rank's chunk against the reference's: the weights
        # alone cannot tell AdamW fed the summed chunk from AdamW fed the average (Adam's
        # step is scale-invariant but for eps). Three steps of m = b1 m + (1 - b1) g on
        # gradients equal to a few float32 roundings (the bound above): rtol 1e-5 is
        # 100x that; a sum is N x off.
        m, ref_m = out["m"], out["ref_m"]
        if m.shape == ref_m.shape and not torch.allclose(m, ref_m, rtol=1e-5, atol=1e-7):
            ratio = (m.norm() / ref_m.norm()).item() if ref_m.norm() > 0 else float("nan")
            hint = (f" It is {N} x the reference: AdamW was given the summed chunk; divide "
                    f"by the group size before the update, not only in the value returned."
                    if abs(ratio - N) < 1e-3 else " AdamW must be given the averaged chunk.")
            raise CheckFailed(f"{where}, rank {rank}: Adam's first moment m of this rank's "
                              f"chunk differs from the reference's.{hint}")
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
            chunk = out["param"].numel() // N
            me = _place(rank, split, world)[1]
            stale = [r for r in range(N) if r != me and bad[r * chunk:(r + 1) * chunk].any()]
            hint = (f" Chunks owned by group ranks {stale} are out of date: all-gather the "
                    f"updated chunks into flat_param." if stale else "")
            raise CheckFailed(f"{where}, rank {rank}: weights after 3 steps differ from "
                              f"all-reduce + AdamW by {diff:.2e}.{hint}{_group_advice(split)}")


def _run_rs(reduce_scatter_bucket, split):
    from helpers import rank_info
    group, N, rank = _groups(split)
    g = torch.Generator().manual_seed(3 + rank_info().rank)
    dev = rank_info().device
    # 11 elements: not a multiple of 2 or 3, so padding is needed in both runs; the first
    # gradient (5) is not a multiple either, so padding each gradient on its own (5 -> 6,
    # then 6) lays the bucket out differently from padding the bucket at its end
    grads = [torch.randn(5, generator=g).to(dev), torch.randn(3, 2, generator=g).to(dev)]
    with _Watched(group, _NO_ALL_REDUCE):
        got = reduce_scatter_bucket([t.clone() for t in grads],
                                    **({"group": group} if split else {}))
    return {"got": got.detach().clone() if isinstance(got, torch.Tensor) else repr(got)[:60],
            "grads": grads, "N": N}


def check_reduce_scatter_bucket(reduce_scatter_bucket) -> None:
    """A bucket of a (5,) and a (3, 2) gradient, 11 elements: on 3 ranks (padded to 12)
    and on 4 ranks in two groups of 2 passed as ``group`` (padded to 12, chunks of 6).

    Catches:
    * the sum, not the average; averaged twice: named;
    * no padding (the last elements dropped): a chunk of the wrong size (named);
    * the buffer in another order than ``grads``, or each gradient padded on its own
      instead of the bucket at its end: named;
    * an all-reduce instead of the reduce-scatter: refused (named);
    * ignores ``group``: a collective without group= refused before it runs (named);
    * returns None, the whole buffer, or raises: named.
    """
    for world, split in RUNS:
        res = on_ranks(_run_rs, world, reduce_scatter_bucket, split,
                       what=f"reduce_scatter_bucket on {world} ranks"
                       + (" in two groups" if split else ""),
                       probe=lambda: reduce_scatter_bucket([torch.zeros(3)]))
        _compare_rs(res, world, split)
    passed("bucket reduce-scattered: each rank holds the averaged 1/N of it, nothing more "
           "(3 ranks, and two groups of 2)")


def _compare_rs(res: list, world: int, split: bool) -> None:
    where = f"{world} ranks" + (" in two groups of 2" if split else "")
    for rank, out in enumerate(res):
        N = out["N"]
        members, me = _place(rank, split, world)
        flat = [torch.cat([t.reshape(-1) for t in res[q]["grads"]]) for q in members]
        padded = -(-11 // N) * N
        k = padded // N
        avg, abs_avg = torch.zeros(padded), torch.zeros(padded)
        avg[:11] = sum(flat) / N
        abs_avg[:11] = sum(f.abs() for f in flat) / N  # sum |terms|, for the bound
        want, got = avg[k * me:k * (me + 1)], out["got"]
        if not isinstance(got, torch.Tensor) or got.numel() != k:
            raise CheckFailed(f"{where}, rank {rank}: expected a chunk of {k} elements (11 "
                              f"padded to {padded}, over {N} ranks), got "
                              f"{got if isinstance(got, str) else tuple(got.shape)}")
        # N ranks' terms summed in some order, divided before or after:
        # Higham's bound on two orders of an N-term sum plus the division
        if not ((got.reshape(-1) - want).abs()
                <= reorder_bound(abs_avg[k * me:k * (me + 1)], N + 1)).all():
            ratio = (got.norm() / want.norm()).item()
            hint = (" averaged twice?" if abs(ratio - 1 / N) < 1e-3 else
                    " summed, not averaged?" if abs(ratio - N) < 1e-3 else
                    " is the buffer laid out in the order of `grads`, padding at the end?")
            raise CheckFailed(f"{where}, rank {rank}: chunk {got.reshape(-1).tolist()} differs "
                              f"from the average {want.tolist()};{hint}{_group_advice(split)}")


_NO_GATHER = {**_NO_ALL_REDUCE,
              **{name: "stage 2's backward only reduce-scatters: nothing is gathered"
                 for name in ("all_gather_single", "all_gather_into_tensor", "all_gather")}}


def _run_zero2(attach_zero2, split):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model

    group, N, rank = _groups(split)
    dev = rank_info().device
    r = rank_info().rank
    data = make_dataset(num_sequences=16, seq_len=16)
    micro = [tuple(t.to(dev) for t in data.batch(range(4 * m + 2 * r, 4 * m + 2 * r + 2)))
             for m in range(2)]
    # reference first: the averaged gradient of two micro-batches over the group, and
    # sum |terms| for the rounding bound
    ref_model = build_model("toy", seed=0).to(dev)
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
        dist.all_reduce(summed, group=group)
        dist.all_reduce(absum, group=group)
        pad = -(-g.numel() // N) * N
        chunk = pad // N
        full, full_abs = torch.zeros(pad, device=dev), torch.zeros(pad, device=dev)
        full[:g.numel()], full_abs[:g.numel()] = summed / N, absum / N
        ref[n] = full[rank * chunk:(rank + 1) * chunk]
        ref_abs[n] = full_abs[rank * chunk:(rank + 1) * chunk]

    model = build_model("toy", seed=0).to(dev)
    params = dict(model.named_parameters())
    live = {"now": 0, "peak": 0}

    def meter(p):  # registered first, so it runs before the learner's hook
        live["now"] = sum(q.grad.numel() * 4 for q in params.values() if q.grad is not None)
        live["peak"] = max(live["peak"], live["now"])

    for p in params.values():
        p.register_post_accumulate_grad_hook(meter)
    with _Watched(group, _NO_GATHER), refusing(exercise="attach_zero2", paths=_ZERO):
        shards = attach_zero2(model, **({"group": group} if split else {}))
        if not isinstance(shards, dict):
            raise TypeError(f"attach_zero2 must return the dict of shards, got "
                            f"{type(shards).__name__}")
        for x, y in micro:
            model(x, y)[1].backward()
    left = sum(p.grad.numel() * 4 for p in params.values() if p.grad is not None)
    return {"shards": {n: (t.clone() if torch.is_tensor(t) else t) for n, t in shards.items()},
            "ref": ref, "ref_abs": ref_abs, "peak": live["peak"], "left": left,
            "largest": max(p.numel() * 4 for p in params.values()),
            "all": sum(p.numel() * 4 for p in params.values()), "N": N}


def check_attach_zero2(attach_zero2) -> None:
    """The toy GPT, two micro-batches (two backwards) per rank: on 3 ranks (some
    parameters' sizes are not multiples of 3, so padding matters), then on 4 ranks in
    two groups of 2 passed as ``group``.

    Catches:
    * keeps p.grad (never frees): named, before the shards it also spoils;
    * frees only after backward: all gradients alive at once (the peak, named);
    * the sum, not the average: 3x (named);
    * overwrites the shard instead of adding: one micro-batch's gradient (named);
    * all-reduce then a slice, or an all-gather: refused (named);
    * no padding (``numel // N`` chunks): a shard of the wrong size (named);
    * ignores ``group``: a collective without group= refused before it runs (named);
    * returns None or not a dict: named; any other exception, as CheckFailed;
    * the course's ``ZeroOptimizer`` doing the work: switched off on the ranks.
    """
    for world, split in RUNS:
        res = on_ranks(_run_zero2, world, attach_zero2, split,
                       what=f"attach_zero2 on {world} ranks" + (" in two groups" if split else ""),
                       probe=lambda: attach_zero2(torch.nn.Linear(2, 2)))
        _compare_zero2(res, world, split)
    peak = res[0]["peak"]
    passed(f"stage 2 from hooks on 3 ranks and in two groups of 2: every shard right after "
           f"two micro-batches; full gradients alive at once peaked at {peak:,} bytes, "
           f"against {res[0]['all']:,} for all of them ({peak / res[0]['all']:.0%})")


def _compare_zero2(res: list, world: int, split: bool) -> None:
    where = f"{world} ranks" + (" in two groups of 2" if split else "")
    for rank, out in enumerate(res):
        N = out["N"]
        # memory first: a gradient left in p.grad also adds into the next backward's
        # gradient, so its shards are wrong too, for this reason
        if out["left"]:
            raise CheckFailed(f"{where}, rank {rank}: {out['left']:,} bytes of full gradients "
                              f"are still in p.grad after backward; stage 2 drops each one "
                              f"once it is reduce-scattered")
        if out["peak"] > out["largest"]:
            raise CheckFailed(f"{where}, rank {rank}: up to {out['peak']:,} bytes of full "
                              f"gradients were alive at once during backward (all of them: "
                              f"{out['all']:,}); drop each gradient in the hook that sends it, "
                              f"so at most one ({out['largest']:,} bytes for the largest) "
                              f"exists at a time")
        for n, want in out["ref"].items():
            got = out["shards"].get(n)
            if not torch.is_tensor(got) or got.shape != want.shape:
                raise CheckFailed(
                    f"{where}, rank {rank}: shards[{n!r}] should be this rank's chunk of "
                    f"{want.numel()} elements (the gradient zero-padded to a multiple of "
                    f"{N}, cut in {N}), got "
                    f"{None if not torch.is_tensor(got) else tuple(got.shape)}")
            # N ranks and two micro-batches: 2N terms added in some order,
            # the division one more rounding; Higham's bound on two orders
            if not ((got - want).abs() <= reorder_bound(out["ref_abs"][n], 2 * N + 1)).all():
                ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                hint = (f" It is {N}x the average: divide by the number of ranks." if
                        abs(ratio - N) < 0.01 else
                        " Only one micro-batch's gradient is there? Add into the shard, "
                        "do not overwrite it: backward runs once per micro-batch."
                        if 0.2 < ratio < 0.8 else
                        " Lay the gradient out flat, zero-pad it to a multiple of N, and "
                        "keep chunk r.")
                raise CheckFailed(f"{where}, rank {rank}: shards[{n!r}] is not the average "
                                  f"over ranks of this rank's chunk, summed over both "
                                  f"backwards.{hint}{_group_advice(split)}")
