"""Checks for chapter 04: bucket assignment, and the hook that launches buckets.

* ``assign_buckets(sizes_bytes, cap_bytes, first_cap_bytes) -> list[list[int]]``:
  parameter sizes in registration order; buckets of parameter indices in the
  order they become ready (see ``helpers.ddp.assign_buckets``, one dtype).
* ``class MyDDP(BucketedDDP)`` overriding the reducer's three steps:
  ``on_grad_ready(self, param)`` counts the parameter's gradient in its bucket;
  ``launch_ready_buckets(self)`` launches complete buckets strictly in bucket
  order (``self.launch_bucket(b)``, advancing ``self.next_bucket``);
  ``finish_backward(self)`` waits for every bucket's future and writes the
  averaged values into each ``p.grad``.
  The check tests the mechanism through the timeline the base class records
  (buckets launched in order, the first before backward is over) and the
  result against one process.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.ddp import BucketedDDP
from helpers.ddp import assign_buckets as _reference_buckets
from helpers.tolerance import within_fp32_noise

CASES = [  # (sizes in bytes, cap, first cap); the mistake each case is there for:
    ([100] * 6, 400, 150),    # first bucket closes between its two caps (200): cap for all
    ([100] * 4, 200, 200),    # fills hit the cap exactly: "more than" instead of "at least"
    ([50, 50, 300, 50], 120, 90),  # 300 overshoots: closing *before* the parameter that
                                   # would overflow, instead of after it
    ([], 100, 100),           # no parameters: no buckets (not [[]])
    ([400] * 6, 800, 400),
    ([400] * 6, 10_000, 10_000),
    ([400] * 6, 0, 0),
    ([10, 5000, 10], 100, 100),
    ([100, 300, 50, 50, 900, 20, 20, 20], 400, 100),
    ([4] * 10, 12, 4),
    ([7], 1, 1),
]


def _drawn_cases(n: int = 20, seed: int = 4) -> list:
    """Random cases from a fixed seed (each printed on failure, so it reproduces):
    sizes 1..600 bytes, caps around a few parameters' worth, the first cap below,
    equal to or above the others."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        sizes = [rng.randint(1, 600) for _ in range(rng.randint(1, 12))]
        cap = rng.randint(1, 1500)
        cases.append((sizes, cap, rng.choice([cap, rng.randint(1, cap), cap * 2])))
    return cases


def check_assign_buckets(assign_buckets) -> None:
    """Catches (case in CASES, then 20 drawn from a fixed seed):
    * buckets in registration order: named ("walk from the last");
    * ignores first_cap_bytes, or uses it for every bucket: ``[100]*6, 400, 150``;
    * closes only when *over* the cap: ``[100]*4, 200, 200``;
    * closes before the parameter that would overflow: ``[50, 50, 300, 50], 120, 90``;
    * drops the last, partly filled bucket: ``[4]*10, 12, 4``;
    * appends the open bucket even when empty (``[[]]`` for no parameters, or a
      trailing ``[]`` after an exact fill): ``[], 100, 100`` and ``[100]*6, 400, 150``;
    * a parameter lost or repeated: named;
    * returns None / not a list of lists, or raises: named, with the case.
    """
    for sizes, cap, first in [*CASES, *_drawn_cases()]:
        want = _reference_buckets(sizes, cap, first)
        got = attempt(assign_buckets, list(sizes), cap, first,
                      what=f"assign_buckets({sizes}, cap={cap}, first={first})")
        try:
            got = [list(map(int, b)) for b in got]
        except (TypeError, ValueError):
            raise CheckFailed(f"assign_buckets({sizes}, cap={cap}, first={first}) should "
                              f"return a list of lists of indices, got {got!r}") from None
        if got == want:
            continue
        flat = [i for b in got for i in b]
        hint = ""
        if any(not b for b in got):
            hint = (" A bucket is never empty: after the loop, append the open bucket only "
                    "if it holds something.")
        elif sorted(flat) != list(range(len(sizes))):
            hint = " Every parameter index must appear in exactly one bucket."
        elif flat == sorted(flat) and len(sizes) > 1:
            hint = (" Your buckets follow registration order; backward produces gradients "
                    "in reverse, so walk the parameters from the last to the first.")
        elif [len(b) for b in got] != [len(b) for b in want]:
            hint = (" Add the parameter first, then close the bucket as soon as it holds at "
                    "least its cap (>=, not >); the first bucket uses first_cap_bytes, later "
                    "ones cap_bytes; a last, partly filled bucket is still a bucket.")
        raise CheckFailed(f"assign_buckets({sizes}, cap={cap}, first={first}) = {got}, "
                          f"expected {want}.{hint}")
    passed(f"bucket assignment matches the reference (and DDP's rule) on {len(CASES)} edge "
           f"cases and {len(_drawn_cases())} drawn ones")


class _Shuffled(torch.nn.Module):
    """Registered a, b, c but used c -> b -> a in forward... except ``late``.

    ``late`` is registered last (so it sits in bucket 0) but used *first* in
    forward, so its gradient is ready *last*: bucket 0 becomes ready after the
    others. An implementation that launches ready buckets out of order shows up.
    ``late`` has no bias, so bucket 0 waits for exactly one gradient while the others
    complete: a launch test off by one (``pending <= 1``) launches it before its
    gradient arrives (the reducer refuses that, naming it).
    """

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.late = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.a(self.b(self.late(x))).pow(2).mean()


def _run_hook(cls):
    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model

    r, p = rank_info().rank, rank_info().world_size
    out = {}
    # 1) the toy GPT: same gradients as one process, overlap visible in the timeline
    data = make_dataset(seq_len=16, num_sequences=16)
    x, y = (t.to(rank_info().device) for t in data.batch(range(2 * p)))
    ddp = cls(build_model("toy", seed=0).to(rank_info().device),
              bucket_cap_mb=0.01, first_bucket_mb=0.001)
    loss = ddp(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])[1]
    # every collective of the backward, as the checks' spy sees it: one all-reduce per
    # bucket is the whole of the reducer's communication
    from helpers.checks.spy import communication_spy
    with communication_spy(keep_values=False) as spy:
        loss.backward()
    out["collectives"] = list(spy.collectives)
    out["grads"] = [p.grad.clone() for p in ddp.module.parameters()]
    out["timeline"] = ddp.timeline
    out["n_buckets"] = len(ddp.buckets)
    # 2) readiness out of bucket order
    torch.manual_seed(0)
    shuffled = _Shuffled().to(rank_info().device)
    ddp2 = cls(shuffled, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    ddp2(torch.randn(4, 64, generator=torch.Generator().manual_seed(r))
         .to(rank_info().device)).backward()
    out["timeline2"] = ddp2.timeline
    out["n_buckets2"] = len(ddp2.buckets)
    return out


def _probe(cls):
    from helpers.model import build_model

    ddp = cls(build_model("toy", seed=0))  # one rank, no process group
    x = torch.zeros(1, 4, dtype=torch.long)
    ddp(x, x)[1].backward()


WORLDS = (3, 4)  # the hook has nothing per world size to hard-code, but a rank's
# result is averaged over p: a "/ 2" written into finish_backward shows at 3 and 4


def check_grad_ready_hook(cls) -> None:
    """Run ``cls`` (a BucketedDDP subclass) on 3 and 4 ranks; compare with one process.

    Catches:
    * launches each bucket as soon as it is complete, out of bucket order: the model
      whose bucket 0 is ready last (``_Shuffled``) shows it (the base refuses it);
    * launches everything at the end of backward: no overlap in the timeline (named);
    * an ``if`` where a ``while`` belongs in launch_ready_buckets: a bucket never
      launched (its future None, named);
    * never writes the averages back into ``.grad``, or writes them without the
      parameter's shape, or divides again (by p or a fixed 2): gradients differ from
      one process (named);
    * never records 'ready', or records it twice: named;
    * launches a bucket that still lacks a gradient (``pending <= 1``), or counts a
      gradient into another bucket than its own: the reducer refuses the launch,
      naming the parameters that had not arrived;
    * right gradients from extra communication (finish_backward all-reducing the
      ``.grad`` tensors again, or instead of waiting for the buckets): the backward's
      collectives are counted, one all-reduce per bucket (named);
    * passes an instance, or a class not derived from BucketedDDP: named;
    * any other exception: the rank's error, as CheckFailed.
    """
    if not (isinstance(cls, type) and issubclass(cls, BucketedDDP)):
        raise CheckFailed(f"pass your BucketedDDP subclass (the class itself), got {cls!r}")
    for world in WORLDS:
        results = on_ranks(_run_hook, world, cls, what=f"{cls.__name__} on {world} ranks",
                           probe=lambda: _probe(cls), hints=_HINTS)
        _compare(results, world)
    passed(f"hook-driven buckets on {' and '.join(map(str, WORLDS))} ranks: same gradients as "
           f"one process, {results[0]['n_buckets']} buckets launched in order, the first "
           f"while backward was still running")


_HINTS = {"NoneType": "a bucket's future is None: it was never launched. "
                      "launch_ready_buckets must keep launching while the "
                      "next bucket is complete, and finish_backward must "
                      "launch what is left before waiting."}


def _compare(results: list, world: int) -> None:
    from helpers.data import make_dataset
    from helpers.model import build_model

    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = make_dataset(seq_len=16, num_sequences=16).batch(range(2 * world))
    ref(x, y)[1].backward()
    ref64(x, y)[1].backward()  # float64: the exact answer, to ~1e-16
    for rank, out in enumerate(results):
        for (name, p), p64, g in zip(ref.named_parameters(), ref64.parameters(), out["grads"]):
            # another fp32 summation order than one process: as close to
            # float64 as the fp32 reference is (helpers.tolerance)
            if g is None or g.shape != p.shape or not within_fp32_noise(g, p.grad, p64.grad)[0]:
                raise CheckFailed(
                    f"{world} ranks, rank {rank}: {name}.grad is not the global-batch "
                    f"gradient. After backward every .grad must hold the average over ranks "
                    f"(the future's buffer is already averaged: don't divide again): "
                    f"finish_backward waits for each bucket's future and writes its averaged "
                    f"values back, in the parameter's shape.")
        n = out["n_buckets"]
        if out["collectives"] != ["all_reduce"] * n:
            names = sorted(set(out["collectives"]))
            raise CheckFailed(
                f"{world} ranks, rank {rank}: the gradients are right, but the backward issued "
                f"{len(out['collectives'])} collective(s) ({', '.join(names) or 'none'}) for "
                f"{n} buckets. The reducer's whole communication is one all-reduce per "
                f"bucket, started by launch_bucket; finish_backward only waits for the "
                f"futures and copies their averaged buffers back.")
        for key, nb in (("timeline", "n_buckets"), ("timeline2", "n_buckets2")):
            tl, n = out[key], out[nb]
            launched = [e["bucket"] for e in tl if e["event"] == "launched"]
            if launched != list(range(n)):
                raise CheckFailed(
                    f"{world} ranks, rank {rank}: buckets were launched in the order "
                    f"{launched}, expected {list(range(n))}. Collectives must be issued in "
                    f"the same order on every rank: launch bucket b only after buckets "
                    f"0..b-1, and keep going while the next one is complete.")
        tl = out["timeline"]
        t = {(e["bucket"], e["event"]): e["t"] for e in tl}
        n = out["n_buckets"]
        if (0, "launched") not in t or (n - 1, "ready") not in t \
                or not t[0, "launched"] < t[n - 1, "ready"]:
            raise CheckFailed("no overlap: bucket 0 was not launched before the last bucket was "
                              "ready. Launch as soon as a bucket's last gradient arrives, from "
                              "the hook, not at the end of backward.")
        ready = [e["bucket"] for e in out["timeline2"] if e["event"] == "ready"]
        if sorted(ready) != list(range(out["n_buckets2"])):
            raise CheckFailed(f"{world} ranks, rank {rank}: 'ready' recorded for buckets "
                              f"{ready}; record self.record(b, 'ready') once per bucket when "
                              f"its count hits 0")
