"""Reduce-scatter gradients during backward, bucket by bucket (ZeRO stages 2-3).

A post-accumulate-grad hook on every parameter counts how many of its
bucket's gradients exist. When the bucket is complete its gradients are
copied into one flat buffer and averaged, and the full-size gradients are
dropped (``p.grad = None``: a rank keeps only its chunk); the buffer is then
reduce-scattered asynchronously while backward goes on with earlier layers
(as DDP overlaps its all-reduces, chapter 04). With ``reduce_bucket_numel``
(DeepSpeed's ``reduce_bucket_size``) buffers wait until that many elements
are pending and go out in one coalesced reduce-scatter, laid out rank by
rank so rank r again receives its chunk of each.

**In order.** Buffers are sent in one fixed *launch order*, the same on
every rank, never in the order buckets happen to complete: bucket k goes
out only when it and every bucket before it in that order are complete
(``_send_ready``). Completion order is not the same on every rank (a
forward that branches on the data, a parameter one rank does not use), and
gloo pairs collectives by the order they are issued in: rank 0's
reduce-scatter of bucket A would meet rank 1's of bucket B, a size mismatch
that aborts the process ("Received data size doesn't match expected size",
SIGABRT) or, for two buckets of one size, wrong sums. This is BucketedDDP's
rule (``helpers.ddp``, module docstring point 4; torch's Reducer launches
``buckets_[next_bucket_]`` while it is complete). The launch order is the
order gradients are expected in: a bucket is complete when its
earliest-registered parameter's gradient arrives, and gradients arrive
roughly in reverse registration order (``helpers.ddp.assign_buckets``), so
buckets go by their smallest parameter index, largest first. For stage 2
(buckets by ``size_buckets``) that is bucket 0, 1, 2, ...; for stage 3 (one
bucket per module, in forward order) it is the modules in reverse. A bucket
completed ahead of its turn is packed at once (its full-size gradients
dropped, stage 3's weights freed) and only its collective waits.

**Missing gradients.** A parameter that gets no gradient in a backward (a
branch not taken, a head another rank trains) counts as arrived when that
backward starts (``_count_missing_gradients``, as DDP's
``find_unused_parameters=True`` marks it ready after forward) and
contributes zeros: averaged as DDP averages it, sum over the ranks that used
it / N. Its bucket therefore completes at the same point of backward as on a
rank that used it. Waiting for it until the end would keep every later
bucket back on this rank only: still the same reduce-scatters in the same
order, but stage 3 also all-gathers during backward, and a reduce-scatter
held back on one rank would meet the other ranks' all-gathers.

A callback queued on the autograd engine runs when backward ends: it packs
whatever is still incomplete, sends the rest in launch order, waits for
every reduce-scatter, and *adds* the results into the rank's gradient
shard, so several backwards before one ``step()`` accumulate (DeepSpeed's
stages 2-3: one reduce-scatter per micro-batch, no ``no_sync``). Every rank
issues the same reduce-scatters, of the same buckets, in the same order,
whatever order its gradients came in. (Stage 3's all-gathers are issued as
modules run, so there every rank must still run the same modules in the
same order, as FSDP and DeepSpeed require.)

No lock around the hooks, unlike BucketedDDP: autograd runs each device's
part of backward on its own thread, so hooks fire concurrently only for a
model spread over devices, and ZeroOptimizer refuses parameters on more
than one device.
"""

from __future__ import annotations


import torch
from torch.autograd.graph import get_gradient_edge

from helpers.comm import reduce_scatter
from helpers.overlap import issue_mark, record_comm, wait_comm

__all__ = ["ReduceScatterInBackward"]


class ReduceScatterInBackward:
    """Mixin for a ``ZeroOptimizer`` that keeps ``grad_shard`` (stages 2 and 3)."""

    def _install_grad_hooks(self) -> None:
        buckets = self.partition.buckets
        self._bucket_of = {}
        for bi, b in enumerate(buckets):
            for i in b.params:
                self._bucket_of[id(self.params[i])] = bi
        # Same on every rank: it depends on the partition only (module docstring).
        self._launch_order = sorted(range(len(buckets)), key=lambda bi: -min(buckets[bi].params))
        self._handles: list = []  # in-flight reduce-scatters: (work, buckets, output, name)
        self._pending: list = []  # (bucket index, averaged full gradient) whose turn came,
        #                           waiting to fill reduce_bucket_numel
        self._reset_backward()
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _reset_backward(self) -> None:
        """Counters for the next backward (a parameter's hook fires once per backward)."""
        self._ready = [0] * len(self.partition.buckets)    # gradients arrived, per bucket
        self._packed: dict[int, torch.Tensor] = {}          # complete, averaged, not yet sent
        self._next = 0  # position in _launch_order of the first bucket not sent yet
        self._callback_queued = False  # end-of-backward callback queued

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._callback_queued:
            # Runs once this backward has finished: send what is left, wait, add
            # into the gradient shard, and get the counters ready for the next one.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
            self._count_missing_gradients()
        self._used[self._index[id(p)]] = True
        self._arrived(self._bucket_of[id(p)])

    def _count_missing_gradients(self) -> None:
        """First hook of a backward: a parameter this backward gives no gradient
        (not in its graph) counts as arrived now, as DDP's
        ``find_unused_parameters`` marks it ready after forward. Its bucket is then
        complete when its other gradients are, at the same point of backward as
        on a rank that does use it, not only at the end: stage 3 all-gathers
        during backward too, and a reduce-scatter held back to the end on one rank
        only would meet the other ranks' all-gathers. (``_will_engine_execute_node``
        asks the running backward whether it will reach the parameter's
        gradient accumulator; ``register_multi_grad_hook(mode="any")`` uses it too.)"""
        for p in self.params:
            if not torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                self._arrived(self._bucket_of[id(p)])

    def _arrived(self, bi: int) -> None:
        """One more of bucket bi's gradients is final; pack it once complete."""
        self._ready[bi] += 1
        if self._ready[bi] == len(self.partition.buckets[bi].params):
            self._pack_bucket(bi)
            self._send_ready()

    def _pack_bucket(self, bi: int) -> None:
        """Bucket bi is complete (or backward is over): average its gradients into
        one flat buffer and drop the full ones; it is sent in its turn."""
        b = self.partition.buckets[bi]
        buf = self._zeros(b.padded)  # padding stays 0, and so does a missing gradient
        for i, off in zip(b.params, b.offsets):
            p = self.params[i]
            if p.grad is not None:
                buf[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None  # a rank keeps only its chunk (stage >= 2)
        buf.div_(self.world)  # average, not sum, of the ranks' gradients
        self._packed[bi] = buf
        self._bucket_done(bi)

    def _send_ready(self) -> None:
        """Send packed buckets in launch order, stopping at the first one not packed
        yet (BucketedDDP.launch_ready_buckets, with a launch order instead of 0, 1, ...)."""
        order = self._launch_order
        while self._next < len(order) and order[self._next] in self._packed:
            bi = order[self._next]
            self._next += 1
            self._pending.append((bi, self._packed.pop(bi)))
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
        """End of one backward: every bucket reduce-scattered once, in launch order,
        the results *added* into the gradient shard (so several backwards accumulate)."""
        # Missing gradients were counted when backward started, so every bucket
        # should be complete by now; one that is not is packed now, with zeros for
        # what is missing, and sent in its turn like the rest.
        for bi in self._launch_order[self._next:]:
            if bi not in self._packed:
                self._pack_bucket(bi)
        self._send_ready()
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
        self._reset_backward()

    def _bucket_done(self, bi: int) -> None:
        """Bucket bi's gradients are packed, the full-size ones dropped (stage 3
        frees its weights here)."""

    def _issue(self, collective, out: torch.Tensor, inp: torch.Tensor, name: str):
        """Start ``collective(out, inp)`` asynchronously (None on one rank, where
        out is inp); recorded on the timeline."""
        if self.world == 1:
            out.copy_(inp)
            return None
        t0 = issue_mark(self.timeline)
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
