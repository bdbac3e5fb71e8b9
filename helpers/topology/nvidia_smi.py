"""Reading ``nvidia-smi topo -m``: which GPUs share NVLink, which only PCIe.

The tool prints a matrix, one row and one column per GPU (and per NIC), each
entry naming the path between the two devices, fastest first:

    NV#   # bonded NVLinks (NVLink 2, 3 and 4 all move 25 GB/s per link per
          direction: V100 6 links, A100 12, H100 18; NVIDIA datasheets)
    PIX   at most one PCIe switch          PXB  several PCIe switches
    PHB   through a PCIe host bridge (the CPU)
    NODE  between host bridges of one NUMA node
    SYS   across the CPU sockets' interconnect (QPI/UPI/xGMI): the slowest

NCCL reads the same information (``NCCL_P2P_LEVEL`` takes these names: the
most distant path over which it still uses direct GPU-to-GPU copies) and the
NIC columns (``NCCL_IB_HCA`` selects which ``mlx5_*`` ports to use). A GPU
and a NIC behind the same PCIe switch (PIX/PXB) can use GPUDirect RDMA.

``topology_from_nvidia_smi`` turns one node's matrix into a ``Topology``:
the intra-node link is the slowest GPU pair's (a ring uses every GPU, so the
weakest pair bounds it), the NIC count is the number of NIC columns.
Samples in the tool's layout ship in ``samples/`` (an 8x H100 SXM board, an
8x A100 SXM board, a 4-GPU PCIe box).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

from helpers.memory import GB
from helpers.topology.links import IB_NDR, NVLINK4_H100, PCIE4_X16, Link, Topology

__all__ = ["parse_topo_matrix", "topology_from_nvidia_smi", "read_live", "SAMPLES",
           "NVLINK_PER_LINK", "PATH_ORDER"]

SAMPLES = {p.stem: p for p in sorted((pathlib.Path(__file__).parent / "samples").glob("*.txt"))}
NVLINK_PER_LINK = 25 * GB  # bytes/s per direction per NVLink (NVLink 2-4, NVIDIA datasheets)
PATH_ORDER = ["NV", "PIX", "PXB", "PHB", "NODE", "SYS"]  # fastest to slowest
_DEVICE = re.compile(r"^(GPU|NIC)\d+$|^mlx\d+_\d+$")
_ENTRY = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS)$")


# Terminal escape codes (ECMA-48 control sequences: ESC [ parameters final-letter).
# Current drivers underline the matrix's header with them even when the output is
# piped (``\x1b[4mGPU0\x1b[0m``), which would hide the column names from the parser.
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def parse_topo_matrix(text: str) -> dict:
    """{"devices": [...], "gpus": [...], "nics": [...], "path": {(a, b): "NV18", ...}}.
    Terminal escape codes (an underlined header) are removed first."""
    text = _ESCAPE.sub("", text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if "GPU0" in ln.split()), None)
    if header is None:
        raise ValueError("no header with GPU0 found: is this the output of `nvidia-smi topo -m`?")
    devices = []
    for tok in header.split():
        if not _DEVICE.match(tok):
            break  # "CPU Affinity" and later columns
        devices.append(tok)
    path = {}
    for ln in lines[lines.index(header) + 1:]:
        toks = ln.split()
        if not toks or toks[0] not in devices:
            if path:
                break  # the legend after the matrix
            continue
        entries = toks[1:1 + len(devices)]
        if len(entries) < len(devices) or not all(_ENTRY.match(e) for e in entries):
            raise ValueError(f"row {toks[0]} has {entries}, expected {len(devices)} path "
                             f"names (X, NV#, PIX, PXB, PHB, NODE, SYS)")
        for other, e in zip(devices, entries):
            path[(toks[0], other)] = e
    gpus = [d for d in devices if d.startswith("GPU")]
    if not all((a, b) in path for a in gpus for b in gpus):
        raise ValueError("the matrix is incomplete: some GPU rows are missing")
    return {"devices": devices, "gpus": gpus, "nics": [d for d in devices if d not in gpus],
            "path": path}


def _rank(entry: str) -> int:
    return 0 if entry.startswith("NV") else PATH_ORDER.index(entry)


def topology_from_nvidia_smi(text: str, nodes: int = 1, network: Link = IB_NDR,
                             pcie: Link = PCIE4_X16) -> Topology:
    """A ``Topology`` of ``nodes`` nodes like the one whose matrix is ``text``.

    The matrix cannot tell the PCIe generation or the NIC speed: ``pcie`` and
    ``network`` say them (defaults: Gen4, InfiniBand NDR).
    """
    m = parse_topo_matrix(text)
    gpus = m["gpus"]
    pairs = [m["path"][(a, b)] for a in gpus for b in gpus if a != b]
    if not pairs:  # one GPU: no GPU-to-GPU link; say PCIe
        intra, worst = pcie, "X"
    else:
        worst = max(pairs, key=lambda e: (_rank(e), -int(e[2:]) if e.startswith("NV") else 0))
        if worst.startswith("NV"):
            links = int(worst[2:])
            intra = Link(f"NVLink x{links}", links * NVLINK_PER_LINK, NVLINK4_H100.latency,
                         f"{links} NVLinks x 25 GB/s each way (NVIDIA datasheets)")
        else:
            intra = Link(f"{pcie.name} (slowest pair: {worst})", pcie.bandwidth, pcie.latency,
                         pcie.source)
    return Topology(f"{len(gpus)} GPUs ({worst}) x {nodes} ({network.name})", nodes, len(gpus),
                    intra, network, max(1, len(m["nics"])))


def read_live(timeout: float = 20) -> str | None:
    """This machine's ``nvidia-smi topo -m``, or None where there is no nvidia-smi / GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = _ESCAPE.sub("", out.stdout)
    return text if out.returncode == 0 and "GPU0" in text.split() else None
