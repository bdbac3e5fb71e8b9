"""Chapter 18's checks pass on the solution, fail on the lab's stubs, on a diagnosis
that names a waiting rank, and on plausible wrong fixes; the broken functions' diffs
name the ranks the diagnosis check expects."""

import pytest
import torch

from checks_harness import ChapterChecks, Check, Wrong
from helpers import RankError, launch
from helpers.checks import ch18
from helpers.checks.ch18 import LR, STEPS, batch
from helpers.debug import first_disagreement
from planted_bugs import pad_with_zero_grads, sync_always


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
    wrong = [
        *(Wrong("diagnosis", _naming(n, rank), f"bug {n}: names waiting rank {rank}",
                says=f"bug {n}: you named rank {rank}") for n, rank in ((1, 0), (2, 1), (3, 2))),
        Wrong("diagnosis", lambda: {1: 2}, "one bug only", says="keys 1, 2, 3"),
        *(Wrong(f"fix {n}", ch18.BROKEN[n], "the broken function itself",
                says=f"fix {n} still fails") for n in (1, 2, 3)),
        Wrong("fix 1", sync_always, "syncs on every step", says="every rank must skip"),
        Wrong("fix 3", pad_with_zero_grads, "pads with zero gradients", says="shortest shard"),
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
        xs, ys = zip(*(batch(r, step) for r in range(3)))
        (torch.cat(xs) @ w - torch.cat(ys)).pow(2).mean().backward()
        with torch.no_grad():
            w -= LR * w.grad
        w.grad = None
    # float64; two summation orders of the same 12 terms: ~1e-15 apart
    assert torch.allclose(ch18.reference(), w.detach(), rtol=0, atol=1e-12)
