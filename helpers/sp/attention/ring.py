"""Ring attention: K/V blocks travel round the ranks, merged exactly by online softmax.

Follows Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context", sec. 3, with FlashAttention's
backward (Dao et al. 2022, App. B.2). K/V blocks travel round the ring of
ranks (isend/irecv, posted together as one batch) while each rank computes
on the block it holds; partial results merge with ``merge_partials``
(``helpers.sp.attention.blocks``).
Memory: two K/V blocks; communication hidden if a block's compute takes
longer than its transfer.

Backward
--------
``ring_attention`` is a custom autograd Function with a ring backward: with
the final output O and log-sum-exp L saved, a block's probabilities are
recomputed as P = exp(q k^T / sqrt(d) - L), and (Dao et al. 2022, App. B.2)

    dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),  dQ = dS K / sqrt(d),
    dK = dS^T Q / sqrt(d).

K, V travel the ring again, and the dK, dV accumulators travel with them one
hop behind, returning to their owner after cp hops: no rank ever holds the
whole sequence.

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

from helpers.clock import clock_for, resolve
from helpers.collectives.ring import post_pair
from helpers.sp.attention.blocks import block_attention, causal_mask, check_qkv, merge_partials
from helpers.sp.layout import cp_rank, cp_size, positions

__all__ = ["ring_shift", "wait_all", "block_mask", "ring_forward", "RingAttention",
           "ring_attention"]


def _compute_dtype(x):
    # bf16 / fp16 inputs: exponentials, sums and the merge in fp32 (as fused kernels do)
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def ring_shift(x, group=None, tag=0):
    """Start sending ``x`` to the next rank of the ring and receiving from the previous one.

    Returns (receive buffer, requests); ``wait_all(requests)`` before reading the buffer.
    With one rank: (x, []).

    The send and the receive go out as one ``batch_isend_irecv``
    (``helpers.collectives.post_pair``, chapter 03's ring exchange), never as a
    lone ``isend`` then a lone ``irecv``: under nccl every rank would queue its
    send first, and a large send waits for a receive that its peer has queued
    behind its own send, so both wait forever. Gloo runs either form.
    """
    cp, r = cp_size(group), cp_rank(group)
    if cp == 1:
        return x, []
    buf = torch.empty_like(x)
    return buf, post_pair(x.contiguous(), buf, (r + 1) % cp, (r - 1) % cp, group, tag=tag)


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
                 communicate=True, trace=None):
    """The ring's forward without autograd: this rank's output chunk and its log-sum-exp.

    Step i computes on the K/V block that started on rank r - i while the block of
    rank r - i - 1 is in flight. ``timeline`` (a list) gets one dict per span,
    ``{"lane": "compute" | "comm" | "wait", "name", "start", "end"}`` in seconds from
    ``helpers.clock`` (``helpers.overlap.plot_timelines`` draws them; on a GPU the
    marks are CUDA events, filled in when the forward returns):
    "comm" runs from posting the isend/irecv to the moment the wait returns, "wait"
    is the part of it the rank spent blocked; a "compute" span also has ``"cpu"``, the
    CPU seconds this rank's process used during it (all its threads): over the span's
    length, the share of the time the rank really ran, which on a machine with fewer
    cores than ranks falls below one thread's 1.0 (a CPU quantity: on a GPU it counts
    only the kernels' launches). ``communicate=False`` computes the
    same cp blocks (same masks) on the local K/V, with no messages: the compute
    alone, for timing how much of the transfer the ring hides. ``trace`` (a list)
    gets one dict per step, what the step did: ``{"step", "rank", "owner"`` (whose K/V
    block it held), ``"q_pos", "k_pos"`` (the global positions of this rank's queries
    and of the block's keys), ``"mask"`` (bool (n, n): which scores it computed),
    ``"computed"`` (False: fully masked, skipped), ``"sent_to", "received_from"`` (the
    ranks in the group it passed the block to and got the next from; None after the
    last step)``}`` (``helpers.drawing.ring_attention`` draws it).
    """
    cp, r, seq = check_qkv(q, k, v, group, layout)
    dt = _compute_dtype(q)
    scale = 1.0 / math.sqrt(q.size(-1))
    qc = q.to(dt)
    q_pos = positions(seq, cp, r, layout).to(q.device)
    kv = torch.stack([k, v]).to(dt)                           # (2, B, H, n, d): one message
    out = torch.zeros_like(qc)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dt, device=q.device)
    clk = clock_for(q.device)
    spans: list[dict] = []  # marks; resolved into ``timeline`` at the end
    span = _spans(spans if timeline is not None else None)
    for step in range(cp):
        t_post = clk.mark()
        nxt, reqs = ring_shift(kv, group, tag=0) if communicate and step < cp - 1 else (kv, [])
        mask = block_mask(q_pos, seq, cp, (r - step) % cp, layout, causal)
        t0, c0 = clk.mark(), time.process_time()
        computed = mask is None or bool(mask.any())
        if computed:                                          # fully masked: skip the block
            o, l = block_attention(qc, kv[0], kv[1], mask, scale)
            out, lse = merge_partials(out, lse, o, l)
        t1, c1 = clk.mark(), time.process_time()
        if trace is not None:
            owner = (r - step) % cp
            k_pos = positions(seq, cp, owner, layout)
            moving = bool(reqs)
            trace.append({"step": step, "rank": r, "owner": owner,
                          "q_pos": q_pos.tolist(), "k_pos": k_pos.tolist(),
                          "mask": (torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
                                   if mask is None else mask.cpu()),
                          "computed": computed,
                          "sent_to": (r + 1) % cp if moving else None,
                          "received_from": (r - 1) % cp if moving else None})
        span("compute", f"block of rank {(r - step) % cp}", t0, t1, c1 - c0)
        wait_all(reqs)                                        # next block arrived under compute
        if reqs:
            t2 = clk.mark()  # after the wait: on a GPU, when the K/V had arrived
            span("comm", f"K/V of rank {(r - step - 1) % cp}", t_post, t2)
            span("wait", "wait for K/V", t1, t2)
        kv = nxt
    if timeline is not None:
        timeline.extend(resolve(spans))
    return out, lse


def _spans(timeline):
    if timeline is None:
        return lambda *a: None

    def span(lane, name, start, end, cpu=None):
        timeline.append({"lane": lane, "name": name, "start": start, "end": end}
                        | ({} if cpu is None else {"cpu": cpu}))
    return span


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
