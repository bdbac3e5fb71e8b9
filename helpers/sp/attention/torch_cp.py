"""PyTorch's own context parallelism, for comparison with ours (CUDA only).

Follows ``torch.distributed.tensor.experimental.context_parallel`` (PyTorch
2.x): SDPA on the full sequence, sharded by PyTorch along the sequence with
its head-tail load balancer and run as its context-parallel attention.
"""

from __future__ import annotations

import torch.nn.functional as F

from helpers.sp.layout import cp_size

__all__ = ["torch_context_parallel"]


def torch_context_parallel(q, k, v, causal=True):
    """Causal SDPA under ``torch.distributed.tensor.experimental.context_parallel``.

    q, k, v: the *full* sequence (B, H, S, d), the same on every rank of the
    default group. PyTorch shards them in place along the sequence with its
    head-tail load balancer (rank r: chunks r and 2 cp - 1 - r, our "zigzag"),
    runs its ring attention inside SDPA, and restores them on exit. Returns
    (this rank's output chunk, this rank's q chunk as PyTorch sharded it).

    It shards only SDPA's CUDA kernels (flash, memory-efficient, cuDNN): on CPU
    it raises NotImplementedError ("... does not have a sharding strategy
    registered"), which this function lets through.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh(q.device.type, (cp_size(),))
    q, k, v = (x.clone() for x in (q, k, v))  # sharded in place: keep the caller's tensors
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.detach().clone(), q.clone()
