"""Chapter 18's checks pass on the solution, fail on the lab's stubs, on a diagnosis
that names a waiting rank, and on plausible wrong fixes; the broken functions' diffs
name the ranks the diagnosis check expects."""

import pytest
import torch

from helpers import RankError, launch
from helpers.checks import CheckFailed, ch18
from helpers.checks.ch18 import LR, STEPS, batch
from helpers.debug import first_disagreement
from tools.nbtool import exercise
from planted_bugs import pad_with_zero_grads, sync_always

LAB, SOL = "labs/18_debugging_health_lab.ipynb", "solutions/18_debugging_health_solution.ipynb"
FIXES = {1: "fixed_skip_nonfinite", 2: "fixed_log_on_rank0", 3: "fixed_uneven_shards"}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_diff_of_each_broken_function_names_the_faulty_rank(n):
    with pytest.raises(RankError) as info:
        launch(ch18.BROKEN[n], 3, record=True, timeout=6)
    finding = first_disagreement(info.value.records)
    assert finding.ranks == [ch18.FAULTY_RANK[n]], info.value.diff


def test_solution_passes_and_stubs_fail(capsys):
    ch18.check_diagnosis(exercise(SOL, "diagnose"))
    for n, name in FIXES.items():
        ch18.check_fixed(n, exercise(SOL, name))
    assert capsys.readouterr().out.count("✓") == 4
    with pytest.raises(CheckFailed, match="not implemented"):
        ch18.check_diagnosis(exercise(LAB, "diagnose"))
    for n, name in FIXES.items():
        with pytest.raises(CheckFailed, match="not implemented"):
            ch18.check_fixed(n, exercise(LAB, name))


def test_a_diagnosis_naming_a_waiting_rank_fails():
    for n, wrong in ((1, 0), (2, 1), (3, 2)):
        answer = {**ch18.FAULTY_RANK, n: wrong}
        with pytest.raises(CheckFailed, match=f"bug {n}: you named rank {wrong}"):
            ch18.check_diagnosis(lambda: answer)
    with pytest.raises(CheckFailed, match="keys 1, 2, 3"):
        ch18.check_diagnosis(lambda: {1: 2})


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_broken_function_itself_is_not_a_fix(n):
    with pytest.raises(CheckFailed, match=f"fix {n} still fails"):
        ch18.check_fixed(n, ch18.BROKEN[n])


@pytest.mark.parametrize("n, fix, message", [(1, sync_always, "every rank must skip"),
                                             (3, pad_with_zero_grads, "shortest shard")])
def test_plausible_wrong_fixes_fail(n, fix, message):
    with pytest.raises(CheckFailed, match=message):
        ch18.check_fixed(n, fix)


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
