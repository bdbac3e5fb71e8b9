"""Chapter 15's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch15
from helpers.zero import all_gather


def _gather_new_tensor(unit):
    # Plausible mistake: a fresh tensor instead of the same storage; the
    # module's parameters still point at the old, empty storage.
    unit.full = torch.empty(unit.full.numel())
    all_gather(unit.full, unit.shard, group=unit.group)


def _free(unit):
    unit.full.untyped_storage().resize_(0)


def _attach_forward_only(module, unit, gather, free):
    module.register_forward_pre_hook(lambda m, a: gather(unit))
    module.register_forward_hook(lambda m, a, o: free(unit))


def _attach_no_free(module, unit, gather, free):
    module.register_forward_pre_hook(lambda m, a: gather(unit))


def _post_backward(average=True, drop=True, free_unit=True, all_reduce=False):
    """The solution's mechanism with one switch turned wrong at a time."""
    import torch.distributed as dist

    from helpers.zero import reduce_scatter

    def post_backward(unit, free):
        N, r = dist.get_world_size(unit.group), dist.get_rank(unit.group)
        flat = torch.zeros(unit.full.numel())
        off = 0
        for p in unit.params:
            flat[off:off + p.numel()] = p.grad.reshape(-1) / (N if average else 1)
            off += p.numel()
            if drop:
                p.grad = None
        if all_reduce:
            dist.all_reduce(flat, group=unit.group)
            chunk = flat.chunk(N)[r].clone()
        else:
            chunk = torch.empty_like(unit.shard)
            reduce_scatter(chunk, flat, group=unit.group)
        if free_unit:
            free(unit)
        return chunk

    return post_backward


class TestChapter15(ChapterChecks):
    lab, sol = "labs/15_fsdp_lab.ipynb", "solutions/15_fsdp_solution.ipynb"
    checks = {
        "gather_free": Check(ch15.check_gather_free, "gather", "free"),
        # gather and free have their own check: only attach's stub here
        "attach": Check(ch15.check_attach, "gather", "free", "attach", stubs=("attach",)),
        "post_backward": Check(ch15.check_post_backward),
    }
    # a wrong answer replaces some of the exercises a check takes; the others are the solution's
    wrong = [
        Wrong("gather_free", {"gather": _gather_new_tensor, "free": _free},
              "gathers into a new tensor", says="in place"),
        Wrong("gather_free", {"free": lambda unit: None}, "free keeps the bytes", says="resize_"),
        Wrong("attach", {"attach": _attach_forward_only}, "no gather before backward",
              says="again before its backward"),
        Wrong("attach", {"attach": _attach_no_free}, "never frees", says="still gathered"),
        Wrong("post_backward", _post_backward(average=False), "the sum, not the average",
              says="average"),
        Wrong("post_backward", _post_backward(drop=False), "keeps p.grad",
              says="still in p.grad"),
        Wrong("post_backward", _post_backward(free_unit=False), "never frees the unit",
              says="still gathered"),
        Wrong("post_backward", _post_backward(all_reduce=True), "all-reduce, then keep a slice",
              says="all_reduce refused"),
    ]
