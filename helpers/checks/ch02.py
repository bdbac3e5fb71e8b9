"""Checks for chapter 02: naive data parallelism equals one process on the global batch.

The learner's functions run on real ranks (``launch``); the reference is one
process on the whole global batch. Every check runs on two world sizes, 3 and 4:
at one size a number hard-coded to that size (``/ 3``, a slice of a fixed width)
gives the right answer, at two it cannot.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, on_ranks, passed
from helpers.tolerance import within_fp32_noise

# 3 ranks: catches a hard-coded "/ 2"; 4 ranks: catches a "/ 3" written for the first run
WORLDS = (3, 4)


# rows per rank: differs between the two world sizes, so a slice width hard-coded
# from the first run (``x[2 * r:2 * r + 2]``) takes the wrong rows in the second
MICRO = {3: 2, 4: 3}


def _data(world_size: int, steps: int = 1):
    from helpers.data import make_dataset

    micro = MICRO[world_size]
    data = make_dataset(seq_len=16, num_sequences=64)
    g = world_size * micro
    return [data.batch(range(s * g, (s + 1) * g)) for s in range(steps)]


# what a collective on a None gradient raises, and the advice for it
_NONE_GRAD = {key: "a parameter whose .grad is None (the model has one its forward never "
                   "uses) reached a collective: skip parameters whose .grad is None"
              for key in ("NoneType", "Invalid function argument")}


def _ranked_grads(average_gradients):
    """Each rank: local backward on its slice, the learner's averaging, return grads."""
    from helpers import rank_info
    from helpers.model import build_model

    r, p = rank_info().rank, rank_info().world_size
    x, y = _data(p)[0]
    m = MICRO[p]
    model = build_model("toy", seed=0)
    # a parameter the forward never uses (a frozen or unused layer): its .grad stays None
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(3, device=x.device)))
    model(x[m * r:m * (r + 1)], y[m * r:m * (r + 1)])[1].backward()
    grad_bytes = sum(q.grad.numel() * q.grad.element_size() for q in model.parameters()
                     if q.grad is not None)
    collectives, reduced = _counted(average_gradients, model)
    if model.unused.grad is not None:
        raise RuntimeError("average_gradients gave a gradient to a parameter that had none "
                           "(.grad was None): skip parameters whose .grad is None")
    grads = [q.grad.clone() if q.grad is not None else None
             for n, q in model.named_parameters() if n != "unused"]
    return grads, collectives, reduced, grad_bytes


def _counted(fn, *args):
    """Run ``fn(*args)`` and return (the collectives it called, in order; the bytes it
    handed to ``all_reduce``), however it spelled them (``helpers.checks.spy``)."""
    from helpers.checks.spy import communication_spy

    with communication_spy(keep_values=False) as spy:
        fn(*args)
    return list(spy.collectives), spy.bytes("all_reduce", "all_reduce_coalesced")


def _probe_model(fn):
    from helpers.model import build_model

    fn(build_model("toy", seed=0))


def _probe_step(fn):
    from helpers.model import build_model

    model = build_model("toy", seed=0)
    x = torch.zeros(3, 4, dtype=torch.long)
    fn(model, torch.optim.SGD(model.parameters(), lr=0.0), x, x)


def _local_grad(rank: int, world: int, name: str) -> torch.Tensor:
    """The gradient rank ``rank`` computes on its own slice, before any averaging."""
    from helpers.model import build_model

    model = build_model("toy", seed=0)
    x, y = _data(world)[0]
    m = MICRO[world]
    model(x[m * rank:m * (rank + 1)], y[m * rank:m * (rank + 1)])[1].backward()
    return dict(model.named_parameters())[name].grad


def check_average_gradients(average_gradients) -> None:
    """``average_gradients(model)`` on 3 and 4 ranks: every ``.grad`` becomes the
    global-batch gradient.

    Catches:
    * forgets to divide: the sum is p times the mean (any world size);
    * divides by a fixed number (``/ 2``, or ``/ 3`` tuned on a first run): the
      4-rank run (and the 3-rank one for ``/ 2``) is off by p/that number;
    * never communicates: the rank's own gradient comes back (named as such);
    * averages only some parameters (e.g. skips biases or stops early): the
      first parameter that differs is named;
    * sets ``p.grad`` to None or replaces it with a non-tensor: named per tensor;
    * all-reduces a parameter whose ``.grad`` is None (the model has one the forward
      never uses): the rank's error, with the advice to skip it;
    * right numbers from more communication than one all-reduce: an all_gather then a
      mean, a reduce then a broadcast (named), a gradient all-reduced twice (the bytes
      handed to all_reduce are counted against the gradients' bytes);
    * raises (a typo, a wrong collective argument): the rank's error, as CheckFailed.
    """
    if not callable(average_gradients):
        raise CheckFailed(f"average_gradients should be a function, got {average_gradients!r}")
    for world in WORLDS:
        results = on_ranks(_ranked_grads, world, average_gradients, what="average_gradients",
                           probe=lambda: _probe_model(average_gradients), hints=_NONE_GRAD)
        _compare_grads([grads for grads, *_ in results], world)
        _check_traffic(results, world)
    n = len(results[0][0])
    passed(f"averaged gradients on {' and '.join(map(str, WORLDS))} ranks equal one process "
           f"on the global batch ({n} tensors, within float32 rounding)")


def _check_traffic(results: list, world: int) -> None:
    """Right numbers can come from more communication than an all-reduce needs: an
    all_gather of every gradient (then a mean) moves p copies to every rank, a
    reduce to rank 0 then a broadcast serializes through one rank, a second all-reduce
    of the same tensor sends everything twice. Count what went in."""
    for rank, (_, collectives, reduced, grad_bytes) in enumerate(results):
        others = sorted(set(collectives) - {"all_reduce"})
        if others:
            raise CheckFailed(
                f"{world} ranks, rank {rank}: the gradients are right, but average_gradients "
                f"called {', '.join(others)}. "
                + ("all_gather hands every rank all p gradients, p times the memory and "
                   "(p-1)/p x p of the bytes per rank where an all-reduce sends 2(p-1)/p: "
                   if "all_gather" in others or "all_gather_into_tensor" in others else
                   "A reduce to one rank and a broadcast back funnel every byte through "
                   "that rank: " if "reduce" in others or "broadcast" in others else "")
                + "sum with dist.all_reduce and divide by the world size.")
        if reduced != grad_bytes:
            raise CheckFailed(
                f"{world} ranks, rank {rank}: the gradients are right, but {reduced:,} bytes "
                f"went through all_reduce for {grad_bytes:,} bytes of gradients: "
                + ("each gradient should be all-reduced once (is one all-reduced twice, or "
                   "something else reduced too?)." if reduced > grad_bytes else
                   "some gradients were not all-reduced (the ranks' shares then only agree "
                   "by chance)."))


def _compare_grads(results: list, world: int) -> None:
    from helpers.model import build_model

    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = _data(world)[0]
    ref(x, y)[1].backward()
    ref64(x, y)[1].backward()  # float64: the exact answer, to ~1e-16
    names = [n for n, _ in ref.named_parameters()]
    for rank, grads in enumerate(results):
        for name, got, want, want64 in zip(names, grads, (q.grad for q in ref.parameters()),
                                           (q.grad for q in ref64.parameters())):
            if got is None:
                raise CheckFailed(f"{world} ranks, rank {rank}: {name}.grad is None after "
                                  f"averaging; average it in place (p.grad), keep it a tensor")
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise CheckFailed(f"{world} ranks, rank {rank}: {name}.grad should stay a "
                                  f"tensor of shape {tuple(want.shape)}, got {got!r:.80}")
            # fp32, another summation order than one process: as close to
            # float64 as the fp32 reference is (helpers.tolerance)
            if within_fp32_noise(got, want, want64)[0]:
                continue
            ratio = float(got.norm() / want.norm())
            hint = ""
            if abs(ratio - world) < 0.01:
                hint = f" It is {world}x too large: sum, then divide by the world size."
            elif any(abs(ratio - world / k) < 0.01 for k in range(1, 9) if k != world):
                hint = (f" It is {ratio:.3f} = {world}/{round(world / ratio)} times the mean: "
                        f"divide by dist.get_world_size(), not by a fixed number.")
            elif torch.allclose(got, _local_grad(rank, world, name), rtol=1e-5, atol=1e-7):
                hint = " It is this rank's own gradient: did the all-reduce run on it?"
            raise CheckFailed(f"{world} ranks, rank {rank}: {name}.grad differs from the "
                              f"global-batch gradient (norm ratio {ratio:.3f}).{hint}")


STEPS = 3


def _ranked_training(dp_step):
    from helpers import rank_info
    from helpers.model import build_model

    p = rank_info().world_size
    model = build_model("toy", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x, y in _data(p, steps=STEPS):
        loss = dp_step(model, opt, x, y)
        # the lab states a float (or a 0-d tensor, as float() takes it); keep what came
        # back when it is neither, to name it on the caller's side
        ok = isinstance(loss, (float, int)) and not isinstance(loss, bool) or \
            isinstance(loss, torch.Tensor) and loss.numel() == 1
        losses.append(float(loss) if ok else repr(loss)[:80])
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


def _reference_training(dtype: torch.dtype, world: int) -> tuple[dict, list]:
    """One process, the whole global batch, STEPS steps, in ``dtype``; and before each
    step, the loss of each rank's slice (what each rank's dp_step returns)."""
    from helpers.model import build_model, lm_loss

    ref = build_model("toy", seed=0).to(dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    slice_losses = []
    for x, y in _data(world, steps=STEPS):
        b = x.size(0) // world
        opt.zero_grad()
        logits, loss = ref(x, y)
        # each rank's loss from the same forward (one forward, not one per rank: the
        # check runs in the learner's kernel): the slice's rows of the logits
        slice_losses.append([lm_loss(logits[r * b:(r + 1) * b].detach(), y[r * b:(r + 1) * b])
                             for r in range(world)])
        loss.backward()
        opt.step()
    return ref.state_dict(), slice_losses


def check_dp_step(dp_step) -> None:
    """``dp_step(model, opt, x_global, y_global) -> local loss`` for 3 steps on 3 and 4
    ranks leaves the same weights as one process stepping on the whole global batch.

    Catches:
    * every rank computes on the whole batch, or on a slice hard-coded for one run
      (a width of 2 rows, ``// 3``): the 4-rank run has 3 rows per rank (MICRO), so
      the returned loss of step 1 is not the loss of the rank's slice;
    * forgets ``zero_grad``: gradients pile up, the weights drift from step 2 on;
    * logs a wrong loss (the all-reduced mean, the loss before the step of an earlier
      batch, the whole batch's loss beside a correct slice): every step's returned
      loss is compared, not only the weights;
    * returns nothing (None) or a non-number: named, with the lab's stated type;
    * forgets to average (steps on local gradients) or steps twice: weights differ;
    * raises: the rank's error, as CheckFailed.
    """
    if not callable(dp_step):
        raise CheckFailed(f"dp_step should be a function, got {dp_step!r}")
    for world in WORLDS:
        try:
            results = on_ranks(_ranked_training, world, dp_step, what="dp_step",
                               probe=lambda: _probe_step(dp_step))
            _compare_training(results, world)
        except CheckFailed:
            _check_average_gradients_used(dp_step)   # the cause may be exercise 1
            raise
    passed(f"{STEPS} naive-DP steps on {' and '.join(map(str, WORLDS))} ranks match one "
           f"process on the global batch (weights and every step's local loss)")


def _check_average_gradients_used(dp_step) -> None:
    """dp_step failed and calls the learner's exercise 1 (``average_gradients`` from the
    notebook): if that is what is wrong, say so, instead of hints about dp_step's lines."""
    import contextlib
    import io

    code = getattr(dp_step, "__code__", None)
    if code is None:
        return
    avg = None
    if "average_gradients" in code.co_names:          # a notebook's global
        avg = dp_step.__globals__.get("average_gradients")
    elif "average_gradients" in code.co_freevars:     # a closure's
        avg = dp_step.__closure__[code.co_freevars.index("average_gradients")].cell_contents
    if not callable(avg):
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check_average_gradients(avg)
    except CheckFailed as exc:
        raise CheckFailed(f"dp_step calls your average_gradients, which is not right yet "
                          f"(exercise 1): {exc}") from None


def _compare_training(results: list, world: int) -> None:
    (want, losses), (want64, losses64) = (_reference_training(dtype, world)
                                          for dtype in (torch.float32, torch.float64))
    b = _data(world)[0][0].size(0) // world
    # weights first: a forgotten zero_grad shows as drifting weights, named as such,
    # before the losses computed on those weights drift too
    for rank, (state, _) in enumerate(results):
        for k, v in want.items():
            # another summation order than one process: float32 rounding only
            if not within_fp32_noise(state[k], v, want64[k])[0]:
                raise CheckFailed(
                    f"{world} ranks, rank {rank}: after {STEPS} steps {k} differs from the "
                    f"single-process run by {float((state[k] - v).abs().max()):.2e}. Zero the "
                    f"gradients each step, use this rank's slice (rank r takes rows "
                    f"r*b..(r+1)*b of the global batch), average, then step once.")
    for rank, (_, got) in enumerate(results):
        for step, loss in enumerate(got):
            if isinstance(loss, str):
                raise CheckFailed(f"{world} ranks, rank {rank}, step {step + 1}: dp_step "
                                  f"should return this rank's loss (a float), got {loss}")
            own, own64 = losses[step][rank], losses64[step][rank]
            # the same forward on the same slice and weights, maybe other kernels:
            # within float32 rounding (helpers.tolerance)
            if within_fp32_noise(torch.tensor(loss), own, own64)[0]:
                continue
            hint = (f"Each rank must compute on its own slice only (rows {rank * b}.."
                    f"{(rank + 1) * b - 1} of the global batch, b = batch / world size), "
                    f"and return that slice's loss before the step"
                    + (", not the loss averaged over ranks." if step == 0 else "."))
            raise CheckFailed(f"{world} ranks, rank {rank}, step {step + 1}: returned loss "
                              f"{loss:.5f}, but the loss on this rank's slice is "
                              f"{float(own):.5f}. {hint}")
