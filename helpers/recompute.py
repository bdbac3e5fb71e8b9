"""Activation recomputation ("checkpointing"): trade one more forward for memory.

Backward needs the tensors the forward produced. Keeping all of them costs
s*b*h*(34 + 5as/h) bytes per layer (``helpers.memory``). Recompute keeps only a
segment's *inputs*, throws the rest away, and when backward reaches the
segment runs its forward again (with autograd on this time) to rebuild what
backward needs (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost", sec. 4.1).

    keep                    saved per layer (Korthikanti Table 2)  extra compute
    everything ("none")     sbh (34 + 5as/h)                       0
    "selective"             34 sbh   (score-sized tensors dropped)  ~2.7% FLOPs (GPT-3, sec. 5)
    "full"                  2 sbh    (the block input only)        one forward, ~+33%
                            (2 sbh/t with sequence parallelism: the input is already split)

Selective recompute (Korthikanti et al. 2022, sec. 5) re-runs only
``attn.core``: softmax(q k^T) v. Its saved tensors grow like a*s^2*b, but it
has few FLOPs (no weight matmuls), so it is the cheapest memory to buy back.

Segmenting (Chen et al. 2016, sec. 4.3): with n blocks cut into k segments,
the forward keeps k segment inputs and backward rebuilds one segment (n/k
blocks) at a time, so memory ~ k + n/k, smallest at k = sqrt(n).

Dropout makes recompute subtle: the second forward must draw the *same*
random mask as the first, or the gradient belongs to a different network.
``Checkpoint`` saves the RNG state before the forward and restores it (in a
forked RNG, so the caller's stream is untouched) before recomputing.

A layer whose forward has state breaks the "same computation twice" rule.
FP8 delayed scaling (``helpers.precision.FP8Linear``) records each forward's
amax and moves its scale: run twice, the recompute would quantize with a
scale the original forward never used (other gradients) and advance the
history a second time. So ``Checkpoint`` gives such layers a place to keep
what they must replay: during the first forward ``forward_state()`` returns
("record", memo), during the recompute ("replay", memo), with one ``memo``
dict per checkpointed call; outside any checkpoint it returns None.
Transformer Engine does the same: its checkpoint saves the FP8 scaling state
of the first forward and swaps it in for the recompute, which records no
amax.

How production differs: ``torch.utils.checkpoint`` (non-reentrant mode, the
default recommendation) does the same through saved-tensor hooks instead of a
custom Function, so it works when no input requires grad and supports early
stopping of the recompute; Megatron's ``--recompute-granularity selective``
wraps its core attention the way ``apply_recompute(model, "selective")`` wraps
``attn.core`` here. FlashAttention makes selective recompute implicit: the
fused kernel never stores the s x s scores at all.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Sequence

import torch
import torch.nn as nn

from helpers.model import GPT, lm_loss
from helpers.validate import is_int, positive_int

__all__ = ["Checkpoint", "checkpoint", "segment_bounds", "sqrt_segments", "apply_recompute",
           "remove_recompute", "forward_state", "RECOMPUTE_MODES", "RECOMPUTE_CHOICES"]

# The modes of the table above: what the memory and cost formulas model
# (Korthikanti et al. 2022, Table 2), so what a job plan (helpers.frameworks.Plan)
# may name. apply_recompute runs one more, Chen et al.'s segments, which no
# formula here prices.
RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_CHOICES = RECOMPUTE_MODES + ("segments",)  # what apply_recompute accepts

# ("record" | "replay", memo) while a checkpointed forward runs or is re-run;
# None otherwise. A context variable, not a module attribute, so that two
# threads (or a nested checkpoint) each see their own.
_PHASE: contextvars.ContextVar = contextvars.ContextVar("recompute_phase", default=None)


def forward_state() -> tuple[str, dict] | None:
    """Where the current forward stands: None outside any checkpoint;
    ("record", memo) in a checkpointed segment's first forward, ("replay",
    memo) in its recompute. A stateful layer (FP8 scaling) stores under its own
    key in ``memo`` what it used while recording, and reuses it, without
    updating its state, while replaying."""
    return _PHASE.get()


@contextlib.contextmanager
def _phase(kind: str, memo: dict):
    token = _PHASE.set((kind, memo))
    try:
        yield
    finally:
        _PHASE.reset(token)


class Checkpoint(torch.autograd.Function):
    """Run ``run_fn(*args)`` without keeping its internals; recompute them in backward.

    A reentrant checkpoint (Chen et al. 2016, sec. 4.1): forward runs ``run_fn``
    under no_grad and saves only the tensor arguments; backward re-runs it
    with grad enabled on detached copies of those arguments, restoring the RNG
    state (so dropout draws the same mask) and the autocast state, then
    back-propagates through the rebuilt graph. Parameters inside ``run_fn``
    receive their gradients from that inner backward. Like
    ``torch.utils.checkpoint(use_reentrant=True)`` it needs at least one
    tensor argument that requires grad, and it works with ``.backward()``
    but not with ``torch.autograd.grad(..., parameters)``: the parameters are
    not inputs of this Function, their gradients land in ``.grad``.
    """

    @staticmethod
    def forward(ctx, run_fn: Callable, preserve_rng_state: bool, *args):
        ctx.run_fn = run_fn
        ctx.preserve_rng_state = preserve_rng_state
        if preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_devices = sorted({a.device.index or 0 for a in args
                                       if isinstance(a, torch.Tensor) and a.is_cuda})
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.autocast = {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                        for dev in ("cpu", "cuda")}   # recompute under the same autocast
        # Non-tensor arguments travel on ctx; tensors through save_for_backward,
        # which is what saved-tensor hooks (our byte counter, FP8 storage) see.
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a, t in zip(args, ctx.is_tensor) if t])
        # what stateful layers (FP8 scales) must replay in the recompute; each
        # backward replays from a copy, so a retained graph can replay it again
        ctx.memo = {}
        with torch.no_grad(), _phase("record", ctx.memo):  # (autograd is off here anyway)
            return run_fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = iter(ctx.saved_tensors)
        needs = ctx.needs_input_grad[2:]                # skip run_fn, preserve_rng_state
        inputs = [next(saved).detach().requires_grad_(req) if is_t else other
                  for is_t, other, req in zip(ctx.is_tensor, ctx.others, needs)]
        with torch.random.fork_rng(devices=ctx.cuda_devices if ctx.preserve_rng_state else [],
                                   enabled=ctx.preserve_rng_state):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng)
                for d, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
            cuda_autocast = (torch.autocast("cuda", dtype=ctx.autocast["cuda"][1],
                                            enabled=ctx.autocast["cuda"][0])
                             if torch.cuda.is_available() else contextlib.nullcontext())
            with torch.enable_grad(), cuda_autocast, \
                    torch.autocast("cpu", dtype=ctx.autocast["cpu"][1],
                                   enabled=ctx.autocast["cpu"][0]), \
                    _phase("replay", {k: list(v) for k, v in ctx.memo.items()}):
                outputs = ctx.run_fn(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [inp.grad if isinstance(inp, torch.Tensor) and inp.requires_grad else None
                 for inp in inputs]
        return (None, None, *grads)


def checkpoint(run_fn: Callable, *args, preserve_rng_state: bool = True,
               saved_tensor_hooks: tuple[Callable, Callable] | None = None):
    """``run_fn(*args)``, keeping only ``args`` for backward (see ``Checkpoint``).

    ``saved_tensor_hooks=(pack, unpack)`` changes how those kept inputs are
    stored, e.g. ``helpers.precision.FP8SavedTensors`` keeps them in FP8.
    """
    if saved_tensor_hooks is None:
        return Checkpoint.apply(run_fn, preserve_rng_state, *args)
    # Function.apply saves the tensors after forward returns, so the hooks
    # must surround the apply call; inside, nothing else is saved (no_grad).
    with torch.autograd.graph.saved_tensors_hooks(*saved_tensor_hooks):
        return Checkpoint.apply(run_fn, preserve_rng_state, *args)


def sqrt_segments(n: int) -> int:
    """Chen et al. 2016's choice of k for n blocks: memory ~ k + n/k is least at sqrt(n)."""
    positive_int("number of blocks", n)
    return max(1, round(math.sqrt(n)))


def segment_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """Cut blocks 0..n-1 into k contiguous segments whose sizes differ by at most 1."""
    positive_int("number of blocks", n)
    if not is_int(k) or not 1 <= k <= n:
        raise ValueError(f"segments must be an int in [1, {n}] for {n} blocks, got {k!r}")
    base, extra = divmod(n, k)
    bounds, lo = [], 0
    for i in range(k):
        hi = lo + base + (1 if i < extra else 0)   # the first `extra` segments get one more
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _run_blocks(blocks: Sequence[nn.Module]) -> Callable:
    def run(x):
        for block in blocks:
            x = block(x)
        return x
    return run


class _AttentionCore(nn.Module):
    """``attn.core`` as a module of its own, the function selective recompute re-runs.

    The checkpoint re-runs it in backward through its ``__call__``, so module hooks see
    the recompute as this layer's: chapter 06's ``SavedTensorCounter`` attributes what
    the re-run saves to ``blocks.i.attn.recomputed_core`` rather than to no module at
    all (the attention core is a method, and in backward no module of the block is
    running). It has no parameters or buffers: names and state_dict do not change."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        object.__setattr__(self, "_attn", attn)   # a plain reference, not a submodule

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return type(self._attn).core(self._attn, q, k, v)


def remove_recompute(model: GPT) -> GPT:
    """Undo ``apply_recompute``: drop the instance attributes and the module it set."""
    for module in [model, *model.blocks, *(b.attn for b in model.blocks)]:
        for name in ("forward", "core"):
            if name in module.__dict__:
                delattr(module, name)
        module._modules.pop("recomputed_core", None)
    return model


def apply_recompute(model: GPT, mode: str = "full", *, segments: int | None = None,
                    preserve_rng_state: bool = True,
                    saved_tensor_hooks: tuple[Callable, Callable] | None = None) -> GPT:
    """Wrap parts of ``model`` in ``checkpoint``, in place; returns the model.

    ``"none"``       remove any recompute.
    ``"selective"``  each ``block.attn.core`` (scores, mask, softmax, dropout, att @ v).
    ``"full"``       each block (keeps every block's input).
    ``"segments"``   groups of blocks, ``segments`` groups (default sqrt(n_layer)).

    Instance attributes shadow the class's methods, so parameter names and
    state_dict keys do not change and ``remove_recompute`` restores the model.
    """
    if mode not in RECOMPUTE_CHOICES:
        raise ValueError(f"unknown recompute mode {mode!r}; choose from {RECOMPUTE_CHOICES}")
    if segments is not None and mode != "segments":
        raise ValueError(f"segments={segments} only applies to mode='segments', not {mode!r}")
    remove_recompute(model)
    ckpt = functools.partial(checkpoint, preserve_rng_state=preserve_rng_state,
                             saved_tensor_hooks=saved_tensor_hooks)
    if mode == "selective":
        for block in model.blocks:
            attn = block.attn
            if attn.use_sdpa:
                raise ValueError("selective recompute of attn.core needs attention='manual'; "
                                 "the fused sdpa kernel already stores no score matrix")
            attn.recomputed_core = _AttentionCore(attn)
            attn.core = functools.partial(ckpt, attn.recomputed_core)
    elif mode == "full":
        for block in model.blocks:
            block.forward = functools.partial(ckpt, type(block).forward.__get__(block))
    elif mode == "segments":
        k = sqrt_segments(len(model.blocks)) if segments is None else segments
        bounds = segment_bounds(len(model.blocks), k)

        def forward(idx, targets=None):
            x = model.embed(idx)
            for lo, hi in bounds:
                x = ckpt(_run_blocks(model.blocks[lo:hi]), x)
            logits = model.head(x)
            return logits, None if targets is None else lm_loss(logits, targets)

        model.forward = forward
    return model
