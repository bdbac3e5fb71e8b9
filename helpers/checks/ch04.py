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

CASES = [  # (sizes in bytes, cap, first cap)
    ([400] * 6, 800, 400),
    ([400] * 6, 10_000, 10_000),
    ([400] * 6, 0, 0),
    ([10, 5000, 10], 100, 100),
    ([100, 300, 50, 50, 900, 20, 20, 20], 400, 100),
    ([4] * 10, 12, 4),
    ([7], 1, 1),
]


def check_assign_buckets(assign_buckets) -> None:
    for sizes, cap, first in CASES:
        want = _reference_buckets(sizes, cap, first)
        got = attempt(assign_buckets, list(sizes), cap, first, what="assign_buckets")
        try:
            got = [list(map(int, b)) for b in got]
        except TypeError:
            raise CheckFailed(f"assign_buckets should return a list of lists of indices, "
                              f"got {got!r}") from None
        if got == want:
            continue
        flat = [i for b in got for i in b]
        hint = ""
        if sorted(flat) != list(range(len(sizes))):
            hint = " Every parameter index must appear in exactly one bucket."
        elif flat == sorted(flat) and len(sizes) > 1:
            hint = (" Your buckets follow registration order; backward produces gradients "
                    "in reverse, so walk the parameters from the last to the first.")
        elif [len(b) for b in got] != [len(b) for b in want]:
            hint = (" Close a bucket as soon as it holds at least its cap; the first bucket "
                    "uses first_cap_bytes, later ones cap_bytes.")
        raise CheckFailed(f"assign_buckets({sizes}, cap={cap}, first={first}) = {got}, "
                          f"expected {want}.{hint}")
    passed(f"bucket assignment matches the reference (and DDP's rule) on {len(CASES)} cases")


class _Shuffled(torch.nn.Module):
    """Registered a, b, c but used c -> b -> a in forward... except ``late``.

    ``late`` is registered last (so it sits in bucket 0) but used *first* in
    forward, so its gradient is ready *last*: bucket 0 becomes ready after the
    others. An implementation that launches ready buckets out of order shows up.
    """

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.late = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.a(self.b(self.late(x))).pow(2).mean()


def _run_hook(cls):
    from helpers import rank_info
    from helpers.data import make_dataset
    from helpers.model import build_model

    r = rank_info().rank
    out = {}
    # 1) the toy GPT: same gradients as one process, overlap visible in the timeline
    data = make_dataset(seq_len=16, num_sequences=16)
    x, y = data.batch(range(4))
    ddp = cls(build_model("toy", seed=0), bucket_cap_mb=0.01, first_bucket_mb=0.001)
    ddp(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])[1].backward()
    out["grads"] = [p.grad.clone() for p in ddp.module.parameters()]
    out["timeline"] = ddp.timeline
    out["n_buckets"] = len(ddp.buckets)
    # 2) readiness out of bucket order
    torch.manual_seed(0)
    shuffled = _Shuffled()
    ddp2 = cls(shuffled, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    ddp2(torch.randn(4, 64, generator=torch.Generator().manual_seed(r))).backward()
    out["timeline2"] = ddp2.timeline
    out["n_buckets2"] = len(ddp2.buckets)
    return out


def _probe(cls):
    from helpers.model import build_model

    ddp = cls(build_model("toy", seed=0))  # one rank, no process group
    x = torch.zeros(1, 4, dtype=torch.long)
    ddp(x, x)[1].backward()


def check_grad_ready_hook(cls) -> None:
    """Run ``cls`` (a BucketedDDP subclass) on 2 ranks; compare with one process."""
    from helpers.data import make_dataset
    from helpers.model import build_model

    if not (isinstance(cls, type) and issubclass(cls, BucketedDDP)):
        raise CheckFailed(f"pass your BucketedDDP subclass (the class itself), got {cls!r}")
    results = on_ranks(_run_hook, 2, cls, what=f"{cls.__name__}", probe=lambda: _probe(cls),
                       hints={"NoneType": "a bucket's future is None: it was never launched. "
                                          "launch_ready_buckets must keep launching while the "
                                          "next bucket is complete, and finish_backward must "
                                          "launch what is left before waiting."})
    ref, ref64 = build_model("toy", seed=0), build_model("toy", seed=0).double()
    x, y = make_dataset(seq_len=16, num_sequences=16).batch(range(4))
    ref(x, y)[1].backward()
    ref64(x, y)[1].backward()  # float64: the exact answer, to ~1e-16
    for rank, out in enumerate(results):
        for (name, p), p64, g in zip(ref.named_parameters(), ref64.parameters(), out["grads"]):
            # another fp32 summation order than one process: as close to
            # float64 as the fp32 reference is (helpers.tolerance)
            if not within_fp32_noise(g, p.grad, p64.grad)[0]:
                raise CheckFailed(
                    f"rank {rank}: {name}.grad is not the global-batch gradient. After "
                    f"backward every .grad must hold the average over ranks: finish_backward "
                    f"waits for each bucket's future and writes its averaged values back.")
        for key, nb in (("timeline", "n_buckets"), ("timeline2", "n_buckets2")):
            tl, n = out[key], out[nb]
            launched = [e["bucket"] for e in tl if e["event"] == "launched"]
            if launched != list(range(n)):
                raise CheckFailed(
                    f"rank {rank}: buckets were launched in the order {launched}, expected "
                    f"{list(range(n))}. Collectives must be issued in the same order on every "
                    f"rank: launch bucket b only after buckets 0..b-1, and keep going while "
                    f"the next one is complete.")
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
            raise CheckFailed(f"rank {rank}: 'ready' recorded for buckets {ready}; record "
                              f"self.record(b, 'ready') once per bucket when its count hits 0")
    passed(f"hook-driven buckets: same gradients as one process, {results[0]['n_buckets']} "
           f"buckets launched in order, the first while backward was still running")
