"""Stage 3 with fewer, larger collectives: DeepSpeed's prefetch and reuse knobs.

One collective per module is what makes plain stage 3 slow on small modules:
a GPT block has six (two LayerNorms, four Linears), and each collective pays a
fixed latency. DeepSpeed's stage 3 has two knobs against that, kept here
under the same meaning (both off by default, so chapter 14 sees one
collective per module):

* ``prefetch_bucket_numel`` (DeepSpeed's ``stage3_prefetch_bucket_size``):
  the first step records the order in which modules ask for their weights
  (the *trace*). In later steps, when a module asks, the units the trace says
  come next are all-gathered too, in one coalesced, asynchronous collective,
  until that many elements are in flight. The next module then usually finds
  its weights already there. More elements in flight: fewer collectives,
  more overlap, more memory held. A step that leaves the trace (a different
  forward) simply stops prefetching until the next ``step()``.
* ``max_reuse_numel`` (DeepSpeed's ``stage3_max_reuse_distance``): a module
  done with its weights does not free them if the trace says they are needed
  again within that many elements of other units' requests (a tied
  embedding, or the last blocks, whose backward comes right after their
  forward). Without it, prefetch would gather a unit, free it, and gather it
  again one module later.
* ``reduce_bucket_numel`` (DeepSpeed's ``reduce_bucket_size``): gradients of
  finished units wait in a bucket until it holds that many elements, then
  one reduce-scatter handles them all.

A coalesced collective over several units lays their chunks out rank by
rank: ``[rank 0: chunk of A, chunk of B | rank 1: chunk of A, chunk of B]``,
so rank r's piece is again "its chunk of every unit".
"""

from __future__ import annotations

__all__ = ["PrefetchMixin"]


class PrefetchMixin:
    """The trace of weight requests, and what it lets ``ZeroStage3`` do ahead."""

    def _init_trace(self) -> None:
        # the recorded order of weight requests (unit indices), and where we are in it
        self._trace: list[int] = []
        self._recording, self._pos = True, 0

    def _restart_trace(self) -> None:
        """step(): the trace is complete after the first step; follow it from the top."""
        self._recording, self._pos = False, 0

    def _follow_trace(self, bi: int) -> range | list:
        """Record (first step) or follow (later steps) the order of weight requests;
        return the positions in the trace of the requests expected next."""
        if self._recording:
            self._trace.append(bi)
            return []
        if self._pos < len(self._trace) and self._trace[self._pos] == bi:
            self._pos += 1
        elif self._trace and self._trace[0] == bi:
            self._pos = 1  # a new forward from the top (e.g. after an evaluation pass)
        else:
            self._pos = len(self._trace) + 1  # off the trace: no prefetch until step()
            return []
        return range(self._pos, len(self._trace))

    def _prefetch(self, upcoming) -> None:
        """Gather upcoming units, in one collective, until prefetch_bucket_numel
        elements are in flight (DeepSpeed counts the same way)."""
        in_flight = sum(self.partition.buckets[j].padded for j, u in enumerate(self.units)
                        if u.pending is not None)
        group: list[int] = []
        for pos in upcoming:
            if in_flight >= self.prefetch_bucket_numel:
                break
            j = self._trace[pos]
            if j in group or self.units[j].gathered:  # (in flight counts as gathered)
                continue
            group.append(j)
            in_flight += self.partition.buckets[j].padded
        if group:
            self._start_gather(group)

    def _reused_soon(self, bi: int) -> bool:
        """Does the trace request bi again within max_reuse_numel elements?"""
        if not self.max_reuse_numel or self._recording or self._pos > len(self._trace):
            return False
        distance = 0
        for j in self._trace[self._pos:]:
            if j == bi:
                return True
            distance += self.partition.buckets[j].padded
            if distance > self.max_reuse_numel:
                return False
        return False  # not again in this step
