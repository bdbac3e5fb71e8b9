"""What one GPU holds and computes: the course's one table of accelerator peaks.

``GPU``: memory in bytes (decimal: 80e9 for an "80 GB" part) and the dense
16-bit Tensor Core peak in FLOP/s. Every cost model reads its peaks here:
chapter 09's ``helpers.tp.cost``, chapter 19's ``helpers.frameworks``
(``Cluster``, ``estimate``) and chapter 20's ``helpers.planner``. The links
between GPUs are next door, in ``helpers.topology.links``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPU", "H100_80GB", "A100_80GB", "GPUS"]


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator: its memory in bytes (decimal: 80e9 for an "80 GB" part) and
    its dense 16-bit Tensor Core peak FLOP/s. ``helpers.frameworks.Cluster`` puts
    many of them on a chapter-07 ``Topology``; the planner (chapter 20) takes one
    directly."""

    name: str
    memory: float
    peak_flops: float

    def __post_init__(self):
        if not self.memory > 0 or not self.peak_flops > 0:
            raise ValueError(f"GPU {self.name!r}: memory and peak_flops must be positive")


# NVIDIA H100 SXM and A100 SXM datasheets: 80 GB HBM; dense BF16 989 and 312 TFLOP/s.
H100_80GB = GPU("H100 SXM 80GB", 80e9, 989e12)
A100_80GB = GPU("A100 SXM 80GB", 80e9, 312e12)

GPUS = {g.name: g for g in (H100_80GB, A100_80GB)}
