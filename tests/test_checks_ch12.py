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


def _w_after_b(p, m):
    """1F1B with every backward cut into B and W, W at once: valid, 1F1B's bubble."""
    from helpers.pipeline import W, one_f_one_b
    return [[x for a in row for x in ([a] if a.kind == "F" else [a, W(a.microbatch)])]
            for row in one_f_one_b(p, m)]


def _all_w_last(p, m):
    """Every W postponed to the end: the smallest bubble, but m micro-batches held."""
    from helpers.pipeline import W, one_f_one_b
    return [row + [W(j) for j in range(m)] for row in one_f_one_b(p, m)]


def _w_before_b(p, m):
    from helpers.pipeline import W, one_f_one_b
    return [[x for a in row for x in ([a] if a.kind == "F" else [W(a.microbatch), a])]
            for row in one_f_one_b(p, m)]


def test_zb_h1_check(capsys):
    ch12.check_zb_h1(exercise(SOL, "zb_h1"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        ch12.check_zb_h1(exercise(LAB, "zb_h1"))
    with pytest.raises(CheckFailed, match="W runs right after its B"):
        ch12.check_zb_h1(_w_after_b)
    with pytest.raises(CheckFailed, match="keeps 1F1B's memory"):
        ch12.check_zb_h1(_all_w_last)
    with pytest.raises(CheckFailed, match="comes before its input-gradient backward"):
        ch12.check_zb_h1(_w_before_b)
    with pytest.raises(CheckFailed, match="no W actions"):
        ch12.check_zb_h1(lambda p, m: exercise(SOL, "one_f_one_b")(p, m))
