"""Ring collectives vs gloo's own, and the alpha-beta cost model."""

import math

import pytest
import torch
import torch.distributed as dist

from helpers import launch, rank_info
from helpers.collectives import (bus_bandwidth, chunk_bounds, fit_alpha_beta, ring_all_gather,
                                 ring_all_reduce, ring_all_reduce_time, ring_reduce_scatter,
                                 sweep, tree_all_reduce_time)

SIZES = [0, 1, 2, 3, 5, 7, 64, 1001]  # several do not divide by 2, 3 or 4; some < world size
DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16]


def _compare(group, member_rank, p, seed):
    """Every size x dtype on ``group``: ring phases vs gloo. Returns the mismatches."""
    bad = []
    g = torch.Generator().manual_seed(seed)  # different data on every rank
    for n in SIZES:
        for dt in DTYPES:
            if dt.is_floating_point:
                x = torch.randn(n, generator=g).to(dt)
            else:
                x = torch.randint(-1000, 1000, (n,), generator=g).to(dt)
            ours, ref = x.clone(), x.clone()
            assert ring_all_reduce(ours, group=group) is ours
            dist.all_reduce(ref, group=group)
            if dt.is_floating_point:
                # Sum order differs (ring adds chunk by chunk, gloo its own way):
                # a few ulps of the sum of p numbers of size ~1.
                tol = {torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dt]
                ok = torch.allclose(ours.double(), ref.double(), rtol=tol, atol=tol)
            else:
                ok = torch.equal(ours, ref)  # integer sums are exact
            if not ok:
                bad.append(("all_reduce", p, n, str(dt)))
            # reduce-scatter leaves the sum in chunk `rank` and returns it
            chunk = ring_reduce_scatter(x.clone(), group=group)
            a, b = chunk_bounds(n, p)[member_rank]
            if not torch.allclose(chunk.double(), ref[a:b].double(), rtol=3e-2, atol=3e-2):
                bad.append(("reduce_scatter", p, n, str(dt)))
            # all-gather: each rank contributes only its own chunk
            ag = torch.zeros(n, dtype=dt)
            ag[a:b] = x[a:b]
            ring_all_gather(ag, group=group)
            parts = [torch.empty_like(x) for _ in range(p)]
            dist.all_gather(parts, x, group=group)  # full x of every member
            want = torch.cat([parts[q][c:d] for q, (c, d) in enumerate(chunk_bounds(n, p))])
            if not torch.equal(ag, want):
                bad.append(("all_gather", p, n, str(dt)))
    return bad


def _ring_vs_gloo():
    """One 4-rank launch covers p = 4 (world), 3 ({0,1,2}) and 2 ({0,2}, {1,3}).

    The subgroups also prove that peers are addressed within the group (rank 1 of
    {1, 3} is global rank 3), not as global ranks 0..p-1.
    """
    import helpers.collectives as C

    r = rank_info().rank
    bad = _compare(None, r, 4, 1234 + r)
    old, C.SEGMENT_BYTES = C.SEGMENT_BYTES, 24  # many segments per chunk (pipelined adds)
    try:
        bad += [("segmented",) + b for b in _compare(None, r, 4, 77 + r)]
    finally:
        C.SEGMENT_BYTES = old
    g3 = dist.new_group([0, 1, 2])  # every rank must call new_group, members only use it
    if r < 3:
        bad += _compare(g3, r, 3, 99 + r)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    bad += _compare(pairs[r % 2], r // 2, 2, 7 + r)
    # a reused workspace gives the same sums; a too-small one is refused
    ws = torch.empty(300)
    for n in (1001, 7):
        a, b = torch.arange(n, dtype=torch.float32) * (r + 1), None
        b = a.clone()
        ring_all_reduce(a, workspace=ws)
        dist.all_reduce(b)
        if not torch.equal(a, b):
            bad.append(("workspace", n))
    try:
        ring_all_reduce(torch.ones(2000), workspace=ws)
        bad.append("small workspace accepted")
    except ValueError:
        pass
    # a 2-D tensor, in place, and the non-contiguous error
    m = torch.full((3, 5), float(r + 1))
    ring_all_reduce(m)
    if not torch.equal(m, torch.full((3, 5), 10.0)):
        bad.append("2-D")
    try:
        ring_all_reduce(torch.zeros(4, 4).t())
        bad.append("non-contiguous accepted")
    except ValueError:
        pass
    # the sweep: every rank reports the slowest rank's time, busbw = algbw * 2(p-1)/p
    rows = sweep([4096, 65536], impls=("ring", "torch"), iters=2, warmup=1)
    return bad, rows


@pytest.mark.slow
def test_ring_matches_gloo_on_2_3_4_ranks():
    results = launch(_ring_vs_gloo, 4)
    assert [bad for bad, _ in results] == [[]] * 4
    rows = results[0][1]
    assert all(r[1] == rows for r in results)
    assert [(r["impl"], r["nbytes"]) for r in rows] == [
        ("ring", 4096), ("torch", 4096), ("ring", 65536), ("torch", 65536)]
    for row in rows:
        assert row["algbw"] == pytest.approx(row["nbytes"] / row["time_s"])
        assert row["busbw"] == pytest.approx(row["algbw"] * 1.5)  # 2(p-1)/p at p = 4


def test_world_size_one_is_a_no_op():
    assert not dist.is_initialized()  # no process group: one rank
    x = torch.arange(5.0)
    assert ring_all_reduce(x.clone()).tolist() == x.tolist()
    assert ring_all_gather(x.clone()).tolist() == x.tolist()


def test_chunk_bounds_cover_everything():
    for n in range(0, 30):
        for p in range(1, 9):
            b = chunk_bounds(n, p)
            assert len(b) == p and b[0][0] == 0 and b[-1][1] == n
            sizes = [e - s for s, e in b]
            assert max(sizes) - min(sizes) <= 1
            assert all(b[i][1] == b[i + 1][0] for i in range(p - 1))
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


def test_cost_model_textbook_example():
    # 1B params in fp16 = 2 GB over 100 Gb/s = 12.5 GB/s: the bandwidth term
    # 2(p-1)/p * N/beta -> 2 * 2e9 / 12.5e9 = 0.32 s for large p.
    t = ring_all_reduce_time(2e9, 1024, alpha=0.0, beta=12.5e9)
    assert t == pytest.approx(0.32, rel=1e-3)
    assert ring_all_reduce_time(2e9, 2, 0.0, 12.5e9) == pytest.approx(0.16)  # p = 2: N/beta
    # latency term: 2(p-1) alphas
    assert ring_all_reduce_time(0, 8, alpha=5e-6, beta=1e9) == pytest.approx(14 * 5e-6)
    # the tree pays log2(p) alphas but the whole message at every level
    assert tree_all_reduce_time(0, 8, 5e-6, 1e9) == pytest.approx(6 * 5e-6)
    assert tree_all_reduce_time(8, 64, 5e-6, 1e9) < ring_all_reduce_time(8, 64, 5e-6, 1e9)
    assert tree_all_reduce_time(1e9, 64, 5e-6, 1e9) > ring_all_reduce_time(1e9, 64, 5e-6, 1e9)
    with pytest.raises(ValueError):
        ring_all_reduce_time(-1, 2, 0, 1)
    with pytest.raises(ValueError):
        ring_all_reduce_time(1, 0, 0, 1)
    with pytest.raises(ValueError):
        ring_all_reduce_time(1, 2, 0, 0)


def test_bus_bandwidth_factors_match_nccl_tests():
    # nccl-tests doc/PERFORMANCE.md: all_reduce 2(n-1)/n, reduce_scatter/all_gather (n-1)/n
    assert bus_bandwidth(100.0, 8, "all_reduce") == pytest.approx(175.0)
    assert bus_bandwidth(100.0, 8, "all_gather") == pytest.approx(87.5)
    assert bus_bandwidth(100.0, 8, "reduce_scatter") == pytest.approx(87.5)
    assert bus_bandwidth(100.0, 8, "broadcast") == 100.0
    with pytest.raises(ValueError):
        bus_bandwidth(1.0, 2, "allreduce")


def test_fit_recovers_alpha_beta():
    alpha, beta, p = 20e-6, 3e9, 4
    sizes = [2 ** k for k in range(10, 27, 2)]
    times = [ring_all_reduce_time(n, p, alpha, beta) for n in sizes]
    a, b = fit_alpha_beta(sizes, times, p)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    # with 10 % multiplicative noise the fit stays within a factor of ~1.5
    g = torch.Generator().manual_seed(0)
    noisy = [t * (1 + 0.1 * float(torch.randn(1, generator=g))) for t in times]
    a, b = fit_alpha_beta(sizes, noisy, p)
    assert math.isclose(a, alpha, rel_tol=0.5) and math.isclose(b, beta, rel_tol=0.5)
    with pytest.raises(ValueError):
        fit_alpha_beta([1], [1.0], 2)
