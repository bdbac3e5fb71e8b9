"""Checks for lab 06: memory over a step, the activation formula, the saved-tensor counter
(and the model-state formula, which lab 01 covers)."""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, expect_close, passed
from helpers.memory import (SavedTensorCounter, activation_bytes_per_layer, memory_over_step,
                            model_state_bytes)
from helpers.model import build_model

__all__ = ["check_step_peak", "check_model_state_bytes", "check_activation_bytes",
           "check_saved_bytes"]


def check_model_state_bytes(learner_fn) -> None:
    """``learner_fn(n_params, dp, zero_stage) -> bytes per GPU`` (bf16 mixed Adam)."""
    cases = [(70e9, 1, 0), (7.5e9, 64, 0), (7.5e9, 64, 1), (7.5e9, 64, 2), (7.5e9, 64, 3),
             (1e9, 8, 2), (3e9, 1, 3)]
    for n, dp, stage in cases:
        want = model_state_bytes(n, dp=dp, zero_stage=stage).total
        got = attempt(learner_fn, n, dp, stage, what="model_state_bytes")
        expect_close(got, want, f"n_params={n:g}, dp={dp}, zero_stage={stage}", rel=1e-9)
    passed("model-state bytes: 70B -> 1,120 GB and ZeRO Fig. 1 "
           "(120 / 31.4 / 16.6 / 1.9 GB) reproduced")


STEP_BUDGETS = [  # (budget in GB, layers): activations above, then below, the gradients
    ({"weights": 14.0, "grads": 14.0, "optimizer": 84.0, "activations": 52.0}, 32),
    ({"weights": 14.0, "grads": 14.0, "optimizer": 84.0, "activations": 6.0}, 32),
    ({"weights": 2.0, "grads": 2.0, "optimizer": 12.0, "activations": 2.0}, 1),
    ({"weights": 140.0, "grads": 140.0, "optimizer": 840.0, "activations": 700.0}, 80),
]


def check_step_peak(learner_fn) -> None:
    """``learner_fn(budget, layers) -> peak bytes`` over one step, against
    ``helpers.memory.memory_over_step``."""
    for budget, layers in STEP_BUDGETS:
        want = max(sum(parts.values()) for _, parts in memory_over_step(budget, layers))
        got = attempt(learner_fn, dict(budget), layers, what="step_peak")
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise CheckFailed(f"step_peak should return a number of bytes, got {got!r}") from None
        if abs(value - want) > 1e-9 * want:
            total = sum(budget.values())
            hint = ""
            if abs(value - total) <= 1e-9 * total:
                hint = (" That is the sum of all four parts: they are never all alive at once "
                        "(backward frees a layer's activations where its gradients appear).")
            elif abs(value - (total - budget["grads"])) <= 1e-9 * total:
                hint = " The gradients are alive too, at the end of backward and at the step."
            raise CheckFailed(f"step_peak({budget}, layers={layers}) = {value:g}, expected "
                              f"{want:g}.{hint}")
    passed("peak over a step: weights + optimizer + the larger of activations (end of forward) "
           "and gradients (end of backward), on 4 budgets")


def check_activation_bytes(learner_fn) -> None:
    """``learner_fn(seq, batch, hidden, heads) -> bytes`` of one layer (Korthikanti eq.)."""
    cases = [(2048, 1, 12288, 96), (1024, 4, 4096, 32), (32, 8, 64, 4), (4096, 1, 8192, 64)]
    for s, b, h, a in cases:
        got = attempt(learner_fn, s, b, h, a, what="activation_bytes")
        expect_close(got, activation_bytes_per_layer(s, b, h, a),
                     f"activation bytes for s={s}, b={b}, h={h}, a={a}", rel=1e-9)
    passed("activation bytes per layer: s*b*h*(34 + 5*a*s/h) on 4 shapes")


def _cases():
    # A toy GPT in bf16 with dropout: parameters are saved (excluded), the
    # cross-entropy saves one buffer twice (count once), views share storage.
    model = build_model("toy", dropout=0.1).to(torch.bfloat16).train()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (2, 16), generator=g)
    tgt = torch.randint(0, 64, (2, 16), generator=g)
    yield "toy GPT forward (bf16, dropout 0.1)", model, lambda: model(idx, tgt)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def views():
        y = lin(x)
        return y[:, :4] * y[:, 4:]      # two views of y, one buffer
    yield "linear then a product of two views", lin, views


def check_saved_bytes(learner_fn) -> None:
    """``learner_fn(model, run) -> int``: bytes autograd keeps for backward while
    ``run()`` executes, each storage once, parameters not counted."""
    for what, model, run in _cases():
        with SavedTensorCounter(model) as ref:
            run()
        torch.manual_seed(0)
        got = attempt(learner_fn, model, run, what="saved_bytes")
        if not isinstance(got, int):
            raise CheckFailed(f"{what}: return an int number of bytes, got {type(got).__name__}")
        if got != ref.total_bytes:
            with_params = ref.total_bytes + sum(
                r.storage_bytes for r in ref.records if r.is_param)
            hint = ""
            if got == with_params:
                hint = " (parameters are model state, not activations: leave them out)"
            elif got > ref.total_bytes:
                hint = " (is a storage saved twice counted twice?)"
            raise CheckFailed(f"{what}: expected {ref.total_bytes:,} bytes, got {got:,}{hint}")
    passed("saved-tensor counter agrees with the reference to the byte")
