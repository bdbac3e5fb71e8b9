"""Gradient compression as communication hooks for ``helpers.ddp.BucketedDDP``.

Overlap (chapter 16's other half) hides communication; compression shrinks it.
Each factory here returns a hook with the BucketedDDP contract

    hook(flat_grad, group) -> torch.futures.Future   # resolves to the averaged flat grad

and counts what it sends: ``hook.bytes_sent`` (ring-model bytes one rank sent,
as in ``helpers.zero.ring_bytes_sent``) and ``hook.dense_bytes`` (what the
plain fp32 all-reduce of the same buckets would have sent).

Three families
--------------
* **Casting** (``cast_hook``): all-reduce the bucket in bf16 or fp16: half the
  bytes, rounding error ~2^-8 (bf16) or ~2^-11 (fp16) relative per element.
  PyTorch ships this as ``fp16_compress_hook`` / ``bf16_compress_hook``.
* **Top-k sparsification** (``TopKHook``): each rank sends only its k largest
  entries (values + int64 indices) by all-gather; the result is the average of
  the ranks' sparse vectors. What a rank did not send is not thrown away: it is
  added to the next step's gradient (**error feedback**, Stich et al. 2018,
  "Sparsified SGD with Memory"; Lin et al. 2018, "Deep Gradient Compression",
  sec. 3.1). Without it top-k is biased and training stalls; with it every
  gradient component is applied eventually.
* **PowerSGD** (``PowerSGDHook``; Vogels et al. 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization", Algorithm 1):
  view the bucket as an n x m matrix M and send a rank-r approximation
  P Q^T: one power-iteration step from last step's Q (warm start, sec. 3),
  ``P = M Q`` all-reduced and orthogonalized, ``Q = M^T P`` all-reduced.
  Bytes: (n + m) r instead of n m. Because P and Q are *sums* over ranks,
  plain all-reduce works (top-k needs all-gather: sparse supports differ).
  Error feedback as above (sec. 3, "error feedback").

Cost model (fp32 dense all-reduce = 2 (N-1)/N * 4 * numel bytes per rank):
cast 0.5x; top-k (N-1) * k * 12 bytes (all-gather of values and indices) =
1.5 * N * k / numel of dense; PowerSGD (n + m) r / (n m).

How production differs: PyTorch's ``powerSGD_hook`` compresses each tensor of
the bucket separately (rank-1 tensors are sent uncompressed), starts after a
warm-up of uncompressed steps (``start_powerSGD_iter``) and runs
asynchronously on CUDA streams. Our top-k and PowerSGD hooks finish their
collectives before returning (a completed future), so they do not overlap
with backward; the cast hook does overlap.

State (error, warm-start Q) is kept per bucket, keyed by the address of the
bucket's flat buffer: BucketedDDP reuses one buffer per bucket. Every
workspace is made on the bucket's device and in its dtype (CPU with gloo, the
rank's GPU with nccl).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from helpers.comm import all_gather, ring_bytes_sent
from helpers.comm import completed_future, world_size

__all__ = ["cast_hook", "TopKHook", "PowerSGDHook", "powersgd_shape"]


class _Counting:
    def __init__(self) -> None:
        self.bytes_sent = 0.0
        self.dense_bytes = 0.0

    def reset(self) -> None:
        self.bytes_sent = self.dense_bytes = 0.0

    @property
    def compression(self) -> float:
        """Bytes sent / bytes a dense fp32 all-reduce would have sent."""
        return self.bytes_sent / self.dense_bytes if self.dense_bytes else float("nan")

    def _dense(self, flat: torch.Tensor, n: int) -> None:
        self.dense_bytes += ring_bytes_sent("all_reduce", flat.numel() * 4, n)


class cast_hook(_Counting):  # noqa: N801 - used like a function factory
    """All-reduce the bucket in ``dtype`` (bf16 or fp16), return it in the bucket's dtype."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"cast_hook compresses to torch.bfloat16 or torch.float16, "
                             f"not {dtype}")
        self.dtype = dtype

    def __call__(self, flat_grad: torch.Tensor, group=None) -> torch.futures.Future:
        n = world_size(group)
        self._dense(flat_grad, n)
        low = flat_grad.div(n).to(self.dtype)  # divide first: fp16 sums stay in range
        self.bytes_sent += ring_bytes_sent("all_reduce", low.numel() * low.element_size(), n)
        if n == 1:
            return completed_future(flat_grad.copy_(low))
        work = dist.all_reduce(low, group=group, async_op=True)
        return work.get_future().then(lambda fut: flat_grad.copy_(fut.value()[0]))


class TopKHook(_Counting):
    """Send the ``ratio`` fraction of largest-magnitude entries, with error feedback."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.k_ratio, self.error_feedback = ratio, error_feedback
        self.errors: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, flat_grad: torch.Tensor, group=None) -> torch.futures.Future:
        n = world_size(group)
        self._dense(flat_grad, n)
        key = (flat_grad.data_ptr(), flat_grad.numel())
        acc = flat_grad.clone()
        if self.error_feedback and key in self.errors:
            acc += self.errors[key]  # what earlier steps did not send
        k = max(1, math.ceil(self.k_ratio * acc.numel()))
        idx = acc.abs().topk(k, sorted=False).indices          # (k,) int64
        vals = acc[idx]                                        # (k,)
        if self.error_feedback:
            err = acc.clone()
            err[idx] = 0  # sent entries leave the memory; the rest wait
            self.errors[key] = err
        self.bytes_sent += ring_bytes_sent("all_gather", n * k * (4 + 8), n)
        if n == 1:
            all_idx, all_vals = idx, vals
        else:
            all_idx = torch.empty(n * k, dtype=idx.dtype, device=idx.device)     # (N k,)
            all_vals = torch.empty(n * k, dtype=vals.dtype, device=vals.device)  # (N k,)
            all_gather(all_idx, idx.contiguous(), group=group)
            all_gather(all_vals, vals.contiguous(), group=group)
        out = torch.zeros_like(flat_grad)
        out.index_add_(0, all_idx, all_vals)  # ranks' supports overlap: add, then average
        return completed_future(flat_grad.copy_(out.div_(n)))


def powersgd_shape(numel: int) -> tuple[int, int]:
    """A near-square (n, m) with n * m >= numel for viewing a flat bucket as a matrix."""
    m = max(1, math.isqrt(max(numel, 1) - 1) + 1)  # ceil(sqrt(numel))
    return -(-numel // m), m


class PowerSGDHook(_Counting):
    """Rank-``rank`` PowerSGD with warm start and error feedback (Vogels et al. 2019, Alg. 1)."""

    def __init__(self, rank: int = 2, error_feedback: bool = True, seed: int = 0):
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        self.rank, self.error_feedback, self.seed = rank, error_feedback, seed
        self.errors: dict[tuple[int, int], torch.Tensor] = {}
        self.qs: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, flat_grad: torch.Tensor, group=None) -> torch.futures.Future:
        world = world_size(group)
        self._dense(flat_grad, world)
        key = (flat_grad.data_ptr(), flat_grad.numel())
        n, m = powersgd_shape(flat_grad.numel())
        r = min(self.rank, n, m)
        # (n m,): the bucket, zero-padded to a matrix; fp32 whatever the bucket's
        # dtype (QR in 16 bits loses the basis), on the bucket's device
        M = torch.zeros(n * m, dtype=torch.float32, device=flat_grad.device)
        M[:flat_grad.numel()] = flat_grad
        if self.error_feedback and key in self.errors:
            M += self.errors[key]
        M = M.view(n, m)
        if key not in self.qs:
            # Every rank draws the same Q (same seed): P = M Q must use one Q.
            # Drawn on the CPU, then moved: the same numbers on every device.
            g = torch.Generator().manual_seed(self.seed)
            self.qs[key] = torch.randn(m, r, generator=g).to(M.device, M.dtype)
        Q = self.qs[key]
        P = M @ Q                                          # (n, r)
        self._allreduce_mean(P, group, world)
        P = torch.linalg.qr(P).Q                           # orthonormal columns
        Q = M.t() @ P                                      # (m, r)
        self._allreduce_mean(Q, group, world)
        self.qs[key] = Q                                   # warm start next step
        approx = P @ Q.t()                                 # (n, m): mean over ranks, rank r
        if self.error_feedback:
            self.errors[key] = (M - approx).reshape(-1)
        return completed_future(flat_grad.copy_(approx.reshape(-1)[:flat_grad.numel()]))

    def _allreduce_mean(self, t: torch.Tensor, group, world: int) -> None:
        self.bytes_sent += ring_bytes_sent("all_reduce", t.numel() * t.element_size(), world)
        if world > 1:
            t.div_(world)
            dist.all_reduce(t, group=group)
