"""Checks for chapter 15: an FSDP unit's gather and free, and the hooks that call them.

The harness (``Unit``, ``make_unit``) is given; the learner writes

* ``gather(unit)``: grow ``unit.full``'s storage back to full size and
  all-gather every rank's ``unit.shard`` into it (``unit.group``);
* ``free(unit)``: shrink ``unit.full``'s storage to 0 bytes;
* ``attach(module, unit, gather, free)``: hooks so that ``module``'s weights exist only while
  it runs: gather before forward, free after forward, gather again when
  backward reaches the module's output. (The check frees after backward.)

* ``post_backward(unit, free) -> grad_shard``: called once every gradient of
  the unit exists in backward: lay the gradients out as the unit's flat
  buffer is laid out (zero padding at the end), average over ranks with one
  reduce-scatter, drop the full gradients (``p.grad = None``), free the unit,
  and return this rank's averaged chunk.

The checks run on 3 ranks and on 4 (a block's 9,636 elements are not a multiple
of 3, so skipped padding fails; gather/free on 4 ranks runs in two groups of 2
passed as ``unit.group``, so a collective without ``group=`` fails). They train
the toy GPT with one unit per block (plus a root unit that the check keeps
gathered), reduce-scatter the gradients themselves, and compare with one
process; they also watch the storage of every unit: the *original* ``full``
tensor's, which the module's parameters view, so rebinding ``unit.full`` to a
new empty tensor does not count as freeing it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from helpers.checks import CheckFailed, on_ranks, passed
from helpers.checks.course_answers import refusing
from helpers.tolerance import within_fp32_noise


@dataclasses.dataclass
class Unit:
    """One FSDP unit: ``params`` are views into ``full`` (padded, flat);
    ``shard`` is this rank's chunk ``full[r * c:(r + 1) * c]``."""

    params: list
    full: torch.Tensor   # (padded,) fp32; its storage is 0 bytes while freed
    shard: torch.Tensor  # (padded / N,)
    group: object = None


def make_unit(params: list[nn.Parameter], world_size: int, rank: int, group=None) -> Unit:
    """Flatten ``params`` into one padded buffer, keep chunk ``rank``, free the rest."""
    numel = sum(p.numel() for p in params)
    padded = -(-numel // world_size) * world_size
    full = torch.zeros(padded)
    off = 0
    with torch.no_grad():
        for p in params:
            full[off:off + p.numel()].copy_(p.reshape(-1))
            p.data = full[off:off + p.numel()].view_as(p)
            off += p.numel()
    c = padded // world_size
    shard = full[rank * c:(rank + 1) * c].clone()
    full.untyped_storage().resize_(0)
    return Unit(list(params), full, shard, group)


# the course's own answers to the exercises, switched off while the learner's code runs
_UNIT_HELPERS = {"helpers.comm.alloc_storage": "", "helpers.comm.free_storage": "",
                 "helpers.unit_gather.start_gather": "", "helpers.unit_gather.UnitBuffer": ""}


# A rank error that means the learner used a weight while its storage was freed.
FREED_HINT = {"storage of size 0": "a weight was used while freed: gather before the module's "
              "forward, and again before its backward (a hook on the forward output)."}


def is_gathered(unit: Unit) -> bool:
    return unit.full.untyped_storage().nbytes() > 0


WORLDS = (3, 4)


def _run_gather_free(gather, free, split):
    import torch.distributed as dist

    from helpers import rank_info
    r = rank_info()
    group, n, rank = None, r.world_size, r.rank
    if split:  # two groups of 2: every rank creates both
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, n, rank = pairs[r.rank // 2], 2, r.rank % 2
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to(r.device)  # 10 elements: padded to 12 on 3 ranks and on 2
    want = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()]).clone()
    unit = make_unit([lin.weight, lin.bias], n, rank, group)
    original = unit.full  # what the Linear's parameters view
    states = [is_gathered(unit)]
    with refusing(exercise="gather/free", paths=_UNIT_HELPERS):
        gather(unit)
    rebound_by_gather = unit.full is not original
    states.append(original.untyped_storage().nbytes() > 0)
    got = original[:10].clone() if states[-1] else None
    # Read the Linear's own weight only if its storage has bytes (reading a
    # 0-byte storage through a view would crash the rank, not raise).
    weight_ok = (lin.weight.untyped_storage().nbytes() > 0
                 and torch.equal(lin.weight.detach().reshape(-1), want[:8]))
    # Gather again: an already gathered unit needs nothing. A mark written into the
    # buffer survives only if no second all-gather overwrote it.
    regathered = None
    if states[-1]:
        with torch.no_grad():
            original.fill_(-7.0)
        with refusing(exercise="gather/free", paths=_UNIT_HELPERS):
            gather(unit)
        regathered = bool((original != -7.0).any())
    with refusing(exercise="gather/free", paths=_UNIT_HELPERS):
        free(unit)
    states.append(original.untyped_storage().nbytes() > 0)
    return {"states": states, "got": got, "want": want, "weight_ok": weight_ok,
            "rebound": unit.full is not original, "rebound_by_gather": rebound_by_gather,
            "regathered": regathered,
            "param_bytes": lin.weight.untyped_storage().nbytes()}


def check_gather_free(gather, free) -> None:
    """A Linear(4, 2), 10 elements, padded to 12: on 3 ranks (4 per rank), and on 4
    ranks in two groups of 2 (6 per rank) passed as ``unit.group``.

    Catches:
    * gathers into a new tensor (``unit.full = torch.empty(...)``): the Linear's
      weight does not see the values (named);
    * fills without growing the storage first: still 0 bytes (named);
    * all_gather without ``group=unit.group``: the 4-rank run mixes the two groups
      (wrong values or a size error on the ranks);
    * no already-gathered guard: a second gather all-gathers again (a mark written
      into the gathered buffer is overwritten; named);
    * free keeps the bytes; free rebinds ``unit.full`` to an empty tensor, so the
      parameters' storage is never released: both named;
    * any exception (None unit fields misused, a shape error): the rank's error;
    * ``helpers.comm``'s storage helpers or ``helpers.unit_gather`` doing the work:
      switched off while it runs.
    """
    for world in WORLDS:
        split = world == 4
        res = on_ranks(_run_gather_free, world, gather, free, split,
                       what=f"gather/free on {world} ranks" + (" in two groups" if split else ""),
                       probe=lambda: (gather(None), free(None)), hints=FREED_HINT)
        where = f"{world} ranks" + (" in two groups of 2" if split else "")
        for rank, out in enumerate(res):
            if out["rebound_by_gather"]:
                raise CheckFailed(f"{where}, rank {rank}: gather replaced unit.full with a new "
                                  f"tensor; the Linear's parameters still view the old, empty "
                                  f"storage. Fill unit.full in place: grow its storage, then "
                                  f"all_gather into it")
            if out["states"][1] is not True:
                raise CheckFailed(f"{where}, rank {rank}: after gather the storage the "
                                  f"parameters view is still 0 bytes; grow it with "
                                  f"unit.full.untyped_storage().resize_(numel * 4) first, and "
                                  f"keep unit.full the same tensor")
            if out["got"] is None or not torch.equal(out["got"], out["want"]):
                raise CheckFailed(f"{where}, rank {rank}: after gather unit.full is not every "
                                  f"rank's shard in rank order (all_gather(unit.full, "
                                  f"unit.shard, group=unit.group))")
            if not out["weight_ok"]:
                raise CheckFailed(f"{where}, rank {rank}: the Linear's weight does not see the "
                                  f"gathered values: fill unit.full in place, do not replace it")
            if out["regathered"]:
                raise CheckFailed(f"{where}, rank {rank}: gather on a unit that is already "
                                  f"gathered ran the all-gather again (the buffer was "
                                  f"overwritten). A gathered unit needs nothing: return early "
                                  f"(is_gathered(unit)), as FSDP does for a unit a prefetch "
                                  f"already brought in")
            if out["rebound"]:
                raise CheckFailed(f"{where}, rank {rank}: free replaced unit.full with another "
                                  f"tensor; the parameters still view the old one, whose "
                                  f"{out['param_bytes']:,} bytes are still held. Shrink the "
                                  f"storage in place: unit.full.untyped_storage().resize_(0)")
            if out["states"][2] is not False:
                raise CheckFailed(f"{where}, rank {rank}: after free the storage still holds "
                                  f"bytes; shrink it to 0 with resize_(0)")
            if out["param_bytes"]:
                raise CheckFailed(f"{where}, rank {rank}: after free unit.full is empty, but "
                                  f"the Linear's parameters still view {out['param_bytes']:,} "
                                  f"bytes: unit.full was given another storage (as "
                                  f"`unit.full.data = ...` does) and the old one, which the "
                                  f"parameters view, stays alive. Shrink the storage itself: "
                                  f"unit.full.untyped_storage().resize_(0)")
    passed("gather fills the full buffer in place from padded shards (3 ranks, and two groups "
           "of 2); free returns the storage the parameters view to 0 bytes")


def _run_attach(gather, free, attach, steps):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model
    from helpers.comm import reduce_scatter

    r = rank_info()
    N, B = r.world_size, 2
    data = make_dataset(num_sequences=64, seq_len=16)
    model = build_model("toy", seed=0)
    units = [make_unit(list(b.parameters()), N, r.rank) for b in model.blocks]
    originals = [u.full for u in units]  # a rebound unit.full is not a freed one
    for blk, u in zip(model.blocks, units):
        attach(blk, u, gather, free)
    gathered_after_own_forward, gathered_after_forward = [], []
    for blk, o in zip(model.blocks, originals):  # runs after the learner's hooks
        blk.register_forward_hook(
            lambda m, a, out, o=o: gathered_after_own_forward.append(_holds(o)))
    blocks = {id(p) for u in units for p in u.params}
    root = [p for p in model.parameters() if id(p) not in blocks]  # kept replicated
    for s in range(steps):
        x, y = data.batch(range(s * B * N, (s + 1) * B * N))
        loss = model(x[r.rank * B:(r.rank + 1) * B], y[r.rank * B:(r.rank + 1) * B])[1]
        gathered_after_forward.append([_holds(o) for o in originals])
        loss.backward()
        with torch.no_grad():
            for u in units:  # reduce-scatter the block grads, SGD on the shard, free
                g = torch.zeros(u.full.numel())
                off = 0
                for p in u.params:
                    g[off:off + p.numel()] = p.grad.reshape(-1) / N
                    off += p.numel()
                    p.grad = None
                out = torch.empty_like(u.shard)
                reduce_scatter(out, g)
                u.shard -= 0.1 * out
                free(u)
            for p in root:
                p.grad /= N
                dist.all_reduce(p.grad)
                p -= 0.1 * p.grad
                p.grad = None
    for u in units:
        gather(u)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"weights": weights, "own": gathered_after_own_forward,
            "after": gathered_after_forward}



def _holds(original: torch.Tensor) -> bool:
    """Whether the unit's original ``full`` (the storage its parameters view) holds bytes."""
    return original.untyped_storage().nbytes() > 0


def _sgd_reference(steps: int, world: int):
    """The toy GPT after `steps` SGD steps (lr 0.1, batches of 2 per rank) on one
    process, in float32 and in float64 (the exact answer, to ~1e-16): what the ranks
    must match."""
    from helpers.data import make_dataset
    from helpers.model import build_model

    data = make_dataset(num_sequences=64, seq_len=16)
    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    b = 2 * world
    for s in range(steps):
        x, y = data.batch(range(s * b, (s + 1) * b))
        for model in (ref, ref64):
            model(x, y)[1].backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    return ref, ref64


def check_attach(gather, free, attach) -> None:
    """3 and 4 ranks, toy GPT, one unit per block, 2 SGD steps vs one process.

    Catches:
    * no gather before backward (forward hooks only): a freed weight used (hint);
    * never frees, or frees by rebinding unit.full: weights still held after the
      block's forward (named);
    * gathers only once per step / stale weights: training differs (named);
    * returns a tensor from the output's gradient hook (replacing the gradient),
      or gathers in the wrong hook: training differs or a freed weight is used;
    * any exception from the hooks: the rank's error, as CheckFailed.
    """
    for world in WORLDS:
        res = on_ranks(_run_attach, world, gather, free, attach, 2, what=f"attach on {world} ranks",
                       probe=lambda: attach(nn.Linear(1, 1), None, gather, free),
                       hints=FREED_HINT)
        ref, ref64 = _sgd_reference(2, world)
        want64 = dict(ref64.named_parameters())
        for rank, out in enumerate(res):
            if any(out["own"]):
                raise CheckFailed(f"{world} ranks, rank {rank}: a block's weights were still "
                                  f"held after its forward; free them in a forward hook "
                                  f"(shrink the storage, don't rebind unit.full)")
            if any(any(a) for a in out["after"]):
                raise CheckFailed(f"{world} ranks, rank {rank}: weights stayed gathered after "
                                  f"the forward pass")
            for n, p in ref.named_parameters():
                # N ranks: the gradient sums differ from one process's only by fp32
                # rounding, so as close to float64 as the fp32 reference is
                if not within_fp32_noise(out["weights"][n], p.detach(), want64[n].detach())[0]:
                    raise CheckFailed(f"{world} ranks, rank {rank}: {n} differs from one "
                                      f"process after 2 SGD steps: are the gathered weights "
                                      f"the current ones, and does the gradient hook return "
                                      f"None?")
    passed("each block's weights live only during its forward and backward; training equals "
           "one process (3 and 4 ranks)")


def _ref_gather(unit: Unit) -> None:
    from helpers.comm import all_gather
    if not is_gathered(unit):
        unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
        all_gather(unit.full, unit.shard, group=unit.group)


def _ref_free(unit: Unit) -> None:
    unit.full.untyped_storage().resize_(0)


def _ref_attach(module: nn.Module, unit: Unit) -> None:
    def post_forward(mod, args, output):
        _ref_free(unit)
        if output.requires_grad:
            output.register_hook(lambda grad: _ref_gather(unit))

    module.register_forward_pre_hook(lambda mod, args: _ref_gather(unit))
    module.register_forward_hook(post_forward)


def _run_post_backward(post_backward, steps, own_group=False):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.checks.groups import GroupWatch
    from helpers.data import make_dataset
    from helpers.model import build_model

    r = rank_info()
    N, B = r.world_size, 2
    data = make_dataset(num_sequences=64, seq_len=16)
    model = build_model("toy", seed=0)
    # own_group: the units' group is a group object of their own (the same ranks), so a
    # collective that leaves out group=unit.group is seen (it would run on the default
    # group: the same numbers here, another group of ranks in a real job)
    group = dist.new_group(list(range(N))) if own_group else None
    units = [make_unit(list(b.parameters()), N, r.rank, group) for b in model.blocks]
    for blk, u in zip(model.blocks, units):
        _ref_attach(blk, u)
    refused = {
        "all_reduce": "FSDP reduce-scatters a unit's gradients (an all-reduce sends twice "
                      "the bytes and leaves full gradients)",
        "all_gather_into_tensor": "post_backward only reduce-scatters: nothing is gathered "
                                  "after backward",
        "all_gather": "post_backward only reduce-scatters: nothing is gathered after backward"}
    shards, calls, problems = {}, [], []

    def on_grad(p, u, i):
        if all(q.grad is not None for q in u.params):  # the unit's last gradient
            # refused however spelled (dist.x, an imported name, helpers.comm's own)
            with GroupWatch(group, refused), \
                    refusing(exercise="post_backward", paths=_UNIT_HELPERS):
                out = post_backward(u, _ref_free)
            calls.append(i)
            if is_gathered(u):
                problems.append(f"unit {i} was still gathered after post_backward: free it")
            if any(q.grad is not None for q in u.params):
                problems.append(f"unit {i}'s full gradients were still in p.grad after "
                                f"post_backward: drop them once they are reduce-scattered")
            shards[i] = out

    for i, u in enumerate(units):
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: on_grad(p, u, i))
    blocks = {id(p) for u in units for p in u.params}
    root = [p for p in model.parameters() if id(p) not in blocks]  # kept replicated
    for s in range(steps):
        x, y = data.batch(range(s * B * N, (s + 1) * B * N))
        model(x[r.rank * B:(r.rank + 1) * B], y[r.rank * B:(r.rank + 1) * B])[1].backward()
        if problems:
            return {"problems": problems}
        with torch.no_grad():
            for i, u in enumerate(units):
                g = shards.pop(i, None)
                if not torch.is_tensor(g) or g.shape != u.shard.shape:
                    return {"problems": [f"post_backward returned "
                                         f"{None if not torch.is_tensor(g) else tuple(g.shape)}"
                                         f" for unit {i}, not its chunk of shape "
                                         f"{tuple(u.shard.shape)}"]}
                u.shard -= 0.1 * g  # SGD on the shard
            for p in root:
                p.grad /= N
                dist.all_reduce(p.grad)
                p -= 0.1 * p.grad
                p.grad = None
    for u in units:
        _ref_gather(u)
    return {"problems": [], "calls": calls,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check_post_backward(post_backward) -> None:
    """3 and 4 ranks, toy GPT, one unit per block, 2 SGD steps vs one process; your
    post_backward is called from inside backward, when a unit's last gradient
    has been accumulated.

    Catches:
    * the sum, not the average: training differs (named);
    * keeps p.grad, or never frees the unit: named;
    * all-reduce then a slice, or any all-gather: refused (named);
    * no padding / another layout than the unit's: a chunk of the wrong shape at
      3 ranks, or wrong values (named);
    * returns None or the whole buffer: named;
    * the reduce-scatter without ``group=unit.group`` (on 4 ranks the units have a group
      object of their own): refused before it runs, named;
    * any exception: the rank's error, as CheckFailed.
    """
    for world in WORLDS:
        res = on_ranks(_run_post_backward, world, post_backward, 2, world == 4,
                       what=f"post_backward on {world} ranks",
                       probe=lambda: post_backward(None, _ref_free), hints=FREED_HINT)
        ref, ref64 = _sgd_reference(2, world)
        want64 = dict(ref64.named_parameters())
        for rank, out in enumerate(res):
            if out["problems"]:
                raise CheckFailed(f"{world} ranks, rank {rank}: {out['problems'][0]}")
            if out["calls"] != [1, 0, 1, 0]:  # backward reaches the last block first
                raise CheckFailed(f"{world} ranks, rank {rank}: post_backward ran for units "
                                  f"{out['calls']}, expected [1, 0, 1, 0] (once per unit per "
                                  f"backward)")
            for n, p in ref.named_parameters():
                # N ranks: the gradient sums differ from one process's only by fp32
                # rounding, so as close to float64 as the fp32 reference is
                ok, _, _ = within_fp32_noise(out["weights"][n], p.detach(), want64[n].detach())
                if not ok:
                    diff = (out["weights"][n] - p.detach()).abs().max().item()
                    raise CheckFailed(f"{world} ranks, rank {rank}: {n} differs from one "
                                      f"process after 2 SGD steps by {diff:.2e}: is the chunk "
                                      f"the *average* over ranks, laid out in the unit's "
                                      f"parameter order with the padding at the end?")
    passed("each unit's gradients reduce-scattered and dropped inside backward, the unit freed; "
           "training equals one process (3 and 4 ranks)")
