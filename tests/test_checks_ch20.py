"""Chapter 20's checks pass on the solution, fail on the lab's stubs and on plausible mistakes:
a memory estimate that forgets the optimizer state, a layout whose TP crosses nodes, a
verdict that ignores the gradients or lets a NaN through."""

import pytest

from helpers.checks import CheckFailed, ch20
from helpers.memory import GB
from helpers.planner import Layout, plan
from tools.nbtool import exercise

LAB = "labs/20_design_training_stack_lab.ipynb"
SOL = "solutions/20_design_training_stack_solution.ipynb"


def test_solution_passes_and_stubs_fail(capsys):
    ch20.check_model_state(exercise(SOL, "model_state_gb"))
    ch20.check_choose_layout(exercise(SOL, "choose_layout"))
    ch20.check_capstone_verdict(exercise(SOL, "capstone_agrees"))
    assert capsys.readouterr().out.count("✓") == 3
    for check, name in ((ch20.check_model_state, "model_state_gb"),
                        (ch20.check_choose_layout, "choose_layout"),
                        (ch20.check_capstone_verdict, "capstone_agrees")):
        with pytest.raises(CheckFailed, match="not implemented"):
            check(exercise(LAB, name))


def test_memory_that_forgets_the_optimizer_state_fails():
    def weights_and_grads(n, dp, tp, pp, zero):
        n = n / (tp * pp)
        return (2 * n / (dp if zero >= 3 else 1) + 2 * n / (dp if zero >= 2 else 1)) / GB

    with pytest.raises(CheckFailed, match="optimizer state .* is missing"):
        ch20.check_model_state(weights_and_grads)


def test_memory_that_shards_at_the_wrong_stage_fails():
    def everything_at_stage_1(n, dp, tp, pp, zero):
        return 16 * n / (tp * pp) / (dp if zero >= 1 else 1) / GB

    with pytest.raises(CheckFailed, match="expected"):
        ch20.check_model_state(everything_at_stage_1)


def test_a_layout_whose_tp_crosses_nodes_fails():
    def tp_over_two_nodes(model, batch, gpu, topo):   # "TP 16 for a 70B model"
        return Layout(topo.world_size // 16, 16, 1, zero=3, recompute="full")

    with pytest.raises(CheckFailed, match="TP crosses a node"):
        ch20.check_choose_layout(tp_over_two_nodes)


def test_a_feasible_but_slow_layout_fails_and_names_the_term():
    def deepest_pipeline(model, batch, gpu, topo):
        # the feasible layout with the most pipeline stages: a large bubble
        p = plan(model, batch, gpu, topo, zero_stages=(1,), interleaves=(1,))
        return max(p.ranked, key=lambda e: (e.layout.pp, e.step_time)).layout

    with pytest.raises(CheckFailed, match="more than 10% over the planner's"):
        ch20.check_choose_layout(deepest_pipeline)


@pytest.mark.parametrize("wrong, case", [
    (lambda r: all(abs(a - b) <= r.bound for a, b in zip(r.losses, r.reference_losses)),
     "gradients off"),                                           # ignores the gradients
    (lambda r: not any(abs(a - b) > r.bound for a, b in zip(r.losses, r.reference_losses))
     and r.max_grad_diff <= r.bound, "a step missing"),           # zip hides a missing step
    (lambda r: len(r.losses) == len(r.reference_losses) and r.max_grad_diff <= r.bound
     and not any(abs(a - b) > r.bound for a, b in zip(r.losses, r.reference_losses)),
     "a NaN loss"),                                              # NaN > bound is False
    (lambda r: r.losses == r.reference_losses and r.max_grad_diff == 0,
     "within the bound"),                                        # exact equality, no bound
])
def test_capstone_verdicts_that_miss_a_case_fail(wrong, case):
    with pytest.raises(CheckFailed, match=case):
        ch20.check_capstone_verdict(wrong)
