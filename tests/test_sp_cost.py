"""helpers.sp.cost: ring attention's hop is one GPU pair on its link, not NCCL's all-gather."""

import pytest

from helpers.costs import network
from helpers.sp.cost import ring_attention_time, ring_hop_time
from helpers.topology import h100_cluster

MiB = 2 ** 20


def test_inside_a_node_a_hop_is_one_nvlink_message():
    topo = h100_cluster(1)
    block = 64 * MiB
    assert ring_hop_time(topo, block, 8) == pytest.approx(topo.intra.time(block))
    # cp - 1 such steps move what NCCL's all-gather moves, in about its time
    sent, t, _ = ring_attention_time(topo, 8 * block, 8, attention=0.0)
    assert sent == 7 * block
    assert t == pytest.approx(network.collective_time(topo, "all_gather", 8 * block, 8), rel=0.01)


def test_across_nodes_the_boundary_hop_goes_through_one_nic():
    topo = h100_cluster(2)
    block = 32 * MiB
    hop = ring_hop_time(topo, block, 16)
    one_nic = topo.inter.latency + block / topo.inter.bandwidth
    assert hop == pytest.approx(one_nic)
    # not NCCL's all-gather, whose ring per NIC leaves the node on all 8 NICs: one step
    # of it moves a block at the bus bandwidth (min(NVLink, 8 x 50 GB/s))
    step_of_all_gather = block / network.bus_bandwidth(topo, 16)
    assert hop > 7 * step_of_all_gather
    # a strided group: 8 groups cross the boundary at once, one NIC each on a DGX
    assert ring_hop_time(topo, block, 2, stride=8) == pytest.approx(one_nic)


def test_a_step_hides_its_transfer_under_its_attention():
    topo = h100_cluster(2)
    kv, cp = 512 * MiB, 16
    hop = ring_hop_time(topo, kv / cp, cp)
    # attention per step longer than the hop: nothing exposed
    assert ring_attention_time(topo, kv, cp, attention=cp * 2 * hop)[2] == 0.0
    # shorter: each of the cp - 1 transfers shows by what it outlasts its step
    attention = cp * hop / 4
    assert ring_attention_time(topo, kv, cp, attention)[2] == \
        pytest.approx((cp - 1) * (hop - attention / cp))
    assert ring_attention_time(topo, kv, 1, attention) == (0.0, 0.0, 0.0)
