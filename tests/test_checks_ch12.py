"""Chapter 12's checks pass on the solution, fail on the lab's stub, on GPipe order and
on a schedule that deadlocks."""

import pytest

from helpers.checks import CheckFailed, ch12
from helpers.pipeline import B, F, gpipe
from tools.nbtool import exercise

LAB, SOL = "labs/12_pipeline_schedules_lab.ipynb", "solutions/12_pipeline_schedules_solution.ipynb"


def reversed_warmup(p, m):
    """Rank r warms up with r forwards instead of p - r - 1: deadlocks for p >= 2."""
    return [[F(j) for j in range(min(r, m))]
            + [a for k in range(m - min(r, m)) for a in (F(k + min(r, m)), B(k))]
            + [B(j) for j in range(m - min(r, m), m)] for r in range(p)]


def one_short(p, m):
    """Warm-up one forward short (p - r - 2): valid and deadlock-free, but not 1F1B."""
    out = []
    for r in range(p):
        w = max(min(p - r - 2, m), 0)
        out.append([F(j) for j in range(w)] + [a for k in range(m - w) for a in (F(k + w), B(k))]
                   + [B(j) for j in range(m - w, m)])
    return out


def test_bubble_check(capsys):
    ch12.check_bubble_fraction(exercise(SOL, "bubble_fraction"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        ch12.check_bubble_fraction(exercise(LAB, "bubble_fraction"))
    with pytest.raises(CheckFailed, match="relative to the ideal"):
        ch12.check_bubble_fraction(lambda p, m, v=1: (p - 1) / (v * m))
    with pytest.raises(CheckFailed):  # forgot that interleaving divides the fill by v
        ch12.check_bubble_fraction(lambda p, m, v=1: (p - 1) / (m + p - 1))


def test_one_f_one_b_check(capsys):
    ch12.check_one_f_one_b(exercise(SOL, "one_f_one_b"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        ch12.check_one_f_one_b(exercise(LAB, "one_f_one_b"))
    with pytest.raises(CheckFailed, match=r"holds up to \[2\] micro-batches"):
        ch12.check_one_f_one_b(gpipe)
    with pytest.raises(CheckFailed, match="can never finish.*deadlocks"):
        ch12.check_one_f_one_b(reversed_warmup)
    with pytest.raises(CheckFailed):
        ch12.check_one_f_one_b(one_short)
    with pytest.raises(CheckFailed, match="not a valid schedule"):
        ch12.check_one_f_one_b(lambda p, m: [[F(j) for j in range(m)] for _ in range(p)])


@pytest.mark.slow
def test_on_ranks_check(capsys):
    # these two fail before any rank starts
    with pytest.raises(CheckFailed, match="not implemented"):
        ch12.check_one_f_one_b_on_ranks(exercise(LAB, "one_f_one_b"))
    with pytest.raises(CheckFailed, match="can never finish"):
        ch12.check_one_f_one_b_on_ranks(reversed_warmup)
    # GPipe order runs correctly on the ranks, but its measured stash gives it away
    with pytest.raises(CheckFailed, match=r"measured peak stash \[4, 4\]"):
        ch12.check_one_f_one_b_on_ranks(gpipe)
    ch12.check_one_f_one_b_on_ranks(exercise(SOL, "one_f_one_b"))
    assert "✓" in capsys.readouterr().out
