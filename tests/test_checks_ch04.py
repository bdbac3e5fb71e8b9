"""Chapter 04's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import sys

import cloudpickle

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch04
from helpers.ddp import BucketedDDP

# Ship this file's wrong answers to the ranks by value (by reference, every rank would
# import this module and with it pytest and nbformat, seconds on a loaded machine).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


class TestChapter04(ChapterChecks):
    lab, sol = "labs/04_ddp_buckets_lab.ipynb", "solutions/04_ddp_buckets_solution.ipynb"
    checks = {
        "assign_buckets": Check(ch04.check_assign_buckets),
        "grad_ready_hook": Check(ch04.check_grad_ready_hook, "MyDDP", slow=True),
    }
    wrong = [
        Wrong("assign_buckets", _forward_order, "buckets in registration order", says="reverse"),
        Wrong("assign_buckets", _no_first_cap, "ignores the small first bucket",
              says="first_cap_bytes"),
        Wrong("grad_ready_hook", _LaunchWhenReady, "launches out of order", says="in the order"),
        Wrong("grad_ready_hook", _LaunchAtEnd, "launches at the end of backward",
              says="no overlap"),
        Wrong("grad_ready_hook", _NoCopyBack, "never copies the averages back",
              says="writes its averaged values back"),
        Wrong("grad_ready_hook", _OneAtATime, "an `if` where a `while` belongs",
              says="never launched"),
    ]
