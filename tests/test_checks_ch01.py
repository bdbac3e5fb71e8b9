"""Chapter 01's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import math

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch01
from helpers.steptime import classify_bottleneck


def _no_master(weights, optimizer):
    w = 4 if weights == "fp32" else 2
    return 2 * w + {"adam": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]


def _largest_only(p):
    if p.mem_frac >= 0.9:
        return "memory-bound"
    part = max(("data", "compute", "comm"), key=p.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]


def _ratio_rule(p):  # "slowest rank computes 2x the fastest" flags noise when compute is small
    if p.mem_frac >= 0.9:
        return "memory-bound"
    if max(p.compute) > 2 * min(p.compute):
        return "straggler-bound"
    part = max(("data", "compute", "comm"), key=p.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]


class TestChapter01(ChapterChecks):
    lab = "labs/01_why_distributed_lab.ipynb"
    sol = "solutions/01_why_distributed_solution.ipynb"
    checks = {
        "bytes_per_param": Check(ch01.check_bytes_per_param),
        "gpus_needed": Check(ch01.check_gpus_needed),
        "classify_bottleneck": Check(ch01.check_classify_bottleneck),
    }
    wrong = [
        Wrong("bytes_per_param", _no_master, "forgets the fp32 master copy", says="master copy"),
        Wrong("gpus_needed", lambda n, b, g: int(n * b / (g * 1e9)),
              "rounds down", says="round up"),
        Wrong("gpus_needed", lambda n, b, g: math.ceil(n * b / (g * 2**30)),
              "GiB where the GPU's memory is in GB", says=None),
        Wrong("classify_bottleneck", _largest_only,
              "largest part only, no straggler rule", says="straggler"),
        Wrong("classify_bottleneck", _ratio_rule,
              "compute ratio flags noise as a straggler", says="all-reduce-bound"),
    ]
    right = [
        Right("classify_bottleneck", classify_bottleneck, "the library's classifier"),
    ]
