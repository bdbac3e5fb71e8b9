"""Checks for chapter 10: the online-softmax merge and the key/value ring.

``check_merge(merge)``: the learner's ``merge(o1, lse1, o2, lse2) -> (o, lse)``
combines attention over two disjoint key blocks (Milakov & Gimelshein 2018,
sec. 3). Checked on one process in float64 against softmax over all keys.
Float64 on both sides, only rounding differs (~1e-16 relative); we allow 1e-9,
while an average of the two blocks is off by O(1). Mistakes it is built to catch:

* averaging the two outputs (weights 1/2 instead of each block's softmax mass);
* an lse that is not logaddexp (max, or a plain sum);
* one empty block (lse = -inf) giving NaN or changing the other block;
* both blocks empty (a query with no visible key yet in a causal ring step):
  exp(-inf - (-inf)) is NaN unless guarded; the answer is o = 0, lse = -inf;
* calling the course's ``merge_partials`` instead of writing the rule (under any
  name: it is switched off while the learner's merge runs).

``check_ring(ring_forward)``: the learner's causal ring attention forward
(contiguous layout, K/V passed round the ring with isend/irecv) in float64
against ``F.scaled_dot_product_attention(..., is_causal=True)`` on the whole
sequence, in one launch of 4 ranks: first as two context-parallel groups, rank 0
alone (cp = 1: plain attention, no message) and ranks 1, 2, 3 (cp = 3, whose ranks
in the group are not their ranks in the job), each group with its own sequence; then
as one ring of 4. Mistakes it is built to catch:

* no causal mask (a rank's queries see the future): wrong output;
* a ring run backwards against its own bookkeeping (sending to rank - 1 while
  naming the block's owner rank - s): at 2 ranks rank + 1 = rank - 1, so the
  check runs 3 and 4, where the owner and so the mask are wrong;
* gathering all K/V with a collective and attending once (the all-gather
  variant, not a ring): refused by name;
* sending each block straight to every other rank (cp - 1 sends, but to cp - 1
  different ranks): each rank must send exactly cp - 1 messages, all to one
  neighbour;
* the group ignored (a ring over the whole job, or peers numbered inside the group
  but posted without it): the groups' outputs are wrong, or the ring hangs (named);
* the course's own ring (``ring_forward``, ``ring_attention``, ``ring_shift``) or the
  all-gather and all-to-all variants called: refused by name;
* a wrong output shape or a missing return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.checks.course_answers import CourseAnswerUsed, refusing

REL = 1e-9  # float64, only rounding differs (module docstring)
# one launch: two rings, of 1 and 3 ranks (odd: at 2 ranks a backwards ring looks like a
# forwards one; ranks 1-3, so a rank in the ring is not its rank in the job), then one of 4
RING_WORLD, RING_LAYOUT = 4, [[0], [1, 2, 3]]
RING_CASES = ("groups", "world")
COURSE_MERGE = ["helpers.sp.attention.blocks.merge_partials"]
COURSE_RING = ["helpers.sp.attention.ring.ring_forward", "helpers.sp.attention.ring.ring_attention",
               "helpers.sp.attention.ring.ring_shift",
               "helpers.sp.attention.allgather.allgather_attention",
               "helpers.sp.attention.ulysses.ulysses_attention"]


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and \
        bool(((a - b).abs().nan_to_num(float("inf")) <= REL * max(b.abs().max().item(), 1.0))
             .all())


def _pair(out, what: str):
    if not (isinstance(out, tuple) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in out)):
        raise CheckFailed(f"{what}: merge must return a pair of tensors (o, lse), got "
                          f"{type(out).__name__}")
    return out


def check_merge(merge) -> None:
    """Two key blocks of one float64 attention, merged, vs softmax over all keys; one
    block empty; both blocks empty (see the module docstring for the mistakes)."""
    from helpers.sp import block_attention

    def merge_(*args, what):
        with refusing(COURSE_MERGE, "merge", "write the rule with torch.logaddexp and the "
                      "two weights yourself"):
            return attempt(merge, *args, what=what)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    k[..., 5:, :] *= 4.0                          # one block with much more softmax mass
    want = F.scaled_dot_product_attention(q, k, v)
    want_lse = torch.logsumexp(q @ k.transpose(-2, -1) / 2.0, -1)
    o1, l1 = block_attention(q, k[..., :3, :], v[..., :3, :])
    o2, l2 = block_attention(q, k[..., 3:, :], v[..., 3:, :])
    o, lse = _pair(merge_(o1, l1, o2, l2, what="merge"), "two blocks")
    if _close(o, (o1 + o2) / 2):
        raise CheckFailed("merge averages the two outputs; weight each by its share of the "
                          "softmax mass: exp(lse_i - lse) with lse = logaddexp(lse1, lse2)")
    if not _close(lse, want_lse):
        raise CheckFailed("the merged lse is not log(exp(lse1) + exp(lse2)) (torch.logaddexp)")
    if not _close(o, want):
        raise CheckFailed("the merged output differs from attention over all keys: "
                          "o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2")
    # Causal attention: a query's first block can be entirely in its future (lse = -inf).
    empty = torch.zeros(6, 3, dtype=torch.bool)
    oe, le = block_attention(q, k[..., :3, :], v[..., :3, :], empty)
    o, lse = _pair(merge_(oe, le, o2, l2, what="merge with an empty block"),
                   "one empty block")
    if not (_close(o, o2) and _close(lse, l2)):
        raise CheckFailed("merging an empty block (lse = -inf, o = 0) must leave the other "
                          "block unchanged; is there a NaN from -inf - (-inf)?")
    # ... and at the first steps of a ring, both blocks can be empty for some queries
    o, lse = _pair(merge_(oe, le, oe.clone(), le.clone(), what="merge with both blocks empty"),
                   "both blocks empty")
    if torch.isnan(o).any() or torch.isnan(lse).any():
        raise CheckFailed("merging two empty blocks (both lse = -inf) gives NaN: "
                          "exp(-inf - (-inf)) is NaN, so guard the case where the merged lse "
                          "is -inf (the output is 0 there, the lse stays -inf)")
    if not (bool((o == 0).all()) and bool(torch.isneginf(lse).all())):
        raise CheckFailed("merging two empty blocks must give o = 0 and lse = -inf")
    passed("merge equals attention over all keys (float64), with one and with both blocks "
           "empty")


_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                "all_reduce", "all_to_all", "all_to_all_single", "reduce_scatter",
                "reduce_scatter_tensor", "gather", "scatter")


def _run_ring(ring_forward):
    """On every rank, both cases (RING_LAYOUT's groups, then the world): the learner's
    ring under the checks' spy (every send seen, alone or in a batch; collectives
    recorded and passed through, so nothing hangs) with the course's rings refused, and
    the reference chunk."""
    import torch.distributed as dist

    from helpers.checks.groups import split_world
    split = split_world(RING_LAYOUT)
    out = {}
    try:
        for case, (group, index, members) in zip(
                RING_CASES, (split, (dist.group.WORLD, 0, list(range(RING_WORLD))))):
            out[case] = _ring_case(ring_forward, group, index, members)
    except CourseAnswerUsed as exc:
        return {"refused": str(exc)}
    return out


def _ring_case(ring_forward, group, index, members):
    from helpers.checks.spy import communication_spy
    from helpers.sp import shard_sequence
    t = len(members)
    gen = torch.Generator().manual_seed(1 + index)   # each group its own sequence
    q, k, v = (torch.randn(1, 2, 4 * t, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    k[..., -3:, :] *= 3.0   # late keys with large scores: a query that sees them errs by O(1)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with communication_spy(keep_values=False) as spy, \
            refusing(COURSE_RING, "ring_forward", "the exercise is the ring itself"):
        got = ring_forward(*(shard_sequence(x, group=group) for x in (q, k, v)), group=group)
    collectives = [c for c in spy.collectives if c in _COLLECTIVES]
    return dict(got=got, want=shard_sequence(want, group=group), sends=spy.destinations,
                collectives=collectives, members=members)


_IN_A_GROUP = ("in a group, point-to-point calls take global ranks "
               "(dist.get_global_rank(group, r)) and group=group; neighbours numbered inside "
               "the group but posted without it land on the wrong ranks, or on the sender "
               "itself")
_RING_HINTS = {"Pair is not connected": f"a rank posted a message to itself: {_IN_A_GROUP}",
               "Timed out": _IN_A_GROUP}


def check_ring(ring_forward, timeout: float = 60.0) -> None:
    """4 ranks: rings of 1 and 3 ranks (groups [0] and [1, 2, 3], each with its own
    sequence), then one ring of 4; contiguous layout, float64, vs full causal SDPA; who
    sends to whom, and no collective (see the module docstring for the mistakes). A
    ring that hangs is stopped after ``timeout`` seconds (under NCCL's rules a lone
    isend/irecv per step does, and the message says why)."""
    probe = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    res = on_ranks(_run_ring, RING_WORLD, ring_forward, what=f"ring_forward on {RING_WORLD} ranks",
                   probe=lambda: ring_forward(probe, probe, probe), timeout=timeout,
                   hints=_RING_HINTS)
    if "refused" in res[0]:
        raise CheckFailed(res[0]["refused"])
    for case in RING_CASES:
        for rank, out in enumerate(r[case] for r in res):
            got, want, sends, collectives = out["got"], out["want"], out["sends"], \
                out["collectives"]
            members = out["members"]
            world = len(members)
            where = (f"one ring of {world} ranks, rank {rank}" if case == "world" else
                     f"the ring {members} of {RING_LAYOUT}, rank {rank}")
            if collectives:
                raise CheckFailed(
                    f"{where}: ring_forward called {sorted(set(collectives))}: that gathers "
                    f"K/V with a collective (the all-gather variant). The ring passes one "
                    f"block at a time to the next rank with isend/irecv")
            outside = sorted(set(sends) - set(members))
            if outside:
                raise CheckFailed(
                    f"{where}: sends went to rank(s) {outside}, outside this ring {members}. "
                    f"In a group, number the neighbours inside the group (cp_rank(group), "
                    f"cp_size(group)) and post with global ranks, "
                    f"dist.get_global_rank(group, r), and group=group")
            if len(sends) != world - 1:
                raise CheckFailed(
                    f"{where}: {len(sends)} point-to-point sends; a ring of {world} ranks "
                    f"passes a block on {world - 1} times (every step but the last), one "
                    f"message carrying k and v stacked")
            if len(set(sends)) > 1:
                raise CheckFailed(
                    f"{where}: sends went to ranks {sends}; in a ring every block goes to "
                    f"the same neighbour, (rank + 1) % cp, which passes it on")
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise CheckFailed(f"{where}: ring_forward must return this rank's output "
                                  f"chunk of shape {tuple(want.shape)}, got "
                                  f"{getattr(got, 'shape', type(got).__name__)}")
            if not _close(got, want):
                group_hint = ("" if case == "world" else
                              " In a group, take cp and the rank from the group "
                              "(cp_size(group), cp_rank(group)), not from the whole job.")
                raise CheckFailed(
                    f"{where}: the output differs from full causal attention. At step s the "
                    f"block you hold came from rank (rank - s) % cp if you receive from "
                    f"rank - 1: mask it with causal_mask(my positions, its owner's "
                    f"positions), and merge with the log-sum-exp rule.{group_hint}")
    passed("the ring's output equals full causal attention in rings of 1, 3 and 4 ranks "
           "(float64), with cp - 1 sends to one neighbour and no collective")
