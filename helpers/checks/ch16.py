"""Checks for chapter 16: the length of a union of spans, FSDP prefetch, and a
top-k communication hook with error feedback.

Learner contracts:

* ``union_length(spans) -> float``: total time covered by possibly
  overlapping ``(start, end)`` spans (overlaps counted once).
* ``prefetch(fsdp, i, phase)``: called by ``helpers.fsdp.FSDP`` right after
  unit ``i`` has been gathered (``phase`` "forward" or "backward"; in forward
  i = -1 means the root, just before block 0). Start the all-gather of the
  unit that runs next with ``fsdp.gather_async(fsdp.units[j])``.
* ``topk_ef_hook(ratio) -> hook``; ``hook(flat_grad, group=None)`` returns a
  ``torch.futures.Future`` holding the bucket's new value: the mean over
  ranks of every rank's k = ceil(ratio * numel) largest-magnitude entries of
  (gradient + the error it kept from earlier calls on that bucket), and it
  keeps as its error what it did not send. The ranks exchange only their k
  values and indices (a dense ``all_reduce`` of the bucket is refused).
"""

from __future__ import annotations

import math

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.checks.course_answers import refusing
from helpers.tolerance import reorder_bound

UNION_CASES = [
    ([], 0.0),
    ([(0.0, 1.0)], 1.0),
    ([(0.0, 1.0), (2.0, 3.5)], 2.5),
    ([(0.0, 2.0), (1.0, 3.0)], 3.0),            # overlap counted once
    ([(1.0, 3.0), (0.0, 2.0)], 3.0),            # unsorted
    ([(0.0, 10.0), (2.0, 3.0), (4.0, 5.0)], 10.0),  # nested
    ([(0.0, 1.0), (1.0, 2.0)], 2.0),            # touching
    ([(5.0, 6.0), (0.0, 1.0), (0.5, 5.5)], 6.0),
    ([(0.0, 1.0), (0.0, 1.0)], 1.0),            # the same span twice
    ([(0.0, 4.0), (1.0, 2.0), (3.0, 5.0)], 5.0),  # after a nested span, the end is still 4
    ([(2.0, 2.0)], 0.0),                        # an empty span
    # three spans over one time at once: inclusion-exclusion stopped at pairs subtracts
    # [2, 3] three times and adds it back never (9 - 5 = 4)
    ([(0.0, 3.0), (1.0, 4.0), (2.0, 5.0)], 5.0),
    # four at once: stopped at triples gives 16 - 14 + 6 = 8
    ([(0.0, 4.0), (1.0, 5.0), (2.0, 6.0), (3.0, 7.0)], 7.0),
]


def _inclusion_exclusion(spans, depth: int) -> float:
    """Inclusion-exclusion over the spans' overlaps, cut after ``depth``-fold terms (exact
    at depth = len(spans)): to name the learner's answer when it stops early."""
    from itertools import combinations

    total = 0.0
    for size in range(1, depth + 1):
        for group in combinations(spans, size):
            common = min(b for _, b in group) - max(a for a, _ in group)
            total += (-1) ** (size + 1) * max(0.0, common)
    return total


def check_union_length(union_length) -> None:
    """Catches:
    * a plain sum of the spans: named;
    * merging without sorting first: ``[(1, 3), (0, 2)]`` (named);
    * keeping the last span's end instead of the furthest end: ``[(0, 10), (2, 3), (4, 5)]``
      (and ``[(0, 4), (1, 2), (3, 5)]``);
    * counting a duplicate span twice: ``[(0, 1), (0, 1)]``;
    * inclusion-exclusion stopped at pairs (sum minus pairwise overlaps), right for every
      case where at most two spans overlap at once: three spans over [2, 3] (named), and
      four over [3, 4] for one stopped at triples;
    * failing on no spans (``max`` of nothing, ``spans[0]``): ``[]`` raises, named;
    * returns None or a non-number (a list of merged spans): named;
    * ``helpers.overlap.union_length`` itself called: switched off while it runs.
    """
    for spans, want in UNION_CASES:
        with refusing(exercise="union_length", paths={"helpers.overlap.union_length": ""}):
            got = attempt(union_length, list(spans), what=f"union_length({spans})")
        try:
            if isinstance(got, (bool, str)):  # float() takes them; the lab wants a number
                raise TypeError
            ok = abs(float(got) - want) < 1e-12
        except (TypeError, ValueError):
            raise CheckFailed(f"union_length({spans}) returned {got!r}, expected a number") \
                from None
        if not ok:
            hint = ""
            if abs(float(got) - sum(b - a for a, b in spans)) < 1e-12:
                hint = " That is the plain sum: overlapping time must be counted once."
            elif cut := next((d for d in range(2, len(spans))
                              if abs(float(got) - _inclusion_exclusion(spans, d)) < 1e-12),
                             None):
                # a moment under m = cut + 1 spans is counted sum_{s <= cut} (-1)^(s+1) C(m, s)
                times = sum((-1) ** (s + 1) * math.comb(cut + 1, s) for s in range(1, cut + 1))
                hint = (f" That is inclusion-exclusion stopped at "
                        f"{'pairs' if cut == 2 else f'{cut}-fold overlaps'}: time that "
                        f"{cut + 1} spans cover at once is counted {times} times, not once. "
                        f"Sort the spans by start and merge them in one pass instead.")
            elif len(spans) > 1 and spans != sorted(spans):
                hint = " Sort the spans by start first."
            raise CheckFailed(f"union_length({spans}) = {got}, expected {want}.{hint}")
    passed("union length right: overlaps, nesting, touching and unsorted spans, three and "
           "four spans over the same time")


class _PublicFSDP:
    """What the learner's prefetch is handed: the FSDP wrapper's public face. Its
    attributes are the wrapper's own; a private one (``fsdp._gather``, a synchronous
    gather) is refused with a reason, as a rank error the check turns into its message."""

    def __init__(self, fsdp):
        object.__setattr__(self, "_fsdp", fsdp)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(
                f"fsdp.{name} is FSDP's own internal, not part of the prefetch contract: start "
                f"the next unit's gather with fsdp.gather_async(unit), which returns at once")
        return getattr(object.__getattribute__(self, "_fsdp"), name)


def _run_prefetch(prefetch):
    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.fsdp import FSDP
    from helpers.model import build_model
    from helpers.overlap import Timeline

    r = rank_info()
    data = make_dataset(num_sequences=64, seq_len=16)
    out = {}
    waited = []   # units the learner's prefetch gathered and waited for before returning
    root_idle = []  # forward passes whose root call (i = -1) left block 0 ungathered

    def watched(fsdp, i, phase):
        before = {id(u): u.gathered for u in fsdp.all_units}
        with refusing(exercise="prefetch", paths=_PREFETCHERS):
            prefetch(_PublicFSDP(fsdp), i, phase)
        # a gather launched here and already waited for: nothing was left to overlap
        waited.extend(f"{phase} {i}: {u.name}" for u in fsdp.all_units
                      if u.gathered and not before[id(u)] and u.pending is None)
        # the root's call comes after every unit was freed (a new forward starts clean):
        # block 0 is gathered or on its way after it only if this call started it
        if i == -1 and phase == "forward" and fsdp.units and not fsdp.units[0].gathered:
            root_idle.append(i)

    for name, pf in (("learner", watched), ("none", False)):
        tl = Timeline()
        model = FSDP(build_model("toy", seed=0, n_layer=3), prefetch=pf, timeline=tl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for s in range(2):
            tl.clear()
            x, y = data.batch(range(8 * s + 4 * r.rank, 8 * s + 4 * r.rank + 4))
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        out[name] = {"events": list(tl.events), "bytes": model.comm_bytes()["total"],
                     "peak": model.peak_gathered_bytes, "weights": model.full_parameters(),
                     "block": model.units[0].full.numel() * 4}
    out["waited"] = waited
    out["root_idle"] = len(root_idle)
    return out


# the course's own answer, switched off while the learner's prefetch runs
_PREFETCHERS = {"helpers.fsdp.next_unit_prefetch": "it is the course's answer to this "
                "exercise (FSDP's default prefetch): write it yourself"}


def _first(events, lane, name, key="start"):
    times = [e[key] for e in events if e["lane"] == lane and e["name"] == name]
    return min(times) if times else None


PREFETCH_WORLD = 3  # an odd world: nothing in prefetch depends on it, but a learner's
# rank-dependent shortcut would show


def check_prefetch(prefetch) -> None:
    """3 ranks, a 3-block toy GPT, 2 AdamW steps with your prefetch and without.

    Catches:
    * prefetches unit i + 1 in backward too (that unit already ran): extra bytes or no
      overlap in backward (named);
    * gathers every unit at once: the peak gathered memory (named);
    * prefetches nothing, or the unit that just ran: no overlap in forward (named);
    * skips the root's call (i = -1, before block 0): block 0 not gathered after it (named);
    * gathers synchronously (a private ``fsdp._gather``, or gather_async followed by a
      wait): refused, or seen (the unit's gather finished before prefetch returned), named;
    * FSDP's own ``next_unit_prefetch`` called: switched off while it runs;
    * changes what is gathered (a wrong unit): training differs (named);
    * any exception: the rank's error, as CheckFailed.
    """
    res = on_ranks(_run_prefetch, PREFETCH_WORLD, prefetch, what="prefetch", timeout=60,
                   probe=lambda: prefetch(None, 0, "forward"))
    for rank, out in enumerate(res):
        if out["waited"]:
            raise CheckFailed(f"rank {rank}: your prefetch gathered and then waited for "
                              f"{out['waited'][0].split(': ')[1]} before returning "
                              f"({len(out['waited'])} time(s); first at {out['waited'][0]}): "
                              f"a gather that is complete when prefetch returns has nothing "
                              f"left to overlap with the current unit's compute. Start it with "
                              f"fsdp.gather_async(unit) and return")
        mine, base = out["learner"], out["none"]
        for n, w in base["weights"].items():
            if not torch.equal(w, mine["weights"][n]):
                raise CheckFailed(f"rank {rank}: with your prefetch {n} trained differently; "
                                  f"prefetch may change when a gather starts, never what it "
                                  f"gathers")
        if mine["bytes"] != base["bytes"]:
            raise CheckFailed(f"rank {rank}: {mine['bytes']:,.0f} bytes sent per step with your "
                              f"prefetch, {base['bytes']:,.0f} without: prefetch a unit that "
                              f"is about to run (and not yet gathered), nothing else")
        if mine["peak"] > base["peak"] + mine["block"]:
            raise CheckFailed(f"rank {rank}: peak gathered bytes {mine['peak']:,} vs "
                              f"{base['peak']:,} without prefetch: prefetch only the next "
                              f"unit, not all of them")
        ev = mine["events"]
        for i in range(2):
            issued = _first(ev, "comm", f"all-gather blocks.{i + 1}")
            done = _first(ev, "compute", f"forward blocks.{i}", key="end")
            if issued is None or done is None or not issued < done:
                raise CheckFailed(f"rank {rank}: in forward, block {i + 1}'s all-gather was "
                                  f"not issued while block {i} ran (phase 'forward': unit i+1)")
        if out["root_idle"]:
            raise CheckFailed(f"rank {rank}: after prefetch(fsdp, -1, 'forward') block 0's "
                              f"all-gather had not started ({out['root_idle']} forward(s)): "
                              f"i = -1 is the root's call, made once the root (embeddings) is "
                              f"gathered and before block 0 runs; start fsdp.units[0] there, or "
                              f"block 0's gather overlaps nothing")
        for i in (2, 1):
            gathers = sorted(e["start"] for e in ev
                             if e["lane"] == "comm" and e["name"] == f"all-gather blocks.{i - 1}")
            bwd = [e for e in ev if e["lane"] == "compute" and e["name"] == f"backward blocks.{i}"]
            if len(gathers) < 2 or not bwd or not gathers[1] < bwd[0]["end"]:
                raise CheckFailed(f"rank {rank}: in backward, block {i - 1}'s all-gather was not "
                                  f"issued while block {i}'s backward ran (backward runs the "
                                  f"units in reverse: unit i-1 is next)")
    passed(f"next unit's gather issued under the current unit's compute, in forward (block 0's "
           f"from the root's call) and backward; same bytes, same weights "
           f"({PREFETCH_WORLD} ranks)")


# 45 elements at ratio 0.1: k = ceil(4.5) = 5, so int(), round() (4, to even) and
# floor all give another k; 40 would make every rounding agree on 4
TOPK_NUMEL, TOPK_RATIO, TOPK_STEPS = 45, 0.1, 4
TOPK_WORLDS = (3, 4)
# Two buckets, each its own buffer, called in turn every step as DDP calls its buckets.
# The same size on purpose: one error kept for the whole hook (not per bucket) then adds
# bucket 1's leftovers to bucket 2's gradient instead of failing on a shape.
TOPK_BUCKETS = 2


def _topk_grads(rank: int, step: int, bucket: int = 0) -> torch.Tensor:
    """Rank ``rank``'s gradient for ``bucket`` at ``step``: the same numbers on every
    rank, so each rank can compute every rank's message by hand."""
    seed = 100 * rank + step + 10_000 * bucket
    return torch.randn(TOPK_NUMEL, generator=torch.Generator().manual_seed(seed))


def _reference_messages(world: int, k: int | None = None,
                        bucket: int = 0) -> list[list[torch.Tensor]]:
    """messages[step][rank]: what each rank sends for ``bucket``, by the definition
    (error feedback: Stich et al. 2018; Lin et al. 2018, sec. 3.1), the error kept per
    bucket; ``k`` another count, to recognize a mistaken one."""
    k = k or math.ceil(TOPK_RATIO * TOPK_NUMEL)
    errors = [torch.zeros(TOPK_NUMEL) for _ in range(world)]
    out = []
    for step in range(TOPK_STEPS):
        msgs = []
        for r in range(world):
            acc = _topk_grads(r, step, bucket) + errors[r]
            idx = acc.abs().topk(k).indices
            msg = torch.zeros(TOPK_NUMEL)
            msg[idx] = acc[idx]
            errors[r] = acc - msg
            msgs.append(msg)
        out.append(msgs)
    return out


def _run_topk(make_hook):
    from helpers import rank_info
    from helpers.checks.spy import communication_spy

    dense = {"all_reduce": "dense all_reduce refused: top-k sends only its k values and "
                           "their indices (gather them from every rank)"}
    r = rank_info()
    with refusing(exercise="make_hook", paths={"helpers.compression.TopKHook": "it is the course's answer to "
                              "this exercise: write the hook yourself"}):
        hook = make_hook(TOPK_RATIO)
    # one buffer per bucket, reused every step (its data_ptr tells the buckets apart)
    bufs = [torch.empty(TOPK_NUMEL, device=r.device) for _ in range(TOPK_BUCKETS)]
    results, wire = [], []   # results[step][bucket]; wire[call], calls in order
    for step in range(TOPK_STEPS):
        results.append([])
        for b, buf in enumerate(bufs):
            buf.copy_(_topk_grads(r.rank, step, b))
            with communication_spy(refuse=dense, keep_values=False) as spy:
                fut = hook(buf, None)
                if not isinstance(fut, torch.futures.Future):
                    raise TypeError(f"the hook returned {type(fut).__name__}, not a "
                                    f"torch.futures.Future")
                value = fut.wait()
            wire.append((sorted({c.op for c in spy.calls}), spy.bytes()))
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"the hook's future holds {type(value).__name__}, not the "
                                f"bucket's new value (a tensor)")
            results[-1].append(value.clone())
    return results, wire


def check_topk_ef_hook(topk_ef_hook) -> None:
    """3 and 4 ranks, two 45-element buckets (two buffers, called in turn), 4 calls each,
    k = ceil(4.5) = 5: every result against the mean of the messages computed by the
    definition, each bucket with its own error.

    Catches:
    * no error feedback: from call 2 on, plain top-k's mean (named);
    * the sum, not the mean: named;
    * a dense all-reduce (average, then sparsify): refused (named);
    * keeps the sent values in the error: named ("the error you keep");
    * k rounded down or to nearest (``int(ratio * n)``, ``round``): 4 entries, not 5;
    * divides by a fixed 2: wrong at 3 and 4 ranks;
    * returns the tensor, not a Future; a Future of None: named;
    * one error kept for the whole hook, not per bucket: bucket 2's first call carries
      bucket 1's leftovers (named);
    * the course's ``TopKHook`` returned: switched off while it runs;
    * any exception: the rank's error, as CheckFailed.
    """
    with refusing(exercise="topk_ef_hook", paths={"helpers.compression.TopKHook": "it is the course's answer "
                                 "to this exercise: write the hook yourself"}):
        hook = attempt(topk_ef_hook, TOPK_RATIO, what="topk_ef_hook(0.1)")
    if not callable(hook):
        raise CheckFailed(f"topk_ef_hook(ratio) returned {type(hook).__name__}, not a hook")
    for world in TOPK_WORLDS:
        res = on_ranks(_run_topk, world, topk_ef_hook, timeout=60,
                       what=f"the hook on {world} ranks")
        _compare_topk([values for values, _ in res], world)
        most = _check_topk_wire([wire for _, wire in res], world)
    passed(f"top-k with error feedback on 3 and 4 ranks, {TOPK_BUCKETS} buckets: every "
           f"call's mean of the ranks' sparse messages, each bucket's error carried to its "
           f"own next call; each rank handed at most "
           f"{most} bytes a call to the collectives (k values and indices; the dense bucket "
           f"is {TOPK_NUMEL * 4})")


# What one rank may hand to the collectives per call: k float32 values and k int64
# indices (the course's TopKHook), with room for a small count; a dense float32 bucket is
# TOPK_NUMEL x 4 = 180 bytes, k x 12 = 60.
def _topk_wire_limit() -> int:
    return math.ceil(TOPK_RATIO * TOPK_NUMEL) * (4 + 8) + 16


def _check_topk_wire(wires: list, world: int) -> int:
    limit, most = _topk_wire_limit(), 0
    for rank, calls in enumerate(wires):
        for call, (ops, nbytes) in enumerate(calls):
            most = max(most, nbytes)
            step, bucket = divmod(call, TOPK_BUCKETS)
            if nbytes > limit:
                raise CheckFailed(
                    f"{world} ranks, rank {rank}, call {step + 1}, bucket {bucket + 1}: "
                    f"the hook handed {nbytes:,} "
                    f"bytes to {', '.join(ops)}; top-k sends only its k = "
                    f"{math.ceil(TOPK_RATIO * TOPK_NUMEL)} values and their indices (at most "
                    f"{limit} bytes). A dense vector holding the top k, gathered from every "
                    f"rank, moves more than the all-reduce top-k is meant to replace")
    return most


def _compare_topk(res: list, world: int) -> None:
    """``res[rank][step][bucket]`` against the definition, each bucket with its own error."""
    refs = [_reference_messages(world, bucket=b) for b in range(TOPK_BUCKETS)]
    k = math.ceil(TOPK_RATIO * TOPK_NUMEL)
    for step in range(TOPK_STEPS):
        first_right = False  # bucket 1's first call right on every rank
        for bucket, ref in enumerate(refs):
            want = sum(ref[step]) / world
            # the ranks' terms added in any order, divided before or after: Higham's bound
            # on two orders of a world-term sum, one more rounding for the division
            bound = reorder_bound(sum(m.abs() for m in ref[step]) / world, world + 1)
            wrong = [r for r in range(world) if not (
                res[r][step][bucket].shape == want.shape
                and ((res[r][step][bucket] - want).abs() <= bound).all())]
            if step == 0 and bucket == 0:
                first_right = not wrong
            if not wrong:
                continue
            rank = wrong[0]
            got = res[rank][step][bucket]
            same = got.shape == want.shape
            if step == 0 and bucket > 0 and first_right:
                why = (f" Bucket 1's first call was right; bucket {bucket + 1}'s first call, "
                       f"on its own buffer, has nothing left over yet, so what it added came "
                       f"from another bucket: keep the error per bucket (a dict keyed by "
                       f"flat_grad.data_ptr()), not one for the whole hook.")
            elif step == 0:
                plain = sum(ref[0])
                fewer = sum(_reference_messages(world, k - 1, bucket)[0]) / world
                if same and torch.allclose(got, plain, rtol=1e-5, atol=1e-6):
                    why = " That is the sum: divide by the number of ranks."
                elif same and torch.allclose(got, fewer, rtol=1e-5, atol=1e-6):
                    why = (f" Each rank should send k = ceil(ratio * numel) = {k} entries "
                           f"(ratio * numel = {TOPK_RATIO * TOPK_NUMEL:g}: round up).")
                else:
                    why = (" Each rank sends the k entries of largest magnitude (values and "
                           "indices); the result is the mean of the ranks' sparse vectors.")
            else:
                no_feedback = _no_feedback_mean(step, world, bucket)
                why = (" That is top-k without error feedback: add what the bucket did "
                       "not send last time before choosing the top k, and keep what you "
                       "do not send now." if same and torch.allclose(
                           got, no_feedback, rtol=1e-5, atol=1e-6)
                       else " Check the error you keep: (gradient + old error) minus "
                            "exactly the entries you sent, one error per bucket.")
            raise CheckFailed(f"{world} ranks, rank {rank}, call {step + 1}, bucket "
                              f"{bucket + 1}: the averaged bucket differs from the "
                              f"definition.{why}\n  expected (first 6): "
                              f"{[round(v, 4) for v in want[:6].tolist()]}\n  got "
                              f"(first 6):      "
                              f"{[round(v, 4) for v in got.flatten()[:6].tolist()]}")


def _no_feedback_mean(step: int, world: int, bucket: int = 0) -> torch.Tensor:
    k = math.ceil(TOPK_RATIO * TOPK_NUMEL)
    msgs = []
    for r in range(world):
        g = _topk_grads(r, step, bucket)
        idx = g.abs().topk(k).indices
        msg = torch.zeros(TOPK_NUMEL)
        msg[idx] = g[idx]
        msgs.append(msg)
    return sum(msgs) / world
