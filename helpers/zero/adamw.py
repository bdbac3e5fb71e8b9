"""One AdamW step on flat fp32 tensors: the update every ZeRO stage shares.

Each rank applies it to the chunks it owns (stage 0: to everything). AdamW is
elementwise, so updating a chunk of a parameter gives the same numbers as
updating the whole parameter and keeping that chunk: that is why sharding the
optimizer state changes nothing in the result. The update is AdamW's
(Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Alg. 2)
in ``torch.optim.AdamW``'s order of operations (its ``foreach=False`` path).
"""

from __future__ import annotations

__all__ = ["adamw_update", "check_betas"]


def adamw_update(param, grad, exp_avg, exp_avg_sq, step: int, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step in place on flat fp32 tensors (Loshchilov & Hutter 2019, Alg. 2).

    The same elementwise operations, in the same order, as
    ``torch.optim.AdamW(foreach=False)``, so a shard updated here is bitwise
    equal to the same elements updated by PyTorch.
    """
    param.mul_(1 - lr * weight_decay)                    # decoupled weight decay
    exp_avg.lerp_(grad, 1 - beta1)                       # m = b1 m + (1 - b1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = b2 v + (1 - b2) g^2
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def check_betas(betas) -> None:
    """AdamW's (beta1, beta2): two numbers in [0, 1), or a clear error."""
    ok = (isinstance(betas, (tuple, list)) and len(betas) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)
          and all(0 <= b < 1 for b in betas))
    if not ok:
        raise ValueError(f"betas must be two floats in [0, 1) (beta1 for the mean, beta2 for "
                         f"the mean square of the gradient), got {betas!r}")
