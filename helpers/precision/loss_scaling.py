"""Loss scaling for fp16, and mixed-precision training by hand.

fp16 and loss scaling (Micikevicius et al. 2018, "Mixed Precision
Training", sec. 3.2). fp16's smallest subnormal is 2^-24 (about 6e-8); small
gradients fall below it and become exactly 0. Multiplying the loss by S
multiplies every gradient by S (backward is linear), lifting them into range;
the optimizer divides by S again in fp32. The paper also skips the update
when a gradient overflows; the *dynamic* schedule that picks S on line (used
by NVIDIA's mixed-precision tooling and ``torch.amp.GradScaler``) is:

    a step with an inf/nan gradient   skip the update, S *= backoff (0.5), reset counter
    ``growth_interval`` clean steps    S *= growth (2.0)

``DynamicLossScaler`` makes exactly the decisions of ``torch.amp.GradScaler``
(tests compare the two on the same finite/non-finite sequence). bf16 keeps
fp32's 8 exponent bits, so it needs no scaling; that is why it won.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from helpers.validate import positive_int

__all__ = ["DynamicLossScaler", "train_fp16"]


def _f32(x: float) -> float:
    """Round to fp32: GradScaler keeps its scale in an fp32 tensor; so do we, in effect."""
    return float(torch.tensor(x, dtype=torch.float32))


class DynamicLossScaler:
    """Loss scaling (Micikevicius et al. 2018, sec. 3.2) with GradScaler's dynamic schedule.

        loss_scaled = scaler.scale(loss); loss_scaled.backward()
        stepped = scaler.step(optimizer, params)   # unscale, skip on inf/nan
        scaler.update()                            # grow or back off the scale

    With an fp16 model and fp32 master weights (the optimizer's), pass both:
    ``scaler.step(optimizer, fp16_params, master_params)`` unscales each fp16
    gradient in fp32 into its master's ``.grad``.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        positive_int("growth_interval", growth_interval)
        self.scale_value = _f32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0          # consecutive steps without inf/nan ("growth tracker")
        self.found_inf: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, params: Iterable[torch.Tensor],
                 master_params: Iterable[torch.Tensor] | None = None) -> bool:
        """Divide every gradient by the scale, in fp32; True if any is inf/nan.

        fp32 gradients are unscaled in place. An fp16/bf16 gradient cannot
        hold the unscaled value: the small gradients that scaling lifted into
        fp16's range would fall out of it again (below 2^-24 they flush to
        0). So it is unscaled in fp32 into the ``.grad`` of its fp32 master
        parameter (``master_params``, same order), the mixed-precision recipe
        (Micikevicius et al. 2018, sec. 3.1); without master parameters it is
        refused, as ``torch.amp.GradScaler`` refuses to unscale fp16 gradients.
        """
        params = list(params)
        masters = None if master_params is None else list(master_params)
        if masters is not None and len(masters) != len(params):
            raise ValueError(f"{len(params)} parameters but {len(masters)} master parameters")
        inv = _f32(1.0 / self.scale_value)   # GradScaler: an fp32 reciprocal of the scale
        found = False
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            found |= not bool(torch.isfinite(p.grad).all())
            if p.grad.dtype == torch.float32 and masters is None:
                p.grad.mul_(inv)
                continue
            if masters is None:
                raise ValueError(f"parameter {i} has a {p.grad.dtype} gradient: unscaled in "
                                 f"its own dtype its small entries underflow again; pass fp32 "
                                 f"master_params to receive the unscaled gradients")
            m = masters[i]
            if m.dtype != torch.float32 or m.shape != p.shape:
                raise ValueError(f"master parameter {i} must be float32 of shape "
                                 f"{tuple(p.shape)}, got {m.dtype} {tuple(m.shape)}")
            m.grad = p.grad.float().mul_(inv)   # widen first, then divide: exact widening
        self.found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
             master_params: Iterable[torch.Tensor] | None = None) -> bool:
        """Unscale (into ``master_params`` if given, see ``unscale_``), then step
        unless a gradient overflowed. Returns whether it stepped."""
        if self.unscale_(params, master_params):
            return False
        optimizer.step()
        return True

    def update(self, found_inf: bool | None = None) -> float:
        """The scale rule. ``found_inf`` defaults to what the last unscale_ saw."""
        found = self.found_inf if found_inf is None else found_inf
        if found is None:
            raise ValueError("update() needs found_inf, or a preceding unscale_/step")
        if found:
            self.scale_value = _f32(self.scale_value * self.backoff_factor)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                grown = _f32(self.scale_value * self.growth_factor)
                if grown != float("inf"):     # never grow the scale itself to inf
                    self.scale_value = grown
                self.clean_steps = 0
        self.found_inf = None
        return self.scale_value


def train_fp16(model: nn.Module, batches, *, lr: float = 3e-3,
               scaler: DynamicLossScaler | None = None, loss_multiplier: float = 1.0):
    """Mixed-precision training by hand: fp16 copy for forward/backward, fp32 master
    weights for the update (Micikevicius et al. 2018, sec. 3.1).

    ``loss_multiplier`` shrinks the loss, and so every fp16 gradient, to build
    an underflow case on a toy model (our toy's gradients are far larger than
    a deep network's); the fp32 update divides it back out, so in exact
    arithmetic every multiplier trains identically and any difference is
    fp16's. Returns (losses, fraction of gradient entries exactly zero per
    step, scale used per step).
    """
    master = [p.detach().clone().float() for p in model.parameters()]
    half = model.half()
    opt = torch.optim.SGD(master, lr=lr)
    losses, zero_frac, scales = [], [], []
    for x, y in batches:
        for p, m in zip(half.parameters(), master):
            p.data.copy_(m)                                 # fp32 master -> fp16 working copy
            p.grad = None
        _, loss = half(x, y)
        losses.append(loss.item())
        small = loss.float() * loss_multiplier      # fp32 scalar; its gradient enters fp16
        (scaler.scale(small) if scaler else small).backward()
        grads = [p.grad for p in half.parameters()]
        zero_frac.append(sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads))
        for m, g in zip(master, grads):
            m.grad = g.float() / loss_multiplier            # unscale in fp32, not in fp16
        scales.append(scaler.scale_value if scaler else 1.0)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt, master)                        # skips the step on inf/nan
            scaler.update()
    for p, m in zip(half.parameters(), master):
        p.data.copy_(m)
    return losses, zero_frac, scales
