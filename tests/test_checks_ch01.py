"""Chapter 01's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import math

import pytest

from helpers.checks import CheckFailed, ch01
from helpers.steptime import classify_bottleneck
from tools.nbtool import exercise

LAB, SOL = "labs/01_why_distributed_lab.ipynb", "solutions/01_why_distributed_solution.ipynb"


@pytest.mark.parametrize("name, check", [
    ("bytes_per_param", ch01.check_bytes_per_param),
    ("gpus_needed", ch01.check_gpus_needed),
    ("classify_bottleneck", ch01.check_classify_bottleneck),
])
def test_solution_passes_and_stub_fails(name, check, capsys):
    check(exercise(SOL, name))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        check(exercise(LAB, name))


def test_forgetting_the_master_copy_fails():
    def no_master(weights, optimizer):
        w = 4 if weights == "fp32" else 2
        return 2 * w + {"adam": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]

    with pytest.raises(CheckFailed, match="master copy"):
        ch01.check_bytes_per_param(no_master)


def test_rounding_down_or_gib_fails():
    with pytest.raises(CheckFailed, match="round up"):
        ch01.check_gpus_needed(lambda n, b, g: int(n * b / (g * 1e9)))
    with pytest.raises(CheckFailed):
        ch01.check_gpus_needed(lambda n, b, g: math.ceil(n * b / (g * 2**30)))


def test_largest_part_without_straggler_rule_fails():
    def largest_only(p):
        if p.mem_frac >= 0.9:
            return "memory-bound"
        part = max(("data", "compute", "comm"), key=p.mean)
        return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]

    with pytest.raises(CheckFailed, match="straggler"):
        ch01.check_classify_bottleneck(largest_only)


def test_compute_ratio_rule_fails():
    # "slowest rank computes 2x the fastest" flags noise when compute is small
    def ratio_rule(p):
        if p.mem_frac >= 0.9:
            return "memory-bound"
        if max(p.compute) > 2 * min(p.compute):
            return "straggler-bound"
        part = max(("data", "compute", "comm"), key=p.mean)
        return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]

    with pytest.raises(CheckFailed, match="all-reduce-bound"):
        ch01.check_classify_bottleneck(ratio_rule)


def test_reference_classifier_passes():
    ch01.check_classify_bottleneck(classify_bottleneck)
