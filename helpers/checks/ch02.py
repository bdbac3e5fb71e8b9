"""Checks for chapter 02: naive data parallelism equals one process on the global batch.

The learner's functions run on real ranks (``launch``); the reference is one
process on the whole global batch.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, on_ranks, passed
from helpers.tolerance import within_fp32_noise

WORLD = 3  # 3 ranks: catches a hard-coded "/ 2" and uneven ring chunks


def _data(world_size: int, micro: int = 2, steps: int = 1):
    from helpers.data import make_dataset

    data = make_dataset(seq_len=16, num_sequences=64)
    g = world_size * micro
    return [data.batch(range(s * g, (s + 1) * g)) for s in range(steps)]


def _ranked_grads(average_gradients):
    """Each rank: local backward on its slice, the learner's averaging, return grads."""
    from helpers import rank_info
    from helpers.model import build_model

    r, p = rank_info().rank, rank_info().world_size
    x, y = _data(p)[0]
    model = build_model("toy", seed=0)
    model(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])[1].backward()
    average_gradients(model)
    return [q.grad.clone() if q.grad is not None else None for q in model.parameters()]


def _probe_model(fn):
    from helpers.model import build_model

    fn(build_model("toy", seed=0))


def _probe_step(fn):
    from helpers.model import build_model

    model = build_model("toy", seed=0)
    x = torch.zeros(3, 4, dtype=torch.long)
    fn(model, torch.optim.SGD(model.parameters(), lr=0.0), x, x)


def _local_grad(rank: int, name: str) -> torch.Tensor:
    """The gradient rank ``rank`` computes on its own slice, before any averaging."""
    from helpers.model import build_model

    model = build_model("toy", seed=0)
    x, y = _data(WORLD)[0]
    model(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])[1].backward()
    return dict(model.named_parameters())[name].grad


def check_average_gradients(average_gradients) -> None:
    """``average_gradients(model)`` on 3 ranks: every ``.grad`` becomes the global-batch grad."""
    from helpers.model import build_model

    if not callable(average_gradients):
        raise CheckFailed(f"average_gradients should be a function, got {average_gradients!r}")
    results = on_ranks(_ranked_grads, WORLD, average_gradients, what="average_gradients",
                       probe=lambda: _probe_model(average_gradients))
    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = _data(WORLD)[0]
    ref(x, y)[1].backward()
    ref64(x, y)[1].backward()  # float64: the exact answer, to ~1e-16
    names = [n for n, _ in ref.named_parameters()]
    for rank, grads in enumerate(results):
        for name, got, want, want64 in zip(names, grads, (q.grad for q in ref.parameters()),
                                           (q.grad for q in ref64.parameters())):
            if got is None:
                raise CheckFailed(f"rank {rank}: {name}.grad is None after averaging")
            # fp32, another summation order than one process: as close to
            # float64 as the fp32 reference is (helpers.tolerance)
            if within_fp32_noise(got, want, want64)[0]:
                continue
            ratio = float(got.norm() / want.norm())
            hint = ""
            if abs(ratio - WORLD) < 0.01:
                hint = f" It is {WORLD}x too large: sum, then divide by the world size."
            elif abs(ratio - WORLD / 2) < 0.01:
                hint = " Divide by dist.get_world_size(), not by a fixed number."
            elif torch.allclose(got, _local_grad(rank, name), rtol=1e-5, atol=1e-7):
                hint = " It is this rank's own gradient: did the all-reduce run?"
            raise CheckFailed(f"rank {rank}: {name}.grad differs from the global-batch gradient "
                              f"(norm ratio {ratio:.3f}).{hint}")
    passed(f"averaged gradients on {WORLD} ranks equal one process on the global batch "
           f"({len(names)} tensors, within float32 rounding)")


STEPS = 3


def _ranked_training(dp_step):
    from helpers import rank_info
    from helpers.model import build_model

    p = rank_info().world_size
    model = build_model("toy", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x, y in _data(p, steps=STEPS):
        losses.append(float(dp_step(model, opt, x, y)))
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


def _reference_training(dtype: torch.dtype) -> dict:
    """One process, the whole global batch, STEPS steps, in ``dtype``."""
    from helpers.model import build_model

    ref = build_model("toy", seed=0).to(dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for x, y in _data(WORLD, steps=STEPS):
        opt.zero_grad()
        ref(x, y)[1].backward()
        opt.step()
    return ref.state_dict()


def check_dp_step(dp_step) -> None:
    """``dp_step(model, opt, x_global, y_global) -> local loss`` for 3 steps on 3 ranks
    leaves the same weights as one process stepping on the whole global batch."""
    from helpers.model import build_model

    if not callable(dp_step):
        raise CheckFailed(f"dp_step should be a function, got {dp_step!r}")
    results = on_ranks(_ranked_training, WORLD, dp_step, what="dp_step",
                       probe=lambda: _probe_step(dp_step))
    want, want64 = (_reference_training(dtype) for dtype in (torch.float32, torch.float64))
    fresh, fresh64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = _data(WORLD, steps=1)[0]
    b = x.size(0) // WORLD
    for rank, (_, losses) in enumerate(results):
        with torch.no_grad():
            mine = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
            own, own64 = fresh(*mine)[1], fresh64(*mine)[1]
        # the same forward on the same slice, maybe with other kernels or
        # threads: within float32 rounding (helpers.tolerance)
        if not within_fp32_noise(torch.tensor(losses[0]), own, own64)[0]:
            own = float(own)
            raise CheckFailed(f"rank {rank}: first loss {losses[0]:.5f}, but the loss on this "
                              f"rank's slice is {own:.5f}. Each rank must compute on its own "
                              f"slice only (rows {rank * b}..{(rank + 1) * b - 1}), or the "
                              f"ranks repeat each other's work.")
    for rank, (state, _) in enumerate(results):
        for k, v in want.items():
            # another summation order than one process: float32 rounding only
            if not within_fp32_noise(state[k], v, want64[k])[0]:
                raise CheckFailed(
                    f"rank {rank}: after {STEPS} steps {k} differs from the single-process run "
                    f"by {float((state[k] - v).abs().max()):.2e}. Zero the gradients each step, "
                    f"use this rank's slice (rank r takes rows r*b..(r+1)*b of the global "
                    f"batch), average, then step.")
    passed(f"{STEPS} naive-DP steps on {WORLD} ranks match one process on the global batch")
