"""helpers.drawing.topology: chapter 07's picture is the Wires' recorded messages on the
Topology's boxes."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.topology import draw_ring_on_topology, ring_hops  # noqa: E402
from helpers.topology import (IB_NDR, NVLINK4_H100, Topology, Wire,  # noqa: E402
                              hierarchical_all_reduce, node_groups, ring_all_reduce)


def _ring(order, gpus_per_node, numel=100):
    wire = Wire(gpus_per_node)
    x = torch.ones(numel)
    ring_all_reduce(x, None, wire, order=order)
    assert torch.equal(x, torch.full_like(x, float(torch.distributed.get_world_size())))
    return wire.sends


def _hierarchical(gpus_per_node, numel=100):
    wire = Wire(gpus_per_node)
    hierarchical_all_reduce(torch.ones(numel), gpus_per_node, groups=node_groups(gpus_per_node),
                            wire=wire)
    return wire.sends


@pytest.mark.slow
def test_a_scattered_order_crosses_at_every_hop_and_doubles_the_network_bytes():
    topo = Topology("2x2", 2, 2, NVLINK4_H100, IB_NDR, nics_per_node=2)
    contiguous, scattered = (launch(_ring, 4, order, 2) for order in ([0, 1, 2, 3],
                                                                     [0, 2, 1, 3]))
    _, a = draw_ring_on_topology(topo, contiguous)
    _, b = draw_ring_on_topology(topo, scattered)
    for sends, data in ((contiguous, a), (scattered, b)):
        # every recorded message is in one hop, with its bytes
        assert sum(n for *_, n, _ in data["hops"]) == sum(n for s in sends for _, _, n, _ in s)
        assert data["cross_bytes"] == sum(n for s in sends for _, _, n, c in s if c)
        assert sum(data["nic_bytes"].values()) == data["cross_bytes"]
    assert [(s, d, c) for s, d, _, c in a["hops"]] == \
        [(0, 1, False), (1, 2, True), (2, 3, False), (3, 0, True)]
    assert [(s, d) for s, d, _, c in b["hops"] if c] == [(0, 2), (1, 3), (2, 1), (3, 0)]
    assert b["cross_bytes"] == 2 * a["cross_bytes"]
    # node-contiguous: one NIC per node busy; scattered: every NIC
    assert sorted(a["nic_bytes"].values()) == [0, 0, a["cross_bytes"] // 2, a["cross_bytes"] // 2]
    assert len(set(b["nic_bytes"].values())) == 1 and 0 not in b["nic_bytes"].values()


@pytest.mark.slow
def test_the_hierarchical_all_reduce_on_a_node_with_one_nic():
    topo = Topology("2x2, one NIC", 2, 2, NVLINK4_H100, IB_NDR, nics_per_node=1)
    sends = launch(_hierarchical, 4, 2)
    data = ring_hops(topo, sends)
    # only the inter-node phase crosses: each of the 4 GPUs all-reduces its N/g = 200 bytes
    # over n = 2 nodes, sending 2 (n-1)/n of them, all through its node's one NIC
    assert data["cross_bytes"] == 4 * (2 * (2 - 1) // 2) * (400 // 2)
    assert data["nic_bytes"] == {(0, 0): data["cross_bytes"] // 2, (1, 0): data["cross_bytes"] // 2}


def test_a_record_that_disagrees_with_the_topology_is_refused():
    topo = Topology("2x2", 2, 2, NVLINK4_H100, IB_NDR, nics_per_node=2)
    with pytest.raises(ValueError, match="gpus_per_node=2"):
        ring_hops(topo, [[(0, 1, 8, True)]])


@pytest.mark.slow
def test_three_rings_stacked_read_in_the_sites_column():
    # chapter 07 stacks the three orders in one column-wide figure: every label, the
    # NICs' byte counts included, at FRAME_TEXT_PT and inside its panel
    import matplotlib.pyplot as plt

    from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT

    topo = Topology("2x2", 2, 2, NVLINK4_H100, IB_NDR, nics_per_node=2)
    fig, axes = plt.subplots(3, 1, figsize=(COLUMN_INCHES, 3 * 3.4))
    for ax, order in zip(axes, ([0, 1, 2, 3], [0, 2, 1, 3], [0, 1, 3, 2])):
        draw_ring_on_topology(topo, launch(_ring, 4, order, 2), title=str(order), ax=ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        box = ax.get_window_extent(renderer)
        texts = [t for t in ax.texts if t.get_text()]
        assert any(t.get_text().startswith("out: ") for t in texts)
        for t in texts:
            assert t.get_fontsize() >= FRAME_TEXT_PT
            ext = t.get_window_extent(renderer)
            assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1, t.get_text()
    plt.close(fig)
