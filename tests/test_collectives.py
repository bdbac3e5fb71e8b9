"""Ring collectives vs gloo's own, and the alpha-beta cost model."""

import math

import pytest
import torch
import torch.distributed as dist

from helpers import launch, rank_info
from helpers.collectives import (IMPLS, bus_bandwidth, check_sweep_args, chunk_bounds,
                                 fit_alpha_beta, halving_doubling_all_reduce,
                                 halving_doubling_all_reduce_time, ring_all_gather, ring_all_reduce,
                                 ring_all_reduce_time, ring_reduce_scatter, sweep,
                                 tree_all_reduce_time)

SIZES = [0, 1, 2, 3, 5, 7, 64, 1001]  # several do not divide by 2, 3 or 4; some < world size
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
# gloo's all_reduce/all_gather reject int16 ("Invalid scalar type"); the ring sums it anyway.
# Its reference is gloo's int64 sum cast back, which wraps around like int16 arithmetic.
NOT_IN_GLOO = {torch.int16}
# Dtypes torch cannot add on CPU: the ring refuses them with a TypeError before any message.
REFUSED = [torch.bool, torch.uint16, torch.float8_e4m3fn]


def _inputs(n, dt, g):
    if dt.is_floating_point or dt.is_complex:
        return torch.randn(n, generator=g, dtype=torch.complex64 if dt.is_complex else None).to(dt)
    info = torch.iinfo(dt)  # full range for the small types: sums overflow and must wrap alike
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    if dt in (torch.int8, torch.uint8, torch.int16):
        lo, hi = info.min, info.max
    return torch.randint(lo, hi + 1, (n,), generator=g).to(dt)


def _gloo_sum(x, group):
    ref = x.to(torch.int64) if x.dtype in NOT_IN_GLOO else x.clone()
    dist.all_reduce(ref, group=group)
    return ref.to(x.dtype)


def _close(ours, ref, abs_sum, p):
    """Exact for integers; floats within the summation error bound.

    Each of two orders of summing p numbers is within (p-1) u sum|x_i| of the
    true sum (u = eps/2, Higham, "Accuracy and Stability of Numerical
    Algorithms", 2002, sec. 4.2), so they differ by at most (p-1) eps sum|x_i|;
    p instead of p-1 leaves room for second-order terms. At p = 2 both orders
    are the same single rounding, so the bound is loose there but not wrong.
    """
    if not (ours.dtype.is_floating_point or ours.dtype.is_complex):
        return torch.equal(ours, ref)
    eps = torch.finfo(ours.dtype).eps
    err = (ours.to(torch.complex128) - ref.to(torch.complex128)).abs()
    return bool((err <= p * eps * abs_sum + 1e-300).all())


def _compare(group, member_rank, p, seed, sizes=SIZES, dtypes=DTYPES, hd=True):
    """Every size x dtype on ``group``: ring phases vs gloo. Returns the mismatches."""
    bad = []
    g = torch.Generator().manual_seed(seed)  # different data on every rank
    for n in sizes:
        for dt in dtypes:
            x = _inputs(n, dt, g)
            ref = _gloo_sum(x, group)
            abs_sum = x.to(torch.complex128).abs()
            dist.all_reduce(abs_sum, group=group)  # sum over ranks of |x_r|, for the bound
            ours = x.clone()
            assert ring_all_reduce(ours, group=group) is ours
            if not _close(ours, ref, abs_sum, p):
                bad.append(("all_reduce", p, n, str(dt)))
            # halving-doubling: another summation order, the same bound
            if hd:
                out = x.clone()
                assert halving_doubling_all_reduce(out, group=group) is out
                if not _close(out, ref, abs_sum, p):
                    bad.append(("halving_doubling", p, n, str(dt)))
            # reduce-scatter leaves the sum in chunk `rank` and returns it
            chunk = ring_reduce_scatter(x.clone(), group=group)
            a, b = chunk_bounds(n, p)[member_rank]
            if chunk.numel() != b - a or not _close(chunk, ref[a:b], abs_sum[a:b], p):
                bad.append(("reduce_scatter", p, n, str(dt)))
            # all-gather: each rank contributes only its own chunk
            ag = torch.zeros(n, dtype=dt)
            ag[a:b] = x[a:b]
            ring_all_gather(ag, group=group)
            wide = x.to(torch.int64) if dt in NOT_IN_GLOO else x
            parts = [torch.empty_like(wide) for _ in range(p)]
            dist.all_gather(parts, wide, group=group)  # full x of every member
            want = torch.cat([parts[q][c:d] for q, (c, d) in enumerate(chunk_bounds(n, p))])
            if not torch.equal(ag, want.to(dt)):
                bad.append(("all_gather", p, n, str(dt)))
    return bad


def _refusals(group=None):
    """Each refused dtype raises TypeError before any message (so on every rank alike)."""
    bad = []
    for dt in REFUSED:
        for fn in (ring_all_reduce, ring_reduce_scatter):
            try:
                fn(torch.zeros(8, dtype=dt), group=group)
                bad.append((fn.__name__, str(dt), "accepted"))
            except TypeError as e:
                if str(dt).split(".")[-1] not in str(e) and "bool" not in str(e):
                    bad.append((fn.__name__, str(dt), "message does not name the dtype"))
    return bad


def _ring_vs_gloo():
    """One 4-rank launch covers p = 4 (world), 3 ({0,1,2}) and 2 ({0,2}, {1,3}).

    The subgroups also prove that peers are addressed within the group (rank 1 of
    {1, 3} is global rank 3), not as global ranks 0..p-1.
    """
    import helpers.collectives.ring as C  # the module that reads SEGMENT_BYTES

    r = rank_info().rank
    bad = _compare(None, r, 4, 1234 + r)
    old, C.SEGMENT_BYTES = C.SEGMENT_BYTES, 24  # many segments per chunk (pipelined adds)
    try:
        bad += [("segmented",) + b for b in _compare(None, r, 4, 77 + r, hd=False)]
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
    bad += _refusals()
    # the sweep: every rank reports the slowest rank's time, busbw = algbw * 2(p-1)/p
    rows = sweep([4096, 65536], impls=("ring", "torch"), iters=2, warmup=1)
    return bad, rows


@pytest.mark.slow
def test_ring_matches_gloo_on_2_3_4_ranks():
    # Plain gloo, not NCCL's rules: the ring is checked on every dtype it can add, int16
    # among them, which nccl has no type for (the rules would refuse it, as nccl does).
    results = launch(_ring_vs_gloo, 4, timeout=120,  # ~10 s alone; room for a loaded machine
                     nccl_rules=False)
    assert [bad for bad, _ in results] == [[]] * 4
    rows = results[0][1]
    assert all(r[1] == rows for r in results)
    assert [(r["impl"], r["nbytes"]) for r in rows] == [
        ("ring", 4096), ("torch", 4096), ("ring", 65536), ("torch", 65536)]
    for row in rows:
        assert row["algbw"] == pytest.approx(row["nbytes"] / row["time_s"])
        assert row["busbw"] == pytest.approx(row["algbw"] * 1.5)  # 2(p-1)/p at p = 4


def _one_rank():
    """A real process group of one rank: every phase leaves the tensor as it was."""
    bad = []
    for dt in DTYPES:
        x = _inputs(7, dt, torch.Generator().manual_seed(3))
        for fn in (ring_all_reduce, ring_reduce_scatter, ring_all_gather):
            y = x.clone()
            out = fn(y)
            if not (torch.equal(y, x) and torch.equal(out.view(-1), x)):
                bad.append((fn.__name__, str(dt)))
    m = torch.arange(6.0).view(2, 3)
    if ring_all_reduce(m) is not m or not torch.equal(m, torch.arange(6.0).view(2, 3)):
        bad.append("2-D")
    rows = sweep([4096], iters=1, warmup=0)
    return bad + _refusals(), dist.get_world_size(), rows


@pytest.mark.slow
def test_world_size_one_with_a_process_group():
    bad, p, rows = launch(_one_rank, 1)[0]
    assert p == 1 and bad == []
    assert [r["busbw"] for r in rows] == [0.0, 0.0]  # 2(p-1)/p = 0: nothing crosses a link


def test_world_size_one_is_a_no_op():
    assert not dist.is_initialized()  # no process group: one rank
    x = torch.arange(5.0)
    assert ring_all_reduce(x.clone()).tolist() == x.tolist()
    assert ring_all_gather(x.clone()).tolist() == x.tolist()
    assert ring_reduce_scatter(x.clone()).tolist() == x.tolist()
    assert _refusals() == []


def _five_to_eight():
    """One 8-rank launch covers p = 8 (world), 7, 6 and 5 (subgroups, two not contiguous)."""
    r = rank_info().rank
    sizes, dtypes = [0, 3, 7, 13, 1001], [torch.float32, torch.float16, torch.int8]
    bad = _compare(None, r, 8, 500 + r, sizes, dtypes)
    for members in ([0, 1, 2, 3, 4], [7, 1, 2, 4, 5, 6], [0, 1, 3, 4, 5, 6, 7]):
        sub = dist.new_group(sorted(members))  # every rank calls new_group; members use it
        if r in members:
            me = sorted(members).index(r)
            bad += _compare(sub, me, len(members), 600 + r, sizes, dtypes)
    return bad


@pytest.mark.slow
def test_ring_matches_gloo_on_5_to_8_ranks():
    assert launch(_five_to_eight, 8, timeout=120) == [[]] * 8


def test_sweep_arguments_checked_before_any_collective():
    assert check_sweep_args(iter([1024, 4096]), ("ring",), 1, 0) == [1024, 4096]
    for sizes, impls, iters, warmup, match in [
            ([], IMPLS, 5, 1, "sizes"), ([0], IMPLS, 5, 1, "sizes"), ([1.5e6], IMPLS, 5, 1, "sizes"),
            ([1024], (), 5, 1, "impls"), ([1024], "ring", 5, 1, "impls"),
            ([1024], ("ring", "mpi"), 5, 1, "impls"), ([1024], ("ring", "ring"), 5, 1, "impls"),
            ([1024], IMPLS, 0, 1, "iters"), ([1024], IMPLS, 2.0, 1, "iters"),
            ([1024], IMPLS, 5, -1, "warmup")]:
        with pytest.raises(ValueError, match=match):
            check_sweep_args(sizes, impls, iters, warmup)
    # sweep itself refuses before touching the (absent) process group
    with pytest.raises(ValueError, match="iters"):
        sweep([1024], iters=0)


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


@pytest.mark.parametrize("argv, message", [
    (["--iters", "0"], "--iters must be >= 1"), (["--ranks", "1"], "--ranks must be >= 2"),
    (["--max-mb", "0"], "--max-mb must be >= 1"), (["--backend", "mpi"], "invalid choice")])
def test_bench_collectives_refuses_bad_arguments_before_starting_ranks(
        argv, message, capsys, load_bench):
    bench = load_bench("bench_collectives")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def _hd_messages(n):
    """Messages and bytes each rank sends in one halving-doubling all-reduce of n floats."""
    sent = []
    real = dist.batch_isend_irecv

    def counting(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops
                    if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        x = torch.full((n,), float(rank_info().rank + 1))
        halving_doubling_all_reduce(x)
    finally:
        dist.batch_isend_irecv = real
    p = rank_info().world_size
    return len(sent), sum(sent), bool((x == p * (p + 1) / 2).all())


@pytest.mark.slow
def test_halving_doubling_sends_the_ring_bytes_in_2_log_p_messages():
    # p = 4: log2 4 = 2 halving + 2 doubling messages; (1/2 + 1/4) * 2 * N bytes = 2(p-1)/p N
    n = 1000
    assert launch(_hd_messages, 4, n) == [(4, 2 * 3 / 4 * n * 4, True)] * 4
    # p = 3: ranks 0 and 1 pair up (0 hands over its whole tensor and gets the sum back),
    # then 1 and 2 run the power-of-two algorithm at q = 2
    assert launch(_hd_messages, 3, n) == [(1, n * 4, True), (3, n * 4 + n * 4, True),
                                         (2, n * 4, True)]


def _exchanges_of_every_ring():
    """One all-reduce of 7 floats (chunks of 3, 2, 2) three ways, each message recorded
    as (elements sent, elements received, right, left) by an exchange hook: chapter 03's
    ring with a recording hook around post_pair, chapter 07's flat ring through a
    recording Wire, and chapter 07's hierarchical all-reduce on one node of 3 (whose
    inter-node ring has one rank: nothing to send)."""
    from helpers.collectives import post_pair
    from helpers.topology import Wire, hierarchical_all_reduce, node_groups
    from helpers.topology import ring_all_reduce as wired_ring_all_reduce

    seen = {"collectives": [], "wire": [], "hierarchical": []}

    def recording(log, post):
        def exchange(send, recv, right, left, group=None):
            log.append((send.numel(), recv.numel(), right, left))
            return post(send, recv, right, left, group)
        return exchange

    class RecordingWire(Wire):
        def __init__(self, log):
            super().__init__(3)
            self.exchange = recording(log, super().exchange)

    groups = node_groups(3)
    r = rank_info().rank
    x, y, z = (torch.full((7,), float(r + 1)) for _ in range(3))
    ring_all_reduce(x, exchange=recording(seen["collectives"], post_pair))
    wired_ring_all_reduce(y, None, RecordingWire(seen["wire"]))
    hierarchical_all_reduce(z, 3, groups=groups, wire=RecordingWire(seen["hierarchical"]))
    return seen, [t.tolist() for t in (x, y, z)]


@pytest.mark.slow
def test_one_ring_behind_chapter_03_and_chapter_07():
    """The hierarchical path runs helpers.collectives' ring: through its exchange hook the
    same 2(p-1) messages of the same sizes, in the same order, as chapter 03's ring."""
    p, n = 3, 7
    size = [b - a for a, b in chunk_bounds(n, p)]  # [3, 2, 2]
    for r, (seen, sums) in enumerate(launch(_exchanges_of_every_ring, p)):
        right, left = (r + 1) % p, (r - 1) % p
        want = [(size[(r - s - 1) % p], size[(r - s - 2) % p], right, left)  # reduce-scatter
                for s in range(p - 1)]
        want += [(size[(r - s) % p], size[(r - s - 1) % p], right, left)      # all-gather
                 for s in range(p - 1)]
        assert len(want) == 2 * (p - 1)
        assert seen == {"collectives": want, "wire": want, "hierarchical": want}, r
        assert sums == [[6.0] * n] * 3


def test_halving_doubling_cost_model():
    # power of two: 2 log2 p alpha + the ring's bandwidth term
    assert halving_doubling_all_reduce_time(1e6, 8, 1e-5, 1e9) == pytest.approx(
        6 * 1e-5 + 2 * 7 / 8 * 1e6 / 1e9)
    assert halving_doubling_all_reduce_time(1e6, 8, 0, 1e9) == pytest.approx(
        ring_all_reduce_time(1e6, 8, 0, 1e9))
    # p = 6: q = 4 plus one fold and one unfold of the whole message
    assert halving_doubling_all_reduce_time(1e6, 6, 1e-5, 1e9) == pytest.approx(
        4 * 1e-5 + 1.5e-3 + 2 * (1e-5 + 1e-3))
    assert halving_doubling_all_reduce_time(1e6, 1, 1e-5, 1e9) == 0.0


def test_a_ring_order_must_name_every_rank_once():
    # outside a process group there is one rank: the only order is [0]
    from helpers.collectives import ring_neighbours
    assert ring_neighbours(None) == ring_neighbours(None, [0]) == (0, 1, 0, 0)
    with pytest.raises(ValueError, match="every rank of the group once"):
        ring_neighbours(None, [1])
    with pytest.raises(ValueError, match="every rank of the group once"):
        ring_neighbours(None, [0, 0])
