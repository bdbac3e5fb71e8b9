"""Lab 06 checks: pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch06
from helpers.memory import model_state_bytes


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


def _counter_using_numel(model, run):
    # counts t.numel() * element_size(): misses that a view keeps its whole buffer
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


def _params_by_id(model, run):  # excludes parameters by id(): a saved weight.t() slips in
    params = {id(p) for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if id(t) not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def _pack_returns_nothing(model, run):  # right count, but autograd keeps None
    inner = _counter(dedup=True, skip_params=True)
    total = inner(model, lambda: None)  # nothing counted by the inner one
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def _float_count(model, run):  # the right count, as a float (bytes / 1 ...)
    return float(_counter(dedup=True, skip_params=True)(model, run))


def _misspelled_part(budget, layers):  # "optimiser": a KeyError
    return budget["weights"] + budget["optimiser"] + max(budget["activations"], budget["grads"])


class TestChapter06(ChapterChecks):
    lab = "labs/06_where_memory_goes_lab.ipynb"
    sol = "solutions/06_where_memory_goes_solution.ipynb"
    checks = {
        "step_peak": Check(ch06.check_step_peak),
        "activation_bytes": Check(ch06.check_activation_bytes),
        "saved_bytes": Check(ch06.check_saved_bytes),
        # no notebook calls it (yet): only the answers below
        "model_state_bytes": Check(ch06.check_model_state_bytes, notebook=False),
    }
    wrong = [
        Wrong("model_state_bytes", lambda n, dp, stage: (4 + 8 / (dp if stage >= 1 else 1)) * n,
              "forgets the fp32 master copy: 2 + 2 + 8 bytes", says="n_params=7e\\+10"),
        Wrong("model_state_bytes",
              lambda n, dp, stage: (4 + 12 / (dp if stage else 1)) * n if stage < 3
              else 16 * n / dp,
              "stage 2 does not shard the gradients", says="zero_stage=2"),
        Wrong("activation_bytes", lambda s, b, h, a: 34 * s * b * h,
              "no attention term", says="add the attention term"),
        Wrong("activation_bytes", lambda s, b, h, a: s * b * h * (34 + 5 * a * s // h),
              "integer division in 5as/h", says=r"s=100, b=2, h=96, a=6.*true division"),
        Wrong("activation_bytes", lambda s, b, h, a: s * h * (34 * b + 5 * a * s / h),
              "attention term without the batch", says="scales with the batch"),
        Wrong("activation_bytes", lambda s, b, h, a: s * b * h * (33 + 5 * a * s / h),
              "one dropout mask left out (33 sbh)",
              says=r"33 sbh \+ 5 a s\^2 b.*1 sbh fewer.*dropout mask"),
        Wrong("activation_bytes", lambda s, b, h, a: s * b * h * (34 + 6 * a * s / h),
              "a 2-byte attention dropout mask (6 as^2b)",
              says=r"1 a s\^2 b more.*attention dropout mask.*1 byte an element"),
        Wrong("activation_bytes", lambda s, b, h, a: 2 * s * b * h * (34 + 5 * a * s / h),
              "4-byte activations (everything x2)", says="Both terms are 2x the paper's"),
        Wrong("activation_bytes", lambda s, b, h, a: s * b * h * (26 + 5 * a * s / h),
              "the GeLU's input left out (26 sbh)", says=r"8 sbh fewer.*the GeLU's input"),
        Wrong("saved_bytes", _params_by_id, "parameters excluded by id()",
              says="excluded by their storage"),
        Wrong("saved_bytes", _pack_returns_nothing, "the pack hook returns nothing",
              says="pack hook must return the tensor"),
        Wrong("saved_bytes", _float_count, "a float count", says="return an int"),
        Wrong("step_peak", _misspelled_part, "a misspelled part name",
              says="raised KeyError"),
        Wrong("step_peak", lambda budget, layers: None, "returns None",
              says="should return a number"),
        Wrong("saved_bytes", _counter(dedup=False, skip_params=True),
              "counts a tensor saved twice twice", says="saved twice"),
        Wrong("saved_bytes", _counter(dedup=True, skip_params=False),
              "counts the parameters", says="parameters are model state"),
        Wrong("saved_bytes", _counter_using_numel, "numel, not the storage's bytes", says=None),
        Wrong("step_peak", lambda budget, layers: sum(budget.values()),
              "as if everything were alive at once", says="sum of all four"),
        Wrong("step_peak",
              lambda budget, layers: budget["weights"] + budget["optimizer"]
              + budget["activations"],
              "forgets the gradients of backward and the step", says="gradients are alive"),
    ]
    right = [
        Right("model_state_bytes",
              lambda n, dp, stage: model_state_bytes(n, dp=dp, zero_stage=stage).total,
              "helpers.memory's model_state_bytes"),
    ]


def test_the_named_terms_add_up_to_the_papers_coefficients():
    # the hint names terms by size: they must be Korthikanti et al.'s 34 sbh and 5 a s^2 b
    assert sum(ch06._SBH_TERMS.values()) == 34 and sum(ch06._AS2B_TERMS.values()) == 5
