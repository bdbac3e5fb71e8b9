"""Lab 06 checks: pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest
import torch

from helpers.checks import CheckFailed
from helpers.checks import ch06
from tools.nbtool import exercise

SOL, LAB = "solutions/06_where_memory_goes_solution.ipynb", "labs/06_where_memory_goes_lab.ipynb"
CASES = [("step_peak", ch06.check_step_peak),
         ("activation_bytes", ch06.check_activation_bytes),
         ("saved_bytes", ch06.check_saved_bytes)]


@pytest.mark.parametrize("name, check", CASES)
def test_solution_passes(name, check, capsys):
    check(exercise(SOL, name))
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("name, check", CASES)
def test_lab_stub_fails(name, check):
    with pytest.raises(CheckFailed, match="not implemented yet"):
        check(exercise(LAB, name))


def test_wrong_bytes_per_param_fails():
    # forgot the fp32 master copy: 2 + 2 + 8 bytes per parameter
    wrong = lambda n, dp, stage: (4 + 8 / (dp if stage >= 1 else 1)) * n  # noqa: E731
    with pytest.raises(CheckFailed, match="n_params=7e\\+10"):
        ch06.check_model_state_bytes(wrong)


def test_stage_2_not_sharding_grads_fails():
    wrong = lambda n, dp, stage: (4 + 12 / (dp if stage else 1)) * n if stage < 3 \
        else 16 * n / dp  # noqa: E731
    with pytest.raises(CheckFailed, match="zero_stage=2"):
        ch06.check_model_state_bytes(wrong)


def test_activation_formula_without_attention_term_fails():
    with pytest.raises(CheckFailed, match="activation bytes"):
        ch06.check_activation_bytes(lambda s, b, h, a: 34 * s * b * h)


def _counter(dedup: bool, skip_params: bool):
    def count(model, run):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen, total = set(), 0

        def pack(t):
            nonlocal total
            ptr = t.untyped_storage().data_ptr()
            if (skip_params and ptr in params) or (dedup and ptr in seen):
                return t
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return total
    return count


def test_counter_without_dedup_fails():
    with pytest.raises(CheckFailed, match="saved twice"):
        ch06.check_saved_bytes(_counter(dedup=False, skip_params=True))


def test_counter_counting_parameters_fails():
    with pytest.raises(CheckFailed, match="parameters are model state"):
        ch06.check_saved_bytes(_counter(dedup=True, skip_params=False))


def test_counter_using_numel_fails():
    # counts t.numel() * element_size(): misses that a view keeps its whole buffer
    def count(model, run):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(seen.values())
    with pytest.raises(CheckFailed):
        ch06.check_saved_bytes(count)


def test_step_peak_mistakes_fail():
    def sum_of_parts(budget, layers):  # as if everything were alive at once
        return sum(budget.values())

    def no_grads(budget, layers):  # forgets the gradients of backward and the step
        return budget["weights"] + budget["optimizer"] + budget["activations"]

    with pytest.raises(CheckFailed, match="sum of all four"):
        ch06.check_step_peak(sum_of_parts)
    with pytest.raises(CheckFailed, match="gradients are alive"):
        ch06.check_step_peak(no_grads)
