"""helpers.checks.course_answers: the course's answers are refused inside the block only."""

import pytest

from helpers.checks import CheckFailed
from helpers.checks.course_answers import CourseAnswerUsed, refusing


def test_a_function_is_refused_under_any_name_and_restored_after():
    from helpers.pipeline import partition
    from helpers.pipeline import partition as alias

    with refusing(["helpers.pipeline.partition.partition"], "balanced_partition"):
        for fn in (partition, alias):
            with pytest.raises(CourseAnswerUsed, match="balanced_partition called "
                                                       "helpers.pipeline.partition.partition"):
                fn([1, 2, 3], 2)
    assert partition([1, 2, 3], 2) == [range(0, 2), range(2, 3)]
    assert issubclass(CourseAnswerUsed, CheckFailed)   # a check passes it on as it is


def test_a_class_is_refused_and_restored_even_when_the_block_fails():
    from helpers.tp import ColumnParallelLinear

    with pytest.raises(ZeroDivisionError):
        with refusing(["helpers.tp.layers.ColumnParallelLinear"], "your layer"):
            with pytest.raises(CourseAnswerUsed, match="your layer called"):
                ColumnParallelLinear(4, 4)
            1 / 0
    assert ColumnParallelLinear(4, 4).weight.shape == (4, 4)


def test_a_function_with_a_closure_is_refused_too():
    import types

    def outer():
        hidden = 3

        def inner(x):
            return x + hidden
        return inner

    inner = outer()
    module = types.ModuleType("tmp_course_answers_mod")
    module.inner = inner
    import sys
    sys.modules[module.__name__] = module
    try:
        with refusing([f"{module.__name__}.inner"], "exercise"):
            with pytest.raises(CourseAnswerUsed):
                inner(1)
        assert inner(1) == 4
    finally:
        del sys.modules[module.__name__]


def test_a_cached_function_is_refused_even_for_a_result_it_cached_and_each_reason_is_said():
    from helpers.costs.network import placement
    from helpers.topology import a100_cluster

    topo = a100_cluster(2)
    before = placement(topo, 16)          # now in placement's lru_cache
    with refusing({"helpers.costs.network.placement": "build it yourself"}, "ring_seconds"):
        with pytest.raises(CourseAnswerUsed, match="ring_seconds called helpers.costs.network"
                                                   ".placement, switched off in this check: "
                                                   "build it yourself"):
            placement(topo, 16)
    assert placement(topo, 16) == before
