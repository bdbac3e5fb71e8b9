"""Chapter 16's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest

from helpers.checks import CheckFailed, ch16
from tools.nbtool import exercise

LAB, SOL = "labs/16_comm_overlap_lab.ipynb", "solutions/16_comm_overlap_solution.ipynb"


@pytest.mark.parametrize("name, check", [
    ("union_length", ch16.check_union_length),
    ("prefetch", ch16.check_prefetch),
])
def test_solution_passes_and_stub_fails(name, check, capsys):
    check(exercise(SOL, name))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        check(exercise(LAB, name))


def test_plain_sum_and_unsorted_merge_fail():
    with pytest.raises(CheckFailed, match="plain sum"):
        ch16.check_union_length(lambda spans: sum(b - a for a, b in spans))

    def no_sort(spans):
        total, end = 0.0, float("-inf")
        for a, b in spans:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return total

    with pytest.raises(CheckFailed):
        ch16.check_union_length(no_sort)


def test_prefetch_mistakes_fail():
    def same_direction(fsdp, i, phase):  # i + 1 in backward too: that unit already ran
        if i + 1 < len(fsdp.units):
            fsdp.gather_async(fsdp.units[i + 1])

    with pytest.raises(CheckFailed, match="bytes sent|backward"):
        ch16.check_prefetch(same_direction)

    def everything(fsdp, i, phase):  # gathers all units at once: memory of DDP
        for u in fsdp.units:
            fsdp.gather_async(u)

    with pytest.raises(CheckFailed):
        ch16.check_prefetch(everything)
