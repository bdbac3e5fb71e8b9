"""Checks for chapter 22: what the loss curve hides.

Learner contracts:

* ``audit_ledgers(my_ids, num_samples, group) -> (duplicates, gaps)`` on every rank:
  ``my_ids`` (n,) int64, the example ids this rank consumed (n differs between
  ranks); duplicates = uses beyond the first of an id, over all ranks; gaps = ids
  in 0 .. num_samples-1 no rank used. The same answer on every rank. Reference:
  ``helpers.data_health.audit_on_ranks``.
* ``ngram_overlap_on_ranks(eval_tokens, shard, n, group) -> (E,) float``: every
  rank passes the same evaluation rows (E, L) and its own training shard (S_r, L);
  for each evaluation row, the share of its L - n + 1 n-grams that occur inside
  some training row of some rank. Reference: ``helpers.data_health.ngram_hits``.
* ``compatible(saved, expected) -> list[str]``: two signatures
  (``helpers.data_health.signature``); one sentence per mismatch (format, a name
  missing or unexpected, a shape, a dtype, a layout), each naming its tensor;
  ``[]`` when they agree. Reference: ``helpers.data_health.compare``.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.checks.course_answers import refusing

_LEDGER_ANSWERS = {"helpers.data_health.ledger.audit_on_ranks": "",
                   "helpers.data_health.ledger.audit": "",
                   "helpers.data_health.ledger.gather_ids": ""}
_OVERLAP_ANSWERS = {"helpers.data_health.contamination.ngram_hits": "",
                    "helpers.data_health.contamination.contaminated_on_ranks": "",
                    "helpers.data_health.contamination.index_shard": ""}


# ---- 1. the ledger

def _sampler_ids(num_samples: int, world: int, drop_last: bool = False) -> list[list[int]]:
    from torch.utils.data import DistributedSampler
    return [list(DistributedSampler(range(num_samples), num_replicas=world, rank=r, seed=0,
                                    drop_last=drop_last)) for r in range(world)]


def ledger_cases(world: int) -> list[tuple[str, int, list[list[int]]]]:
    """(what, num_samples, ids of each rank) for ``world`` ranks: every case's answer
    differs from what each near-right ledger gives."""
    cases = []
    if world == 3:
        cases.append(("DistributedSampler pads 10 ids to 12 for 3 ranks (drop_last=False): "
                      "the padding repeats", 10, _sampler_ids(10, 3)))
        # uneven shards, a replayed step on rank 1 (ids 6, 7 twice), a skipped id 11,
        # and id 2 on two ranks
        cases.append(("uneven shards (5, 5, 3 ids), a step replayed on rank 1 after a "
                      "resume, an id skipped, an id on two ranks", 12,
                      [[0, 1, 2, 3, 4], [5, 6, 7, 6, 7], [2, 8, 9]]))
        # an epoch of 12 on 3 ranks, resumed after 2 ids each on 2 ranks whose new deal
        # skips 2 ids per rank: a world-size change that re-deals the epoch
        first = [ids[:2] for ids in _sampler_ids(12, 3, drop_last=True)]
        after = [ids[2:] for ids in _sampler_ids(12, 2, drop_last=True)]
        cases.append(("an epoch of 12 on 3 ranks, resumed on 2 after 2 ids per rank (the "
                      "new deal fast-forwarded by 2 ids per rank)", 12,
                      [first[0] + after[0], first[1] + after[1], first[2]]))
    if world == 4:
        same = list(range(0, 20, 4))
        cases.append(("every rank seeded the same: 4 ranks on one batch", 20, [same] * 4))
    return cases


def _ledger_rank(fn, world_cases):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.checks.spy import communication_spy

    r = rank_info()
    out = []
    for what, n, ids in world_cases:
        mine = torch.tensor(ids[r.rank], dtype=torch.long, device=r.device)
        with refusing(exercise="audit_ledgers", paths=_LEDGER_ANSWERS), \
                communication_spy(keep_values=False) as spy:
            got = fn(mine, n, dist.group.WORLD)
        if isinstance(got, tuple) and len(got) == 2:
            got = tuple(int(v) for v in got)
        out.append({"got": got, "collectives": len(spy.collectives)})
    return out


def _reference(n: int, ids: list[list[int]]) -> tuple[int, int]:
    from helpers.data_health import audit
    a = audit([torch.tensor(i, dtype=torch.long) for i in ids], n)
    return a.duplicates, a.gaps


def _ledger_hint(what: str, want: tuple[int, int], got) -> str:
    dup, gaps = want
    if got[0] == 0 and dup:
        if "padding" in what:
            return (" The padding repeats are examples used twice in one epoch: count every "
                    "use beyond an id's first, over all ranks (consumed - distinct).")
        return " Count every use beyond an id's first, over all ranks."
    if "replayed" in what:
        return (" A replayed step repeats ids on one rank: an id used twice by the same "
                "rank is a duplicate too, and an id used three times is two.")
    if "seeded" in what:
        return (" Each id here is used by all 4 ranks: that is 3 duplicates per id, not 1.")
    return ""


def check_audit_ledgers(audit_ledgers) -> None:
    """``audit_ledgers`` on 3 ranks (padding repeats; uneven shards with a replay, a
    skip and a shared id; a resume on another world size) and on 4 ranks (every rank
    seeded the same), against ``helpers.data_health.audit`` of every rank's ids.

    Mistakes it is built to catch: a ledger that checks coverage only (padding
    repeats and replays missed); duplicates as ids seen on more than one rank (a
    replay on one rank, an id on 4 ranks counted once); ids made unique per rank
    before gathering; an all-gather that assumes every rank consumed the same number
    (uneven shards); duplicates as consumed - num_samples (a gap hides a duplicate);
    no communication at all; different answers on different ranks; the course's own
    ``audit_on_ranks`` / ``gather_ids`` / ``audit``: switched off while it runs."""
    for world in (3, 4):
        cases = ledger_cases(world)
        res = on_ranks(_ledger_rank, world, audit_ledgers, cases,
                       what=f"audit_ledgers on {world} ranks",
                       probe=lambda: audit_ledgers(torch.zeros(0, dtype=torch.long), 1, None),
                       hints={"SIGABRT": "an all-gather needs the same size on every rank: "
                              "the ranks consumed different numbers of ids, so exchange the "
                              "sizes first and pad (or use all_gather_object)",
                              "size": "the ranks consumed different numbers of ids: exchange "
                              "the sizes first and pad to the largest"}, timeout=30)
        for c, (what, n, ids) in enumerate(cases):
            want = _reference(n, ids)
            answers = [rank_out[c]["got"] for rank_out in res]
            if not all(isinstance(a, tuple) and len(a) == 2 for a in answers):
                raise CheckFailed(f"audit_ledgers must return (duplicates, gaps), got "
                                  f"{answers[0]!r:.80}")
            if any(rank_out[c]["collectives"] == 0 for rank_out in res):
                raise CheckFailed(f"{what}: a rank answered without any collective; it "
                                  f"sees only its own ids, not the other ranks' ledgers")
            for r, got in enumerate(answers):
                if got != want:
                    raise CheckFailed(f"{what}: rank {r} found (duplicates, gaps) = {got}, "
                                      f"expected {want} (ids per rank: {ids})."
                                      f"{_ledger_hint(what, want, got)}")
    passed("ledger audit right on 3 and 4 ranks: padding repeats, a replay, a skip, a "
           "world-size change, and 4 ranks on one batch, with uneven shards")


# ---- 2. the overlap test

def overlap_case(n: int = 4, L: int = 12, seed: int = 0):
    """(eval rows (E, L), shards of 3 ranks (uneven), what each eval row is)."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randint(0, 50, (k, L), generator=g) for k in (4, 1, 3)]
    clean = torch.randint(50, 100, (2, L), generator=g)   # tokens no shard has
    near = shards[0][1].clone()
    near[[3, 8]] = torch.tensor([90, 91])                   # 2 tokens changed
    split = torch.cat([shards[0][2][:L // 2], shards[2][0][L // 2:]])  # halves on 2 ranks
    seam = torch.cat([shards[0][0][L // 2:], shards[0][1][:L // 2]])   # across two rows
    rows = [shards[2][2], near, split, seam, shards[1][0], clean[0], clean[1]]
    what = ["an exact copy of a row of rank 2", "a near copy (2 tokens changed) of a row of "
            "rank 0", "its first half from rank 0, its second from rank 2", "the end of one "
            "training row and the start of the next (same rank)", "an exact copy of rank "
            "1's only row", "unseen", "unseen"]
    return torch.stack(rows), shards, what


def _overlap_rank(fn, evals, shards, n):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.checks.spy import communication_spy

    r = rank_info()
    with refusing(exercise="ngram_overlap_on_ranks", paths=_OVERLAP_ANSWERS), \
            communication_spy(keep_values=False) as spy:
        got = fn(evals.to(r.device), shards[r.rank].to(r.device), n, dist.group.WORLD)
    return {"got": torch.as_tensor(got).float().cpu() if got is not None else None,
            "collectives": len(spy.collectives)}


def _overlap_reference(evals, shards, n) -> torch.Tensor:
    from helpers.data_health import ngram_hashes
    grams = ngram_hashes(evals, n)
    index = torch.unique(torch.cat([ngram_hashes(s, n).reshape(-1) for s in shards]))
    return torch.isin(grams, index).float().mean(1)


def check_ngram_overlap(ngram_overlap_on_ranks) -> None:
    """``ngram_overlap_on_ranks`` on 3 ranks with uneven shards (4, 1 and 3 rows), n = 4,
    against the n-grams of every shard: an exact copy, a near copy, a row whose halves
    live on two ranks, a row across the seam of two training rows, and unseen rows.

    Mistakes it is built to catch: an exact-copy test (whole rows compared: the near
    copy gets 0); each rank looking only at its own shard; the largest per-rank
    overlap instead of the union of hits (the split row); the shard flattened into one
    stream (n-grams across the seam of two rows match); an all-gather of shards that
    assumes equal sizes; no communication; different answers on different ranks; the
    course's ``ngram_hits`` / ``index_shard``: switched off while it runs."""
    n = 4
    evals, shards, what = overlap_case(n)
    want = _overlap_reference(evals, shards, n)
    res = on_ranks(_overlap_rank, 3, ngram_overlap_on_ranks, evals, shards, n,
                   what="ngram_overlap_on_ranks on 3 ranks",
                   probe=lambda: ngram_overlap_on_ranks(evals, shards[0], n, None),
                   hints={"SIGABRT": "the shards have different numbers of rows (4, 1, 3): "
                          "gather sizes first, or keep each shard where it is and reduce "
                          "the hits instead"}, timeout=30)
    for r, out in enumerate(res):
        got = out["got"]
        if got is None or tuple(got.shape) != tuple(want.shape):
            raise CheckFailed(f"rank {r}: expected a tensor of {want.numel()} overlaps (one per "
                              f"evaluation row), got {None if got is None else tuple(got.shape)}")
        if out["collectives"] == 0:
            raise CheckFailed(f"rank {r} answered without any collective: it sees only its own "
                              f"shard, and the training data is spread over 3 ranks")
        # shares k / 9 computed in float32: a few ulps at most
        bad = [i for i in range(len(want)) if abs(float(got[i]) - float(want[i])) > 1e-6]
        if bad:
            i = bad[0]
            hint = ""
            if i == 1 and float(got[i]) == 0:
                hint = (" A whole-row comparison sees only exact copies; count the row's "
                        "n-grams found anywhere in the training data.")
            elif i == 2:
                hint = (" Its n-grams are found on two ranks: combine every rank's hits "
                        "(an all-reduce of hit flags) before taking the share, not the best "
                        "rank's share.")
            elif i == 3:
                hint = (" An n-gram must lie inside one training row: a shard flattened into "
                        "one stream makes n-grams across two rows that no text contains.")
            elif float(got[i]) == 0:
                hint = " Did each rank look only at its own shard?"
            raise CheckFailed(f"rank {r}, evaluation row {i} ({what[i]}): overlap "
                              f"{float(got[i]):.3f}, expected {float(want[i]):.3f}.{hint}")
    passed("n-gram overlap right on 3 uneven shards: exact and near copies, a row split "
           "over two ranks, no n-gram across two training rows")


# ---- 3. the compatibility test

def _sig(**overrides):
    from helpers.data_health import signature
    from helpers.model import build_model
    dtype = overrides.pop("dtype", None)
    model = build_model("toy", seed=0, device="cpu", **overrides)
    if dtype is not None:
        model = model.to(dtype)
    return signature(model)


def compat_cases() -> list[tuple[str, dict, dict, list[str]]]:
    """(what, saved, expected, names every problem list must mention)."""
    base = _sig()
    fmt = {**_sig(), "format": 2}
    dropped = _sig()
    del dropped["tensors"]["ln_f.bias"]
    extra = _sig()
    extra["tensors"]["blocks.2.ln_1.weight"] = dict(extra["tensors"]["ln_f.weight"])
    turned = _sig()
    t = turned["tensors"]["blocks.0.mlp.c_fc.weight"]
    t["shape"] = t["shape"][::-1]  # same number of elements, transposed
    heads = _sig(n_head=4)
    wider = _sig(n_embd=48)
    c_attn = [k for k in base["tensors"] if ".c_attn." in k]
    return [
        ("the same model", base, _sig(), []),
        ("another width (n_embd 48 vs 32)", wider, base,
         ["wte.weight", "blocks.0.mlp.c_fc.weight", "ln_f.weight"]),
        ("a weight stored transposed (same number of elements)", turned, base,
         ["blocks.0.mlp.c_fc.weight"]),
        ("a bfloat16 checkpoint for a float32 job", _sig(dtype=torch.bfloat16), base,
         ["wte.weight", "ln_f.bias"]),
        ("another head count (n_head 4 vs 2: same shapes, other layout)", heads, base, c_attn),
        ("a checkpoint of format 2", fmt, base, ["format"]),
        ("a tensor missing from the checkpoint", dropped, base, ["ln_f.bias"]),
        ("a tensor this job does not have", extra, base, ["blocks.2.ln_1.weight"]),
    ]


def check_compatible(compatible) -> None:
    """``compatible`` on signatures of the course GPT: the same model (no problem), and
    one mismatch of each kind, each of which must be reported naming its tensor (or the
    format).

    Mistakes it is built to catch: names compared but not shapes; shapes as element
    counts (a transposed weight); dtypes or layouts or the format version not compared;
    missing names reported but not unexpected ones (or the reverse); a problem
    reported for identical signatures; a bool or None instead of a list."""
    from helpers.data_health import compare
    for what, saved, expected, names in compat_cases():
        want = compare(saved, expected)
        with refusing(exercise="compatible",
                      paths={"helpers.data_health.compat.compare": "",
                             "helpers.data_health.compat.require_compatible": ""}):
            got = attempt(compatible, saved, expected, what=f"compatible ({what})")
        if not isinstance(got, (list, tuple)):
            raise CheckFailed(f"compatible must return a list of problems (sentences), "
                              f"got {type(got).__name__}")
        text = "\n".join(map(str, got))
        if not names and got:
            raise CheckFailed(f"{what}: expected no problem, got {list(got)[:3]}")
        if names and not got:
            raise CheckFailed(f"{what}: compatible found no problem; the reference finds "
                              f"{len(want)}, e.g. {want[0]!r}")
        missing = [n for n in names if n not in text]
        if missing:
            raise CheckFailed(f"{what}: no problem names {missing[0]} (the reference says "
                              f"{[p for p in want if missing[0] in p][:1]})")
    passed("compatibility right: names both ways, shapes (not element counts), dtypes, "
           "layouts and the format version, each mismatch named")
