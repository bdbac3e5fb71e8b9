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


def _gather_via_course(unit):   # the course's UnitBuffer machinery does it
    from helpers.comm import alloc_storage, is_allocated
    if is_allocated(unit.full):
        return
    alloc_storage(unit.full)
    all_gather(unit.full, unit.shard, group=unit.group)


def _free_via_course(unit):
    from helpers.comm import free_storage
    free_storage(unit.full)


def _free(unit):
    unit.full.untyped_storage().resize_(0)


def _free_rebinds(unit):  # a new empty tensor: the parameters still hold the old storage
    unit.full = torch.empty(0)


def _gather_no_group(unit):  # the all-gather over the whole world, not unit.group
    if unit.full.untyped_storage().nbytes() > 0:
        return
    unit.full.untyped_storage().resize_(unit.full.numel() * 4)
    all_gather(unit.full, unit.shard)


def _gather_every_time(unit):  # no already-gathered guard: all-gathers on every call
    unit.full.untyped_storage().resize_(unit.full.numel() * 4)
    all_gather(unit.full, unit.shard, group=unit.group)


def _gather_no_resize(unit):  # fills the 0-byte storage without growing it first
    all_gather(unit.full, unit.shard, group=unit.group)


def _attach_returns_grad(module, unit, gather, free):  # the output hook returns a tensor
    def post(m, a, o):
        free(unit)
        if o.requires_grad:
            o.register_hook(lambda g: (gather(unit), g * 0)[1])
    module.register_forward_pre_hook(lambda m, a: gather(unit))
    module.register_forward_hook(post)


def _attach_no_free_rebinds(module, unit, gather, free):  # "frees" by rebinding
    def post(m, a, o):
        unit.full.untyped_storage()  # the learner's free, written inline: rebinds
        keep = unit.full
        unit.full = torch.empty(0)
        if o.requires_grad:
            o.register_hook(lambda g: (setattr(unit, "full", keep), gather(unit), None)[2])
    module.register_forward_pre_hook(lambda m, a: gather(unit))
    module.register_forward_hook(post)


def _attach_forward_only(module, unit, gather, free):
    module.register_forward_pre_hook(lambda m, a: gather(unit))
    module.register_forward_hook(lambda m, a, o: free(unit))


def _attach_no_free(module, unit, gather, free):
    module.register_forward_pre_hook(lambda m, a: gather(unit))


def _post_backward(average=True, drop=True, free_unit=True, all_reduce=False, pad=True,
                   answer=True, gather_back=False, use_group=True):
    """The solution's mechanism with one switch turned wrong at a time."""
    import torch.distributed as dist

    from helpers.zero import reduce_scatter

    def post_backward(unit, free):
        N, r = dist.get_world_size(unit.group), dist.get_rank(unit.group)
        numel = sum(p.numel() for p in unit.params)
        flat = torch.zeros(unit.full.numel() if pad else numel // N * N)
        off = 0
        for p in unit.params:
            piece = p.grad.reshape(-1)[:max(0, flat.numel() - off)]
            flat[off:off + piece.numel()] = piece / (N if average else 1)
            off += p.numel()
            if drop:
                p.grad = None
        if all_reduce:
            dist.all_reduce(flat, group=unit.group)
            chunk = flat.chunk(N)[r].clone()
        else:
            chunk = torch.empty(flat.numel() // N)
            reduce_scatter(chunk, flat, group=unit.group if use_group else None)
        if gather_back:  # gathers the averaged gradient back: an all-gather too many
            whole = torch.empty(flat.numel())
            all_gather(whole, chunk, group=unit.group)
        if free_unit:
            free(unit)
        return chunk if answer else None

    return post_backward


def _free_by_data(unit):  # a new, empty storage for unit.full; the parameters keep the old
    import torch
    unit.full.data = torch.empty(0, device=unit.full.device)


class TestChapter15(ChapterChecks):
    lab, sol = "labs/15_fsdp_lab.ipynb", "solutions/15_fsdp_solution.ipynb"
    checks = {
        "gather_free": Check(ch15.check_gather_free, "gather", "free"),
        # gather and free have their own check: only attach's stub here
        "attach": Check(ch15.check_attach, "gather", "free", "attach", stubs=("attach",)),
        "post_backward": Check(ch15.check_post_backward, wire=True),
    }
    # a wrong answer replaces some of the exercises a check takes; the others are the solution's
    wrong = [
        Wrong("gather_free", {"gather": _gather_new_tensor, "free": _free},
              "gathers into a new tensor", says="in place"),
        Wrong("gather_free", {"free": _free_by_data}, "free swaps unit.full.data",
              says="parameters still view 48 bytes"),
        Wrong("gather_free", {"free": lambda unit: None}, "free keeps the bytes", says="resize_"),
        Wrong("gather_free", {"free": _free_rebinds}, "free rebinds unit.full",
              says="replaced unit.full"),
        Wrong("gather_free", {"gather": _gather_every_time}, "gathers an already gathered unit",
              says="already gathered"),
        Wrong("gather_free", {"gather": _gather_no_group}, "all_gather without group=",
              says="in two groups"),
        Wrong("gather_free", {"gather": _gather_no_resize}, "no resize before the all-gather",
              says="gather/free on 3 ranks failed on a rank|still 0 bytes"),
        Wrong("gather_free", {"gather": lambda unit: unit.shard.view(5, -1)},
              "raises a RuntimeError", says="raised RuntimeError"),
        Wrong("attach", {"attach": _attach_returns_grad}, "the output hook returns a tensor",
              says="gradient hook return"),
        Wrong("attach", {"attach": _attach_no_free_rebinds}, "frees by rebinding unit.full",
              says="still held after its forward"),
        Wrong("post_backward", _post_backward(pad=False), "no padding", says="not its chunk"),
        Wrong("post_backward", _post_backward(answer=False), "returns None",
              says="returned None"),
        Wrong("post_backward", _post_backward(gather_back=True), "gathers the gradient back",
              says=r"all_gather\w* refused"),
        Wrong("attach", {"attach": _attach_forward_only}, "no gather before backward",
              says="again before its backward"),
        Wrong("attach", {"attach": _attach_no_free}, "never frees", says="still held"),
        Wrong("post_backward", _post_backward(average=False), "the sum, not the average",
              says="average"),
        Wrong("post_backward", _post_backward(drop=False), "keeps p.grad",
              says="still in p.grad"),
        Wrong("post_backward", _post_backward(free_unit=False), "never frees the unit",
              says="still gathered"),
        Wrong("post_backward", _post_backward(all_reduce=True), "all-reduce, then keep a slice",
              says="all_reduce refused"),
        Wrong("post_backward", _post_backward(use_group=False),
              "reduce-scatter without group=unit.group", says="without group=group"),
        Wrong("gather_free", {"gather": _gather_via_course, "free": _free_via_course},
              "the course's storage helpers and start_gather", says="switched off in this check"),
    ]
