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

# (ranks, micro-batches per step): the count differs between the runs, so a "/ 3" or a
# "range(3)" written for the first run fails the second; 3 ranks, then 4
RUNS = ((3, 3), (4, 2))
ROWS = 2  # sequences per micro-batch


def _run_accumulate(accumulate, k):
    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.ddp import BucketedDDP, allreduce_hook
    from helpers.model import build_model

    r = rank_info().rank
    dev = rank_info().device
    calls, forwards = [], []
    ddp = None

    class Watched(BucketedDDP):
        def forward(self, *args, **kwargs):  # was the forward run inside no_sync()?
            forwards.append(not self.require_backward_grad_sync)
            return super().forward(*args, **kwargs)

    def counting_hook(flat, group):  # every bucket all-reduce goes through here
        # inside no_sync() *now*: the backward ran inside it, its forward did not
        calls.append(not ddp.require_backward_grad_sync)
        return allreduce_hook(flat, group)

    ddp = Watched(build_model("toy", seed=0).to(dev), comm_hook=counting_hook)
    n = ROWS * k
    x, y = (t.to(dev) for t in _data().batch(range(n * r, n * r + n)))
    micro = [(x[ROWS * i:ROWS * (i + 1)], y[ROWS * i:ROWS * (i + 1)]) for i in range(k)]
    loss = accumulate(ddp, micro)
    # the lab states a float; keep what came back when it is not a number
    ok = isinstance(loss, (float, int)) and not isinstance(loss, bool) or \
        isinstance(loss, torch.Tensor) and loss.numel() == 1
    return ([None if p.grad is None else p.grad.clone() for p in ddp.module.parameters()],
            len(calls), len(ddp.buckets), float(loss) if ok else repr(loss)[:60],
            {"forwards_in_no_sync": sum(forwards), "forwards": len(forwards),
             "reduced_in_no_sync": sum(calls)})


def _data():
    from helpers.data import make_dataset
    return make_dataset(seq_len=16, num_sequences=24)


def _probe(accumulate):
    from helpers.ddp import BucketedDDP
    from helpers.model import build_model

    x = torch.zeros(1, 4, dtype=torch.long)
    accumulate(BucketedDDP(build_model("toy", seed=0)), [(x, x), (x, x)])


def check_accumulate(accumulate) -> None:
    """3 ranks x 3 micro-batches, then 4 ranks x 2, of 2 sequences each: the gradient of
    the global batch (18, then 16 sequences).

    Catches:
    * forgets the 1/k: k times the gradient (named);
    * 1/k hard-coded from the first run (``/ 3``): the 4-rank run has k = 2 (named
      as a ratio);
    * all-reduces every micro-batch (no no_sync): more bucket all-reduces (named);
    * the backwards inside no_sync() but their forwards outside: the hooks were armed
      at the forward, so every backward still reduced (named as such);
    * no_sync around *every* micro-batch: the count of bucket all-reduces (0) is named
      before the gradient, which is then this rank's own;
    * the gradients all-reduced by hand after a fully local accumulation: right
      numbers, 0 bucket all-reduces (named);
    * returns the last micro-batch's loss, or the sum: named;
    * returns None or a non-number: named; any exception: as CheckFailed.
    """
    if not callable(accumulate):
        raise CheckFailed(f"accumulate should be a function, got {accumulate!r}")
    for world, k in RUNS:
        results = on_ranks(_run_accumulate, world, accumulate, k,
                           what=f"accumulate on {world} ranks, {k} micro-batches",
                           probe=lambda: _probe(accumulate))
        _compare(results, world, k)
    passed(f"accumulation on 3 ranks x 3 micro-batches and 4 x 2 = the global batch, with "
           f"{results[0][2]} bucket all-reduce(s) per step instead of one set per micro-batch")


def _compare(results: list, world: int, k: int) -> None:
    from helpers.model import build_model

    where = f"{world} ranks x {k} micro-batches"
    n = ROWS * k
    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = _data().batch(range(world * n))
    ref(x, y)[1].backward()
    ref64(x, y)[1].backward()  # float64: the exact answer, to ~1e-16
    for rank, (grads, n_calls, n_buckets, loss, seen) in enumerate(results):
        right = all(g is not None and within_fp32_noise(g, p.grad, p64.grad)[0]
                    for p, p64, g in zip(ref.parameters(), ref64.parameters(), grads))
        if n_calls == 0:
            raise CheckFailed(
                f"{where}, rank {rank}: the check counted 0 bucket all-reduces: "
                + (f"all {seen['forwards']} forward(s) ran inside no_sync(), so the wrapper "
                   f"never reduced and each rank kept its own gradient. Run the last "
                   f"micro-batch, forward and backward, outside no_sync()."
                   if not right else
                   "the gradients are right, but they never went through the wrapper's "
                   "buckets (all-reduced by hand?). Let the last micro-batch's backward run "
                   "outside no_sync(): the wrapper then all-reduces the accumulated sum, "
                   "bucket by bucket, overlapped with that backward."))
        for (name, p), p64, g in zip(ref.named_parameters(), ref64.parameters(), grads):
            if g is None:
                raise CheckFailed(f"{where}, rank {rank}: {name}.grad is None after accumulate")
            # another fp32 summation order than one process: as close to
            # float64 as the fp32 reference is (helpers.tolerance)
            if within_fp32_noise(g, p.grad, p64.grad)[0]:
                continue
            ratio = float(g.norm() / p.grad.norm())
            hint = (f" It is {k}x too large: scale each micro-batch loss by 1/k "
                    f"(k = len(micro_batches) = {k})." if abs(ratio - k) < 0.01 else
                    f" It is {ratio:.3f}x the right one: scale by 1/len(micro_batches), "
                    f"not by a fixed number." if any(abs(ratio - k / j) < 0.01
                                                      for j in range(2, 9) if j != k) else "")
            raise CheckFailed(f"{where}, rank {rank}: {name}.grad differs from the global "
                              f"batch's (norm ratio {ratio:.3f}).{hint}")
        if n_calls != n_buckets and seen["reduced_in_no_sync"]:
            raise CheckFailed(
                f"{where}, rank {rank}: {n_calls} bucket all-reduces for {n_buckets} "
                f"bucket(s), {seen['reduced_in_no_sync']} of them from a backward you ran "
                f"inside no_sync(): its forward ran outside. The wrapper decides at the "
                f"forward whether the next backward reduces (the forward arms the hooks, as "
                f"in DDP, chapter 04), so put each of the first {k - 1} forwards inside "
                f"no_sync() together with its backward.")
        if n_calls != n_buckets:
            raise CheckFailed(f"{where}, rank {rank}: {n_calls} bucket all-reduces for "
                              f"{n_buckets} bucket(s): the first {k - 1} micro-batch(es) must "
                              f"run inside ddp_model.no_sync() so that only the last backward "
                              f"communicates.")
        if isinstance(loss, str):
            raise CheckFailed(f"{where}, rank {rank}: accumulate should return the mean loss "
                              f"as a float, got {loss}")
        with torch.no_grad():
            want, want64 = (sum(m(x[n * rank + ROWS * i:n * rank + ROWS * (i + 1)],
                                  y[n * rank + ROWS * i:n * rank + ROWS * (i + 1)])[1]
                                for i in range(k)) / k for m in (ref, ref64))
        # the same micro-batch losses, maybe added in another order: float32 rounding
        if not within_fp32_noise(torch.as_tensor(loss), want, want64)[0]:
            raise CheckFailed(f"{where}, rank {rank}: returned mean loss {loss:.6g}, expected "
                              f"{float(want):.6g}: the mean of this rank's {k} micro-batch "
                              f"losses")


def check_noise_scale(noise_scale) -> None:
    """Exact expectations E|G_B|^2 = |G|^2 + tr(Sigma)/B for a few (|G|^2, tr) pairs.

    Catches:
    * the ratio inverted (|G|^2 / tr): named;
    * noise over signal from the big batch alone: wrong values;
    * integer division (``1 // b``): a ZeroDivisionError, named with the case;
    * the batch sizes' roles swapped in |G|^2's estimate (b_small where b_big belongs):
      wrong values;
    * returns None, a string or a bool: named.
    """
    for G2, tr, bs, bb in [(4.0, 200.0, 8, 64), (1.0, 10.0, 2, 4), (0.5, 1000.0, 16, 256)]:
        got = attempt(noise_scale, G2 + tr / bs, bs, G2 + tr / bb, bb,
                      what=f"noise_scale({G2 + tr / bs:.4g}, {bs}, {G2 + tr / bb:.4g}, {bb})")
        try:
            if isinstance(got, (str, bool)):  # float() takes them; the lab wants a number
                raise TypeError
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
