"""helpers.topology: validated topologies, cost models, the hierarchical all-reduce on
real ranks (vs dist.all_reduce), counted cross-node bytes, and the emulated slow network."""

import math
import pathlib

import pytest
import torch
import torch.distributed as dist

from helpers import launch
from helpers.collectives import bus_bandwidth, ring_all_reduce_time
from helpers.topology import (ETH_100G, IB_HDR, IB_NDR, NVLINK3_A100, NVLINK4_H100, PCIE4_X16,
                              SAMPLES, Link, Topology, Wire, a100_cluster, all_reduce_time,
                              collective_cost, emulated_topology, grid_layout, h100_cluster,
                              hierarchical_all_reduce, layout, mesh_groups, node_groups,
                              packed_ranks, parse_topo_matrix, pcie_cluster, preset,
                              ring_all_reduce, spread_ranks, time_emulated,
                              topology_from_nvidia_smi)

GB = 1e9


# ---------------------------------------------------------------- links and presets

def test_presets_carry_the_datasheet_figures_per_direction():
    # datasheets quote both directions: 900 GB/s (H100 NVLink 4), 600 GB/s (A100 NVLink 3)
    assert NVLINK4_H100.bandwidth == 900 * GB / 2
    assert NVLINK3_A100.bandwidth == 600 * GB / 2
    assert IB_NDR.bandwidth == 400e9 / 8 and IB_HDR.bandwidth == 200e9 / 8  # Gb/s -> bytes/s
    assert ETH_100G.bandwidth == 100e9 / 8
    assert PCIE4_X16.bandwidth == 31.5 * GB
    for link in (NVLINK4_H100, NVLINK3_A100, PCIE4_X16, IB_NDR, IB_HDR, ETH_100G):
        assert link.source  # every figure names where it comes from
    h = h100_cluster(8)
    assert (h.nodes, h.gpus_per_node, h.nics_per_node, h.world_size) == (8, 8, 8, 64)
    assert preset("pcie-eth", 8).world_size == 64


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus_per_node=0), "gpus_per_node must be an int >= 1"),
    (dict(nodes=0), "nodes must be an int >= 1"),
    (dict(nodes=2.0), "nodes must be an int >= 1"),
    (dict(nics_per_node=0), "nics_per_node"),
])
def test_topology_refuses_nonsense(kwargs, match):
    args = dict(name="t", nodes=2, gpus_per_node=4, intra=NVLINK4_H100, inter=IB_NDR)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Topology(**args)


def test_link_refuses_nonsense():
    with pytest.raises(ValueError, match="bandwidth must be a positive"):
        Link("x", -1.0, 0.0)
    with pytest.raises(ValueError, match="bandwidth must be a positive"):
        Link("x", 0.0, 0.0)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        Link("x", 1.0, -1e-6)


def test_layout_names_the_constraint():
    t = h100_cluster(4)
    assert layout(t, 8) == (1, 8) and layout(t, 4) == (1, 4) and layout(t, 32) == (4, 8)
    assert layout(t, [0, 8, 16, 24]) == (4, 1)
    with pytest.raises(ValueError, match="do not fill whole nodes of 8 GPUs"):
        layout(t, 12)
    with pytest.raises(ValueError, match="do not fit"):
        layout(t, 33)
    with pytest.raises(ValueError, match="same number of GPUs on every node"):
        layout(t, [0, 1, 8])
    with pytest.raises(ValueError, match="not in 0..31"):
        layout(t, [0, 32])
    assert packed_ranks(t, 8) == list(range(8))
    assert spread_ranks(t, 4) == [0, 8, 16, 24]
    assert spread_ranks(t, 8) == [0, 8, 16, 24, 1, 9, 17, 25]
    with pytest.raises(ValueError, match="do not spread evenly over 4 nodes"):
        spread_ranks(t, 6)


# ---------------------------------------------------------------- cost models

def test_one_node_ring_is_chapter_03s_formula():
    t = h100_cluster(1)
    for N in (1e3, 1e6, 1e9):
        for p in (2, 4, 8):
            ours = all_reduce_time(t, N, p, "ring")
            ch03 = ring_all_reduce_time(N, p, NVLINK4_H100.latency, NVLINK4_H100.bandwidth)
            assert ours == pytest.approx(ch03, rel=1e-12)  # same formula, other operation order


def test_hierarchical_reduces_to_the_ring_on_one_node_or_one_gpu_per_node():
    t = h100_cluster(8)
    for N in (1e4, 1e8):
        assert all_reduce_time(t, N, 8, "hierarchical") == all_reduce_time(t, N, 8, "ring")
        across = spread_ranks(t, 8)  # one GPU on each of 8 nodes
        assert all_reduce_time(t, N, across, "hierarchical") == all_reduce_time(t, N, across)


def test_bus_bandwidth_of_one_node_tends_to_the_nvlink_peak():
    """nccl-tests' busbw (doc/PERFORMANCE.md: busbw = algbw 2(p-1)/p) of a ring over one
    8x H100 node tends to the per-direction NVLink figure of the datasheet (450 GB/s).
    The gap is the latency term: 2(p-1) a / T exactly, which we check to 1e-12."""
    t = h100_cluster(1)
    for N in (1e6, 1e8, 8e9):
        T = all_reduce_time(t, N, 8, "ring")
        bus = bus_bandwidth(N / T, 8)
        latency_share = 2 * 7 * NVLINK4_H100.latency / T
        assert bus == pytest.approx(NVLINK4_H100.bandwidth * (1 - latency_share), rel=1e-12)
    assert bus > 0.998 * 450 * GB  # 8 GB: latency is 14 x 3.4 us of ~31 ms, 0.15 %
    # The A100 preset: 300 GB/s peak. NCCL's own tuning model (src/graph/tuning.cc) caps an
    # A100 ring at 235 GB/s busbw: the model states the peak, real runs reach ~80% of it.
    ta = a100_cluster(1)
    assert bus_bandwidth(8e9 / all_reduce_time(ta, 8e9, 8), 8) == pytest.approx(300 * GB, rel=2e-3)


def test_cross_node_bytes_flat_vs_hierarchical():
    """Per NIC the hierarchical all-reduce sends 2(n-1)/n N/m, the flat ring 2(P-1)/P N:
    a ratio (n-1)P / (n m (P-1)), which tends to 1/m as nodes are added. Totals: ring
    n 2(P-1) N/P, hierarchical 2(n-1) N (all exact arithmetic on the formulas)."""
    N = 1e9
    for nodes in (2, 3, 8, 1000):
        t = h100_cluster(nodes)
        P, m = t.world_size, 8
        ring = collective_cost(t, "all_reduce", N, P, "ring")
        hier = collective_cost(t, "all_reduce", N, P, "hierarchical")
        assert ring.cross_node_bytes == pytest.approx(nodes * 2 * (P - 1) * N / P, rel=1e-12)
        assert hier.cross_node_bytes == pytest.approx(2 * (nodes - 1) * N, rel=1e-12)
        ratio = hier.nic_bytes / ring.nic_bytes
        assert ratio == pytest.approx((nodes - 1) * P / (nodes * m * (P - 1)), rel=1e-12)
    assert ratio == pytest.approx(1 / 8, rel=2e-3)  # 1000 nodes: (999 * 8000)/(1000 * 8 * 7999)


def test_model_rankings():
    N_big, N_small = 1e9, 1e3
    h = h100_cluster(8)  # 8 NICs per node: the hierarchy spreads over all of them
    assert all_reduce_time(h, N_big, 64, "hierarchical") < all_reduce_time(h, N_big, 64, "ring")
    # latency: the tree pays log2(8) = 3 network steps each way, the ring 2 x 63
    assert all_reduce_time(h, N_small, 64, "tree") < all_reduce_time(h, N_small, 64, "ring")
    tree = collective_cost(h, "all_reduce", N_small, 64, "tree")
    assert tree.phases[0][1] == pytest.approx(2 * (7 * h.intra.latency + 3 * h.inter.latency))
    # One NIC per node: the flat ring's intra hops overlap its network hop, the hierarchy's
    # phases run one after another, so at large N the ring wins; at small N the hierarchy
    # still wins on latency (2(m-1) + 2(n-1) steps instead of 2(P-1) network steps).
    p = pcie_cluster(8)
    assert all_reduce_time(p, N_big, 64, "ring") < all_reduce_time(p, N_big, 64, "hierarchical")
    assert all_reduce_time(p, N_small, 64, "hierarchical") < all_reduce_time(p, N_small, 64)
    # the same 64 GPUs: 8x8 H100/NDR vs 8x8 PCIe/100GbE, best algorithm each
    best = lambda t: min(all_reduce_time(t, N_big, 64, a) for a in ("ring", "tree", "hierarchical"))
    assert best(p) > 10 * best(h)


def test_tp_inside_a_node_beats_tp_across_nodes():
    t = h100_cluster(8)
    N = 16 * 4096 * 8192 * 2  # one layer's activations: b s h bf16
    inside = collective_cost(t, "all_reduce", N, packed_ranks(t, 8), "ring")
    across = collective_cost(t, "all_reduce", N, spread_ranks(t, 8), "ring")
    assert inside.cross_node_bytes == 0 and across.cross_node_bytes > 0
    assert across.time > 5 * inside.time  # NVLink 450 GB/s vs one NDR NIC 50 GB/s


def test_reduce_scatter_all_gather_all_to_all():
    t = h100_cluster(4)
    N = 1e8
    for coll in ("reduce_scatter", "all_gather"):
        ring = collective_cost(t, coll, N, 32, "ring")
        hier = collective_cost(t, coll, N, 32, "hierarchical")
        assert ring.cross_node_bytes == pytest.approx(4 * 31 * N / 32)
        assert hier.cross_node_bytes == pytest.approx(3 * N)
        assert hier.time < ring.time
        # one node: half the all-reduce's ring steps
        one = collective_cost(t, coll, N, 8, "ring").time
        assert one == pytest.approx(all_reduce_time(t, N, 8, "ring") / 2, rel=1e-12)
    a2a = collective_cost(t, "all_to_all", N, 32, "direct")
    assert a2a.cross_node_bytes == pytest.approx(32 * 24 * N / 32)  # (P - m) N: 3/4 leaves
    with pytest.raises(ValueError, match="as rings only"):
        collective_cost(t, "all_gather", N, 32, "tree")
    with pytest.raises(ValueError, match="unknown collective"):
        collective_cost(t, "gather", N, 32)
    assert collective_cost(t, "all_reduce", N, 1).time == 0.0


# ---------------------------------------------------------------- nvidia-smi topo -m

def test_an_underlined_header_from_a_current_driver_parses_like_the_plain_one():
    """tests/data/nvidia_smi_topo_underlined.txt: the H100 sample with its header wrapped
    in terminal escape codes (ESC[4m GPU0 ESC[0m), as current drivers print it even
    through a pipe."""
    underlined = (pathlib.Path(__file__).parent / "data" / "nvidia_smi_topo_underlined.txt").read_text()
    assert "\x1b[4mGPU0\x1b[0m" in underlined
    assert parse_topo_matrix(underlined) == parse_topo_matrix(SAMPLES["dgx_h100"].read_text())


def test_parse_nvidia_smi_samples():
    h = topology_from_nvidia_smi(SAMPLES["dgx_h100"].read_text(), nodes=2)
    assert (h.gpus_per_node, h.nics_per_node, h.intra.bandwidth) == (8, 8, 18 * 25 * GB)
    assert h.intra.bandwidth == NVLINK4_H100.bandwidth  # NV18 = the datasheet's 900 GB/s / 2
    a = topology_from_nvidia_smi(SAMPLES["dgx_a100"].read_text(), network=IB_HDR)
    assert (a.intra.bandwidth, a.nics_per_node, a.inter) == (NVLINK3_A100.bandwidth, 8, IB_HDR)
    p = topology_from_nvidia_smi(SAMPLES["pcie_4gpu"].read_text())
    assert (p.gpus_per_node, p.nics_per_node) == (4, 1)
    assert p.intra.bandwidth == PCIE4_X16.bandwidth and "SYS" in p.intra.name
    m = parse_topo_matrix(SAMPLES["pcie_4gpu"].read_text())
    assert m["path"][("GPU0", "GPU1")] == "PIX" and m["path"][("GPU1", "GPU2")] == "SYS"
    assert m["nics"] == ["NIC0"]
    with pytest.raises(ValueError, match="nvidia-smi topo -m"):
        parse_topo_matrix("GPU 0: NVIDIA H100")
    broken = SAMPLES["pcie_4gpu"].read_text().replace("PIX", "FAST", 1)
    with pytest.raises(ValueError, match="path names"):
        parse_topo_matrix(broken)


# ---------------------------------------------------------------- real ranks

def test_grid_layout():
    assert grid_layout(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert grid_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="6 ranks do not fill nodes of 4 GPUs"):
        grid_layout(6, 4)


def test_one_rank_without_a_process_group_is_the_plain_tensor():
    x = torch.arange(5.0)
    assert torch.equal(hierarchical_all_reduce(x, 1), torch.arange(5.0))
    assert torch.equal(ring_all_reduce(x), torch.arange(5.0))
    with pytest.raises(ValueError, match="1 ranks do not fill nodes of 2 GPUs"):
        hierarchical_all_reduce(x, 2)


def test_the_wired_rings_are_chapter_03s_with_the_wire_as_exchange_hook(monkeypatch):
    """No second ring: chapter 07's phases call helpers.collectives' with wire.exchange
    (the same messages on real ranks: test_collectives.test_one_ring_behind_...)."""
    import helpers.collectives as ch03
    import helpers.collectives.ring as ch03_ring
    from helpers.topology import ring_all_gather, ring_reduce_scatter

    calls = []
    # the package's names (what chapter 07 calls) and the ring module's own (what its
    # ring_all_reduce calls): one spy each, both around the one real ring
    for module in (ch03, ch03_ring):
        for name in ("ring_reduce_scatter", "ring_all_gather"):
            def spy(tensor, group=None, *args, _real=getattr(ch03_ring, name), _name=name,
                    **kwargs):
                calls.append((_name, kwargs["exchange"].__self__, kwargs.get("segmented")))
                return _real(tensor, group, *args, **kwargs)
            monkeypatch.setattr(module, name, spy)
    w = Wire(2)
    x = torch.arange(4.0)
    assert ring_all_reduce(x, None, w) is x and torch.equal(x, torch.arange(4.0))
    ring_reduce_scatter(x, None, w)
    ring_all_gather(x, None, w)
    assert calls == [("ring_reduce_scatter", w, False), ("ring_all_gather", w, None)] * 2


def test_mesh_groups_puts_the_mesh_on_cuda_whenever_nccl_is_in_the_backend(monkeypatch):
    """The course's GPU groups are "cpu:gloo,cuda:nccl": not == "nccl", but on CUDA."""
    import torch.distributed.device_mesh as device_mesh

    devices = []

    class Mesh:
        def get_group(self, dim):
            return dim

    def init_device_mesh(device, shape, mesh_dim_names):
        devices.append(device)
        assert shape == (2, 2) and mesh_dim_names == ("node", "local")
        return Mesh()

    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    for backend in ("gloo", "nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        groups = mesh_groups(2)
        assert (groups.intra, groups.inter, groups.node, groups.local) == ("local", "node", 1, 1)
    assert devices == ["cpu", "cuda", "cuda"]


SHAPES = [(1,), (5,), (7,), (64,), (3, 5), (1001,)]  # several do not divide by g or p
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64]


def _close(ours, ref, abs_sum, p):
    """Integers: exact. Floats: two summation orders of p terms differ by at most
    2 (p-1) u sum|x| = (p-1) eps sum|x| (Higham 2002, sec. 4.2; u = eps/2, every partial
    sum rounded to the dtype); p eps leaves room for second-order terms."""
    if not ours.dtype.is_floating_point:
        return torch.equal(ours, ref)
    eps = torch.finfo(ours.dtype).eps
    return bool(((ours.double() - ref.double()).abs() <= p * eps * abs_sum).all())


def _equals_all_reduce(g, use_mesh):
    p, rank = dist.get_world_size(), dist.get_rank()
    groups = mesh_groups(g) if use_mesh else node_groups(g)
    gen = torch.Generator().manual_seed(rank)
    bad = []
    for shape in SHAPES:
        for dt in DTYPES:
            x = (torch.randn(shape, generator=gen) * 100).to(dt)
            ref = x.clone()
            dist.all_reduce(ref)
            abs_sum = x.double().abs()
            dist.all_reduce(abs_sum)
            assert hierarchical_all_reduce(x, g, groups=groups) is x
            if not _close(x, ref, abs_sum, p):
                bad.append((shape, str(dt)))
    # counted cross-node bytes vs the model, on a size every chunk divides (numel % p == 0)
    N = 4 * 60  # float32 bytes
    counts = []
    for alg in ("ring", "hierarchical"):
        w = Wire(g)
        x = torch.ones(60)
        if alg == "ring":
            ring_all_reduce(x, None, w)
        else:
            hierarchical_all_reduce(x, g, groups=groups, wire=w)
        assert torch.equal(x, torch.full_like(x, float(p)))
        counts.append(w.cross_bytes)
    return bad, counts, N


def _wrong_grid():
    """Every rank raises the same ValueError before any message (caught here, so that the
    pool of 4 ranks survives for the next test)."""
    try:
        hierarchical_all_reduce(torch.ones(4), 3)
    except ValueError as err:
        return str(err)
    return "no error"


def _on_a_subgroup():
    sub = dist.new_group([0, 1, 2, 3])
    groups = node_groups(2, sub)  # every rank helps build them; ranks 4, 5 get None
    x = torch.full((10,), float(dist.get_rank() + 1))
    if groups is None:
        return None
    hierarchical_all_reduce(x, 2, sub, groups=groups)
    return x[0].item()


def _check_equality(results, world, g):
    t = Topology("grid", world // g, g, NVLINK4_H100, IB_NDR, nics_per_node=g)
    for bad, counts, N in results:
        assert bad == []
    n = world // g
    for i, alg in enumerate(("ring", "hierarchical")):
        model = collective_cost(t, "all_reduce", N, world, alg)
        per_rank = [r[1][i] for r in results]
        assert sum(per_rank) == model.cross_node_bytes   # exact: integers of bytes
        assert max(per_rank) == model.nic_bytes
    assert sum(r[1][1] for r in results) == 2 * (n - 1) * N


# The 4-rank tests come first and the 6-rank test last: launch keeps one pool of ranks,
# and every change of world size starts a new one (~2 s per rank).

@pytest.mark.slow
def test_2x2_equals_dist_all_reduce_with_a_device_mesh_and_refuses_a_bad_grid():
    _check_equality(launch(_equals_all_reduce, 4, 2, True), 4, 2)
    assert launch(_wrong_grid, 4) == ["4 ranks do not fill nodes of 3 GPUs: the world size "
                                      "must be a multiple of gpus_per_node"] * 4


@pytest.mark.slow
def test_emulated_network_follows_the_model():
    """Each cross-node message sleeps latency + bytes/bandwidth before it is sent, so the
    measured time is at least the model's (which counts exactly those sleeps, the loopback
    inside a "node" being free in the model): that lower bound holds on any machine. The
    upper bound (25 %) holds where bandwidth dominates: each emulated step sleeps 132 ms
    (32 KB at 0.25 MB/s, + 1 ms), 2 such steps for the hierarchical all-reduce, 6 for the
    ring, while a real loopback step costs about a millisecond (a few on a loaded machine:
    4 extra intra-node steps would need > 16 ms each to break the bound)."""
    slow = Link("emulated 0.25 MB/s", 0.25e6, 1e-3)
    numel = 32768  # 128 KB of float32: 32 KB chunks per ring step
    rows = launch(time_emulated, 4, numel, 2, slow, 3)[0]
    topo = emulated_topology(2, 2, slow)
    measured = {r["algorithm"]: r for r in rows}
    for alg, r in measured.items():
        model = collective_cost(topo, "all_reduce", 4 * numel, 4, alg)
        assert r["cross_node_bytes"] == model.cross_node_bytes
        assert min(r["samples"]) >= model.time * (1 - 1e-3)  # sleep never returns early
        assert r["time_s"] <= 1.25 * model.time, (alg, r["samples"], model.time)
    assert measured["hierarchical"]["time_s"] < measured["ring"]["time_s"]
    # the ranks sleep through most of each call: the machine's cores are far from busy
    # (the ranks' CPU seconds over cores x wall time; at most 1 by construction)
    for r in rows:
        assert 0 <= r["cores_busy"] <= 1 + 1e-6
    assert measured["ring"]["cores_busy"] < 0.5


def _six_ranks():
    return _equals_all_reduce(3, False), _on_a_subgroup()


@pytest.mark.slow
def test_2x3_equals_dist_all_reduce_with_new_group_and_runs_on_a_subgroup():
    results = launch(_six_ranks, 6)
    _check_equality([r[0] for r in results], 6, 3)
    assert [r[1] for r in results] == [10.0, 10.0, 10.0, 10.0, None, None]


# ---------------------------------------------------------------- the benchmark's arguments

@pytest.mark.parametrize("argv, message", [
    (["--world", "1"], "--world must be >= 2"),
    (["--world", "6", "--gpus-per-node", "4"], "6 ranks do not fill nodes of 4 GPUs"),
    (["--world", "4", "--gpus-per-node", "4"], "one node: nothing crosses a network"),
    (["--gpus-per-node", "1"], "--gpus-per-node must be >= 2"),
    (["--mbps", "0"], "--mbps must be > 0"),
    (["--latency-ms", "-1"], "--latency-ms must be >= 0"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--sizes", "10,x"], "--sizes must be comma-separated ints"),
    (["--plain-sizes", "0"], "--sizes must be >= 1"),
])
def test_benchmark_refuses_bad_arguments(argv, message, load_bench):
    with pytest.raises(ValueError, match=message):
        load_bench("bench_topology").main(argv)
