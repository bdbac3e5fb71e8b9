"""Chapter 16's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

from functools import partial

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch16


def _no_sort(spans):  # merges overlaps in the given order, without sorting first
    total, end = 0.0, float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def _same_direction(fsdp, i, phase):  # i + 1 in backward too: that unit already ran
    if i + 1 < len(fsdp.units):
        fsdp.gather_async(fsdp.units[i + 1])


def _everything(fsdp, i, phase):  # gathers all units at once: memory of DDP
    for u in fsdp.units:
        fsdp.gather_async(u)


def _last_end(spans):  # sorts, but keeps the last span's end, not the furthest one
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = b
    return total


def _first_span(spans):  # starts from spans[0]: IndexError on no spans
    spans = sorted(spans)
    (start, end), total = spans[0], 0.0
    for a, b in spans[1:]:
        if a > end:
            total, start = total + end - start, a
        end = max(end, b)
    return total + end - start


def _merged_spans(spans):  # returns the merged spans, not their length
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _just_ran(fsdp, i, phase):  # prefetches the unit that was just gathered: nothing new
    if 0 <= i < len(fsdp.units):
        fsdp.gather_async(fsdp.units[i])


def _private_gather(fsdp, i, phase):  # FSDP's private synchronous gather
    j = i + 1 if phase == "forward" else i - 1
    if 0 <= j < len(fsdp.units):
        fsdp._gather(fsdp.units[j])


def _async_then_wait(fsdp, i, phase):  # the public call, then waits for it: no overlap
    j = i + 1 if phase == "forward" else i - 1
    if 0 <= j < len(fsdp.units):
        fsdp.gather_async(fsdp.units[j])
        fsdp.units[j].wait()


def _default_prefetch(fsdp, i, phase):  # FSDP's own default, called
    from helpers.fsdp import next_unit_prefetch
    next_unit_prefetch(fsdp, i, phase)


def _course_union(spans):  # the chapter's helper, called
    from helpers.overlap import union_length
    return union_length(spans)


def _course_topk(ratio):  # the chapter's hook, returned
    from helpers.compression import TopKHook
    return TopKHook(ratio)


def _topk_hook(ratio, feedback=True, average=True, dense=False, zero_sent=True,
               k_of=None, divide_by=None, as_future=True):
    """The solution's mechanism with one switch turned wrong at a time (with every
    switch right, it is the solution)."""
    import math

    import torch
    import torch.distributed as dist

    errors = {}

    def hook(flat, group=None):
        n = dist.get_world_size(group)
        acc = flat + errors.get(flat.data_ptr(), 0) if feedback else flat.clone()
        if dense:  # average densely, then sparsify: sends every element
            dist.all_reduce(acc, group=group)
        k = (k_of or (lambda r, n: math.ceil(r * n)))(ratio, acc.numel())
        idx = acc.abs().topk(k).indices
        vals = acc[idx]
        errors[flat.data_ptr()] = acc.index_fill(0, idx, 0.0) if zero_sent else acc.clone()
        all_idx = [torch.empty_like(idx) for _ in range(n)]
        all_vals = [torch.empty_like(vals) for _ in range(n)]
        dist.all_gather(all_idx, idx, group=group)
        dist.all_gather(all_vals, vals, group=group)
        out = torch.zeros_like(flat)
        for i, v in zip(all_idx, all_vals):
            out.index_add_(0, i, v)
        value = flat.copy_(out / (divide_by or n) if average else out)
        if not as_future:
            return value
        fut = torch.futures.Future()
        fut.set_result(value)
        return fut

    return hook


def _topk_dense_gather(ratio):
    """Plausible detour: each rank's top k written into a dense vector, and the dense
    vectors all-gathered (imported by name): the right mean, (N - 1) x the bucket on the
    wire, more than the all-reduce it replaces."""
    import math

    import torch
    from torch.distributed import all_gather, get_world_size

    errors = {}

    def hook(flat, group=None):
        acc = flat + errors.get(flat.data_ptr(), 0)
        idx = acc.abs().topk(math.ceil(ratio * acc.numel())).indices
        msg = torch.zeros_like(acc)
        msg[idx] = acc[idx]
        errors[flat.data_ptr()] = acc - msg
        parts = [torch.empty_like(msg) for _ in range(get_world_size(group))]
        all_gather(parts, msg, group=group)
        fut = torch.futures.Future()
        fut.set_result(flat.copy_(torch.stack(parts).sum(0) / len(parts)))
        return fut

    return hook


def _no_root_prefetch(fsdp, i, phase):  # skips the root's call (i = -1): block 0 never prefetched
    j = i + 1 if phase == "forward" else i - 1
    if i >= 0 and 0 <= j < len(fsdp.units):
        fsdp.gather_async(fsdp.units[j])


def _pairs_only(spans):  # inclusion-exclusion stopped at pairs: sum minus pairwise overlaps
    total = sum(b - a for a, b in spans)
    for i, (a, b) in enumerate(spans):
        for c, d in spans[i + 1:]:
            total -= max(0.0, min(b, d) - max(a, c))
    return total


def _topk_shared_error(ratio):
    """The solution with one error tensor for the hook, not one per bucket: bucket 2's
    message carries what bucket 1 left out (its own error goes to bucket 1 next)."""
    import math

    import torch
    import torch.distributed as dist

    state = {"error": None}

    def hook(flat, group=None):
        n = dist.get_world_size(group)
        acc = flat + state["error"] if state["error"] is not None else flat.clone()
        idx = acc.abs().topk(math.ceil(ratio * acc.numel())).indices
        vals = acc[idx]
        state["error"] = acc.index_fill(0, idx, 0.0)
        all_idx = [torch.empty_like(idx) for _ in range(n)]
        all_vals = [torch.empty_like(vals) for _ in range(n)]
        dist.all_gather(all_idx, idx, group=group)
        dist.all_gather(all_vals, vals, group=group)
        out = torch.zeros_like(flat)
        for i, v in zip(all_idx, all_vals):
            out.index_add_(0, i, v)
        fut = torch.futures.Future()
        fut.set_result(flat.copy_(out / n))
        return fut

    return hook


class TestChapter16(ChapterChecks):
    lab, sol = "labs/16_comm_overlap_lab.ipynb", "solutions/16_comm_overlap_solution.ipynb"
    checks = {
        "union_length": Check(ch16.check_union_length),
        "prefetch": Check(ch16.check_prefetch),
        "topk_ef_hook": Check(ch16.check_topk_ef_hook, wire=True),
    }
    wrong = [
        Wrong("union_length", lambda spans: sum(b - a for a, b in spans),
              "a plain sum of the spans", says="plain sum"),
        Wrong("union_length", _no_sort, "merges without sorting", says=None),
        Wrong("prefetch", _same_direction, "prefetches i + 1 in backward too",
              says="bytes sent|backward"),
        Wrong("prefetch", _everything, "gathers every unit at once", says=None),
        Wrong("topk_ef_hook", partial(_topk_hook, feedback=False), "no error feedback",
              says="without error feedback"),
        Wrong("topk_ef_hook", partial(_topk_hook, average=False), "the sum, not the average",
              says="the sum"),
        Wrong("topk_ef_hook", partial(_topk_hook, dense=True), "averages densely first",
              says="dense all_reduce refused"),
        Wrong("union_length", _last_end, "keeps the last end, not the furthest",
              says=r"\(4.0, 5.0\)\]\) = 11.0"),
        Wrong("union_length", _first_span, "spans[0] on no spans", says="raised IndexError"),
        Wrong("union_length", _merged_spans, "returns the merged spans", says="expected a number"),
        Wrong("prefetch", _just_ran, "prefetches the unit that just ran", says="not issued"),
        Wrong("topk_ef_hook", partial(_topk_hook, k_of=lambda r, n: int(r * n)),
              "k rounded down", says="round up"),
        Wrong("topk_ef_hook", _topk_dense_gather, "a dense vector of the top k, all-gathered",
              says="handed 180 bytes to all_gather.*k = 5 values and their indices"),
        Wrong("topk_ef_hook", partial(_topk_hook, divide_by=2), "divides by a fixed 2",
              says="3 ranks, rank 0, call 1"),
        Wrong("topk_ef_hook", partial(_topk_hook, as_future=False), "returns the tensor",
              says="not a torch.futures.Future"),
        Wrong("topk_ef_hook", partial(_topk_hook, zero_sent=False),
              "keeps the sent values in the error", says="the error you keep"),
        Wrong("prefetch", _private_gather, "fsdp._gather: a private synchronous gather",
              says="FSDP's own internal"),
        Wrong("prefetch", _async_then_wait, "gather_async, then waits for it",
              says="waited for"),
        Wrong("prefetch", _default_prefetch, "FSDP's own next_unit_prefetch",
              says="switched off in this check"),
        Wrong("union_length", _course_union, "helpers.overlap.union_length called",
              says="switched off in this check"),
        Wrong("prefetch", _no_root_prefetch, "skips the root's prefetch (i = -1)",
              says="i = -1"),
        Wrong("union_length", _pairs_only, "inclusion-exclusion stopped at pairs",
              says="stopped at pairs"),
        Wrong("topk_ef_hook", _topk_shared_error, "one error tensor shared by all buckets",
              says="per bucket"),
        Wrong("topk_ef_hook", _course_topk, "the course's TopKHook returned",
              says="switched off in this check"),
    ]
