"""Chapter 04's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch04
from helpers.ddp import BucketedDDP


def _forward_order(sizes, cap, first):  # buckets in registration order
    buckets, cur, filled = [], [], 0
    for i, s in enumerate(sizes):
        cur.append(i)
        filled += s
        if filled >= (first if not buckets else cap):
            buckets.append(cur)
            cur, filled = [], 0
    return buckets + ([cur] if cur else [])


def _no_first_cap(sizes, cap, first):  # ignores the small first bucket
    buckets, cur, filled = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        filled += sizes[i]
        if filled >= cap:
            buckets.append(cur)
            cur, filled = [], 0
    return buckets + ([cur] if cur else [])


def _solution_like(sizes, cap, first, close=lambda filled, cap: filled >= cap,
                   first_for_all=False, keep_last=True, before=False):
    buckets, cur, filled = [], [], 0
    for i in reversed(range(len(sizes))):
        limit = first if (not buckets or first_for_all) else cap
        if before and cur and filled + sizes[i] > limit:  # would overflow: close first
            buckets.append(cur)
            cur, filled = [], 0
            limit = first if first_for_all else cap
        cur.append(i)
        filled += sizes[i]
        if close(filled, limit):
            buckets.append(cur)
            cur, filled = [], 0
    return buckets + ([cur] if cur and keep_last else [])


def _first_cap_for_all(sizes, cap, first):  # every bucket uses the first bucket's cap
    return _solution_like(sizes, cap, first, first_for_all=True)


def _strictly_over(sizes, cap, first):  # closes only when over the cap, not at it
    return _solution_like(sizes, cap, first, close=lambda filled, cap: filled > cap)


def _never_overflow(sizes, cap, first):  # closes before a parameter that would overflow
    return _solution_like(sizes, cap, first, before=True)


def _drops_last(sizes, cap, first):  # forgets the last, partly filled bucket
    return _solution_like(sizes, cap, first, keep_last=False)


def _always_appends_last(sizes, cap, first):  # appends the open bucket even when empty
    b = _solution_like(sizes, cap, first, keep_last=False)
    return b + [[i for i in reversed(range(len(sizes))) if all(i not in x for x in b)]]


def _prints_instead(sizes, cap, first):  # builds the buckets, forgets to return them
    print(_solution_like(sizes, cap, first))


def _largest_first(sizes, cap, first):  # starts from max(sizes): ValueError on no parameters
    biggest = max(sizes)
    return _solution_like(sizes, cap, first) if biggest else []


class _DividesAgain(BucketedDDP):
    """Divides the (already averaged) buffer by the world size once more."""

    def finish_backward(self):
        import torch
        import torch.distributed as dist
        self.launch_ready_buckets()
        with torch.no_grad():
            for b, fut in enumerate(self.futures):
                avg = fut.wait() / dist.get_world_size()
                for p, start, end in self.layout[b]:
                    p.grad.copy_(avg[start:end].view_as(p))


class _NoViewAs(BucketedDDP):
    """Copies a flat slice into a 2-D .grad: a shape error on the ranks."""

    def finish_backward(self):
        import torch
        self.launch_ready_buckets()
        with torch.no_grad():
            for b, fut in enumerate(self.futures):
                avg = fut.wait()
                for p, start, end in self.layout[b]:
                    p.grad.copy_(avg[start:end])


class _ReadyTwice(BucketedDDP):
    """Records 'ready' on every gradient of a bucket, not once when it completes."""

    def on_grad_ready(self, param):
        b = self.bucket_of_param[id(param)]
        self.pending[b] -= 1
        self.record(b, "ready")
        if self.pending[b] == 0:
            self.launch_ready_buckets()


class _LaunchWhenReady(BucketedDDP):
    """Launches a bucket the moment it is complete, out of order if need be."""

    def on_grad_ready(self, param):
        b = self.bucket_of_param[id(param)]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.record(b, "ready")
            self.launch_bucket(b)
            if b == self.next_bucket:
                self.next_bucket += 1
                while self.next_bucket < len(self.buckets) and \
                        self.futures[self.next_bucket] is not None:
                    self.next_bucket += 1


class _LaunchAtEnd(BucketedDDP):
    """Counts and records, but leaves every launch to the end of backward: no overlap."""

    def on_grad_ready(self, param):
        b = self.bucket_of_param[id(param)]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.record(b, "ready")


class _NoCopyBack(BucketedDDP):
    """Waits for every bucket but never writes the averages into .grad: local gradients."""

    def finish_backward(self):
        self.launch_ready_buckets()
        for fut in self.futures:
            fut.wait()


class _OneAtATime(BucketedDDP):
    """Launches at most one bucket per call (an `if` where a `while` belongs)."""

    def launch_ready_buckets(self):
        if self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self.launch_bucket(self.next_bucket)
            self.next_bucket += 1


class _ReduceAgain(BucketedDDP):
    """Waits for the buckets, then all-reduces every .grad itself: right gradients, every
    byte sent twice."""

    def finish_backward(self):
        import torch.distributed as dist

        self.launch_ready_buckets()
        for fut in self.futures:
            fut.wait()
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


class _OffByOne(BucketedDDP):
    """Launches the next bucket while it still lacks one gradient (``<= 1`` for ``== 0``)."""

    def launch_ready_buckets(self):
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] <= 1:
            self.launch_bucket(self.next_bucket)
            self.next_bucket += 1


class _CountsIntoNextBucket(BucketedDDP):
    """Counts every gradient into the bucket due next, not into its own."""

    def on_grad_ready(self, param):
        b = min(self.next_bucket, len(self.buckets) - 1)
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.record(b, "ready")
            self.launch_ready_buckets()


class TestChapter04(ChapterChecks):
    lab, sol = "labs/04_ddp_buckets_lab.ipynb", "solutions/04_ddp_buckets_solution.ipynb"
    checks = {
        "assign_buckets": Check(ch04.check_assign_buckets),
        "grad_ready_hook": Check(ch04.check_grad_ready_hook, "MyDDP", slow=True, wire=True),
    }
    wrong = [
        Wrong("grad_ready_hook", _ReduceAgain, "all-reduces every .grad again in finish",
              says="one all-reduce per bucket"),
        Wrong("assign_buckets", _forward_order, "buckets in registration order", says="reverse"),
        Wrong("assign_buckets", _no_first_cap, "ignores the small first bucket",
              says="first_cap_bytes"),
        Wrong("assign_buckets", _first_cap_for_all, "the first cap for every bucket",
              says=r"\[100, 100, 100, 100, 100, 100\], cap=400, first=150"),
        Wrong("assign_buckets", _strictly_over, "closes only when over the cap", says=">="),
        Wrong("assign_buckets", _never_overflow, "closes before a parameter that would overflow",
              says="Add the parameter first"),
        Wrong("assign_buckets", _drops_last, "drops the last partly filled bucket",
              says="exactly one bucket"),
        Wrong("assign_buckets", _always_appends_last, "an empty bucket for no parameters",
              says="never empty"),
        Wrong("assign_buckets", _prints_instead, "returns None", says="got None"),
        Wrong("assign_buckets", _largest_first, "max() of no parameters raises",
              says=r"raised ValueError"),
        Wrong("grad_ready_hook", _DividesAgain, "divides the averaged buffer again",
              says="don't divide again"),
        Wrong("grad_ready_hook", _NoViewAs, "copies a flat slice without view_as",
              says="raised RuntimeError"),
        Wrong("grad_ready_hook", _ReadyTwice, "records ready for every gradient",
              says="once per bucket"),
        Wrong("grad_ready_hook", _LaunchWhenReady, "launches out of order", says="in the order"),
        Wrong("grad_ready_hook", _OffByOne, "launches a bucket lacking one gradient",
              says="launched while the gradient.* had not arrived"),
        Wrong("grad_ready_hook", _CountsIntoNextBucket, "counts gradients into the wrong bucket",
              says="count each gradient into its own bucket"),
        Wrong("grad_ready_hook", _LaunchAtEnd, "launches at the end of backward",
              says="no overlap"),
        Wrong("grad_ready_hook", _NoCopyBack, "never copies the averages back",
              says="writes its averaged values back"),
        Wrong("grad_ready_hook", _OneAtATime, "an `if` where a `while` belongs",
              says="never launched"),
    ]
