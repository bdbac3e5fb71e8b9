"""Global batch size: accumulation, learning-rate scaling and the noise scale.

What
----
With data parallelism the batch the optimizer sees is

    global batch = micro-batch per rank x accumulation steps x DP ranks

so adding ranks silently changes the optimizer's problem. Three tools:

* **Gradient accumulation.** Run k micro-batches, each loss scaled by 1/k,
  backward after each, step once: ``.grad`` then holds the gradient of the
  mean loss over all k micro-batches, the same as one k-times larger batch
  (exactly, up to summation order). Under DDP the first k-1 backwards run
  inside ``no_sync()``, so only the last one all-reduces (1 instead of k).
* **LR scaling.** Goyal et al. 2017 ("Accurate, Large Minibatch SGD", sec. 2.1
  and 2.2): when the batch grows k times, multiply SGD's learning rate by k
  (lr = 0.1 * B/256 for ResNet-50), ramping up linearly from the small-batch
  lr over the first 5 epochs (gradual warmup), because the early, fast-changing
  loss landscape breaks the linear rule's assumption. For Adam the common
  heuristic is square-root scaling (lr ~ sqrt(B)) (Malladi et al. 2022, "On
  the SDEs and scaling rules for adaptive gradient algorithms"); both stop
  working past the critical batch size.
* **Gradient noise scale.** McCandlish et al. 2018 ("An Empirical Model of
  Large-Batch Training", sec. 2.2 and App. A.1): B_simple = tr(Sigma) / |G|^2,
  Sigma the per-example gradient covariance, G the true gradient. Below
  B_simple, doubling the batch nearly halves the steps needed; above it,
  extra examples (extra ranks) mostly average away noise that was already
  small, i.e. wasted compute. Neither tr(Sigma) nor |G|^2 is observable
  directly, but the expected squared norm of a batch-B gradient is
  E|G_B|^2 = |G|^2 + tr(Sigma)/B, so two batch sizes give two equations:

      |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
      tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

  In data parallel training both come for free: each rank's local gradient is
  a B_small = b batch gradient, the all-reduced one a B_big = p*b gradient.

How production differs: frameworks track these estimates as exponential
moving averages over many steps (each single estimate is very noisy) and
schedule the batch size (batch-size warmup in GPT-3) instead of fixing it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.comm import world_size
from helpers.validate import positive_int

__all__ = ["global_batch_size", "accumulate_gradients", "accumulate_token_weighted", "linear_scaled_lr", "sqrt_scaled_lr",
           "warmup_lr", "scaled_lr", "grad_sq_norm", "noise_scale", "measure_noise_scale"]


def global_batch_size(micro_batch: int, accum_steps: int = 1, dp: int = 1) -> int:
    """micro-batch x accumulation steps x data-parallel ranks."""
    for name, v in (("micro_batch", micro_batch), ("accum_steps", accum_steps), ("dp", dp)):
        positive_int(name, v)
    return micro_batch * accum_steps * dp


def accumulate_gradients(model: nn.Module, micro_batches: Sequence, loss_fn: Callable) -> float:
    """Backward over ``micro_batches`` so ``.grad`` = gradient of their mean loss.

    ``loss_fn(model, batch) -> scalar loss`` (mean over the micro-batch). Each
    loss is scaled by 1/k. If ``model`` has ``no_sync`` (BucketedDDP, DDP),
    the first k-1 backwards skip communication. Returns the mean loss (float).
    Micro-batches must be of equal size, or the 1/k weighting is wrong.
    """
    k = len(micro_batches)
    if k == 0:
        raise ValueError("need at least one micro-batch")
    total = 0.0
    for i, batch in enumerate(micro_batches):
        last = i == k - 1
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else _nullctx()
        with ctx:
            loss = loss_fn(model, batch) / k
            loss.backward()
        total += float(loss.detach())
    return total


def accumulate_token_weighted(model: nn.Module, micro_batches: Sequence,
                              loss_sum_fn: Callable, count_fn: Callable, group=None) -> tuple[float, int]:
    """Backward over ``micro_batches`` so that, after the data-parallel mean
    all-reduce, ``.grad`` = gradient of the mean loss per token of the whole
    global batch (all micro-batches of all ranks), whatever each holds.

    ``loss_sum_fn(model, batch)``: the loss *summed* over the batch's loss tokens;
    ``count_fn(batch)``: how many loss tokens it has (e.g. labels != -100).
    One all-reduce of the local token count gives the global count N; each
    summed loss is scaled by p / N, because the gradient all-reduce (DDP,
    ``average_gradients``) then divides by p. Returns (this rank's summed loss / N,
    N): the ranks' first values add up to the global mean loss.
    """
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    p = world_size(group)
    count = torch.tensor([float(sum(int(count_fn(b)) for b in micro_batches))],
                         device=next(model.parameters()).device)  # where the group reduces
    if p > 1:
        dist.all_reduce(count, group=group)  # 4 bytes: the global number of loss tokens
    n_tokens = int(count.item())
    if n_tokens == 0:
        raise ValueError("the global batch has no loss tokens (every label is ignored)")
    total = 0.0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else _nullctx()
        with ctx:
            loss = loss_sum_fn(model, batch) * (p / n_tokens)
            loss.backward()
        total += float(loss.detach()) / p
    return total, n_tokens


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check_lr_args(base_lr: float, batch: float, base_batch: float) -> None:
    if base_lr <= 0 or batch <= 0 or base_batch <= 0:
        raise ValueError(f"base_lr, batch and base_batch must be > 0, got {base_lr}, {batch}, "
                         f"{base_batch}")


def linear_scaled_lr(base_lr: float, batch: float, base_batch: float = 256) -> float:
    """Goyal et al. 2017, sec. 2.1: lr = base_lr * batch / base_batch (0.1 per 256 for SGD)."""
    _check_lr_args(base_lr, batch, base_batch)
    return base_lr * batch / base_batch


def sqrt_scaled_lr(base_lr: float, batch: float, base_batch: float = 256) -> float:
    """lr = base_lr * sqrt(batch / base_batch): the usual Adam heuristic (Malladi et al. 2022)."""
    _check_lr_args(base_lr, batch, base_batch)
    return base_lr * math.sqrt(batch / base_batch)


def warmup_lr(step: int, target_lr: float, warmup_steps: int,
              start_lr: float | None = None) -> float:
    """Gradual warmup (Goyal et al. 2017, sec. 2.2): linear from start_lr to target_lr.

    Goyal et al. start from the small-batch lr (pass it as ``start_lr``); the
    default ``None`` ramps from 0, as most LLM recipes do. After
    ``warmup_steps`` the lr stays at ``target_lr``.
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be >= 0, got {step}, {warmup_steps}")
    start = 0.0 if start_lr is None else start_lr
    if warmup_steps == 0 or step >= warmup_steps:
        return target_lr
    return start + (target_lr - start) * step / warmup_steps


def scaled_lr(step: int, base_lr: float, batch: float, base_batch: float, rule: str = "linear",
              warmup_steps: int = 0) -> float:
    """lr at ``step`` for ``batch``, given a base_lr tuned at ``base_batch``.

    rule: "none" (base_lr), "linear", "sqrt". Warmup ramps from base_lr (the
    small-batch lr, as Goyal et al. do) to the scaled lr.
    """
    if rule == "none":
        _check_lr_args(base_lr, batch, base_batch)
        return base_lr
    if rule == "linear":
        target = linear_scaled_lr(base_lr, batch, base_batch)
    elif rule == "sqrt":
        target = sqrt_scaled_lr(base_lr, batch, base_batch)
    else:
        raise ValueError(f"rule must be 'none', 'linear' or 'sqrt', got {rule!r}")
    return warmup_lr(step, target, warmup_steps, start_lr=base_lr)


def grad_sq_norm(params: Iterable[torch.Tensor]) -> float:
    """sum of squared gradient entries over ``params`` (float64 accumulation)."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total


def noise_scale(g_small_sq: float, b_small: float, g_big_sq: float, b_big: float) -> dict:
    """B_simple from squared gradient norms at two batch sizes (McCandlish et al. 2018, App. A.1).

    Returns {"G2": |G|^2 estimate, "trace_sigma": tr(Sigma) estimate,
    "b_simple": their ratio}. Single estimates can be negative when noise
    dominates; average over many steps before trusting the ratio.
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small}, {b_big}")
    G2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return {"G2": G2, "trace_sigma": trace, "b_simple": trace / G2 if G2 != 0 else math.inf}


def measure_noise_scale(model: nn.Module, loss_fn: Callable, batch, group=None) -> dict:
    """One estimate of B_simple inside a data-parallel step (run on every rank).

    ``loss_fn(model, batch)`` -> mean loss over this rank's ``batch`` of b
    examples (``batch[0].size(0)`` is b). Small batch: each rank's own gradient
    (b examples; the p ranks' |g|^2 are averaged, which lowers the noise of
    the estimate). Big batch: the all-reduced mean gradient (p*b examples).
    Leaves ``.grad`` holding the averaged gradient. Needs p >= 2.
    """
    p = dist.get_world_size(group)
    if p < 2:
        raise ValueError("the two-batch estimate needs >= 2 ranks (or use noise_scale directly)")
    b = batch[0].size(0)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = None
    loss_fn(model, batch).backward()
    local = torch.tensor([grad_sq_norm(params)], dtype=torch.float64, device=params[0].device)
    dist.all_reduce(local, group=group)
    g_small_sq = float(local) / p
    for q in params:
        if q.grad is not None:
            dist.all_reduce(q.grad, group=group)
            q.grad.div_(p)
    g_big_sq = grad_sq_norm(params)
    out = noise_scale(g_small_sq, b, g_big_sq, p * b)
    out.update(g_small_sq=g_small_sq, g_big_sq=g_big_sq, b_small=b, b_big=p * b)
    return out
