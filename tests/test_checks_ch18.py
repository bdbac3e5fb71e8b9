"""Chapter 18's checks pass on the solution, fail on the lab's stubs, on a diagnosis
that names a waiting rank, and on plausible wrong fixes; the broken functions' diffs
name the ranks the diagnosis check expects."""

from collections import Counter

import pytest
import torch

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers import RankError, launch
from helpers.checks import ch18
from helpers.checks.ch18 import LR, STEPS, batch
from helpers.debug import first_disagreement
from planted_bugs import pad_with_zero_grads, sync_always


def _skip_step_one():
    """Fix 1 written for the lab's data: every rank skips step 1, whatever the losses."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = (x @ w - y).pow(2).mean()
        loss.backward()
        if step != 1:
            dist.all_reduce(w.grad)
            with torch.no_grad():
                w -= LR * w.grad / world
        dist.all_reduce(loss.detach())
        w.grad = None
    return w.detach()


def _uneven(steps_rule):
    """Fix 3 with another rule for the number of steps: ``steps_rule(n_batches(rank))``,
    given the rank's own count, on every rank."""
    def fixed():
        import torch.distributed as dist
        from helpers.checks.ch18 import n_batches
        rank, world = dist.get_rank(), dist.get_world_size()
        w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
        for step in range(steps_rule(n_batches(rank), world)):
            x, y = batch(rank, step)
            (x @ w - y).pow(2).mean().backward()
            dist.all_reduce(w.grad)
            with torch.no_grad():
                w -= LR * w.grad / world
            w.grad = None
        return w.detach()
    return fixed


def _mean_steps(mine, world):   # the shard sizes summed over ranks, divided: a mean, floored
    import torch.distributed as dist
    t = torch.tensor(mine)
    dist.all_reduce(t)
    return int(t) // world


def _min_from_everyone(mine, world):   # reads every rank's shard size itself, no collective
    from helpers.checks.ch18 import n_batches
    return min(n_batches(r) for r in range(world))


def _logged(what):
    """Fix 2 with the collectives right and the log wrong: rank 0's own loss, or the sum."""
    def fixed():
        import torch.distributed as dist

        from helpers import rank_info
        rank, world = dist.get_rank(), dist.get_world_size()
        w = torch.zeros(8, dtype=torch.float64, device=rank_info().device, requires_grad=True)
        for step in range(STEPS):
            x, y = batch(rank, step)
            loss = (x @ w - y).pow(2).mean()
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                shown = loss.item() if what == "own" else total.item()
                print(f"step {step}: loss {shown:.4f}")
            loss.backward()
            dist.all_reduce(w.grad)
            with torch.no_grad():
                w -= LR * w.grad / world
            w.grad = None
        return w.detach()
    return fixed


def _naming(n, rank):
    """A diagnosis right but for bug n, where it names ``rank``."""
    answer = {**ch18.FAULTY_RANK, n: rank}
    return lambda: answer


class TestChapter18(ChapterChecks):
    lab, sol = "labs/18_debugging_health_lab.ipynb", "solutions/18_debugging_health_solution.ipynb"
    checks = {
        "diagnosis": Check(ch18.check_diagnosis, "diagnose"),
        "fix 1": Check(ch18.check_fixed, 1, "fixed_skip_nonfinite"),
        "fix 2": Check(ch18.check_fixed, 2, "fixed_log_on_rank0"),
        "fix 3": Check(ch18.check_fixed, 3, "fixed_uneven_shards"),
    }
    uses = {"diagnose": ("first_disagreement",)}
    wrong = [
        *(Wrong("diagnosis", _naming(n, rank), f"bug {n}: names waiting rank {rank}",
                says=f"bug {n}: you named rank {rank}") for n, rank in ((1, 0), (2, 1), (3, 2))),
        Wrong("diagnosis", lambda: {1: 2}, "one bug only", says="keys 1, 2, 3"),
        Wrong("diagnosis", lambda: {1: [2], 2: [0], 3: [1]}, "ranks as the diff's lists",
              says="one rank .an int."),
        *(Wrong(f"fix {n}", ch18.BROKEN[n], "the broken function itself",
                says=f"fix {n} still fails") for n in (1, 2, 3)),
        Wrong("fix 1", sync_always, "syncs on every step", says="every rank must skip"),
        Wrong("fix 2", _logged("own"), "logs rank 0's own loss", says="rank 0's own loss"),
        Wrong("fix 2", _logged("sum"), "logs the sum over ranks", says="the sum over the ranks"),
        Wrong("fix 3", pad_with_zero_grads, "pads with zero gradients", says="shortest shard"),
        Wrong("fix 1", _skip_step_one, "skips step 1, the lab's step, whatever the losses",
              says="on other data .*NaNs in rank 0's batch at step 0"),
        Wrong("fix 3", _uneven(lambda mine, world: STEPS - 1), "trains STEPS - 1 steps: the "
              "lab's shortest shard written in", says="on other data .*shards of 5, 3, 4"),
        Wrong("fix 3", _uneven(_mean_steps), "the mean shard size, floored", says="not a mean"),
        Wrong("fix 3", _uneven(_min_from_everyone), "reads every rank's shard size itself",
              says="sees only its own data"),
    ]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_diff_of_each_broken_function_names_the_faulty_rank(n):
    with pytest.raises(RankError) as info:
        launch(ch18.BROKEN[n], 3, record=True, timeout=6)
    finding = first_disagreement(info.value.records)
    assert finding.ranks == [ch18.FAULTY_RANK[n]], info.value.diff


def test_the_reference_is_data_parallel_sgd():
    """reference() equals plain SGD on the concatenated batches of all ranks (the
    gradient of a mean over equal-size batches is the mean of their gradients)."""
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(STEPS):
        xs, ys = zip(*(ch18._clean_batch(r, step) for r in range(3)))   # no NaN planted
        (torch.cat(xs) @ w - torch.cat(ys)).pow(2).mean().backward()
        with torch.no_grad():
            w -= LR * w.grad
        w.grad = None
    # float64; two summation orders of the same 12 terms: ~1e-15 apart
    assert torch.allclose(ch18.reference(), w.detach(), rtol=0, atol=1e-12)


# -- exercise 1: the cross-rank diff, and the mistakes its check is built to catch --------

def _diff_vs_rank0(calls):
    """Compares every rank with rank 0 instead of with the majority."""
    ranks = sorted(calls)
    for i in range(max(len(calls[r]) for r in ranks)):
        present = {r: calls[r][i] for r in ranks if i < len(calls[r])}
        odd = [r for r in present if present[r] != present.get(ranks[0])]
        if odd:
            return i, sorted(odd)
        missing = [r for r in ranks if r not in present]
        if missing:
            return i, missing
    return None


def _diff_zip(calls):
    """zip() over the lists: stops at the shortest, so a rank that stopped is never seen."""
    ranks = sorted(calls)
    for i, row in enumerate(zip(*(calls[r] for r in ranks))):
        counts = Counter(row)
        if len(counts) > 1:
            ref = counts.most_common(1)[0][0]
            return i, [r for r, c in zip(ranks, row) if c != ref]
    return None


def _diff_all_short(calls, one_based=False, dict_order=False, tie_by_dict=False,
                    vote_missing=False):
    """The right walk with one mistake switched on."""
    ranks = list(calls) if dict_order or tie_by_dict else sorted(calls)
    longest = max(len(v) for v in calls.values())
    for i in range(longest):
        if vote_missing:
            present = {r: calls[r][i] if i < len(calls[r]) else None for r in ranks}
        else:
            present = {r: calls[r][i] for r in ranks if i < len(calls[r])}
        counts = Counter(present.values())
        if len(counts) > 1:
            ref = counts.most_common(1)[0][0] if tie_by_dict else next(
                present[r] for r in sorted(present) if counts[present[r]] == max(counts.values()))
            odd = [r for r in present if present[r] != ref]
            return i + one_based, odd if dict_order else sorted(odd)
        missing = [r for r in ranks if r not in present]
        if missing:
            return i + one_based, missing
    return None


def _diff_every_short_rank(calls):
    """Names every rank shorter than the longest, at the first index one is missing."""
    found = _diff_all_short(calls)
    longest = max(len(v) for v in calls.values())
    if found and any(len(calls[r]) <= found[0] for r in calls):
        return found[0], sorted(r for r in calls if len(calls[r]) < longest)
    return found


def _diff_empty_instead_of_none(calls):
    return _diff_all_short(calls) or (max(len(v) for v in calls.values()), [])


def _diff_ranks_as_tuple(calls):
    found = _diff_all_short(calls)
    return found and (found[0], tuple(found[1]))


def _diff_via_course(calls):
    """helpers.debug's own diff, its Finding turned into the pair."""
    from helpers.debug import first_disagreement as course_diff
    found = course_diff({r: [_Call(c) for c in v] for r, v in calls.items()})
    return None if found is None else (found.index, found.ranks)


class _Call(str):
    """A string that quacks enough like a CallRecord for the course's diff."""


def _diff_by_columns(calls):
    """Another right diff: pad every list with None, then read column by column."""
    ranks = sorted(calls)
    width = max((len(calls[r]) for r in ranks), default=0)
    rows = {r: calls[r] + [None] * (width - len(calls[r])) for r in ranks}
    for i in range(width):
        made = {r: rows[r][i] for r in ranks if rows[r][i] is not None}
        kinds = sorted(set(made.values()), key=lambda c: (-list(made.values()).count(c),
                                                          min(r for r in made if made[r] == c)))
        if len(kinds) > 1:
            return i, [r for r in ranks if r in made and made[r] != kinds[0]]
        if len(made) < len(ranks):
            return i, [r for r in ranks if r not in made]
    return None


class TestChapter18Diff(ChapterChecks):
    lab, sol = TestChapter18.lab, TestChapter18.sol
    checks = {"first_disagreement": Check(ch18.check_first_disagreement)}
    right = [Right("first_disagreement", _diff_by_columns, "padded columns, sorted by count")]
    wrong = [
        Wrong("first_disagreement", _diff_vs_rank0, "compares with rank 0",
              says="compare with the majority"),
        Wrong("first_disagreement", _diff_zip, "zip stops at the shortest list",
              says="zip.. stops at the shortest"),
        Wrong("first_disagreement", _diff_every_short_rank, "names every short rank",
              says="only rank 1 is missing"),
        Wrong("first_disagreement", lambda c: _diff_all_short(c, one_based=True),
              "counts from 1", says="expected \\(0, \\[2\\]\\)"),
        Wrong("first_disagreement", lambda c: _diff_all_short(c, tie_by_dict=True),
              "breaks a tie by dict order", says="a 2-2 tie"),
        Wrong("first_disagreement", lambda c: _diff_all_short(c, dict_order=True),
              "ranks in dict order, unsorted", says="sorted order"),
        Wrong("first_disagreement", lambda c: _diff_all_short(c, vote_missing=True),
              "votes on missing calls", says="not a majority vote"),
        Wrong("first_disagreement", _diff_empty_instead_of_none, "(len, []) when all agree",
              says="expected None"),
        Wrong("first_disagreement", _diff_ranks_as_tuple, "ranks as a tuple",
              says="a list of ints"),
        Wrong("first_disagreement", _diff_via_course, "the course's diff, converted",
              says="switched off in this check"),
    ]


def test_batch_plants_the_lab_nan_and_hides_other_ranks_data():
    """The lab's data: rank 2's batch at step 1 holds the NaN, the others are clean and
    equal to the reference's; inside a job a rank may read only its own batch and shard."""
    x, _ = batch(2, 1)
    assert torch.isnan(x[0, 0]) and not torch.isnan(x[1:]).any()
    assert torch.equal(batch(0, 1)[0], ch18._clean_batch(0, 1)[0])

    def other_ranks_batch():
        import torch.distributed as dist
        from helpers.checks.ch18 import batch
        try:
            batch((dist.get_rank() + 1) % 3, 0)
        except RuntimeError as exc:
            return str(exc)
        return "read"

    said = launch(other_ranks_batch, 3)
    assert all("sees only its own data" in s for s in said), said
