"""A ring drawn on the machine it runs on: which hops stay in a node, which cross, per NIC.

Chapter 07's point in one picture. A ``Topology`` says how a cluster is wired: nodes of
``gpus_per_node`` GPUs on a fast fabric (``topology.intra``: NVLink through NVSwitch, or
PCIe), each node with ``nics_per_node`` network cards (``topology.inter``) shared by its
GPUs. A ring all-reduce sends every message to the next rank of its order. Where that
next rank sits on the same node, the message stays on the fabric; where it sits on
another node, it leaves through the sender's NIC. Over rank order [0, 1, 2, 3] on 2
nodes x 2, two of the four hops cross; over [0, 2, 1, 3] all four do, twice the bytes
through the network and a NIC busy on every GPU. NCCL does not run the second: it
orders each ring from the topology, node by node, whatever the ranks' numbering (NCCL
2.30, ``src/graph/connect.cc``), so only hand-written, topology-blind rings (chapter
03's, run over such an order) and groups that take one GPU per node cross at every hop.

The boxes come from the ``Topology`` object; the arrows and byte counts from the run:
every rank's ``helpers.topology.Wire`` lists the messages it sent (``wire.sends``:
sender, receiver, bytes, whether it crossed a node boundary). A hop is drawn once
with the bytes of all its messages; each NIC is labelled with the bytes its GPUs sent
to other nodes (NIC j of a node serves its GPUs j*g/k .. (j+1)*g/k - 1).

    sends = launch(fn, 4)        # fn returns wire.sends after a ring through the Wire
    fig, data = draw_ring_on_topology(topo, sends)
"""

from __future__ import annotations

__all__ = ["ring_hops", "draw_ring_on_topology"]


def _nic_of(topo, gpu: int) -> tuple[int, int]:
    """(node, NIC index) of the NIC that GPU ``gpu`` sends through."""
    local = gpu % topo.gpus_per_node
    return gpu // topo.gpus_per_node, local * topo.nics_per_node // topo.gpus_per_node


def ring_hops(topo, sends: list) -> dict:
    """Plain values of what the picture draws, from every rank's ``wire.sends``:
    ``hops``: ``(src, dst, bytes, crossed)`` per distinct hop, in first-seen order;
    ``nic_bytes[(node, nic)]``: bytes sent to other nodes through that NIC;
    ``cross_bytes``: their sum; ``nodes``: the GPUs of each node."""
    totals: dict = {}
    nic_bytes = {(n, j): 0 for n in range(topo.nodes) for j in range(topo.nics_per_node)}
    for per_rank in sends:
        for src, dst, nbytes, crossed in per_rank:
            if topo.node_of(src) != topo.node_of(dst) and not crossed \
                    or topo.node_of(src) == topo.node_of(dst) and crossed:
                raise ValueError(f"the record says {src} -> {dst} crossed={crossed}, the "
                                 f"topology says otherwise: was the Wire built with "
                                 f"gpus_per_node={topo.gpus_per_node}?")
            key = (int(src), int(dst), bool(crossed))
            totals[key] = totals.get(key, 0) + int(nbytes)
            if crossed:
                nic_bytes[_nic_of(topo, src)] += int(nbytes)
    hops = [(s, d, b, c) for (s, d, c), b in totals.items()]
    g = topo.gpus_per_node
    return {"nodes": [list(range(n * g, (n + 1) * g)) for n in range(topo.nodes)],
            "hops": hops, "nic_bytes": nic_bytes, "cross_bytes": sum(nic_bytes.values())}


def _kb(n: int) -> str:
    return f"{n / 1e3:,.1f} KB" if n >= 1000 else f"{n} B"


def draw_ring_on_topology(topo, sends: list, title: str | None = None, ax=None):
    """The picture of the module docstring. Returns ``(fig, data)``, ``data`` being
    ``ring_hops(topo, sends)``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT, rank_color

    data = ring_hops(topo, sends)
    g, k = topo.gpus_per_node, topo.nics_per_node
    width = g * 1.3 + 0.4          # one node's box
    pos = {}                       # GPU -> centre of its box
    if ax is None:
        _, ax = plt.subplots(figsize=(min(COLUMN_INCHES, max(5.0, 2.2 * topo.nodes * g / 2 + 1)),
                                      3.6))
    for n, gpus in enumerate(data["nodes"]):
        x0 = n * (width + 0.8)
        ax.add_patch(FancyBboxPatch((x0, 0), width, 2.6, boxstyle="round,pad=0.05",
                                    fc="0.96", ec="0.5"))
        # at the box's left corner: the arrows within the node rise from the GPUs' middles
        ax.text(x0, 2.72, f"node {n}", ha="left", fontsize=FRAME_TEXT_PT)
        ax.add_patch(plt.Rectangle((x0 + 0.2, 1.45), width - 0.4, 0.18, color="#6baed6"))
        ax.text(x0 + width / 2, 1.3, topo.intra.name.split(" (")[0], ha="center", va="top",
                fontsize=FRAME_TEXT_PT, color="#08519c")
        for i, gpu in enumerate(gpus):
            cx = x0 + 0.2 + 1.3 * i + 0.55
            pos[gpu] = (cx, 2.05)
            ax.add_patch(plt.Rectangle((cx - 0.45, 1.8), 0.9, 0.5, fc=rank_color(gpu),
                                       alpha=0.85, ec="k", lw=0.5))
            ax.text(cx, 2.05, f"GPU {gpu}", ha="center", va="center", fontsize=FRAME_TEXT_PT)
            ax.plot([cx, cx], [1.63, 1.8], color="#6baed6", lw=2)
        for j in range(k):
            served = gpus[j * g // k:(j + 1) * g // k]
            cx = sum(pos[q][0] for q in served) / len(served)
            ax.add_patch(plt.Rectangle((cx - 0.42, 0.35), 0.84, 0.4, fc="#fdd0a2", ec="k",
                                       lw=0.5))
            ax.text(cx, 0.55, f"NIC {j}", ha="center", va="center", fontsize=FRAME_TEXT_PT)
            sent = data["nic_bytes"][(n, j)]
            ax.text(cx, 0.27, f"out: {_kb(sent)}", ha="center", va="top",
                    fontsize=FRAME_TEXT_PT,
                    color="#a50f15" if sent else "0.4")
            for q in served:
                ax.plot([pos[q][0], cx], [1.45, 0.75], color="#fdae6b", lw=1)
    total_width = topo.nodes * (width + 0.8) - 0.8
    ax.plot([0, total_width], [-0.45, -0.45], color="#fd8d3c", lw=3)
    ax.text(total_width / 2, -0.55, topo.inter.name, ha="center", va="top",
            fontsize=FRAME_TEXT_PT,
            color="#a63603")
    for src, dst, nbytes, crossed in data["hops"]:
        (x1, _), (x2, _) = pos[src], pos[dst]
        east = 1 if x2 > x1 else -1  # arc3 bends to the right of travel for rad > 0
        if crossed:
            # below the GPUs, towards the network: the message leaves through a NIC
            arrow = FancyArrowPatch((x1, 1.8), (x2, 1.8), arrowstyle="-|>",
                                    connectionstyle=f"arc3,rad={0.3 * east}",
                                    mutation_scale=10, color="#cb181d", lw=1.6)
        else:  # above the GPUs: the message stays on the node's fabric
            arrow = FancyArrowPatch((x1, 2.3), (x2, 2.3), arrowstyle="-|>",
                                    connectionstyle=f"arc3,rad={-0.5 * east}",
                                    mutation_scale=10, color="#2171b5", lw=1.4)
        ax.add_patch(arrow)
    ax.set_xlim(-0.3, total_width + 0.3)
    ax.set_ylim(-1.0, 3.4)
    ax.axis("off")
    crossing = sum(c for *_, c in data["hops"])
    ax.set_title((title + "\n" if title else "")
                 + f"{crossing} of {len(data['hops'])} hops cross nodes; "
                 f"{_kb(data['cross_bytes'])} through the network", fontsize=FRAME_TEXT_PT + 1)
    ax.figure.tight_layout()
    return ax.figure, data
