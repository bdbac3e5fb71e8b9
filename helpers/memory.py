"""How many bytes does training hold? Formulas first, measured where possible.

Model state (Rajbhandari et al. 2020, "ZeRO", sec. 3.1): mixed-precision
training with Adam keeps, per parameter,

    2 bytes   bf16/fp16 weights used in forward and backward
    2 bytes   bf16/fp16 gradients
    12 bytes  optimizer state: fp32 master weights (4) + Adam m (4) + v (4)
    --------
    16 bytes  ("K = 12" in the paper's notation)

so a 70B-parameter model needs 70e9 * 16 = 1,120 GB before one activation is
stored: fourteen 80 GB GPUs. ZeRO shards these three parts over N_d
data-parallel ranks, one more part per stage:

    stage 0 (DP)   (2 + 2 + 12) * Psi
    stage 1        2 Psi + 2 Psi + 12 Psi / N_d      (optimizer state sharded)
    stage 2        2 Psi + (2 + 12) Psi / N_d        (+ gradients)
    stage 3        (2 + 2 + 12) Psi / N_d            (+ weights)

Bytes are decimal (1 GB = 1e9 bytes), as in the papers we compare against.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ModelStateBytes", "model_state_bytes", "GB"]

GB = 1e9  # decimal gigabyte, as in the ZeRO and Megatron papers


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank bytes of each part of the model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def in_gb(self) -> dict[str, float]:
        return {k: v / GB for k, v in (("params", self.params), ("grads", self.grads),
                                      ("optimizer", self.optimizer), ("total", self.total))}


def model_state_bytes(n_params: float, *, dp: int = 1, zero_stage: int = 0,
                      param_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12) -> ModelStateBytes:
    """Per-rank bytes of weights, gradients and optimizer state.

    Defaults are mixed-precision Adam: 2 + 2 + 12 = 16 bytes per parameter.
    ``zero_stage`` 1/2/3 divides the optimizer / + gradients / + weights by ``dp``.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp (data-parallel ranks) must be a positive int, got {dp!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    shard = lambda stage: dp if zero_stage >= stage else 1  # noqa: E731
    return ModelStateBytes(params=n_params * param_bytes / shard(3),
                           grads=n_params * grad_bytes / shard(2),
                           optimizer=n_params * optimizer_bytes / shard(1))
