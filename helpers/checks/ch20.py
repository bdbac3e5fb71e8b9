"""Checks for chapter 20's lab: the model state a layout leaves on each GPU, a layout
chosen for a budget, and the verdict on the 3-D capstone's run."""

from __future__ import annotations

import dataclasses

from helpers.checks import CheckFailed, attempt, expect_close, passed

__all__ = ["check_model_state", "check_choose_layout", "check_capstone_verdict",
           "LAYOUT_CASES"]


def check_model_state(model_state_gb) -> None:
    """``model_state_gb(n_params, dp, tp, pp, zero)`` -> GB per GPU of weights, gradients
    and optimizer state (bf16 mixed-precision Adam), against ``helpers.memory``."""
    from helpers.memory import GB, model_state_bytes

    cases = [(7e9, 8, 1, 1, 0), (7e9, 8, 1, 1, 1), (70e9, 64, 1, 1, 3), (70e9, 8, 8, 1, 2),
             (175e9, 16, 8, 4, 1), (405e9, 128, 8, 16, 1)]
    for n, dp, tp, pp, zero in cases:
        want = model_state_bytes(n / (tp * pp), dp=dp, zero_stage=zero).total / GB
        got = attempt(model_state_gb, n, dp, tp, pp, zero, what="model_state_gb")
        what = f"model_state_gb({n:.0e} params, dp={dp}, tp={tp}, pp={pp}, zero={zero})"
        try:
            # the same products in another order: equal to rounding (rel 1e-9)
            expect_close(got, want, what, rel=1e-9)
        except CheckFailed as exc:
            states = model_state_bytes(n / (tp * pp), dp=dp, zero_stage=zero)
            if abs(float(got) - (states.params + states.grads) / GB) < 1e-9 * want:
                raise CheckFailed(f"{what}: {got:.4g} GB is weights + gradients only; the "
                                  f"optimizer state (fp32 master copy, Adam's m and v: 12 "
                                  f"bytes per parameter before ZeRO) is missing") from None
            raise exc
    passed("model state per GPU matches helpers.memory on 6 layouts, every ZeRO stage")


# (model, global batch, nodes of 8 H100s): the budgets choose_layout is tried on
LAYOUT_CASES = [("70B", 1024, 8), ("70B", 1024, 32), ("7B", 512, 1)]


def _models():
    from helpers.planner import ModelSpec
    return {"7B": ModelSpec(name="7B", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096,
                            ffn=11008, gated_mlp=True),
            "70B": ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                             ffn=28672, kv_heads=8,
                             gated_mlp=True)}


def check_choose_layout(choose_layout, slack: float = 0.10) -> None:
    """``choose_layout(model, global_batch, gpu, topology)`` -> a ``Layout`` that the
    planner finds feasible and whose step time is within ``slack`` of the planner's
    fastest: a simpler layout you can defend is fine, an infeasible one is not."""
    from helpers.planner import H100_80GB, Layout, evaluate, plan
    from helpers.topology import h100_cluster

    models = _models()
    for name, batch, nodes in LAYOUT_CASES:
        model, topo = models[name], h100_cluster(nodes)
        lay = attempt(choose_layout, model, batch, H100_80GB, topo, what="choose_layout")
        case = f"{name} on {topo.world_size} GPUs, global batch {batch}"
        if not isinstance(lay, Layout):
            raise CheckFailed(f"{case}: choose_layout must return a helpers.planner.Layout, "
                              f"got {type(lay).__name__}")
        e = evaluate(model, lay, batch, H100_80GB, topo)
        if not e.feasible:
            raise CheckFailed(f"{case}: {lay.short()} is not feasible: {e.reason}")
        best = plan(model, batch, H100_80GB, topo).best
        if e.step_time > best.step_time * (1 + slack):
            p = plan(model, batch, H100_80GB, topo)
            term, diff = p.decide(best, e)
            raise CheckFailed(f"{case}: {lay.short()} fits but takes {e.step_time:.2f} s per "
                              f"step, more than {slack:.0%} over the planner's "
                              f"{best.layout.short()} ({best.step_time:.2f} s); most of the "
                              f"difference is {term} (+{diff:.2f} s)")
    passed(f"choose_layout gives a feasible layout within {slack:.0%} of the fastest on "
           f"{len(LAYOUT_CASES)} budgets")


@dataclasses.dataclass
class _Run:
    """The fields of ``helpers.parallel3d.run_capstone``'s result that a verdict reads."""

    losses: list
    reference_losses: list
    max_grad_diff: float
    bound: float


def check_capstone_verdict(capstone_agrees) -> None:
    """``capstone_agrees(result) -> bool``: True exactly when every step's loss and the
    gradients after step 1 are within ``result.bound`` of the single-process run, and
    both runs have the same number of steps."""
    ref = [4.17, 4.02, 3.88]
    cases = [
        ("equal runs", _Run(list(ref), ref, 0.0, 1e-5), True),
        ("within the bound", _Run([x + 5e-6 for x in ref], ref, 8e-6, 1e-5), True),
        ("the last loss off by 1e-3", _Run(ref[:2] + [ref[2] + 1e-3], ref, 0.0, 1e-5), False),
        ("gradients off by 1e-2, losses equal", _Run(list(ref), ref, 1e-2, 1e-5), False),
        ("a step missing", _Run(ref[:2], ref, 0.0, 1e-5), False),
        ("a NaN loss", _Run(ref[:2] + [float("nan")], ref, 0.0, 1e-5), False),
    ]
    for what, run, want in cases:
        got = attempt(capstone_agrees, run, what="capstone_agrees")
        if not isinstance(got, bool):
            raise CheckFailed(f"capstone_agrees must return a bool, got {type(got).__name__}")
        if got != want:
            raise CheckFailed(f"{what}: capstone_agrees returned {got}, expected {want}")
    passed(f"capstone_agrees decides {len(cases)} runs correctly (losses, gradients, steps, NaN)")
