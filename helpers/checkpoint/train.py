"""The chapter's resumable training loop: a rank function that saves and resumes.

``resumable_run(directory, steps, ...)`` runs on every rank (``launch``, or
``torchrun``): it builds the toy GPT, the Markov data and a sharded sampler,
resumes from the newest usable checkpoint in ``directory`` if there is one,
trains to ``steps``, saving every ``save_every`` steps, and returns what a
test compares: the loss of each step, the global sample indices each step
used, and the final full weights.

``forget`` leaves parts of the state out of the *restore* (they are still
saved), to show what goes wrong without them: ``"rng"`` (dropout masks redrawn
from the launch's seed), ``"sampler"`` (data order restarted at the beginning
of the epoch), ``"scaler"`` (the loss scale back at its initial value and its
count of clean steps at 0, so other steps overflow and are skipped).
``fp16=True`` (DDP only) runs forward and backward under fp16 autocast with
``helpers.precision.DynamicLossScaler``, whose state the checkpoint carries;
``"stepped"`` in the result says which steps the scaler let through (a skipped step
does not advance the LR schedule either). ``crash`` = (step, rank): that rank SIGKILLs itself right
after finishing that step, the way a GPU falling off the bus ends a process;
``crash_in_save`` = (step, rank): the same in the middle of that step's save,
once its own file is written and before the manifest. ``extras`` =
(capture, restore): the lab's own ``capture(sampler) -> dict`` and
``restore(state, sampler)`` replace the built-in handling of the sampler
position and the RNG streams.

What "bitwise" depends on besides the state: the arithmetic itself. Two runs
compared bit for bit must split their reductions the same way, so
``resumable_run`` pins the intra-op thread count (``threads``, 1 by default) and
turns on ``torch.use_deterministic_algorithms`` for the run, and puts both back
afterwards (under torchrun the run is the caller's own process). On CPU the
thread count is what matters: a reduction split over N threads adds N partial
sums, so 1 and 8 threads round differently (in the toy GPT, LayerNorm's weight
and bias gradients, summed over the batch's rows by ATen's own kernel, on every
CPU; a matmul's long inner dimension too where the CPU's BLAS splits it over
threads, as MKL does on Intel CPUs). Without the pin the
thread count comes from outside: ``launch`` gives each rank
``cpu_count // world_size`` threads, ``torchrun`` sets ``OMP_NUM_THREADS=1`` for
its workers when there is more than one; on a 16-core machine a launched
reference (8 threads) and a torchrun job (1) end with different weights.
"""

from __future__ import annotations

import contextlib
import os
import signal

import torch
import torch.distributed as dist

from helpers.checkpoint.async_save import AsyncSaver
from helpers.checkpoint.state import restore_training_state, resume_request, training_state
from helpers.checkpoint.store import load_latest, save
from helpers.comm import world_size
from helpers.data import ShardedSampler, make_dataset
from helpers.launch import rank_info
from helpers.model import build_model
from helpers.validate import positive_int

__all__ = ["resumable_run", "OPTIMIZERS"]

OPTIMIZERS = ("ddp", "zero2", "zero3", "fsdp")
_PARTS = ("rng", "sampler", "scaler")


def _check(steps, save_every, optimizer, forget, crash, fp16) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if fp16 and optimizer != "ddp":
        # the scaler reads every p.grad, full and averaged: DDP's, not a shard's
        raise ValueError(f"fp16 (loss scaling) runs with optimizer='ddp', got {optimizer!r}")
    positive_int("steps", steps)
    positive_int("save_every", save_every)
    bad = set(forget) - set(_PARTS)
    if bad:
        raise ValueError(f"forget may name {_PARTS}, got {sorted(bad)}")
    if crash is not None and (len(crash) != 2 or not 1 <= crash[0] <= steps):
        raise ValueError(f"crash must be (step in [1, {steps}], rank), got {crash!r}")


def resumable_run(directory: str, steps: int, *, save_every: int = 2, optimizer: str = "ddp",
                  dropout: float = 0.1, forget: tuple = (), crash: tuple | None = None,
                  global_batch: int = 8, seq_len: int = 16, lr: float = 1e-2,
                  async_save: bool = False, keep: int | None = None,
                  crash_in_save: tuple | None = None, extras=None, size: str = "toy",
                  fp16: bool = False, threads: int | None = 1) -> dict:
    """Train (resuming if possible) to ``steps``; see the module docstring.

    Returns {"start": step resumed from, "losses": {step: global mean loss},
    "samples": {step: global sample indices}, "params": full weights,
    "skipped": reasons load_latest gave, "stepped": {step: whether the optimizer
    stepped} with fp16, "threads": the intra-op threads it trained with}. The
    global batch is fixed, so any world size that divides it sees the same data
    at every step.

    ``threads``: the intra-op thread count the run uses (and deterministic
    algorithms on); runs compared bitwise must use the same value. ``None``
    leaves both as the caller has them, so the result depends on the process
    it runs in (the tests use it to show that dependency).
    """
    _check(steps, save_every, optimizer, forget, crash, fp16)
    if threads is not None:
        positive_int("threads (None: torch's default)", threads)
    with _pinned_arithmetic(threads):
        return _run(directory, steps, save_every, optimizer, dropout, forget, crash,
                    global_batch, seq_len, lr, async_save, keep, crash_in_save, extras, size,
                    fp16)


@contextlib.contextmanager
def _pinned_arithmetic(threads: int | None):
    """``threads`` intra-op threads and deterministic algorithms inside; the caller's
    settings back afterwards. ``None``: the caller's settings, untouched.

    A bitwise comparison holds only if both runs do the same arithmetic, and a
    kernel's reduction order depends on how many threads split it. So the count
    is pinned here, in the one function every compared run goes through, not
    inherited from launch (cpu_count // world_size) or torchrun
    (OMP_NUM_THREADS=1). With deterministic algorithms an op that has only a
    nondeterministic implementation raises instead of silently differing."""
    if threads is None:
        yield
        return
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])


def _run(directory, steps, save_every, optimizer, dropout, forget, crash, global_batch,
         seq_len, lr, async_save, keep, crash_in_save, extras, size, fp16) -> dict:
    info = rank_info()
    if global_batch % info.world_size:
        raise ValueError(f"global batch {global_batch} does not split over "
                         f"{info.world_size} ranks")
    model = build_model(size, dropout=dropout)  # on the rank's device
    data = make_dataset(vocab_size=model.config.vocab_size, seq_len=seq_len, num_sequences=128)
    sampler = ShardedSampler(len(data), global_batch // info.world_size, info.rank,
                             info.world_size, seed=1)
    scheduler = None
    if optimizer in ("ddp", "fsdp"):
        if optimizer == "ddp":
            from helpers.ddp import BucketedDDP
            wrapped = BucketedDDP(model)
            params = model.parameters()
        else:  # the checkpoint holds the shards: the model is the wrapper
            from helpers.fsdp import FSDP
            wrapped = model = FSDP(model)
            params = wrapped.parameters()
        opt = torch.optim.AdamW(params, lr=lr, foreach=False)
        # a warm-up schedule, so that a resume that forgot it would show
        scheduler = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
    else:
        from helpers.zero import ZeroOptimizer
        wrapped = model
        opt = ZeroOptimizer(model, stage=int(optimizer[-1]), lr=lr)
    scaler = None
    if fp16:
        from helpers.precision import DynamicLossScaler
        # 2^20 overflows fp16's activation gradients of the toy at once; growing
        # every 2 clean steps brings the overflows back every few steps, so the
        # scale and the count of clean steps both decide which steps are skipped.
        scaler = DynamicLossScaler(init_scale=2.0 ** 20, growth_interval=2)
    # With the lab's extras, its two functions handle the sampler and the RNGs.
    parts = {"sampler": None if extras else sampler, "scheduler": scheduler, "scaler": scaler}
    rng = extras is None
    loaded = load_latest(directory, like=resume_request(model, opt, rng=rng, **parts))
    start = 0
    if loaded.state is not None:
        state = dict(loaded.state)
        for part in forget:
            state.pop(part, None)
        start = restore_training_state(state, model, opt, **parts)
        if extras:
            extras[1](state["extras"], sampler)

    saver = AsyncSaver(keep=keep) if async_save else None
    losses, samples, stepped = {}, {}, {}
    device = next(model.parameters()).device
    for step in range(start, steps):
        idx = next(sampler)
        x, y = (t.to(device) for t in data.batch(idx))  # the data set lives on the CPU
        # fp16: matmuls in fp16 (autocast), weights and gradients fp32, as torch.amp's recipe
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            _, loss = wrapped(x, y)
        if scaler is None:
            loss.backward()
            opt.step()
            applied = True
        else:  # DDP has averaged the scaled gradients: every rank sees the same overflow
            scaler.scale(loss).backward()
            applied = stepped[step + 1] = scaler.step(opt, model.parameters())  # inf/nan: skip
            scaler.update()
        if scheduler is not None:
            opt.zero_grad(set_to_none=True)
            # A step the scaler skipped updated nothing, so the schedule does not advance
            # either (Megatron-LM steps its scheduler only ``if update_successful``:
            # megatron/training/training.py, train_step, Megatron-Core main, d98e8a6 of
            # 2026-08-22). Stepping it anyway would also run torch's scheduler before any
            # optimizer.step(), which torch warns about, and it would shift the warm-up by
            # one value per skip.
            if applied:
                scheduler.step()
        losses[step + 1] = _global_mean(loss.detach())
        samples[step + 1] = _gather_indices(idx.to(device))
        if (step + 1) % save_every == 0:
            state = training_state(model, opt, step=step + 1, rng=rng, **parts)
            if extras:
                state["extras"] = extras[0](sampler)
            if saver is not None:
                saver.save(directory, state, step + 1)
            else:
                save(directory, state, step + 1, keep=keep,
                     on_written=_killer(crash_in_save, step + 1, info.rank))
        if crash is not None and crash == (step + 1, info.rank):
            if saver is not None:
                saver.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    if saver is not None:
        saver.wait()
    if optimizer == "ddp":
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:  # sharded: all-gather the shards
        full = (model if optimizer == "fsdp" else opt).full_parameters()
    return {"start": start, "losses": losses, "samples": samples, "params": full,
            "skipped": loaded.skipped, "stepped": stepped, "threads": torch.get_num_threads(),
            "reads": loaded.reads}


def _killer(crash_in_save, step: int, rank: int):
    """on_written hook: SIGKILL this rank once its file of that step is on disk, saying
    so first (a supervisor such as torchrun names only the worker whose exit it
    collected first, which may be a peer that failed because of this one)."""
    if crash_in_save is None or tuple(crash_in_save) != (step, rank):
        return None

    def kill(path):
        print(f"rank {rank} SIGKILLs itself in the step-{step} save, its file written and "
              f"the manifest not", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return kill


def _global_mean(loss: torch.Tensor) -> float:
    t = loss.clone()
    if world_size() > 1:
        dist.all_reduce(t)
        t /= world_size()
    return float(t)


def _gather_indices(idx: torch.Tensor) -> list[int]:
    if world_size() == 1:
        return idx.tolist()
    out = [torch.empty_like(idx) for _ in range(world_size())]
    dist.all_gather(out, idx)
    return torch.cat(out).tolist()
