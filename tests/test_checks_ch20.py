"""Chapter 20's checks pass on the solution, fail on the lab's stubs and on plausible mistakes:
a memory estimate that forgets the optimizer state, a layout whose TP crosses nodes, a
verdict that ignores the gradients or lets a NaN through."""

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch20
from helpers.memory import GB
from helpers.planner import Layout, plan


def _weights_and_grads(n, dp, tp, pp, zero):  # forgets the optimizer state
    n = n / (tp * pp)
    return (2 * n / (dp if zero >= 3 else 1) + 2 * n / (dp if zero >= 2 else 1)) / GB


def _everything_at_stage_1(n, dp, tp, pp, zero):
    return 16 * n / (tp * pp) / (dp if zero >= 1 else 1) / GB


def _tp_over_two_nodes(model, batch, gpu, topo):   # "TP 16 for a 70B model"
    return Layout(topo.world_size // 16, 16, 1, zero=3, recompute="full")


def _deepest_pipeline(model, batch, gpu, topo):
    # the feasible layout with the most pipeline stages: a large bubble
    p = plan(model, batch, gpu, topo, zero_stages=(1,), interleaves=(1,))
    return max(p.ranked, key=lambda e: (e.layout.pp, e.step_time)).layout


class TestChapter20(ChapterChecks):
    lab = "labs/20_design_training_stack_lab.ipynb"
    sol = "solutions/20_design_training_stack_solution.ipynb"
    checks = {
        "model_state": Check(ch20.check_model_state, "model_state_gb"),
        "choose_layout": Check(ch20.check_choose_layout),
        "capstone_verdict": Check(ch20.check_capstone_verdict, "capstone_agrees"),
    }
    wrong = [
        Wrong("model_state", _weights_and_grads, "forgets the optimizer state",
              says="optimizer state .* is missing"),
        Wrong("model_state", _everything_at_stage_1, "shards everything at stage 1",
              says="expected"),
        Wrong("choose_layout", _tp_over_two_nodes, "TP across two nodes",
              says="TP crosses a node"),
        Wrong("choose_layout", _deepest_pipeline, "feasible but slow: the deepest pipeline",
              says="more than 10% over the planner's"),
        Wrong("capstone_verdict",
              lambda r: all(abs(a - b) <= r.bound for a, b in zip(r.losses, r.reference_losses)),
              "ignores the gradients", says="gradients off"),
        Wrong("capstone_verdict",
              lambda r: not any(abs(a - b) > r.bound for a, b in zip(r.losses, r.reference_losses))
              and r.max_grad_diff <= r.bound,
              "zip hides a missing step", says="a step missing"),
        Wrong("capstone_verdict",
              lambda r: len(r.losses) == len(r.reference_losses) and r.max_grad_diff <= r.bound
              and not any(abs(a - b) > r.bound for a, b in zip(r.losses, r.reference_losses)),
              "NaN > bound is False", says="a NaN loss"),
        Wrong("capstone_verdict",
              lambda r: r.losses == r.reference_losses and r.max_grad_diff == 0,
              "exact equality, no bound", says="within the bound"),
    ]
