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
    """``learner_fn(n_params, dp, zero_stage) -> bytes per GPU`` (bf16 mixed Adam).

    Catches:
    * forgets the fp32 master copy (12 bytes, not 16): 70e9 at dp 1;
    * stage 2 not sharding the gradients, stage 3 not the weights: the 7.5e9 rows;
    * ZeRO applied at dp = 1 or stage 0: the dp = 1 and stage 0 rows;
    * None or an exception: named with the case.
    """
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
    ``helpers.memory.memory_over_step``.

    Catches:
    * the sum of all four parts: named;
    * forgets the gradients (alive at the end of backward and at the step): named;
    * always activations, or always gradients, as the third term: the budgets with
      activations above, then below, the gradients;
    * mutates the budget dict the caller passed: the next case's numbers (a copy is
      passed, and the check compares with a fresh one);
    * returns None or a string: named; an exception (a KeyError on a part's name): named.
    """
    for budget, layers in STEP_BUDGETS:
        want = max(sum(parts.values()) for _, parts in memory_over_step(budget, layers))
        got = attempt(learner_fn, dict(budget), layers,
                      what=f"step_peak({budget}, layers={layers})")
        try:
            if isinstance(got, (str, bool)):  # float() takes them; the lab wants a number
                raise TypeError
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
    """``learner_fn(seq, batch, hidden, heads) -> bytes`` of one layer (Korthikanti eq.).

    Catches:
    * no attention term (34 sbh only): every case;
    * integer division in 5as/h (``5 * a * s // h``): (100, 2, 96, 6), where 5as/h =
      31.25 is not a whole number (in the GPT-3-like shapes it always is);
    * the attention term without the batch, or with h where s belongs: wrong values;
    * a count of the right shape with a term off (33 sbh: a dropout mask left out; 6 as^2b:
      a 2-byte mask; everything x2: 4-byte values): the two coefficients are solved from
      the five shapes and the one that is off is named, with the terms of that size;
    * None or an exception: named with the case.
    """
    cases = [(2048, 1, 12288, 96), (1024, 4, 4096, 32), (32, 8, 64, 4), (4096, 1, 8192, 64),
             (100, 2, 96, 6)]
    for s, b, h, a in cases:
        got = attempt(learner_fn, s, b, h, a, what=f"activation_bytes({s}, {b}, {h}, {a})")
        want = activation_bytes_per_layer(s, b, h, a)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and \
                abs(got - want) > 1e-9 * abs(want):
            raise CheckFailed(_activation_hint(got, s, b, h, a,
                                               _coefficient_hint(learner_fn, cases)))
        expect_close(got, want, f"activation bytes for s={s}, b={b}, h={h}, a={a}", rel=1e-9)
    passed(f"activation bytes per layer: s*b*h*(34 + 5*a*s/h) on {len(cases)} shapes, one "
           f"where 5as/h is not a whole number")


# Korthikanti et al. 2022, sec. 4.1, 16-bit activations, dropout masks 1 byte an element:
# the sbh terms (34 in all) and the a s^2 b terms (5 in all), each named, so that a count
# off by one term's size can say which terms have that size.
_SBH_TERMS = {"the LayerNorm inputs": 4, "the QKV input": 2, "Q and K": 4, "V": 2,
              "the attention projection's input": 2, "the attention output's dropout mask": 1,
              "the MLP's input": 2, "the GeLU's input": 8, "the GeLU's output": 8,
              "the MLP output's dropout mask": 1}
_AS2B_TERMS = {"the softmax output": 2, "the attention dropout mask": 1,
               "the dropout output (the scores V multiplies)": 2}


def _sizes_named(terms: dict, diff: float) -> str:
    """The terms, or pairs of terms, whose coefficients add up to ``|diff|``."""
    names, diff = list(terms), round(abs(diff), 6)
    one = [n for n in names if terms[n] == diff]
    two = [f"{x} and {y}" for i, x in enumerate(names) for y in names[i + 1:]
           if terms[x] + terms[y] == diff]
    fits = one + two[:3]
    return f" ({' or '.join(fits)}?)" if fits else ""


def _coefficient_hint(learner_fn, cases) -> str:
    """When the learner's count is some c1 * sbh + c2 * a s^2 b on every case (a formula
    of the right shape with a wrong term), solve for c1 and c2 from the five shapes and
    name the term that is off; otherwise nothing."""
    import numpy as np

    got = []
    for s, b, h, a in cases:
        try:
            value = learner_fn(s, b, h, a)
        except Exception:  # noqa: BLE001 - the per-case hint has already named the case
            return ""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return ""
        got.append(float(value))
    design = np.array([[s * b * h, a * s * s * b] for s, b, h, a in cases], dtype=float)
    (c1, c2), *_ = np.linalg.lstsq(design, np.array(got), rcond=None)
    # the five shapes determine c1 and c2; a count of another shape leaves a residual
    if not np.allclose(design @ (c1, c2), got, rtol=1e-9, atol=0):
        return ""
    parts = [f" Over the five shapes your count is {c1:.4g} sbh + {c2:.4g} a s^2 b (the "
             f"paper, Korthikanti et al. 2022, sec. 4.1: 34 sbh + 5 a s^2 b)."]
    if abs(c1 / 34 - c2 / 5) < 1e-9 and abs(c1 - 34) > 1e-9:
        return parts[0] + (f" Both terms are {c1 / 34:.4g}x the paper's: the paper counts "
                           f"2 bytes a value (16-bit activations) and 1 byte a mask element.")
    if abs(c1 - 34) > 1e-9:
        what = "more" if c1 > 34 else "fewer"
        parts.append(f" The linear-layer term has {abs(c1 - 34):.4g} sbh {what} than it "
                     f"should{_sizes_named(_SBH_TERMS, c1 - 34)}.")
    if abs(c2 - 5) > 1e-9:
        what = "more" if c2 > 5 else "fewer"
        parts.append(f" The attention term has {abs(c2 - 5):.4g} a s^2 b {what} than it "
                     f"should{_sizes_named(_AS2B_TERMS, c2 - 5)}; a dropout mask is 1 byte "
                     f"an element.")
    return "".join(parts)


def _activation_hint(got, s, b, h, a, coefficients: str = "") -> str:
    """Which part of Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) (2022, sec. 4.1) is off
    (``coefficients``: ``_coefficient_hint``'s sentence, used when no slip below fits)."""
    want = activation_bytes_per_layer(s, b, h, a)
    head = (f"activation bytes for s={s}, b={b}, h={h}, a={a}: got {got:,.6g}, expected "
            f"{want:,.6g} = s*b*h*(34 + 5*a*s/h).")
    if abs(got - 34 * s * b * h) <= 1e-9 * want:
        return head + (" That is the 34 sbh of the linear layers alone: add the attention "
                       "term 5 a s^2 b (the scores, the softmax and its dropout mask, per "
                       "head).")
    if abs(got - s * b * h * (34 + 5 * a * s // h)) <= 1e-9 * want:
        return head + (" 5*a*s/h is not a whole number here: use true division (/), not "
                       "//.")
    if abs(got - s * h * (34 * b + 5 * a * s / h)) <= 1e-9 * want:
        return head + " The attention term scales with the batch too: 5 a s^2 b."
    return head + (coefficients or " Check each term: 34 s b h for the linear layers, "
                   "5 a s^2 b for attention (Korthikanti et al. 2022, sec. 4.1).")


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
    ``run()`` executes, each storage once, parameters not counted.

    Catches:
    * a storage saved twice counted twice: named;
    * parameters counted (all of them, or those autograd saves as a view such as
      ``weight.t()`` when excluded by ``id()``): named, with the bytes involved;
    * numel x element size instead of the storage's bytes (a view keeps its whole
      buffer): the product of two views;
    * a pack hook that returns nothing: the count may be right, but backward then
      fails; the check runs backward after your function and names it;
    * returns a float, None: named; an exception: named with the case.
    """
    for what, model, run in _cases():
        with SavedTensorCounter(model) as ref:
            run()
        torch.manual_seed(0)
        outputs = []

        def run_and_keep():
            out = run()
            outputs.append(out)
            return out

        got = attempt(learner_fn, model, run_and_keep, what=f"saved_bytes ({what})")
        if not isinstance(got, int) or isinstance(got, bool):
            raise CheckFailed(f"{what}: return an int number of bytes, got {got!r}")
        # backward first: a pack hook that returns nothing also spoils the count (freed
        # buffers are reused, so storages look shared), and that is not the mistake
        _backward_still_works(what, outputs)
        if got != ref.total_bytes:
            raise CheckFailed(f"{what}: expected {ref.total_bytes:,} bytes, got {got:,}"
                              f"{_saved_hint(got, ref, model)}")
    passed("saved-tensor counter agrees with the reference to the byte, and backward still runs")


def _saved_hint(got: int, ref, model) -> str:
    with_params = ref.total_bytes + sum(r.storage_bytes for r in ref.records if r.is_param)
    extra = got - ref.total_bytes
    param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    every_save = sum(r.storage_bytes for r in ref.records if not r.is_param)
    if got == with_params:
        return " (parameters are model state, not activations: leave them out)"
    if got == every_save:
        return (" (a storage saved twice is counted twice: count each storage once, keyed "
                "by t.untyped_storage().data_ptr())")
    if 0 < extra <= param_bytes:
        return (f" ({extra:,} bytes too many, no more than the parameters' {param_bytes:,}: "
                f"are parameters excluded by their storage? autograd often saves a weight "
                f"as a view such as weight.t(), another tensor object than the parameter, "
                f"so an id() test misses it)")
    if extra > 0:
        return " (is a storage saved twice counted twice, or a parameter counted?)"
    return (" (count each storage's bytes, t.untyped_storage().nbytes(): a view keeps its "
            "whole buffer alive)")


def _backward_still_works(what: str, outputs: list) -> None:
    """Backward through what ``run`` produced under the learner's hooks: a pack hook
    that returns nothing leaves autograd nothing to unpack."""
    if not outputs:
        raise CheckFailed(f"{what}: your function never called run(): call it inside your "
                          f"saved_tensors_hooks context")
    out = outputs[0]
    loss = out[1] if isinstance(out, tuple) else out.float().sum()
    try:
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - the learner's hooks broke backward: say so
        raise CheckFailed(f"{what}: the count is right, but backward through the graph built "
                          f"under your hooks fails ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}). The pack hook must return the "
                          f"tensor (and unpack return what pack gave it).") from None
