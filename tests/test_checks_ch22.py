"""Chapter 22's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch22
from helpers.data_health import ngram_hashes


# ---- ledgers

def _gathered(my_ids, group, unique=False):
    """Every rank's ids, sizes exchanged first (right for uneven shards)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (torch.unique(my_ids) if unique else my_ids).cpu().tolist(),
                           group=group)
    return out


def _ledger_objects(my_ids, num_samples, group):  # right: another style (object gather)
    every = [i for ids in _gathered(my_ids, group) for i in ids]
    return len(every) - len(set(every)), num_samples - len(set(every))


def _ledger_counts(my_ids, num_samples, group):  # right: all-reduce of per-id counts
    uses = torch.bincount(my_ids.cpu(), minlength=num_samples).to(my_ids.device)
    dist.all_reduce(uses, group=group)
    return int((uses - 1).clamp(min=0).sum()), int((uses == 0).sum())


def _coverage_only(my_ids, num_samples, group):  # misses the padding repeats
    seen = {i for ids in _gathered(my_ids, group) for i in ids}
    return 0, num_samples - len(seen)


def _cross_rank(my_ids, num_samples, group):  # duplicates = ids on more than one rank
    per_rank = [set(ids) for ids in _gathered(my_ids, group)]
    seen = set().union(*per_rank)
    shared = sum(1 for i in seen if sum(i in s for s in per_rank) > 1)
    return shared, num_samples - len(seen)


def _unique_first(my_ids, num_samples, group):  # ids made unique on each rank first
    every = [i for ids in _gathered(my_ids, group, unique=True) for i in ids]
    return len(every) - len(set(every)), num_samples - len(set(every))


def _over_size(my_ids, num_samples, group):  # duplicates = consumed - num_samples
    every = [i for ids in _gathered(my_ids, group) for i in ids]
    return max(0, len(every) - num_samples), num_samples - len(set(every))


def _equal_sizes(my_ids, num_samples, group):  # all-gather assuming equal sizes
    out = [torch.empty_like(my_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, my_ids, group=group)
    every = torch.cat(out).tolist()
    return len(every) - len(set(every)), num_samples - len(set(every))


def _padding_counted(my_ids, num_samples, group):  # the -1 padding left in: bincount raises
    world = dist.get_world_size(group)
    sizes = [None] * world
    dist.all_gather_object(sizes, my_ids.numel(), group=group)
    padded = torch.full((max(sizes),), -1, dtype=torch.long, device=my_ids.device)
    padded[:my_ids.numel()] = my_ids
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    uses = torch.bincount(torch.cat(out).cpu(), minlength=num_samples)
    return int((uses - 1).clamp(min=0).sum()), int((uses == 0).sum())


def _local(my_ids, num_samples, group):  # no communication: only this rank's ids
    ids = my_ids.tolist()
    return len(ids) - len(set(ids)), num_samples - len(set(ids))


def _course_ledger(my_ids, num_samples, group):
    from helpers.data_health import audit_on_ranks
    a = audit_on_ranks(my_ids, num_samples, group)
    return a.duplicates, a.gaps


# ---- overlap

def _overlap_gather_grams(eval_tokens, shard, n, group):  # right: gather the shards' n-grams
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, ngram_hashes(shard, n).reshape(-1).cpu(), group=group)
    index = torch.unique(torch.cat(out))
    return torch.isin(ngram_hashes(eval_tokens, n).cpu(), index).float().mean(1)


def _overlap_tuples(eval_tokens, shard, n, group):  # right: plain tuples, no hashing
    out = [None] * dist.get_world_size(group)
    mine = {tuple(row[i:i + n].tolist()) for row in shard for i in range(row.numel() - n + 1)}
    dist.all_gather_object(out, mine, group=group)
    every = set().union(*out)
    return torch.tensor([sum(tuple(row[i:i + n].tolist()) in every
                             for i in range(row.numel() - n + 1)) / (row.numel() - n + 1)
                         for row in eval_tokens])


def _exact_rows(eval_tokens, shard, n, group):  # only exact copies: 1 or 0
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, {tuple(r.tolist()) for r in shard}, group=group)
    rows = set().union(*out)
    return torch.tensor([float(tuple(r.tolist()) in rows) for r in eval_tokens])


def _own_shard(eval_tokens, shard, n, group):  # no collective: own shard only
    mine = torch.unique(ngram_hashes(shard, n).reshape(-1))
    return torch.isin(ngram_hashes(eval_tokens, n), mine).float().mean(1)


def _best_rank(eval_tokens, shard, n, group):  # the best rank's share, not the union
    mine = torch.unique(ngram_hashes(shard, n).reshape(-1))
    share = torch.isin(ngram_hashes(eval_tokens, n), mine).float().mean(1)
    dist.all_reduce(share, op=dist.ReduceOp.MAX, group=group)
    return share


def _flattened(eval_tokens, shard, n, group):  # shard as one stream: n-grams across rows
    stream = shard.reshape(1, -1)
    mine = torch.unique(ngram_hashes(stream, n).reshape(-1))
    hits = torch.isin(ngram_hashes(eval_tokens, n), mine).to(torch.int32)
    dist.all_reduce(hits, group=group)
    return (hits > 0).float().mean(1)


def _gather_equal(eval_tokens, shard, n, group):  # all-gather of shards of equal size
    out = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, shard, group=group)
    index = torch.unique(ngram_hashes(torch.cat(out), n).reshape(-1))
    return torch.isin(ngram_hashes(eval_tokens, n), index).float().mean(1)


def _course_overlap(eval_tokens, shard, n, group):
    from helpers.data_health import ngram_hits
    return ngram_hits(eval_tokens, shard, n, group).float().mean(1)


# ---- compatibility

def _names_only(saved, expected):
    a, b = set(saved["tensors"]), set(expected["tensors"])
    return [f"{k}: missing" for k in b - a] + [f"{k}: unexpected" for k in a - b]


def _fields(saved, expected, fields, fmt=True, shape=list):
    out = [] if not fmt or saved["format"] == expected["format"] else ["format differs"]
    out += _names_only(saved, expected)
    for k in expected["tensors"].keys() & saved["tensors"].keys():
        for f in fields:
            a, b = saved["tensors"][k][f], expected["tensors"][k][f]
            if f == "shape":
                a, b = shape(a), shape(b)
            if a != b:
                out.append(f"{k}: {f}")
    return out


def _indexes_missing(saved, expected):  # looks every expected name up: KeyError
    out = ["format differs"] if saved["format"] != expected["format"] else []
    return out + [k for k in expected["tensors"] if saved["tensors"][k] != expected["tensors"][k]]


def _numel(shape):
    return int(torch.tensor(shape).prod())


class TestChapter22(ChapterChecks):
    lab = "labs/22_loss_curve_hides_lab.ipynb"
    sol = "solutions/22_loss_curve_hides_solution.ipynb"
    checks = {
        "audit_ledgers": Check(ch22.check_audit_ledgers, slow=True, wire=True),
        "ngram_overlap_on_ranks": Check(ch22.check_ngram_overlap, "ngram_overlap_on_ranks",
                                        slow=True, wire=True),
        "compatible": Check(ch22.check_compatible),
    }
    right = [
        Right("audit_ledgers", _ledger_objects, "all_gather_object of the id lists"),
        Right("audit_ledgers", _ledger_counts, "an all-reduce of per-id use counts"),
        Right("ngram_overlap_on_ranks", _overlap_gather_grams,
              "the shards' n-gram hashes all-gathered"),
        Right("ngram_overlap_on_ranks", _overlap_tuples, "n-grams as tuples, sets gathered"),
        Right("compatible", lambda s, e: _fields(s, e, ("shape", "dtype", "layout")),
              "set differences, then every field"),
    ]
    wrong = [
        Wrong("audit_ledgers", _coverage_only, "coverage only: padding repeats missed",
              says="padding repeats are examples used twice"),
        Wrong("audit_ledgers", _cross_rank, "duplicates = ids on more than one rank",
              says="replayed step repeats ids on one rank"),
        Wrong("audit_ledgers", _unique_first, "ids made unique per rank first",
              says="replayed step"),
        Wrong("audit_ledgers", _over_size, "duplicates = consumed - num_samples",
              says=r"expected \(3, 2\)"),
        Wrong("audit_ledgers", _equal_sizes, "all-gather assuming equal sizes",
              says="exchange the sizes first|different numbers of ids"),
        Wrong("audit_ledgers", _local, "no communication", says="without any collective"),
        Wrong("audit_ledgers", _padding_counted, "the -1 padding counted: bincount raises",
              says="failed on a rank: .*bincount|failed on a rank: .*negative"),
        Wrong("audit_ledgers", _course_ledger, "calls helpers.data_health.audit_on_ranks",
              says="switched off in this check"),
        Wrong("audit_ledgers", lambda ids, n, g: None, "returns None",
              says="must return"),
        Wrong("ngram_overlap_on_ranks", _exact_rows, "exact copies only",
              says="whole-row comparison sees only exact copies"),
        Wrong("ngram_overlap_on_ranks", _own_shard, "own shard only",
              says="without any collective"),
        Wrong("ngram_overlap_on_ranks", _best_rank, "best rank's share, not the union",
              says="combine every rank's hits"),
        Wrong("ngram_overlap_on_ranks", _flattened, "shard flattened into one stream",
              says="inside one training row"),
        Wrong("ngram_overlap_on_ranks", _gather_equal, "all-gather of equal-size shards",
              says="different numbers of rows|failed on a rank"),
        Wrong("ngram_overlap_on_ranks", _course_overlap, "calls ngram_hits",
              says="switched off in this check"),
        Wrong("compatible", _names_only, "names only, not shapes", says="another width"),
        Wrong("compatible", lambda s, e: _fields(s, e, ("shape",), shape=_numel),
              "shapes compared as element counts", says="transposed"),
        Wrong("compatible", lambda s, e: _fields(s, e, ("shape",)),
              "names and shapes, not dtypes", says="bfloat16"),
        Wrong("compatible", lambda s, e: _fields(s, e, ("shape", "dtype")),
              "no layout", says="head count"),
        Wrong("compatible", lambda s, e: _fields(s, e, ("shape", "dtype", "layout"), fmt=False),
              "no format version", says="format 2"),
        Wrong("compatible", lambda s, e: [p for p in _fields(s, e, ("shape", "dtype", "layout"))
                                          if "unexpected" not in p],
              "missing names only, not unexpected ones", says="does not have"),
        Wrong("compatible", lambda s, e: s == e, "a bool", says="must return a list"),
        Wrong("compatible", _indexes_missing, "raises KeyError on a missing name",
              says=r"\(a tensor missing from the checkpoint\) raised KeyError: 'ln_f.bias'"),
        Wrong("compatible", lambda s, e: ["mismatch"] if s != e else ["ok"],
              "a problem for identical signatures", says="expected no problem"),
    ]
