"""Checks for chapter 05: accumulation with no_sync, and the gradient noise scale.

* ``accumulate(ddp_model, micro_batches) -> float``: backward over every
  micro-batch ``(x, y)`` so that ``.grad`` is the gradient of their mean loss,
  communicating only once; return the mean loss.
* ``noise_scale(g_small_sq, b_small, g_big_sq, b_big) -> float``: B_simple
  from squared gradient norms at two batch sizes (McCandlish et al. 2018, App. A.1).
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.tolerance import within_fp32_noise

ACCUM = 3


def _run_accumulate(accumulate):
    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.ddp import BucketedDDP, allreduce_hook
    from helpers.model import build_model

    r = rank_info().rank
    calls = []

    def counting_hook(flat, group):  # every bucket all-reduce goes through here
        calls.append(flat.numel())
        return allreduce_hook(flat, group)

    ddp = BucketedDDP(build_model("toy", seed=0), comm_hook=counting_hook)
    x, y = make_dataset(seq_len=16, num_sequences=16).batch(range(6 * r, 6 * r + 6))
    micro = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for i in range(ACCUM)]
    loss = accumulate(ddp, micro)
    return [p.grad.clone() for p in ddp.module.parameters()], len(calls), len(ddp.buckets), \
        float(loss)


def _probe(accumulate):
    from helpers.ddp import BucketedDDP
    from helpers.model import build_model

    x = torch.zeros(1, 4, dtype=torch.long)
    accumulate(BucketedDDP(build_model("toy", seed=0)), [(x, x), (x, x)])


def check_accumulate(accumulate) -> None:
    """2 ranks x 3 micro-batches of 2 sequences = the gradient of the global batch of 12."""
    from helpers.data import make_dataset
    from helpers.model import build_model

    if not callable(accumulate):
        raise CheckFailed(f"accumulate should be a function, got {accumulate!r}")
    results = on_ranks(_run_accumulate, 2, accumulate, what="accumulate",
                       probe=lambda: _probe(accumulate))
    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = make_dataset(seq_len=16, num_sequences=16).batch(range(12))
    ref(x, y)[1].backward()
    ref64(x, y)[1].backward()  # float64: the exact answer, to ~1e-16
    for rank, (grads, n_calls, n_buckets, loss) in enumerate(results):
        for (name, p), p64, g in zip(ref.named_parameters(), ref64.parameters(), grads):
            # another fp32 summation order than one process: as close to
            # float64 as the fp32 reference is (helpers.tolerance)
            if within_fp32_noise(g, p.grad, p64.grad)[0]:
                continue
            ratio = float(g.norm() / p.grad.norm())
            hint = (f" It is {ACCUM}x too large: scale each micro-batch loss by 1/{ACCUM}."
                    if abs(ratio - ACCUM) < 0.01 else "")
            raise CheckFailed(f"rank {rank}: {name}.grad differs from the global batch's "
                              f"(norm ratio {ratio:.3f}).{hint}")
        if n_calls != n_buckets:
            raise CheckFailed(f"rank {rank}: {n_calls} bucket all-reduces for {n_buckets} "
                              f"bucket(s): the first {ACCUM - 1} micro-batches must run inside "
                              f"ddp_model.no_sync() so that only the last backward communicates.")
        with torch.no_grad():
            want, want64 = (sum(m(x[6 * rank + 2 * i:6 * rank + 2 * i + 2],
                                  y[6 * rank + 2 * i:6 * rank + 2 * i + 2])[1]
                                for i in range(ACCUM)) / ACCUM for m in (ref, ref64))
        # the same micro-batch losses, maybe added in another order: float32 rounding
        try:
            ok = within_fp32_noise(torch.as_tensor(float(loss)), want, want64)[0]
        except (TypeError, ValueError):
            raise CheckFailed(f"rank {rank}: accumulate should return the mean loss as a "
                              f"number, got {loss!r}") from None
        if not ok:
            raise CheckFailed(f"rank {rank}: returned mean loss {float(loss):.6g}, expected "
                              f"{float(want):.6g}: the mean of this rank's {ACCUM} "
                              f"micro-batch losses")
    passed(f"accumulation of {ACCUM} micro-batches on 2 ranks = the global batch of 12, "
           f"with {results[0][2]} bucket all-reduce(s) per step instead of "
           f"{ACCUM * results[0][2]}")


def check_noise_scale(noise_scale) -> None:
    # Exact expectations E|G_B|^2 = |G|^2 + tr(Sigma)/B for a few (|G|^2, tr) pairs.
    for G2, tr, bs, bb in [(4.0, 200.0, 8, 64), (1.0, 10.0, 2, 4), (0.5, 1000.0, 16, 256)]:
        got = attempt(noise_scale, G2 + tr / bs, bs, G2 + tr / bb, bb, what="noise_scale")
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise CheckFailed(f"noise_scale should return a number (B_simple), got {got!r}") \
                from None
        if abs(got - tr / G2) > 1e-9 * tr / G2:
            hint = ""
            if abs(got - G2 / tr) < 1e-9:
                hint = " That is |G|^2 / tr(Sigma): B_simple is tr(Sigma) / |G|^2."
            raise CheckFailed(f"noise_scale({G2 + tr / bs:.4g}, {bs}, {G2 + tr / bb:.4g}, {bb}) "
                              f"= {got:.6g}, expected tr(Sigma)/|G|^2 = {tr / G2:.6g}.{hint}")
    passed("noise scale recovers tr(Sigma)/|G|^2 from two batch sizes exactly")
