"""helpers.costs: the per-term cost library against NCCL's published behaviour and the
chapters' own formulas.

NCCL references (read at the versions named; the formulas are quoted, not copied):
* NCCL 2.30.7, src/graph/tuning.cc, ncclTopoTuneModel: a ring collective's latency
  is (nsteps - nInterSteps) intraLat + nInterSteps interLat, nsteps = 2(P-1) for
  all-reduce and P-1 for reduce-scatter / all-gather, nInterSteps = 2(n-1) and n-1;
  its time is latency + N / algbw with algbw = busBw P / nsteps. NCCL 2.8.3's
  version of the file capped an A100 (compute capability 8.0) ring at
  busBw <= 235 GB/s.
* nccl-tests 2.19.6, src/all_reduce.cu (AllReduceGetBw), src/all_gather.cu,
  src/reduce_scatter.cu and doc/PERFORMANCE.md: algbw = S / t (S the full tensor,
  the gathered size for all-gather and reduce-scatter), busbw = algbw x 2(n-1)/n
  for all-reduce, x (n-1)/n for all-gather and reduce-scatter.
* Published figures: Sylvain Jeaugey (NCCL), NVIDIA/nccl-tests issue 212,
  2024-05-06: on 8 H100s, "with the protocol overhead (~20%) NCCL can get an
  effective NVLink bandwidth of 370GB/s", the ring's busbw (NCCL_ALGO=RING), of
  the 450 GB/s line rate. David Addison (NCCL), NVIDIA/nccl issue 812, 2023-03-31:
  "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure
  192GB/s AllReduce BusBW" across nodes.
"""

import math

import pytest

from helpers import costs
from helpers.frameworks import ModelSpec
from helpers.memory import activation_bytes_model, model_state_bytes
from helpers.topology import (IB_NDR, NVLINK4_H100, Topology, a100_cluster, collective_cost,
                              h100_cluster, pcie_cluster)

# nccl-tests' busbw factors (src/all_reduce.cu, all_gather.cu, reduce_scatter.cu)
NCCL_TESTS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
                     "all_gather": lambda n: (n - 1) / n,
                     "reduce_scatter": lambda n: (n - 1) / n}
# A published busbw over the model's (line-rate) busbw: the model is an upper bound,
# and NCCL's maintainers put the Simple protocol's overhead at ~20 % (nccl-tests #212),
# so a measured ring lands between 3/4 of the model and the model itself.
EFFICIENCY_BAND = (0.75, 1.0)
BIG = 8e9   # bytes: a large nccl-tests size, where the latency is < 1 % of the time

LLAMA_7B = ModelSpec(name="7B", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096,
                     ffn=11008, gated_mlp=True)
LLAMA_70B = ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                      ffn=28672, kv_heads=8, gated_mlp=True)


def measured_busbw(topo, collective, nbytes, size, stride=1):
    """What nccl-tests would print as busbw if the model's time were measured."""
    t = costs.ring_time(topo, collective, nbytes, size, stride)
    return nbytes / t * NCCL_TESTS_FACTOR[collective](size)


# --- NCCL's model, term by term ------------------------------------------------------------

@pytest.mark.parametrize("collective", sorted(NCCL_TESTS_FACTOR))
@pytest.mark.parametrize("nodes,size,stride", [(1, 8, 1), (4, 32, 1), (8, 8, 8), (4, 16, 2)])
def test_nccl_tests_busbw_is_the_models_bus_bandwidth(collective, nodes, size, stride):
    # t = latency + f(P) N / busbw, and nccl-tests reports f(P) N / t: without the
    # latency it is busbw itself (the same few float64 operations: rel 1e-12)
    topo = h100_cluster(nodes)
    t = costs.ring_time(topo, collective, BIG, size, stride)
    lat = costs.ring_latency(topo, collective, size, stride)
    bw = costs.bus_bandwidth(topo, size, stride)
    assert BIG * NCCL_TESTS_FACTOR[collective](size) / (t - lat) == pytest.approx(bw, rel=1e-12)
    # and at 8 GB the latency is under 1 % of the time for these groups (at most 62
    # steps of a few us against tens of ms): nccl-tests' large sizes read busbw
    assert measured_busbw(topo, collective, BIG, size, stride) == pytest.approx(bw, rel=1e-2)


@pytest.mark.parametrize("collective", sorted(NCCL_TESTS_FACTOR))
@pytest.mark.parametrize("nodes,size,stride,n,m", [
    (1, 8, 1, 1, 8),      # one node: every step on NVLink
    (2, 16, 1, 2, 8),     # two whole nodes
    (8, 64, 1, 8, 8),     # eight whole nodes
    (8, 8, 8, 8, 1),      # one GPU per node (DP over TP 8): every step crosses
    (4, 16, 2, 4, 4),     # half of each node
])
def test_latency_counts_the_steps_as_tuning_cc(collective, nodes, size, stride, n, m):
    topo = h100_cluster(nodes)
    P = n * m
    assert costs.placement(topo, size, stride) == costs.Placement(size, stride, n, m, m)
    nsteps = 2 * (P - 1) if collective == "all_reduce" else P - 1
    n_inter = 0 if n == 1 else (2 * (n - 1) if collective == "all_reduce" else n - 1)
    want = (nsteps - n_inter) * topo.intra.latency + n_inter * topo.inter.latency
    # the same two products and a sum: equal to float64 rounding (rel 1e-12)
    assert costs.ring_latency(topo, collective, size, stride) == pytest.approx(want, rel=1e-12)
    assert costs.ring_time(topo, collective, 0, size, stride) == 0.0   # nothing to send
    if n > 1 and m > 1:
        # chapter 07's flat ring pays the network latency at every one of its steps
        flat = collective_cost(topo, collective, 0.0, [i * stride for i in range(size)],
                               "ring").time
        assert flat == pytest.approx(nsteps * topo.inter.latency, rel=1e-12)
        assert costs.ring_latency(topo, collective, size, stride) < flat


def test_every_nic_of_a_node_carries_a_packed_ring():
    # NCCL's one channel per NIC: 8 H100s per node, 8 NDR NICs of 50 GB/s. A group
    # that fills its nodes has all 8 (busbw 400 GB/s, below NVLink's 450); each NIC
    # carries 1/8 of the node's network bytes
    topo = h100_cluster(4)
    assert costs.bus_bandwidth(topo, 32, 1) == min(NVLINK4_H100.bandwidth, 8 * IB_NDR.bandwidth)
    assert costs.bus_bandwidth(topo, 8, 1) == NVLINK4_H100.bandwidth      # inside one node
    # one GPU per node (stride 8): ring neighbours on different nodes, one NIC each,
    # 8 times the bytes per NIC and 1/8 of the bandwidth
    assert costs.bus_bandwidth(topo, 4, 8) == IB_NDR.bandwidth
    # half a node (stride 2): 4 of the node's NICs
    assert costs.bus_bandwidth(topo, 16, 2) == 4 * IB_NDR.bandwidth
    nbytes = 1e9
    packed = costs.ring_time(topo, "all_reduce", nbytes, 4, 1)     # 4 GPUs in one node
    strided = costs.ring_time(topo, "all_reduce", nbytes, 4, 8)    # the same 4, across
    assert strided > 8 * packed * 0.9
    # a PCIe box's single NIC: the whole node's share goes through it
    box = pcie_cluster(4)
    assert costs.bus_bandwidth(box, 32, 1) == box.inter.bandwidth
    assert costs.bus_bandwidth(box, 4, 8) == box.inter.bandwidth / 8   # 8 groups share it


def test_uneven_group_is_limited_by_its_thinnest_node():
    # 20 consecutive GPUs on 8-GPU A100 nodes: 8, 8 and 4. The node with 4 of them
    # owns 4 of its 8 HDR NICs: busbw min(300, 4 x 25) = 100 GB/s; 2(20-1) = 38 steps,
    # 2(3-1) = 4 of them across nodes. (The planner priced this group with chapter 07's
    # flat ring before: 38 network latencies and one NIC, 25 GB/s.)
    topo = a100_cluster(8)
    assert costs.placement(topo, 20, 1) == costs.Placement(20, 1, 3, 4, 8)
    want = 34 * topo.intra.latency + 4 * topo.inter.latency + 2 * 19 / 20 * 1e9 / 100e9
    assert costs.ring_time(topo, "all_reduce", 1e9, 20, 1) == pytest.approx(want, rel=1e-12)


def test_wire_bytes_are_nccl_tests_factors():
    for coll, f in NCCL_TESTS_FACTOR.items():
        for p in (2, 8, 64):
            assert costs.sent_bytes(coll, 1e9, p) == pytest.approx(f(p) * 1e9, rel=1e-15)
    assert costs.sent_bytes("all_to_all", 8e6, 8) == 7e6


# --- published figures ----------------------------------------------------------------------

def test_8_h100_ring_busbw_against_nccls_370_gbs():
    # nccl-tests #212 (NCCL maintainer): ring busbw on 8 H100s ~370 GB/s of the 450
    # GB/s NVLink line rate the model charges
    model = measured_busbw(h100_cluster(1), "all_reduce", BIG, 8)
    lo, hi = EFFICIENCY_BAND
    assert lo <= 370e9 / model <= hi


def test_8_a100_ring_busbw_against_nccls_235_gbs_cap():
    # NCCL 2.8.3's tuning model capped an A100 node's ring at 235 GB/s of the 300 GB/s
    # NVLink 3 line rate (the course's A100 preset)
    model = measured_busbw(a100_cluster(1), "all_reduce", BIG, 8)
    lo, hi = EFFICIENCY_BAND
    assert lo <= 235e9 / model <= hi


def test_dgx_a100_across_nodes_against_nccls_192_gbs():
    # NVIDIA/nccl #812 (NCCL maintainer): 192 GB/s all-reduce busbw across DGX A100s
    # with 8 x 200 Gb/s HDR NICs. The model: all 8 NICs carry the ring, min(300, 8 x 25)
    # = 200 GB/s. Through one NIC (chapter 07's flat ring) it would be 25 GB/s: the
    # published figure is 7.7 times that, so NCCL's ring is not that one.
    topo = a100_cluster(16)
    model = measured_busbw(topo, "all_reduce", BIG, 128)
    lo, hi = EFFICIENCY_BAND
    assert lo <= 192e9 / model <= hi
    flat = collective_cost(topo, "all_reduce", BIG, 128, "ring").time
    assert BIG / flat * 2 * 127 / 128 < 192e9 / 7


# --- the other collectives ------------------------------------------------------------------

@pytest.mark.parametrize("nodes,size,stride", [(1, 8, 1), (2, 16, 1), (4, 4, 8), (2, 8, 2)])
def test_all_to_all_is_chapter_07s_direct_model(nodes, size, stride):
    topo = h100_cluster(nodes)
    ranks = [i * stride for i in range(size)]
    for nbytes in (1e3, 5e7, 3e9):
        want = collective_cost(topo, "all_to_all", nbytes, ranks, "direct").time
        # the model is alpha + N x rate, recovered from two sizes: rel 1e-9 covers it
        assert costs.all_to_all_time(topo, nbytes, size, stride) == pytest.approx(want,
                                                                                  rel=1e-9)


def test_p2p_hop():
    topo = h100_cluster(2)
    assert costs.p2p_time(topo, 1e8, crosses_node=False) == topo.intra.time(1e8)
    assert costs.p2p_time(topo, 1e8, crosses_node=True) == topo.inter.time(1e8)
    box = pcie_cluster(2)     # one NIC for 8 GPUs that all send at once
    assert costs.p2p_time(box, 1e8, crosses_node=True) == pytest.approx(
        box.inter.latency + 8 * 1e8 / box.inter.bandwidth, rel=1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda: costs.ring_time(h100_cluster(1), "all_to_all", 1e6, 8), "not a ring collective"),
    (lambda: costs.ring_time(h100_cluster(1), "all_reduce", -1, 8), "nbytes must be >= 0"),
    (lambda: costs.placement(h100_cluster(1), 16, 1), "needs 16 GPUs"),
    (lambda: costs.placement(h100_cluster(1), 0, 1), "size must be a positive int"),
    (lambda: costs.collective_time(h100_cluster(1), "broadcast", 1e6, 8), "not a ring"),
    (lambda: costs.compute_time(LLAMA_7B, 8, "none", 8, 0), "flops_per_gpu"),
])
def test_refusals(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the per-axis terms are the chapters' formulas -------------------------------------------

def test_tp_bytes_and_time_are_chapter_09s():
    # the block all-reduces of chapter 09's count, 2(t-1)/t of each sent, per micro-batch
    tp_transformer = pytest.importorskip("helpers.tp.transformer")
    from helpers.model import GPTConfig
    from helpers.tp.cost import tp_layer_comm_time

    topo, t, mb, m, seq, layers = h100_cluster(1), 8, 2, 3, 2048, 4
    cfg = GPTConfig(vocab_size=1000, block_size=seq, n_layer=layers, n_head=32, n_embd=4096)
    payload = sum(v for (name, _), v in tp_transformer.tp_comm_bytes(cfg, mb, seq, t, 2).items()
                  if name.startswith("blocks."))
    c = costs.tp_cost(topo, tp=t, tokens=mb * seq, hidden=4096, layers=layers,
                      micro_batches=m, recompute="selective")
    assert c.sent == pytest.approx(2 * (t - 1) / t * payload * m, rel=1e-12)
    per_layer = tp_layer_comm_time(4096, mb * seq, t, topo.intra)   # 4 ring all-reduces
    assert c.time == c.exposed == pytest.approx(per_layer * layers * m, rel=1e-12)
    full = costs.tp_cost(topo, tp=t, tokens=mb * seq, hidden=4096, layers=layers,
                         micro_batches=m, recompute="full")
    assert full.time == pytest.approx(1.5 * c.time, rel=1e-12)      # 6 all-reduces, not 4


def test_memory_terms_are_chapter_06s_formulas():
    w, g, o = costs.model_state(LLAMA_70B, 32, 16, 1)
    s = model_state_bytes(LLAMA_70B.dense_params() / 32, dp=16, zero_stage=1)
    assert (w, g, o) == (s.params, s.grads, s.optimizer)              # the same arithmetic
    act = costs.activations(LLAMA_70B, 2048, 1, 8, 4, True, "selective", 2)
    assert act == activation_bytes_model(2048, 1, 8192, 64, 80, tp=8, pp=4,
                                         sequence_parallel=True, recompute="selective",
                                         vocab=32000, interleave=2)
    assert costs.activations(LLAMA_70B, 2048, 1, 8, 4, True, "selective", 2, "fp32") == 2 * act
    assert costs.bytes_per_param("bf16") == (2.0, 2.0, 12.0)
    assert costs.bytes_per_param("bf16", params_fp32=True, main_grads_fp32=True) == (4, 4, 8)
    assert costs.bytes_per_param("fp32") == (4.0, 4.0, 8.0)


def test_bubble_and_compute():
    compute = 10.0
    # (p-1)/(v m) of the compute; f/(1-f) computed another way: rel 1e-12
    assert costs.bubble_time(compute, 4, 16, 2) == pytest.approx(10 * 3 / 32, rel=1e-12)
    assert costs.bubble_time(compute, 1, 16) == 0.0
    flops = costs.hardware_flops_per_step(LLAMA_7B, 64, "none")
    assert flops == costs.model_flops_per_step(LLAMA_7B, 64)
    assert costs.compute_time(LLAMA_7B, 64, "none", 8, 1e15) == flops / 8e15


def test_dp_zero3_hides_behind_the_step_and_zero1_gathers_after_it():
    topo = h100_cluster(2)
    params = LLAMA_7B.dense_params()
    ops = costs.dp_ops(LLAMA_7B, dp=16, tp=1, pp=1, zero=3, micro_batches=4)
    assert ops == (("reduce", "reduce_scatter", params * 2, 16, 1, 4),
                   ("gather", "all_gather", params * 2, 16, 1, 8))
    ring = costs.ring_time(topo, "all_gather", params * 2, 16)     # = the reduce-scatter's
    total = 12 * ring
    for t_mb in (0.01, 1.0):
        c = costs.dp_cost(LLAMA_7B, topo, dp=16, tp=1, pp=1, zero=3, micro_batches=4,
                          micro_batch_time=t_mb, overlap_grad_reduce=True,
                          overlap_param_gather=True)
        assert c.time == pytest.approx(total, rel=1e-12)
        assert c.exposed == pytest.approx(max(0.0, total - 4 * t_mb), rel=1e-12, abs=1e-15)
    # ZeRO-1: the reduce-scatter hides behind the last backward (2/3 of a micro-batch),
    # the all-gather of the updated weights, not overlapped, shows whole
    c = costs.dp_cost(LLAMA_7B, topo, dp=16, tp=1, pp=1, zero=1, micro_batches=4,
                      micro_batch_time=1.0)
    assert c.exposed == pytest.approx(ring, rel=1e-12)
    assert c.sent == pytest.approx(2 * 15 / 16 * params * 2, rel=1e-12)


def test_dp_zero2_pays_for_its_sharded_gradients_once_per_micro_batch():
    # ZeRO-2 under accumulation: either a reduce-scatter per micro-batch with the shard
    # held, or whole gradients held until one reduce-scatter, which is ZeRO-1 exactly
    topo = h100_cluster(2)
    params = LLAMA_7B.dense_params()
    kw = dict(dp=16, tp=1, pp=1, micro_batches=4)
    assert costs.dp_ops(LLAMA_7B, zero=2, **kw) == (
        ("reduce", "reduce_scatter", params * 2, 16, 1, 4),
        ("gather", "all_gather", params * 2, 16, 1, 1))
    assert costs.dp_ops(LLAMA_7B, zero=2, whole_grads=True, **kw) == costs.dp_ops(
        LLAMA_7B, zero=1, **kw)
    # one micro-batch: the two are the same step
    one = dict(kw, micro_batches=1)
    assert costs.dp_ops(LLAMA_7B, zero=2, **one) == costs.dp_ops(LLAMA_7B, zero=1, **one)
    ring = costs.ring_time(topo, "reduce_scatter", params * 2, 16)
    gather = costs.ring_time(topo, "all_gather", params * 2, 16)
    for t_mb in (0.01, 0.5 * ring, 10.0):
        c = costs.dp_cost(LLAMA_7B, topo, zero=2, micro_batch_time=t_mb, **kw)
        assert c.time == pytest.approx(4 * ring + gather, rel=1e-12)
        # each micro-batch's reduce-scatter behind its own backward (2/3 of t_mb); the
        # all-gather (not overlapped by default) shows whole
        hidden = min(ring, 2 / 3 * t_mb)
        assert c.exposed == pytest.approx(4 * (ring - hidden) + gather, rel=1e-12)
        whole = costs.dp_cost(LLAMA_7B, topo, zero=2, whole_grads=True, micro_batch_time=t_mb,
                              **kw)
        assert whole == costs.dp_cost(LLAMA_7B, topo, zero=1, micro_batch_time=t_mb, **kw)
        assert c.sent == pytest.approx(whole.sent + 3 * 15 / 16 * params * 2, rel=1e-12)
    # memory: the shard, or (whole_grads) ZeRO-1's whole gradients
    w1, g1, o1 = costs.model_state(LLAMA_7B, 1, 16, 1)
    w2, g2, o2 = costs.model_state(LLAMA_7B, 1, 16, 2)
    assert (w2, o2) == (w1, o1) and g2 == pytest.approx(g1 / 16, rel=1e-12)
    assert costs.model_state(LLAMA_7B, 1, 16, 2, whole_grads=True) == (w1, g1, o1)
    assert costs.model_state(LLAMA_7B, 1, 16, 3, whole_grads=True) == costs.model_state(
        LLAMA_7B, 1, 16, 3)                       # only stage 2 has the choice


def test_dp_experts_reduce_over_the_ranks_that_share_them():
    moe = ModelSpec(name="MoE", layers=16, hidden=2048, heads=16, vocab=32000, seq=2048,
                    experts=8, top_k=2)
    ops = costs.dp_ops(moe, dp=16, tp=1, pp=1, ep=4, zero=0)
    dense = moe.dense_params()
    assert ops == (("reduce", "all_reduce", dense * 2, 16, 1, 1),
                   ("reduce", "all_reduce", moe.expert_params() / 4 * 2, 4, 4, 1))
    # hybrid sharding: ZeRO over 4, an all-reduce of the shard across the 4 replicas
    ops = costs.dp_ops(LLAMA_7B, dp=16, tp=2, pp=1, zero=1, shard=4)
    p = LLAMA_7B.dense_params() / 2
    assert ops == (("reduce", "reduce_scatter", p * 2, 4, 2, 1),
                   ("gather", "all_gather", p * 2, 4, 2, 1),
                   ("reduce", "all_reduce", p * 2 / 4, 4, 8, 1))


def test_zero3_gathers_only_the_experts_its_ep_group_holds():
    """An MoE layer's ZeRO-3 gather is the attention, norms and router whole, and E / ep
    of its experts (the rank's expert-parallel group holds no others), over tp."""
    moe = ModelSpec(name="MoE", layers=16, hidden=2048, heads=16, vocab=32000, seq=2048,
                    experts=8, top_k=2)
    expert = moe.mlp_params()
    shared = moe.layer_params() - 8 * expert            # attention, router, norms
    for ep, tp, units in ((1, 1, 1), (4, 1, 2), (8, 2, 2)):
        assert costs.gathered_layers(moe, tp, units, "bf16", ep) == pytest.approx(
            units * 2 * (shared + 8 / ep * expert) / tp)
    # a dense model: no experts to split, ep changes nothing
    assert costs.gathered_layers(LLAMA_7B, 2, 2, "bf16", 4) == \
        costs.gathered_layers(LLAMA_7B, 2, 2) == 2 * 2 * LLAMA_7B.layer_params() / 2


def test_cp_sends_k_and_v_three_times_round_the_ring():
    topo = h100_cluster(4)
    cp, tp, mb = 4, 8, 1
    c = costs.cp_cost(LLAMA_70B, topo, tp=tp, cp=cp, micro_batch=mb, layers=10, micro_batches=2)
    # K and V of the whole 4096 tokens, this TP rank's one of 8 key/value heads of 128
    kv = 2 * mb * 4096 * 128 * 1 * 2
    assert c.sent == pytest.approx(10 * 2 * 3 * (cp - 1) / cp * kv, rel=1e-12)
    # the CP group is 8 apart: one GPU per node, every step on the network
    assert costs.placement(topo, cp, tp).max_per_node == 1
    per = 3 * costs.ring_time(topo, "all_gather", kv, cp, tp)
    assert c.time == c.exposed == pytest.approx(10 * 2 * per, rel=1e-12)


def test_clear_caches_and_placement_math():
    topo = Topology("odd", 3, 6, NVLINK4_H100, IB_NDR, 6)
    costs.clear_caches()
    pl = costs.placement(topo, 9, 2)         # 0, 2, ..., 16 on 6-GPU nodes: 3, 3, 3
    assert (pl.nodes, pl.min_per_node, pl.max_per_node) == (3, 3, 3)
    assert costs.nic_share(topo, 3) == 3
    assert math.isclose(costs.bus_bandwidth(topo, 9, 2), 3 * IB_NDR.bandwidth)


# --- chapter 07's contrast: the same GPUs, node-contiguous or scattered ring -----------------

@pytest.mark.parametrize("make,nodes", [(h100_cluster, 8), (a100_cluster, 4), (pcie_cluster, 4)])
def test_scattered_ring_sends_m_times_more_through_each_nic(make, nodes):
    # every hop of a scattered ring is a network hop: each of a node's m GPUs sends its
    # whole share over its k/g NICs, where NCCL's node-contiguous ring sends one GPU's
    # share per node over the same k NICs. Bandwidth term: exactly m times, unless
    # NVLink caps the contiguous ring (then less)
    topo = make(nodes)
    g, P = topo.gpus_per_node, topo.world_size
    contiguous = costs.bus_bandwidth(topo, P, 1)
    scattered = costs.network.scattered_bus_bandwidth(topo)
    assert scattered == pytest.approx(topo.inter.bandwidth * topo.nics_per_node / g)
    assert contiguous / scattered == pytest.approx(min(g, topo.intra.bandwidth / scattered))
    t = costs.network.scattered_ring_time(topo, "all_reduce", 0.0, P)
    assert t == 0.0
    lat = costs.network.scattered_ring_time(topo, "all_reduce", 1.0, P) - 2 * (P - 1) / P / scattered
    assert lat == pytest.approx(2 * (P - 1) * topo.inter.latency)      # every step waits
    # inside one node there is no network hop to scatter over
    assert (costs.network.scattered_ring_time(topo, "all_gather", 1e9, g)
            == costs.ring_time(topo, "all_gather", 1e9, g))


@pytest.mark.parametrize("make", [h100_cluster, a100_cluster, pcie_cluster])
def test_hierarchical_is_chapter_07s_model_built_from_rings(make):
    # one model: the two-level all-reduce composed from the network module's rings
    # equals chapter 07's hierarchical formula, on packed or spread rank lists (it
    # builds its groups from the nodes, so the rank order cannot change it)
    from helpers.topology import spread_ranks
    topo = make(4)
    for N in (1e3, 1e9):
        composed = costs.network.hierarchical_all_reduce_time(topo, N, topo.world_size)
        for ranks in (topo.world_size, spread_ranks(topo, topo.world_size)):
            assert collective_cost(topo, "all_reduce", N, ranks, "hierarchical").time == \
                pytest.approx(composed, rel=1e-12)
    with pytest.raises(ValueError, match="whole nodes"):
        costs.network.hierarchical_all_reduce_time(topo, 1e9, topo.gpus_per_node + 2)


def test_where_nccl_beats_its_ring():
    # Tree: NCCL 2.4's double binary tree pays ceil(log2 n) network latencies each way
    # where the node-contiguous ring pays n-1: it wins small all-reduces on many nodes
    topo = h100_cluster(64)
    small = 1e3
    assert (collective_cost(topo, "all_reduce", small, 512, "tree").time
            < costs.ring_time(topo, "all_reduce", small, 512))
    # and for large messages the ring's full busbw beats the tree's 0.92 of it
    # (tuning.cc's "busBw*.92"), which is why NCCL keeps the ring there
    eight = h100_cluster(8)
    assert (costs.ring_time(eight, "all_reduce", 1e9, 64)
            < collective_cost(eight, "all_reduce", 1e9, 64, "tree").time)
    # NVLS: nccl-tests #212 (NCCL maintainer, 2024): all-reduce on 8 H100s uses NVLink
    # SHARP by default and reaches ~480 GB/s busbw, above the 450 GB/s line rate that
    # bounds any ring (the model's ring busbw): the switch does the reduction
    assert 480e9 > measured_busbw(h100_cluster(1), "all_reduce", BIG, 8) >= 370e9


def test_chapter_03s_flat_ring_is_the_scattered_ring_when_every_gpu_has_a_nic():
    # helpers.topology.cost's "ring" (one channel, every step waiting for its network
    # hop) is what NCCL's model charges a ring whose neighbours sit on different nodes,
    # on machines with a NIC per GPU; with one NIC per node the scattered ring is slower
    for topo in (h100_cluster(8), a100_cluster(4)):
        for N in (1e3, 1e9):
            flat = collective_cost(topo, "all_reduce", N, topo.world_size, "ring").time
            assert flat == pytest.approx(
                costs.network.scattered_ring_time(topo, "all_reduce", N, topo.world_size),
                rel=1e-12)
    box = pcie_cluster(4)
    assert (costs.network.scattered_ring_time(box, "all_reduce", 1e9, 32)
            > collective_cost(box, "all_reduce", 1e9, 32, "ring").time)
