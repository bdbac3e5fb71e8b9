"""Links and clusters: the ``Topology`` dataclass and presets with cited figures.

A GPU cluster has two kinds of wire. Inside a node, GPUs talk over NVLink
(through NVSwitch on an 8-GPU SXM board) or, on cheaper boxes, over PCIe.
Between nodes, each node has a few network cards (NICs: InfiniBand or
Ethernet/RoCE), each much slower than NVLink. A ``Link`` is one such wire,
described by the alpha-beta model of chapter 03: a message of n bytes costs
``latency + n / bandwidth``.

Units: bandwidth in bytes/s **per direction** (datasheets often quote the sum
of both directions: "900 GB/s" for H100 NVLink is 450 GB/s each way), latency
in seconds, per message.

Latencies are the per-step figures NCCL's own tuning model uses (NVIDIA/nccl,
``src/graph/tuning.cc``, table ``hwLat``, ring algorithm, Simple protocol, the
2020 version: NVLink 3.4 us, PCIe 5.7 us, network 9.6 us). They are what a
ring step costs inside NCCL, not a wire's physical latency (which is far
smaller). Bandwidths are the vendors' peak figures; real collectives reach
less (NCCL's own model caps an 8x A100 node's ring at 235 GB/s of the 300 GB/s
peak, same file).
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.memory import GB  # decimal, 1e9: "GB/s" on datasheets too
from helpers.validate import is_int

__all__ = ["Link", "Topology", "NVLINK4_H100", "NVLINK3_A100", "PCIE4_X16", "PCIE5_X16",
           "IB_HDR", "IB_NDR", "ETH_100G", "LINKS", "h100_cluster", "a100_cluster",
           "pcie_cluster", "PRESETS", "preset"]

US = 1e-6


@dataclass(frozen=True)
class Link:
    """One kind of wire: per-direction bandwidth (bytes/s), per-message latency (s), source."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""

    def __post_init__(self):
        if not self.bandwidth > 0 or self.bandwidth == float("inf"):
            raise ValueError(f"link {self.name!r}: bandwidth must be a positive, finite number "
                             f"of bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0 seconds, "
                             f"got {self.latency!r}")

    def time(self, nbytes: float) -> float:
        """alpha + n / beta: one message of ``nbytes`` over this link."""
        return self.latency + nbytes / self.bandwidth


# Each figure: bytes/s per direction per GPU (intra) or per NIC (inter).
NVLINK4_H100 = Link("NVLink 4 (H100 SXM, NVSwitch)", 450 * GB, 3.4 * US,
                    "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s per GPU, both "
                    "directions (18 links x 25 GB/s each way)")
NVLINK3_A100 = Link("NVLink 3 (A100 SXM, NVSwitch)", 300 * GB, 3.4 * US,
                    "NVIDIA A100 Tensor Core GPU datasheet: NVLink 600 GB/s per GPU, both "
                    "directions (12 links x 25 GB/s each way)")
PCIE4_X16 = Link("PCIe Gen4 x16", 31.5 * GB, 5.7 * US,
                 "PCI Express Base Specification 4.0: 16 GT/s per lane, 128b/130b encoding, "
                 "x16 = 31.5 GB/s each way")
PCIE5_X16 = Link("PCIe Gen5 x16", 63 * GB, 5.7 * US,
                 "PCI Express Base Specification 5.0: 32 GT/s per lane, 128b/130b encoding, "
                 "x16 = 63 GB/s each way")
IB_HDR = Link("InfiniBand HDR (200 Gb/s)", 25 * GB, 9.6 * US,
              "InfiniBand Trade Association roadmap / NVIDIA ConnectX-6: HDR 200 Gb/s per port "
              "= 25 GB/s each way")
IB_NDR = Link("InfiniBand NDR (400 Gb/s)", 50 * GB, 9.6 * US,
              "InfiniBand Trade Association roadmap / NVIDIA ConnectX-7: NDR 400 Gb/s per port "
              "= 50 GB/s each way")
ETH_100G = Link("Ethernet 100 Gb/s", 12.5 * GB, 9.6 * US,
                "IEEE 802.3 100GBASE: 100 Gb/s = 12.5 GB/s each way")
LINKS = [NVLINK4_H100, NVLINK3_A100, PCIE5_X16, PCIE4_X16, IB_NDR, IB_HDR, ETH_100G]


@dataclass(frozen=True)
class Topology:
    """A cluster: ``nodes`` x ``gpus_per_node`` GPUs, one link type inside, one between.

    ``intra``: each GPU's link into its node's fabric (NVSwitch or PCIe), per
    direction. ``inter``: one NIC; a node has ``nics_per_node`` of them, which
    its GPUs share. A DGX H100 has 8 GPUs and 8 NDR NICs for compute traffic
    (one per GPU, "rail-optimized"); a PCIe box often has one NIC for all GPUs.
    """

    name: str
    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int = 1

    def __post_init__(self):
        for field in ("nodes", "gpus_per_node", "nics_per_node"):
            v = getattr(self, field)
            if not is_int(v) or v < 1:
                raise ValueError(f"topology {self.name!r}: {field} must be an int >= 1, got {v!r}")
        for field in ("intra", "inter"):
            if not isinstance(getattr(self, field), Link):
                raise TypeError(f"topology {self.name!r}: {field} must be a Link")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        """Node index of global GPU id ``gpu`` (GPUs are numbered node by node)."""
        if not is_int(gpu) or not 0 <= gpu < self.world_size:
            raise ValueError(f"GPU id {gpu!r} is not in 0..{self.world_size - 1} "
                             f"({self.nodes} nodes x {self.gpus_per_node} GPUs)")
        return gpu // self.gpus_per_node

    def with_nodes(self, nodes: int) -> "Topology":
        return Topology(self.name, nodes, self.gpus_per_node, self.intra, self.inter,
                        self.nics_per_node)

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} GPUs; inside: "
                f"{self.intra.name} {self.intra.bandwidth / GB:g} GB/s per GPU each way; "
                f"between: {self.nics_per_node} x {self.inter.name} "
                f"({self.nics_per_node * self.inter.bandwidth / GB:g} GB/s per node each way)")


def h100_cluster(nodes: int = 1, network: Link = IB_NDR) -> Topology:
    """DGX H100-like nodes: 8 GPUs on NVLink 4 / NVSwitch, 8 NICs (NVIDIA DGX H100
    datasheet: 8x ConnectX-7 400 Gb/s for compute traffic)."""
    return Topology(f"8x H100 SXM x {nodes} ({network.name.split(' (')[0]})", nodes, 8,
                    NVLINK4_H100, network, 8)


def a100_cluster(nodes: int = 1, network: Link = IB_HDR) -> Topology:
    """DGX A100-like nodes: 8 GPUs on NVLink 3 / NVSwitch, 8 NICs (NVIDIA DGX A100
    datasheet: 8x ConnectX-6 200 Gb/s HDR)."""
    return Topology(f"8x A100 SXM x {nodes} ({network.name.split(' (')[0]})", nodes, 8,
                    NVLINK3_A100, network, 8)


def pcie_cluster(nodes: int = 1, gpus_per_node: int = 8, pcie: Link = PCIE4_X16,
                 network: Link = ETH_100G, nics_per_node: int = 1) -> Topology:
    """PCIe-only nodes (no NVLink): GPUs talk through the PCIe switches / host bridge,
    one NIC per node by default, as on a typical cloud PCIe box."""
    return Topology(f"{gpus_per_node}x PCIe GPU x {nodes} ({network.name})", nodes,
                    gpus_per_node, pcie, network, nics_per_node)


PRESETS = {
    "h100-ndr": h100_cluster,
    "a100-hdr": a100_cluster,
    "pcie-eth": pcie_cluster,
}


def preset(name: str, nodes: int = 1) -> Topology:
    """A preset cluster by name (``PRESETS``) with ``nodes`` nodes."""
    if name not in PRESETS:
        raise ValueError(f"unknown topology preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name](nodes)
