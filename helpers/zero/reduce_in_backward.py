"""Reduce-scatter gradients during backward, bucket by bucket (ZeRO stages 2-3).

A post-accumulate-grad hook on every parameter counts how many of its
bucket's gradients exist; when the bucket is complete its gradients are
copied into one flat buffer, averaged, the full-size gradients dropped
(``p.grad = None``: a rank keeps only its chunk) and the buffer
reduce-scattered asynchronously, while backward goes on with earlier layers
(as DDP overlaps its all-reduces, chapter 04). With ``reduce_bucket_numel``
(DeepSpeed's ``reduce_bucket_size``) finished buckets wait until that many
elements are pending and go out in one coalesced reduce-scatter, laid out
rank by rank so rank r again receives its chunk of each.

A callback queued on the autograd engine runs when backward ends: it sends
what is left (an unused module's bucket, with zeros), waits for every
reduce-scatter, and *adds* the results into the rank's gradient shard, so
several backwards before one ``step()`` accumulate (DeepSpeed's stages 2-3:
one reduce-scatter per micro-batch, no ``no_sync``).
"""

from __future__ import annotations

import time

import torch

from helpers.comm import reduce_scatter
from helpers.overlap import record_comm, wait_comm

__all__ = ["ReduceScatterInBackward"]


class ReduceScatterInBackward:
    """Mixin for a ``ZeroOptimizer`` that keeps ``grad_shard`` (stages 2 and 3)."""

    def _install_grad_hooks(self) -> None:
        self._bucket_of = {}
        for bi, b in enumerate(self.partition.buckets):
            for i in b.params:
                self._bucket_of[id(self.params[i])] = bi
        self._ready = [0] * len(self.partition.buckets)
        self._launched = [False] * len(self.partition.buckets)
        self._handles: list = []  # in-flight reduce-scatters: (work, buckets, output, name)
        self._pending: list = []  # (bucket index, averaged full gradient) not yet sent
        self._callback_queued = False  # end-of-backward callback queued
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        self._used[self._index[id(p)]] = True
        if not self._callback_queued:
            # Runs once this backward has finished: reduce what is left, wait, add
            # into the gradient shard, and get the counters ready for the next one.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        bi = self._bucket_of[id(p)]
        self._ready[bi] += 1
        if self._ready[bi] == len(self.partition.buckets[bi].params):
            self._launch_bucket(bi)

    def _launch_bucket(self, bi: int) -> None:
        """Bucket bi's gradients are complete: average them into one flat buffer,
        drop the full ones, and reduce-scatter (now, or once the reduce bucket fills)."""
        b = self.partition.buckets[bi]
        buf = self._zeros(b.padded)  # padding stays 0
        for i, off in zip(b.params, b.offsets):
            p = self.params[i]
            if p.grad is not None:
                buf[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None  # a rank keeps only its chunk (stage >= 2)
        buf.div_(self.world)  # average, not sum, of the ranks' gradients
        self._launched[bi] = True
        self._bucket_done(bi)
        self._pending.append((bi, buf))
        if sum(g.numel() for _, g in self._pending) >= self.reduce_bucket_numel:
            self._reduce_pending()

    def _reduce_pending(self) -> None:
        """One asynchronous reduce-scatter of every pending bucket (coalesced if several)."""
        if not self._pending:
            return
        units = [bi for bi, _ in self._pending]
        if len(units) == 1:
            inp = self._pending[0][1]
        else:  # rank-major layout, as in _start_gather: rank r receives its chunk of each
            inp = torch.cat([g.view(self.world, -1) for _, g in self._pending], dim=1).reshape(-1)
        self._pending = []
        out = self._empty(inp.numel() // self.world)
        name = f"reduce-scatter {units[0]}" + (f"..{units[-1]}" if len(units) > 1 else "")
        work = self._issue(reduce_scatter, out, inp, name)
        self._count("reduce_scatter", inp.numel() * inp.element_size())
        self._handles.append((work, units, out, name))

    def _end_backward(self) -> None:
        """End of one backward: every bucket reduce-scattered once, the results
        *added* into the gradient shard (so several backwards accumulate)."""
        self._callback_queued = False
        # Buckets whose gradients never arrived (an unused module) are reduced
        # now with zeros, in bucket order, identically on every rank.
        for bi, done in enumerate(self._launched):
            if not done:
                self._launch_bucket(bi)
        self._reduce_pending()
        with torch.no_grad():
            for work, units, out, name in self._handles:
                if work is not None:
                    self._wait(work, name)
                col = 0
                for bi in units:
                    b = self.partition.buckets[bi]
                    self.grad_shard[b.shard_start:b.shard_start + b.chunk].add_(
                        out[col:col + b.chunk])
                    col += b.chunk
        self._handles = []
        # A parameter's hook fires once per backward: reset the counts, or the
        # next micro-batch's buckets would never fill (and never be sent).
        self._ready = [0] * len(self.partition.buckets)
        self._launched = [False] * len(self.partition.buckets)

    def _bucket_done(self, bi: int) -> None:
        """Bucket bi's gradients are on their way (stage 3 frees its weights here)."""

    def _issue(self, collective, out: torch.Tensor, inp: torch.Tensor, name: str):
        """Start ``collective(out, inp)`` asynchronously (None on one rank, where
        out is inp); recorded on the timeline."""
        if self.world == 1:
            out.copy_(inp)
            return None
        t0 = time.perf_counter()
        work = collective(out, inp, group=self.group, async_op=True)
        record_comm(self.timeline, work, name, t0)
        return work

    def _wait(self, work, name: str) -> None:
        wait_comm(self.timeline, work, name)

    def _reduce_grads(self):
        """Reduce-scattered and summed into the shard during backward already."""
        return [self.grad_shard[b.shard_start:b.shard_start + b.chunk]
                for b in self.partition.buckets]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shard (``p.grad`` is already None here)."""
        super().zero_grad()
        self.grad_shard.zero_()
        for p in self.params:
            p.grad = None
