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
  view each 2-D gradient of the bucket as the n x m matrix M it is and send
  a rank-r approximation P Q^T: one power-iteration step from last step's Q
  (warm start, sec. 3), ``P = M Q`` all-reduced and orthogonalized,
  ``Q = M^T P`` all-reduced. Bytes: (n + m) r instead of n m per matrix;
  1-D gradients (biases, LayerNorm) go uncompressed, as in the paper. Because
  P and Q are *sums* over ranks, plain all-reduce works (top-k needs
  all-gather: sparse supports differ). Error feedback as above (sec. 3). A
  bucket's first ``start_iter`` steps are plain all-reduces (warm-up).

Cost model (fp32 dense all-reduce = 2 (N-1)/N * 4 * numel bytes per rank):
cast 0.5x; top-k (N-1) * k * 12 bytes (all-gather of values and indices) =
1.5 * N * k / numel of dense; PowerSGD sum (n + m) r over matrices plus the
1-D numel, over the bucket's numel.

How production differs: PyTorch's ``cast`` hooks (``bf16_compress_hook``)
cast first and divide in 16 bits (the same result for a power-of-two world
size); its ``powerSGD_hook`` works as ``PowerSGDHook`` (per tensor, 1-D
uncompressed, ``start_powerSGD_iter`` warm-up, ``min_compression_rate``),
batches same-shape matrices, and chains its two all-reduces as futures on
the CUDA side stream. Our ``asynchronous=True`` runs the same chain on a
worker thread with its own process group. To run torch's hook itself on CPU
buckets (gloo) on a machine that has CUDA, call it through
``torch_powersgd_hook`` (see there why). The top-k hook finishes its
all-gathers before returning (a completed future): it does not overlap with
backward.

State (error, warm-start Q) is kept per bucket, keyed by the address of the
bucket's flat buffer: BucketedDDP reuses one buffer per bucket. Every
workspace is made on the bucket's device and in its dtype (CPU with gloo, the
rank's GPU with nccl).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading

import torch
import torch.distributed as dist

from helpers.comm import all_gather, ring_bytes_sent
from helpers.comm import completed_future, world_size
from helpers.validate import int_at_least, positive_int

__all__ = ["cast_hook", "TopKHook", "PowerSGDHook", "should_compress", "torch_powersgd_hook"]


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


def should_compress(n: int, m: int, rank: int, min_rate: float = 2.0) -> bool:
    """Worth compressing an n x m gradient at ``rank`` only if (n + m) r numbers
    are at least ``min_rate`` times fewer than n m (torch's
    ``min_compression_rate``); below that the matmuls and QR cost more than the
    bytes they save."""
    return (n + m) * rank * min_rate < n * m


class PowerSGDHook(_Counting):
    """Rank-``rank`` PowerSGD per 2-D gradient, with warm start and error feedback
    (Vogels et al. 2019, Algorithm 1; sec. 3 for warm start and feedback).

    * **Per tensor.** Each gradient of 2 or more dimensions is viewed as the
      matrix (shape[0], rest) it is, so a layer's low rank survives; 1-D
      gradients (biases, norms) and matrices too small to gain
      (``should_compress``) go uncompressed in one all-reduce. The bucket's
      layout comes from ``BucketedDDP`` (it calls ``bind``), or from
      ``set_layout(flat, shapes)``; a bucket without a layout is sent
      uncompressed.
    * **Warm-up.** The first ``start_iter`` steps of each bucket are plain
      all-reduces (torch's ``start_powerSGD_iter``): early gradients change
      fast, so a warm-started Q lags, and early errors steer training for good.
    * **Asynchronous.** With ``asynchronous=True`` a bucket is compressed on a
      worker thread with its own process group (made in ``bind``), so backward
      goes on computing meanwhile, as DDP's hook does on its own CUDA stream
      (on a GPU the worker runs on a stream of its own, too);
      the worker handles buckets in launch order, so every rank issues the same
      collectives in the same order on that group.

    Per compressed bucket: P = M Q for every matrix, one all-reduce of all P's
    (with the uncompressed tensors), QR of each P, Q = M^T P, one all-reduce of
    all Q's, result P Q^T. Torch's ``powerSGD_hook`` does the same per tensor,
    but also re-orthogonalizes the warm-started Q and draws a fresh random Q
    from numpy's RNG per bucket; results agree up to that choice of start.
    """

    def __init__(self, rank: int = 2, error_feedback: bool = True, seed: int = 0,
                 start_iter: int = 0, asynchronous: bool = False, min_rate: float = 2.0):
        super().__init__()
        positive_int("rank", rank)
        int_at_least("start_iter (plain all-reduce steps first)", start_iter, 0)
        self.rank, self.error_feedback, self.seed = rank, error_feedback, seed
        self.start_iter, self.asynchronous, self.min_rate = start_iter, asynchronous, min_rate
        self.errors: dict[tuple[int, int], torch.Tensor] = {}
        self.qs: dict[tuple[int, int, int], torch.Tensor] = {}
        self.layouts: dict[tuple[int, int], list[tuple[torch.Size, int, int]]] = {}
        self.calls: dict[tuple[int, int], int] = {}
        self._side_group = None
        self._jobs: queue.Queue | None = None

    # -- layout and worker ---------------------------------------------------
    def set_layout(self, flat: torch.Tensor, shapes) -> None:
        """The tensors packed in ``flat``, in order: ``shapes`` as torch.Size / tuples."""
        layout, off = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            layout.append((torch.Size(shape), off, off + numel))
            off += numel
        if off > flat.numel():
            raise ValueError(f"the shapes hold {off} elements, the bucket only {flat.numel()}")
        self.layouts[(flat.data_ptr(), flat.numel())] = layout

    def bind(self, ddp) -> None:
        """Called by ``BucketedDDP`` at construction (on every rank, in the same
        order): read each bucket's layout; for ``asynchronous`` make the worker's
        process group (a collective: every rank of the DDP group calls it)."""
        for flat, layout in zip(ddp.flat_buffers, ddp.layout):
            self.set_layout(flat, [p.shape for p, _, _ in layout])
        if self.asynchronous and world_size(ddp.process_group) > 1:
            ranks = (None if ddp.process_group is None
                     else dist.get_process_group_ranks(ddp.process_group))
            self._side_group = dist.new_group(ranks=ranks)
            self._jobs = queue.Queue()
            threading.Thread(target=self._worker, daemon=True).start()

    def _worker(self) -> None:
        streams: dict = {}   # device -> the worker's own CUDA stream
        while True:
            flat, key, fut, producer = self._jobs.get()
            try:
                with self._on_own_stream(flat, producer, streams):
                    self._compress(flat, key, self._side_group)
                    fut.set_result(flat)
            except Exception as err:  # noqa: BLE001 - handed to whoever waits
                fut.set_exception(err)

    @staticmethod
    def _on_own_stream(flat: torch.Tensor, producer, streams: dict):
        """On a GPU, run the compression on a stream of its own (on the thread's default
        stream it would queue behind backward's kernels, and backward's behind it), after
        the stream that produced the gradient; on CPU, nothing to do."""
        if producer is None:
            return contextlib.nullcontext()
        stream = streams.setdefault(flat.device, torch.cuda.Stream(flat.device))
        stream.wait_stream(producer)        # the gradient bucket is complete
        flat.record_stream(stream)          # the allocator must not reuse it before we finish
        return torch.cuda.stream(stream)

    # -- the hook --------------------------------------------------------------
    def __call__(self, flat_grad: torch.Tensor, group=None) -> torch.futures.Future:
        world = world_size(group)
        self._dense(flat_grad, world)
        key = (flat_grad.data_ptr(), flat_grad.numel())
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] <= self.start_iter:  # warm-up: the plain average
            self.bytes_sent += ring_bytes_sent("all_reduce", flat_grad.numel() * 4, world)
            if world == 1:
                return completed_future(flat_grad)
            flat_grad.div_(world)
            work = dist.all_reduce(flat_grad, group=group, async_op=True)
            return work.get_future().then(lambda f: f.value()[0])
        if self._jobs is not None:
            # On a GPU the future is CUDA-aware (devices=...): set_result records an
            # event on the worker's stream and whoever waits on the future waits for it.
            cuda = flat_grad.is_cuda
            fut = torch.futures.Future(devices=[flat_grad.device] if cuda else None)
            producer = torch.cuda.current_stream(flat_grad.device) if cuda else None
            self._jobs.put((flat_grad, key, fut, producer))
            return fut
        self._compress(flat_grad, key, group)
        return completed_future(flat_grad)

    def _compress(self, flat: torch.Tensor, key, group) -> None:
        """Replace ``flat`` by the mean over ranks: rank r for the matrices worth
        compressing, exact for the rest."""
        world = world_size(group)
        layout = self.layouts.get(key) or [(torch.Size([flat.numel()]), 0, flat.numel())]
        # (numel,): gradient plus what earlier steps owed; fp32 whatever the
        # bucket's dtype (QR in 16 bits loses the basis)
        acc = flat.to(torch.float32, copy=True)
        if self.error_feedback and key in self.errors:
            acc += self.errors[key]
        mats, plain = [], []  # (layout index, (n, m) view, r) / layout index
        for i, (shape, a, b) in enumerate(layout):
            n, m = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, b - a)
            r = min(self.rank, n, m)
            if len(shape) >= 2 and should_compress(n, m, r, self.min_rate):
                mats.append((i, acc[a:b].view(n, m), r))
            else:
                plain.append(i)
        Ps = [M @ self._q(key, i, M, r) for i, M, r in mats]           # (n, r) each
        # First all-reduce: the uncompressed tensors and every P, in one buffer.
        sizes = [layout[i][2] - layout[i][1] for i in plain] + [P.numel() for P in Ps]
        first = torch.cat([acc[layout[i][1]:layout[i][2]] for i in plain]
                          + [P.reshape(-1) for P in Ps]) if sizes else acc[:0].clone()
        self._allreduce_mean(first, group, world)
        parts = first.split(sizes)
        out = torch.empty_like(acc)
        for i, part in zip(plain, parts):
            out[layout[i][1]:layout[i][2]] = part                       # exact mean
        Ps = [torch.linalg.qr(part.view_as(P)).Q                        # orthonormal columns
              for part, P in zip(parts[len(plain):], Ps)]
        # Second all-reduce: every Q = M^T P.
        Qs = [M.t() @ P for (_, M, _), P in zip(mats, Ps)]              # (m, r) each
        second = torch.cat([Q.reshape(-1) for Q in Qs]) if Qs else acc[:0].clone()
        self._allreduce_mean(second, group, world)
        for (i, M, r), P, Q in zip(mats, Ps, second.split([Q.numel() for Q in Qs])):
            Q = Q.view(M.shape[1], r)
            self.qs[(key, i)] = Q                                       # warm start
            out[layout[i][1]:layout[i][2]] = (P @ Q.t()).reshape(-1)    # rank-r mean
        tail = layout[-1][2] if layout else 0
        out[tail:] = 0  # padding past the last tensor, if any
        if self.error_feedback:
            # local minus global: summed over ranks the exact parts cancel, the
            # compressed parts leave what rank r did not carry (torch's convention)
            self.errors[key] = acc - out
        flat.copy_(out)

    def _q(self, key, i: int, M: torch.Tensor, r: int) -> torch.Tensor:
        """Last step's Q for tensor ``i`` (warm start), or the same random one on every rank."""
        if (key, i) not in self.qs:
            # Drawn on the CPU from a seeded generator, then moved: the same
            # numbers on every rank and device (P = M Q must use one Q).
            g = torch.Generator().manual_seed(self.seed + i)
            self.qs[(key, i)] = torch.randn(M.shape[1], r, generator=g).to(M.device, M.dtype)
        return self.qs[(key, i)]

    def _allreduce_mean(self, t: torch.Tensor, group, world: int) -> None:
        self.bytes_sent += ring_bytes_sent("all_reduce", t.numel() * t.element_size(), world)
        if world > 1 and t.numel():
            t.div_(world)
            dist.all_reduce(t, group=group)


# --------------------------------------------------------------------------
# PyTorch's own PowerSGD hook, runnable on CPU buckets where CUDA is present.
# --------------------------------------------------------------------------

def torch_powersgd_hook(state, bucket):
    """``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``,
    also for a CPU bucket on a machine that has CUDA. Register it on torch's DDP
    in its place: ``ddp.register_comm_hook(state, torch_powersgd_hook)``.

    Why: torch's hook ends (its ``decompress`` callback) with

        if torch.cuda.is_available():
            torch.cuda.synchronize(device)      # device: the bucket's

    whatever that device is. For a CPU bucket, which is what gloo trains on
    when a node has fewer GPUs than ranks, ``torch.cuda.synchronize(cpu)``
    raises ValueError ("Expected a cuda device"). A CPU bucket has no CUDA
    stream to wait for, so for one we run torch's hook with
    ``torch.cuda.synchronize`` skipping non-CUDA devices (``_cuda_sync_only``)
    and wait for its future inside that, because its callbacks may run on
    another thread after the hook returns; DDP gets the finished future. The
    arithmetic is torch's, untouched. CUDA buckets, and machines without CUDA,
    get torch's hook as it is, asynchronous.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if bucket.buffer().is_cuda or not torch.cuda.is_available():
        return psgd.powerSGD_hook(state, bucket)
    with _cuda_sync_only():
        fut = psgd.powerSGD_hook(state, bucket)
        fut.wait()  # every callback, the synchronizing one too, has run when this returns
    return fut


@contextlib.contextmanager
def _cuda_sync_only():
    """Within: ``torch.cuda.synchronize(device)`` does nothing for a non-CUDA device
    (there is nothing to wait for) and synchronizes CUDA devices as before."""
    synchronize = torch.cuda.synchronize

    def cuda_only(device=None):
        if device is None or isinstance(device, int) or torch.device(device).type == "cuda":
            return synchronize(device)
        return None

    torch.cuda.synchronize = cuda_only
    try:
        yield
    finally:
        torch.cuda.synchronize = synchronize
