"""Checks for lab 13: the checkpoint Function, the delayed-scaling update, MXFP8 blocks.

A property the runtime already guarantees cannot show a learner's step. torch 2.13's
cast to ``float8_e4m3fn`` saturates by itself: its conversion
(``fp8e4m3fn_from_fp32_value`` in ``torch/headeronly/util/Float8_e4m3fn.h``) maps every
value above 448, inf included, to 448 (``torch.tensor([486.]).to(torch.float8_e4m3fn)``
is 448 in this torch), where an earlier version of the same function in PyTorch's
repository (``c10/util/Float8_e4m3fn.h``) returned NaN for the values from 480 up.
Comparing the FP8 bits with the reference would then pass a quantizer that never
saturates, in one torch and not in another. So ``check_mx_quantize`` watches what
reaches the cast instead: every call that makes or fills an E4M3 tensor from a wider
float is seen (a ``TorchFunctionMode`` sees ``.to``, ``.type``, ``copy_``,
``__setitem__``...), and a value above 448 going in is the learner's missing clamp,
whatever this torch's cast does with it.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, passed
from helpers.checks.course_answers import refusing
from helpers.memory import SavedTensorCounter
from helpers.model import Block, GPTConfig
from helpers.precision import update_delayed_scale
from helpers.tolerance import gamma

__all__ = ["check_checkpoint", "check_delayed_scale", "check_mx_quantize"]

COURSE_DELAYED = ["helpers.precision.fp8.update_delayed_scale"]
COURSE_MX = ["helpers.precision.block_scaling.mx_quantize",
             "helpers.precision.block_scaling.block_quantize"]


def check_checkpoint(LearnerCheckpoint) -> None:
    """``LearnerCheckpoint.apply(run_fn, x)`` must equal ``run_fn(x)`` in output and in
    every gradient (dropout on), and keep only ``x`` for backward.

    Catches:
    * a fresh dropout mask in the recompute (RNG state not saved): gradients (named);
    * reseeds instead of saving the state (torch.initial_seed(), or one fixed seed for forward
      and recompute): matches right after torch.manual_seed, not once the stream has drawn
      (the second case; named);
    * forward rewinds the stream after drawing: the stream after forward (named);
    * rewinds the global RNG without fork_rng: the caller's stream after backward (named);
    * saves the output (or runs forward with grad): bytes kept for backward (named); the
      RNG state kept with ``save_for_backward`` is not counted (it is part of an answer);
    * backward returns one gradient for two inputs (no None for run_fn), or the
      recompute outside enable_grad: the RuntimeError, named;
    * backward returns the gradient of the output, not of x: gradients differ (named);
    * forward returns a tuple or another shape: named.
    """
    cfg = GPTConfig(dropout=0.3)
    torch.manual_seed(0)
    block = Block(cfg).train()
    x0 = torch.randn(2, 16, cfg.n_embd)

    def grads(fn, drawn):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(42)
        if drawn:                     # the stream in use since the seed, as at every layer
            torch.rand(drawn)         # but the first: only a saved state replays it
        with SavedTensorCounter(block) as counter:
            y = fn(x)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            raise CheckFailed(f"the checkpoint should return block(x), a tensor of shape "
                              f"{tuple(x.shape)}, got {type(y).__name__}")
        after_forward = torch.get_rng_state()  # the next layer draws from here
        torch.manual_seed(1234)       # backward runs with the RNG elsewhere, as in training
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        after = torch.get_rng_state()  # backward must leave the caller's stream alone
        # the RNG state (a uint8 tensor) may be kept with save_for_backward too: it is not
        # an activation, and keeping it is part of a right answer
        rng = torch.get_rng_state()
        kept = sum(r.nbytes for r in counter.records
                   if not (r.dtype == rng.dtype and r.shape == tuple(rng.shape)))
        return (y.detach(), x.grad, [p.grad for p in block.parameters()], kept,
                after, after_forward)

    def same_run(ref, got):           # output and every gradient as without checkpointing
        return (torch.equal(got[0], ref[0]) and got[1] is not None
                and all(g is not None for g in got[2]) and torch.equal(got[1], ref[1])
                and all(torch.equal(a, b) for a, b in zip(got[2], ref[2])))

    # Two cases: forward the first draw after torch.manual_seed (where reseeding with
    # torch.initial_seed() or any fixed seed happens to replay the mask), and forward after
    # the stream has drawn (only the saved RNG state replays that mask).
    runs = [(drawn, grads(block, drawn),
             attempt(grads, lambda x: LearnerCheckpoint.apply(block, x), drawn,
                     what="Checkpoint"))
            for drawn in (0, 5)]
    fresh_ok = same_run(runs[0][1], runs[0][2])
    for drawn, ref, got in runs:
        if drawn and fresh_ok and not same_run(ref, got):
            raise CheckFailed(
                f"right after torch.manual_seed the checkpoint matched block(x), but with the "
                f"random stream already in use ({drawn} numbers drawn since the seed, as at "
                f"every layer but the first) its "
                f"{'output' if not torch.equal(got[0], ref[0]) else 'gradients'} differ: "
                f"reseeding (torch.initial_seed() or a fixed seed) restarts the stream from "
                f"the seed, not from where forward drew its mask. Save torch.get_rng_state() "
                f"in forward and restore it with torch.set_rng_state in backward")
        if not torch.equal(got[0], ref[0]):
            raise CheckFailed("forward output differs from block(x) run on the caller's random "
                              "stream as it is (dropout on)")
        if got[1] is None or any(g is None for g in got[2]):
            raise CheckFailed("some gradients are missing: backward must run the recomputed "
                              "graph backward and return the input's gradient")
        if not same_run(ref, got):
            raise CheckFailed("gradients differ from no recompute: with dropout on, the "
                              "recompute must draw the same mask (save the RNG state in "
                              "forward, restore it in backward)")
        if not torch.equal(got[5], ref[5]):
            raise CheckFailed("after forward the caller's random stream is not where block(x) "
                              "leaves it: forward draws its dropout from the stream as it is "
                              "and leaves it advanced (the next layer needs fresh masks); only "
                              "backward's recompute rewinds, inside fork_rng")
        if not torch.equal(got[4], ref[4]):
            raise CheckFailed("backward changed the caller's random stream: restore the saved "
                              "RNG state inside torch.random.fork_rng(devices=[]) so it is put "
                              "back after the recompute")
        if got[3] > x0.nbytes:
            raise CheckFailed(f"the checkpoint kept {got[3]:,} bytes for backward; only the "
                              f"input ({x0.nbytes:,} bytes) should be kept (run the block under "
                              f"no_grad)")
    passed("checkpoint: same output and gradients with dropout (first draw after the seed, and "
           "the stream already in use), keeps only the input, leaves the caller's random stream "
           "where block(x) would after forward and after backward")


def check_delayed_scale(learner_fn) -> None:
    """``learner_fn(amax_history, new_amax, scale, fp8_max, margin) -> (history, scale)``.

    Catches:
    * current scaling (the newest amax only): the scale after 8.0 leaves the newest slot;
    * forgets the margin: the margin = 1 run (named);
    * history not rolled (newest overwritten) or rolled the wrong way: named;
    * a zero amax history dividing by zero (inf scale): the length-2 run, whose history
      is all zeros at its first two steps and again at its last;
    * returns None, a single value, or a scale that is not one number: named;
    * calls the course's ``update_delayed_scale``: refused by name.
    """
    seen = [2.0, 8.0, 1.0, 0.5, 0.5, 0.5, 0.0, 3.0]
    nothing_yet = [0.0, 0.0, 4.0, 0.0, 0.0, 0.0]     # all-zero history: keep the scale
    for fp8_max, margin, length, amaxes in ((448.0, 0, 4, seen), (57344.0, 1, 3, seen),
                                            (448.0, 0, 2, nothing_yet)):
        hist_ref = torch.zeros(length)
        hist, scale_ref = hist_ref.clone(), torch.tensor(1.0)
        scale = scale_ref.clone()
        for step, a in enumerate(amaxes):
            hist_ref, scale_ref = update_delayed_scale(hist_ref, a, scale_ref, fp8_max=fp8_max,
                                                       margin=margin)
            with refusing(COURSE_DELAYED, "update_delayed_scale", "the update is the exercise"):
                out = attempt(learner_fn, hist.clone(), a, scale.clone(), fp8_max, margin,
                              what="update_delayed_scale")
            try:
                hist, scale = torch.as_tensor(out[0], dtype=torch.float32), \
                    torch.as_tensor(out[1], dtype=torch.float32)
            except (TypeError, IndexError, ValueError, KeyError, RuntimeError):
                raise CheckFailed(f"step {step}: return a pair (new_history, new_scale), got "
                                  f"{out!r:.80}") from None
            if scale.numel() != 1:
                raise CheckFailed(f"step {step}: the new scale should be one number, got a "
                                  f"tensor of shape {tuple(scale.shape)}")
            # the history only moves the given amaxes around: exact
            if hist.shape != hist_ref.shape or not torch.equal(hist, hist_ref):
                raise CheckFailed(f"step {step}: history should be {hist_ref.tolist()} (newest "
                                  f"first, oldest dropped), got {hist.tolist()}")
            # one division fp8_max / amax (the margin's 2^-margin is exact):
            # each side within a rounding of the exact quotient, two if it went
            # through float64 first, so at most gamma(2) apart, twice over
            if not torch.isfinite(scale):
                raise CheckFailed(f"step {step} (amax history {hist_ref.tolist()}): the scale "
                                  f"became {scale.item()}: with nothing seen (every amax 0) "
                                  f"keep the previous scale instead of dividing by zero")
            if not (scale - scale_ref).abs() <= 2 * gamma(2) * scale_ref.abs():
                raise CheckFailed(f"step {step} (fp8_max={fp8_max:g}, margin={margin}, amax "
                                  f"history {hist_ref.tolist()}): scale should be "
                                  f"{scale_ref.item():g}, got {scale.item():g}")
    passed("delayed scaling: history roll, max over history, margin, zero amax keeps the scale")


class _CastWatch:
    """While active (``with _CastWatch() as w``), every torch call that makes or fills an
    E4M3 tensor from a wider float tensor is seen, and the largest finite magnitude that
    went into such a cast is kept in ``w.largest`` (module docstring). A
    ``TorchFunctionMode`` sees every call of torch's Python API: ``.to(dtype)``,
    ``.type(dtype)``, ``copy_`` or ``__setitem__`` into an FP8 buffer,
    ``torch.as_tensor(..., dtype=...)``. (A ``TorchDispatchMode`` would see the same one
    level lower, but its first use imports ``torch._dynamo``, seconds on a laptop.)"""

    def __init__(self):
        self.largest = 0.0

    def __enter__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_leaves

        watch = self
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                tensors = [t for t in tree_leaves((out, args, kwargs))
                           if isinstance(t, torch.Tensor)]
                if any(t.dtype == torch.float8_e4m3fn for t in tensors):
                    for t in tree_leaves((args, kwargs)):
                        if isinstance(t, torch.Tensor) and t.is_floating_point() \
                                and t.dtype not in fp8 and t.numel():
                            finite = t.detach()[torch.isfinite(t.detach())]
                            if finite.numel():
                                watch.largest = max(watch.largest, float(finite.abs().max()))
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def check_mx_quantize(mx_quantize_fn) -> None:
    """``mx_quantize(x) -> (x8, scales)``: MXFP8, 1x32 blocks along the last dimension,
    one power-of-two scale per block (OCP MX v1.0), compared exactly with the reference
    ``helpers.precision.mx_quantize`` (the same arithmetic gives the same bits).

    Catches:
    * one scale per tensor: named;
    * scales not powers of two (fp8_max / amax): named;
    * the exponent rounded instead of floored: the 1.9 x 2^k block;
    * no saturation before the cast: the same block, whose 1.9 x 256 = 486.4 must be
      clamped to 448. torch 2.13's cast would clamp it too (module docstring), so the
      check does not read the bits for this: it sees the unclamped values reach the cast;
    * an all-zero block dividing by zero: the zeros case;
    * x8 not FP8 (left in float32), or not a tensor: named;
    * returns None or one tensor: named; an exception: named;
    * calls the course's ``mx_quantize`` or ``block_quantize``: refused by name.
    """
    from helpers.precision import mx_quantize as reference

    g = torch.Generator().manual_seed(13)
    cases = [torch.randn(4, 64, generator=g), torch.randn(2, 96, generator=g) * 1e-3,
             torch.zeros(1, 32)]
    outlier = torch.randn(3, 128, generator=g)
    outlier[:, 5] *= 1e4
    cases.append(outlier)
    # a block whose amax is 1.9 x 2^k: the exponent is floor(log2 amax) (rounding it would
    # halve the scale), and 1.9 x 256 = 486.4 after scaling lies above E4M3's 448: saturate
    top = torch.ones(1, 32)
    top[0, 0] = 1.9
    cases.append(top)
    for x in cases:
        want8, want_s = reference(x)
        with refusing(COURSE_MX, "mx_quantize", "the block scaling is the exercise"), \
                _CastWatch() as watch:
            got = attempt(mx_quantize_fn, x.clone(), what="mx_quantize")
        try:
            got8, got_s = got
            got_s = torch.as_tensor(got_s, dtype=torch.float32)
        except (TypeError, ValueError):
            raise CheckFailed(f"mx_quantize should return (x8, scales), got {got!r}") from None
        if tuple(got_s.shape) != tuple(want_s.shape):
            hint = (" One scale for the whole tensor is per-tensor scaling: MX gives every "
                    "32 consecutive values of a row their own scale."
                    if got_s.numel() == 1 else "")
            raise CheckFailed(f"scales of shape {tuple(got_s.shape)} for x of shape "
                              f"{tuple(x.shape)}; expected {tuple(want_s.shape)}, one per 1x32 "
                              f"block.{hint}")
        if not torch.equal(got_s, want_s):
            p2 = bool((got_s > 0).all()) and torch.equal(got_s, torch.exp2(torch.round(torch.log2(got_s))))
            hint = ("" if p2 else " MX scales are powers of two (an 8-bit exponent, E8M0): "
                    "round the exponent of the block's amax down, not the scale itself.")
            raise CheckFailed(f"scales {got_s.flatten()[:4].tolist()}..., expected "
                              f"{want_s.flatten()[:4].tolist()}...{hint}")
        if not isinstance(got8, torch.Tensor) or got8.dtype != want8.dtype:
            raise CheckFailed(f"x8 should be a tensor of dtype {want8.dtype}, got "
                              f"{got8.dtype if isinstance(got8, torch.Tensor) else got8!r:.60}")
        if watch.largest > 448.0:
            raise CheckFailed(
                f"values up to {watch.largest:g} reached the cast to E4M3 unclamped: saturate "
                f"each scaled block to [-448, 448] before casting. (torch 2.13's cast happens "
                f"to clamp them for you, to 448; an earlier version of torch's conversion "
                f"turned them into NaN. Saturating is the quantizer's job, not the cast's.)")
        if got8.shape != want8.shape or not torch.equal(got8.float().nan_to_num(1e9),
                                                        want8.float()):
            raise CheckFailed("the scales are right but the FP8 values are not: multiply each "
                              "block by its scale, saturate to the format's range, then cast")
    passed(f"MXFP8 block quantization equals the reference bit for bit on {len(cases)} tensors "
           f"(outliers, tiny values, zeros, a block that saturates before the cast)")
