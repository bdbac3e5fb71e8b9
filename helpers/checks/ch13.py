"""Checks for lab 13: the checkpoint autograd.Function and the delayed-scaling update."""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, passed
from helpers.memory import SavedTensorCounter
from helpers.model import Block, GPTConfig
from helpers.precision import update_delayed_scale
from helpers.tolerance import gamma

__all__ = ["check_checkpoint", "check_delayed_scale"]


def check_checkpoint(LearnerCheckpoint) -> None:
    """``LearnerCheckpoint.apply(run_fn, x)`` must equal ``run_fn(x)`` in output and in
    every gradient (dropout on), and keep only ``x`` for backward."""
    cfg = GPTConfig(dropout=0.3)
    torch.manual_seed(0)
    block = Block(cfg).train()
    x0 = torch.randn(2, 16, cfg.n_embd)

    def grads(fn):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(42)
        with SavedTensorCounter(block) as counter:
            y = fn(x)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            raise CheckFailed(f"the checkpoint should return block(x), a tensor of shape "
                              f"{tuple(x.shape)}, got {type(y).__name__}")
        torch.manual_seed(1234)       # backward runs with the RNG elsewhere, as in training
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        after = torch.get_rng_state()  # backward must leave the caller's stream alone
        return (y.detach(), x.grad, [p.grad for p in block.parameters()], counter.total_bytes,
                after)

    ref = grads(block)
    got = attempt(grads, lambda x: LearnerCheckpoint.apply(block, x), what="Checkpoint")
    if not torch.equal(got[0], ref[0]):
        raise CheckFailed("forward output differs from block(x)")
    if got[1] is None or any(g is None for g in got[2]):
        raise CheckFailed("some gradients are missing: backward must run the recomputed "
                          "graph backward and return the input's gradient")
    same_params = all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
    if not torch.equal(got[1], ref[1]) or not same_params:
        raise CheckFailed("gradients differ from no recompute: with dropout on, the recompute "
                          "must draw the same mask (save the RNG state in forward, restore it "
                          "in backward)")
    if not torch.equal(got[4], ref[4]):
        raise CheckFailed("backward changed the caller's random stream: restore the saved RNG "
                          "state inside torch.random.fork_rng(devices=[]) so it is put back "
                          "after the recompute")
    if got[3] > x0.nbytes:
        raise CheckFailed(f"the checkpoint kept {got[3]:,} bytes for backward; only the input "
                          f"({x0.nbytes:,} bytes) should be kept (run the block under no_grad)")
    passed("checkpoint: same output and gradients with dropout, keeps only the input, "
           "leaves the caller's RNG alone")


def check_delayed_scale(learner_fn) -> None:
    """``learner_fn(amax_history, new_amax, scale, fp8_max, margin) -> (history, scale)``."""
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.5, 0.5, 0.0, 3.0]
    for fp8_max, margin, length in ((448.0, 0, 4), (57344.0, 1, 3)):
        hist_ref = torch.zeros(length)
        hist, scale_ref = hist_ref.clone(), torch.tensor(1.0)
        scale = scale_ref.clone()
        for step, a in enumerate(amaxes):
            hist_ref, scale_ref = update_delayed_scale(hist_ref, a, scale_ref, fp8_max=fp8_max,
                                                       margin=margin)
            out = attempt(learner_fn, hist.clone(), a, scale.clone(), fp8_max, margin,
                          what="update_delayed_scale")
            try:
                hist, scale = torch.as_tensor(out[0], dtype=torch.float32), \
                    torch.as_tensor(out[1], dtype=torch.float32)
            except (TypeError, IndexError, ValueError):
                raise CheckFailed("return a pair (new_history, new_scale)") from None
            # the history only moves the given amaxes around: exact
            if hist.shape != hist_ref.shape or not torch.equal(hist, hist_ref):
                raise CheckFailed(f"step {step}: history should be {hist_ref.tolist()} (newest "
                                  f"first, oldest dropped), got {hist.tolist()}")
            # one division fp8_max / amax (the margin's 2^-margin is exact):
            # each side within a rounding of the exact quotient, two if it went
            # through float64 first, so at most gamma(2) apart, twice over
            if not (scale - scale_ref).abs() <= 2 * gamma(2) * scale_ref.abs():
                raise CheckFailed(f"step {step} (fp8_max={fp8_max:g}, margin={margin}, amax "
                                  f"history {hist_ref.tolist()}): scale should be "
                                  f"{scale_ref.item():g}, got {scale.item():g}")
    passed("delayed scaling: history roll, max over history, margin, zero amax keeps the scale")
