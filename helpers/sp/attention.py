"""Causal attention over a sequence split across ranks: all-gather, ring, and all-to-all.

What
----
Each of cp ranks holds a chunk of the sequence: q, k, v of shape
(batch, heads, seq / cp, head_dim), positions given by ``helpers.sp.layout``.
Every query still needs every earlier key. Three ways to get there, each
returning this rank's chunk of the output, equal to full attention:

* ``allgather_attention``: all-gather K and V (the whole sequence), keep Q
  local. Llama 3's context parallelism (Dubey et al. 2024, sec. 3.3.2): simple,
  and K/V are small under grouped-query attention. Memory: the whole K, V.
* ``ring_attention``: K/V blocks travel round the ring of ranks (isend/irecv)
  while each rank computes on the block it holds; partial results merge
  exactly with the online-softmax rule below (Liu, Zaharia & Abbeel 2023,
  "Ring Attention with Blockwise Transformers for Near-Infinite Context",
  sec. 3). Memory: two K/V blocks; communication hidden if a block's compute
  takes longer than its transfer.
* ``ulysses_attention``: an all-to-all turns sequence-split into head-split,
  each rank runs ordinary attention on the whole sequence for heads/cp heads,
  and a second all-to-all turns it back (Jacobs et al. 2023, "DeepSpeed
  Ulysses", sec. 3). Needs heads divisible by cp.

The merge (online softmax)
--------------------------
Attention of a query over keys split into blocks A and B: with per-block
outputs o_A = softmax(s_A) v_A and log-sum-exps l_A = log sum exp(s_A),

    l = log(e^{l_A} + e^{l_B}),    o = e^{l_A - l} o_A + e^{l_B - l} o_B

exactly (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax", sec. 3; the same rule as FlashAttention, Dao et al. 2022, sec. 3.1).
Averaging o_A and o_B instead is wrong whenever the blocks carry different
softmax mass.

Backward
--------
``ring_attention`` is a custom autograd Function with a ring backward: with
the final output O and log-sum-exp L saved, a block's probabilities are
recomputed as P = exp(q k^T / sqrt(d) - L), and (Dao et al. 2022, App. B.2)

    dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),  dQ = dS K / sqrt(d),
    dK = dS^T Q / sqrt(d).

K, V travel the ring again, and the dK, dV accumulators travel with them one
hop behind, returning to their owner after cp hops: no rank ever holds the
whole sequence. The all-gather and all-to-all variants rely on autograd, with
the conjugate collectives as backward (reduce-scatter for all-gather,
the reverse all-to-all for all-to-all).

How production differs
----------------------
The blocks here use explicit (seq/cp)^2 score matrices; production calls a
fused kernel per block (FlashAttention returns the log-sum-exp for the merge),
runs communication on a separate CUDA stream, and skips masked blocks by
layout (Megatron-LM / TransformerEngine's ``attn_fwd_...cp`` kernels, PyTorch's
``torch.distributed.tensor.experimental.context_parallel``).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.sp.layout import check_layout, cp_rank, cp_size, positions

__all__ = ["block_attention", "merge_partials", "allgather_attention", "ring_attention",
           "ring_forward", "ring_shift", "wait_all", "block_mask", "ulysses_attention",
           "check_ulysses", "causal_mask", "unmasked_scores", "attention_saved_bytes",
           "torch_context_parallel"]


# --------------------------------------------------------------------------
# One block, and the merge.
# --------------------------------------------------------------------------

def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(len q, len k) bool, True where key position <= query position (may attend)."""
    return k_pos[None, :] <= q_pos[:, None]


def block_attention(q, k, v, mask=None, scale=None):
    """softmax(q k^T scale, masked) v and the log-sum-exp of each row.

    q: (B, H, n, d), k, v: (B, H, m, d), mask: (n, m) bool or None.
    Returns o (B, H, n, d) and lse (B, H, n); a row with no allowed key has
    o = 0 and lse = -inf (it carries no softmax mass into a merge).
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale                        # (B, H, n, m)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                             # (B, H, n)
    p = torch.exp(s - _finite(lse)[..., None])                   # exp(-inf) = 0 on empty rows
    return p @ v, lse


def merge_partials(o1, lse1, o2, lse2):
    """The online-softmax merge of two partial attentions over disjoint key blocks.

    l = logaddexp(l1, l2); o = e^{l1-l} o1 + e^{l2-l} o2 (Milakov & Gimelshein 2018).
    """
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - _finite(lse)).nan_to_num(0.0)   # both -inf: the row stays empty
    w2 = torch.exp(lse2 - _finite(lse)).nan_to_num(0.0)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def unmasked_scores(seq: int, cp: int, layout: str) -> list[int]:
    """Score entries each rank computes under the causal mask (the work per rank)."""
    return [int(causal_mask(positions(seq, cp, r, layout), torch.arange(seq)).sum())
            for r in range(cp)]


def _compute_dtype(x):
    # bf16 / fp16 inputs: exponentials, sums and the merge in fp32 (as fused kernels do)
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _check(q, k, v, group, layout):
    """Same checks on every rank before any communication: all fail alike, none hangs."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"q, k, v must share one shape (batch, heads, seq/cp, head_dim), "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    cp = cp_size(group)
    check_layout(q.size(-2) * cp, cp, layout)
    return cp, cp_rank(group), q.size(-2) * cp


# --------------------------------------------------------------------------
# All-gather K/V (Llama 3).
# --------------------------------------------------------------------------

class _GatherSequence(torch.autograd.Function):
    """All-gather chunks into the global order forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, layout):
        cp = cp_size(group)
        ctx.group, ctx.order = group, torch.cat(
            [positions(x.size(-2) * cp, cp, r, layout) for r in range(cp)]).to(x.device)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full = torch.empty_like(torch.cat(parts, -2))
        return full.index_copy_(-2 % x.dim(), ctx.order, torch.cat(parts, -2))

    @staticmethod
    def backward(ctx, grad):
        # every rank's queries used my keys: sum their gradients for my rows
        by_rank = grad.index_select(-2, ctx.order).chunk(cp_size(ctx.group), dim=-2)
        out = torch.empty_like(by_rank[0])
        dist.reduce_scatter(out, [c.contiguous() for c in by_rank], group=ctx.group)
        return out, None, None


def allgather_attention(q, k, v, group=None, causal=True, layout="contiguous",
                        materialize=False):
    """Local q against the all-gathered K, V; returns this rank's output chunk.

    ``materialize=True`` computes softmax(q k^T) v explicitly, so autograd keeps the
    (seq/cp, seq) probabilities per head, the s^2 term a fused kernel avoids
    (``attention_saved_bytes``); otherwise it calls SDPA.
    """
    cp, r, seq = _check(q, k, v, group, layout)
    if cp > 1:
        k, v = (_GatherSequence.apply(x, group, layout) for x in (k, v))  # (B, H, S, d)
    mask = causal_mask(positions(seq, cp, r, layout), torch.arange(seq)) if causal else None
    mask = None if mask is None else mask.to(q.device)
    if materialize:
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))           # (B, H, S/cp, S)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))                     # saves the bool mask
        return torch.softmax(s, dim=-1) @ v                             # saves the probabilities
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_saved_bytes(seq, cp, batch, heads, head_dim, itemsize=4, materialize=False,
                          causal=True):
    """Bytes autograd keeps per rank for one attention call, s = seq split over cp ranks.

    n = s/cp local queries, per (batch, head):
    * ``materialize=True`` (``allgather_attention(materialize=True)``): q (n d), the
      gathered K and V (2 s d), the probabilities (n s), plus the causal mask
      (n s bools, shared by all heads). The n s terms are the s^2/cp growth that
      Korthikanti et al. 2022 (Table 2) write as 5as/h per sbh.
    * flash-style (``ring_attention``): q, k, v, the output (4 n d) and one
      log-sum-exp per row (n): linear in s, what FlashAttention saves (Dao et al.
      2022, sec. 3.1) and why the s^2 term vanishes with a fused kernel.
    """
    n = seq // cp
    if materialize:
        return itemsize * batch * heads * (n * head_dim + 2 * seq * head_dim + n * seq) \
            + (n * seq if causal else 0)
    return itemsize * batch * heads * (4 * n * head_dim + n)


# --------------------------------------------------------------------------
# Ring attention.
# --------------------------------------------------------------------------

def ring_shift(x, group=None, tag=0):
    """Start sending ``x`` to the next rank of the ring and receiving from the previous one.

    Returns (receive buffer, requests); ``wait_all(requests)`` before reading the buffer.
    With one rank: (x, []).
    """
    cp, r = cp_size(group), cp_rank(group)
    if cp == 1:
        return x, []
    peer = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    buf = torch.empty_like(x)
    reqs = [dist.isend(x.contiguous(), peer((r + 1) % cp), group=group, tag=tag),
            dist.irecv(buf, peer((r - 1) % cp), group=group, tag=tag)]
    return buf, reqs


def wait_all(reqs):
    for req in reqs:
        req.wait()


def block_mask(q_pos, seq, cp, src, layout, causal=True):
    """Mask of queries at ``q_pos`` against rank ``src``'s keys; None when nothing is masked."""
    if not causal:
        return None
    mask = causal_mask(q_pos, positions(seq, cp, src, layout).to(q_pos.device))
    return None if mask.all() else mask


def ring_forward(q, k, v, group=None, causal=True, layout="contiguous", timeline=None,
                 communicate=True):
    """The ring's forward without autograd: this rank's output chunk and its log-sum-exp.

    Step i computes on the K/V block that started on rank r - i while the block of
    rank r - i - 1 is in flight. ``timeline`` (a list) gets one dict per span,
    ``{"lane": "compute" | "comm" | "wait", "name", "start", "end"}`` in
    ``time.perf_counter()`` seconds (``helpers.overlap.plot_timelines`` draws them):
    "comm" runs from posting the isend/irecv to the moment the wait returns, "wait"
    is the part of it the rank spent blocked. ``communicate=False`` computes the
    same cp blocks (same masks) on the local K/V, with no messages: the compute
    alone, for timing how much of the transfer the ring hides.
    """
    cp, r, seq = _check(q, k, v, group, layout)
    dt = _compute_dtype(q)
    scale = 1.0 / math.sqrt(q.size(-1))
    qc = q.to(dt)
    q_pos = positions(seq, cp, r, layout).to(q.device)
    kv = torch.stack([k, v]).to(dt)                           # (2, B, H, n, d): one message
    out = torch.zeros_like(qc)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dt, device=q.device)
    span = _spans(timeline)
    for step in range(cp):
        t_post = time.perf_counter()
        nxt, reqs = ring_shift(kv, group, tag=0) if communicate and step < cp - 1 else (kv, [])
        mask = block_mask(q_pos, seq, cp, (r - step) % cp, layout, causal)
        t0 = time.perf_counter()
        if mask is None or mask.any():                        # fully masked: skip the block
            o, l = block_attention(qc, kv[0], kv[1], mask, scale)
            out, lse = merge_partials(out, lse, o, l)
        t1 = time.perf_counter()
        span("compute", f"block of rank {(r - step) % cp}", t0, t1)
        wait_all(reqs)                                        # next block arrived under compute
        if reqs:
            t2 = time.perf_counter()
            span("comm", f"K/V of rank {(r - step - 1) % cp}", t_post, t2)
            span("wait", "wait for K/V", t1, t2)
        kv = nxt
    return out, lse


def _spans(timeline):
    if timeline is None:
        return lambda *a: None
    return lambda lane, name, start, end: timeline.append(
        {"lane": lane, "name": name, "start": start, "end": end})


class RingAttention(torch.autograd.Function):
    """Forward and backward both on the ring (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        out, lse = ring_forward(q, k, v, group, causal, layout)
        ctx.save_for_backward(q.to(out.dtype), k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        ctx.scale = 1.0 / math.sqrt(q.size(-1))
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        qc, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, r, seq = cp_size(group), cp_rank(group), qc.size(-2) * cp_size(group)
        q_pos = positions(seq, cp, r, ctx.layout).to(qc.device)
        dt = qc.dtype
        d_out = d_out.to(dt)
        delta = (d_out * out).sum(-1, keepdim=True)           # rowsum(dO * O): (B, H, n, 1)
        dq = torch.zeros_like(qc)
        kv = torch.stack([k, v]).to(dt)
        dkv, dkv_reqs = None, []
        for step in range(cp):
            nxt, kv_reqs = ring_shift(kv, group, tag=0) if step < cp - 1 else (None, [])
            grads = torch.zeros_like(kv)                      # this step's dK, dV of the held block
            mask = block_mask(q_pos, seq, cp, (r - step) % cp, ctx.layout, ctx.causal)
            if mask is None or mask.any():
                s = (qc @ kv[0].transpose(-2, -1)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                p = torch.exp(s - lse[..., None])             # recomputed probabilities
                grads[1] = p.transpose(-2, -1) @ d_out
                ds = p * (d_out @ kv[1].transpose(-2, -1) - delta)
                dq += (ds @ kv[0]) * scale
                grads[0] = (ds.transpose(-2, -1) @ qc) * scale
            wait_all(dkv_reqs)                                # accumulator, one hop behind
            dkv = grads if dkv is None else dkv + grads
            dkv, dkv_reqs = ring_shift(dkv, group, tag=1)     # last hop takes it home
            wait_all(kv_reqs)
            kv = nxt
        wait_all(dkv_reqs)
        dq_t, dk_t, dv_t = ctx.dtypes
        return dq.to(dq_t), dkv[0].to(dk_t), dkv[1].to(dv_t), None, None, None


def ring_attention(q, k, v, group=None, causal=True, layout="contiguous"):
    """Ring attention on this rank's chunk; returns its output chunk (see module docstring)."""
    return RingAttention.apply(q, k, v, group, causal, layout)


# --------------------------------------------------------------------------
# All-to-all (DeepSpeed-Ulysses).
# --------------------------------------------------------------------------

def check_ulysses(heads: int, cp: int) -> None:
    """Pure: raise ValueError unless ``heads`` split over cp ranks (call before launching)."""
    if heads % cp:
        raise ValueError(f"{heads} heads do not divide over context-parallel size {cp}")


def _exchange(send, group):
    """All-to-all of equal-shaped chunks: send[j] goes to rank j, recv[j] came from rank j.

    That is the contract of the list form ``dist.all_to_all(recv, send)``, but
    torch 2.11's gloo refuses the list form ("Backend gloo does not support
    alltoall"), while every version's gloo and NCCL have ``all_to_all_single``.
    So the chunks are stacked along a new leading dimension, which
    ``all_to_all_single`` splits evenly over the ranks: row j goes to rank j,
    and row j of the result came from rank j.
    """
    stacked = torch.stack(send)                           # (cp, *chunk); copies, so contiguous
    out = torch.empty_like(stacked)
    dist.all_to_all_single(out, stacked, group=group)
    return out.unbind(0)


def _seq_to_head(x, group, layout):
    """(B, H, S/cp, d) sequence-split -> (B, H/cp, S, d) head-split, global order."""
    cp = cp_size(group)
    recv = _exchange(x.chunk(cp, dim=1), group)           # head group j goes to rank j
    by_rank = torch.cat(recv, dim=-2)                     # rank 0's positions, rank 1's, ...
    order = torch.cat([positions(by_rank.size(-2), cp, r, layout)
                       for r in range(cp)]).to(x.device)
    return torch.empty_like(by_rank).index_copy_(2, order, by_rank)


def _head_to_seq(x, group, layout):
    """(B, H/cp, S, d) head-split, global order -> (B, H, S/cp, d) this rank's chunk."""
    cp = cp_size(group)
    order = torch.cat([positions(x.size(-2), cp, r, layout) for r in range(cp)]).to(x.device)
    send = x.index_select(2, order).chunk(cp, dim=-2)     # rank r's positions go to rank r
    recv = _exchange(send, group)
    return torch.cat(recv, dim=1)                         # heads of rank 0, rank 1, ...


class _AllToAll(torch.autograd.Function):
    """Sequence-split <-> head-split; the conjugate of an all-to-all is the reverse one."""

    @staticmethod
    def forward(ctx, x, group, layout, to_heads):
        ctx.group, ctx.layout, ctx.to_heads = group, layout, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group, layout)

    @staticmethod
    def backward(ctx, grad):
        back = _head_to_seq if ctx.to_heads else _seq_to_head
        return back(grad, ctx.group, ctx.layout), None, None, None


def ulysses_attention(q, k, v, group=None, causal=True, layout="contiguous"):
    """All-to-all to head-split, full-sequence attention on H/cp heads, all-to-all back."""
    cp, _, _ = _check(q, k, v, group, layout)
    check_ulysses(q.size(1), cp)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    q, k, v = (_AllToAll.apply(x, group, layout, True) for x in (q, k, v))  # (B, H/cp, S, d)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _AllToAll.apply(y, group, layout, False)


# --------------------------------------------------------------------------
# PyTorch's own context parallelism, for comparison.
# --------------------------------------------------------------------------

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
