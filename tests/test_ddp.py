"""BucketedDDP vs torch DistributedDataParallel and vs a single process."""

import copy
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import launch, rank_info
from helpers.data import make_dataset
from helpers.ddp import (MB, BucketedDDP, assign_buckets, completed_future,
                         ring_allreduce_hook)
from helpers.model import build_model
from helpers.tolerance import assert_within_fp32_noise, within_fp32_noise


# ---------------------------------------------------------------- pure parts
def test_assign_buckets_matches_torch_reducer_rule():
    """Same grouping as DDP's C++ rule fed the parameters in reverse order."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 25)
        ts = [torch.empty(rng.choice([1, 10, 100, 1000, 5000])) for _ in range(n)]
        cap, first = rng.choice([100, 4000, 20000]), rng.choice([10, 400, 20000])
        rev = list(range(n - 1, -1, -1))
        theirs, _ = dist._compute_bucket_assignment_by_size(
            [ts[i] for i in rev], [first, cap], [False] * n, rev)
        ours = assign_buckets([t.numel() * t.element_size() for t in ts], cap, first)
        assert ours == [list(b) for b in theirs]


def test_assign_buckets_reverse_order_small_first_bucket_and_dtypes():
    sizes = [400] * 6  # bytes, registration order 0..5
    assert assign_buckets(sizes, 800, 400) == [[5], [4, 3], [2, 1], [0]]
    assert assign_buckets(sizes, 10_000, 10_000) == [[5, 4, 3, 2, 1, 0]]  # one bucket
    assert assign_buckets(sizes, 0, 0) == [[5], [4], [3], [2], [1], [0]]  # one per parameter
    # a parameter larger than the cap gets its own bucket; one open bucket per dtype
    assert assign_buckets([10, 5000, 10], 100, 100) == [[2, 1], [0]]
    f32, f16 = torch.float32, torch.float16
    assert assign_buckets([8, 8, 8, 8], 16, 16, [f32, f16, f32, f16]) == [[3, 1], [2, 0]]
    with pytest.raises(ValueError):
        assign_buckets([1], -1)


def test_default_caps_are_torchs():
    """first_bucket_mb=1 and bucket_cap_mb=25 are torch's own defaults, as
    assign_buckets' docstring says: torch 2.13 takes the first cap from
    dist._DEFAULT_FIRST_BUCKET_BYTES (c10d's kDefaultFirstBucketBytes) and
    the others from distributed.py's _DEFAULT_BUCKET_CAP_MB."""
    import inspect

    from torch.nn.parallel import distributed as torch_ddp

    defaults = inspect.signature(BucketedDDP).parameters
    assert defaults["first_bucket_mb"].default * MB == dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert defaults["bucket_cap_mb"].default == getattr(torch_ddp, "_DEFAULT_BUCKET_CAP_MB", 25)


def test_bad_arguments_raise_before_any_communication():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedDDP(model, bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="first_bucket_mb"):
        BucketedDDP(model, first_bucket_mb="1")
    with pytest.raises(TypeError):
        BucketedDDP(lambda x: x)
    with pytest.raises(TypeError):
        BucketedDDP(model, comm_hook=3)


def test_world_size_one_is_the_plain_module():
    assert not dist.is_initialized()
    model = build_model("toy", seed=3)
    ref = copy.deepcopy(model)
    ddp = BucketedDDP(model, bucket_cap_mb=0.01)
    x = torch.randint(0, 64, (2, 8))
    ddp(x, x)[1].backward()
    ref(x, x)[1].backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert {e["event"] for e in ddp.timeline} == {"ready", "launched", "finished"}


# ------------------------------------------------------------- multi-rank
class _Awkward(nn.Module):
    """The toy GPT (tied embedding/head) plus a frozen and an unused layer, and a buffer."""

    def __init__(self, seed):
        super().__init__()
        self.gpt = build_model("toy", seed=seed)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(4, 4)  # registered last: lands in the first bucket
        # a buffer that differs per seed and scales the loss: without its broadcast at
        # construction, every rank's gradients would differ from DDP's
        self.register_buffer("temperature",
                             0.5 + torch.rand(1, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x, y):
        logits, _ = self.gpt(x)
        logits = logits + 0.01 * self.frozen(self.gpt.wte.weight).sum()  # frozen but in the graph
        logits = logits / self.temperature
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


_DATA = None


def _batch(step, rank, micro=2):
    global _DATA
    if _DATA is None:
        _DATA = make_dataset(seq_len=16, num_sequences=64)
    return _DATA.batch(range(step * 8 + rank * micro, step * 8 + (rank + 1) * micro))


def _vs_torch_ddp():
    """Same grads as DistributedDataParallel, 2 steps, several configurations."""
    r = rank_info().rank
    report = {}
    for name, kw in [("find_unused", dict(find_unused_parameters=True)),
                     ("ring_hook", dict(find_unused_parameters=True,
                                        comm_hook=ring_allreduce_hook)),
                     ("no_find", dict())]:
        torch.manual_seed(100 + r)
        model = _Awkward(seed=100 + r)        # different weights on every rank ...
        ref_model = copy.deepcopy(model)
        ours = BucketedDDP(model, bucket_cap_mb=0.02, first_bucket_mb=0.005, **kw)
        theirs = torch.nn.parallel.DistributedDataParallel(
            ref_model, bucket_cap_mb=0.02, find_unused_parameters=True)
        same_start = all(torch.equal(a, b) for a, b in
                         zip(model.state_dict().values(), ref_model.state_dict().values()))
        w0 = model.gpt.wte.weight.detach().clone()  # ... until the broadcast: rank 0's
        temperature = model.temperature.clone()
        diffs, nones, unused_grad = [], [], []
        for step in range(2):
            x, y = _batch(step, r)
            ours(x, y).backward()
            theirs(x, y).backward()
            for (n, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters()):
                if a.grad is None or b.grad is None:
                    nones.append((n, a.grad is None, b.grad is None))
                else:
                    diffs.append(float((a.grad - b.grad).abs().max()))
                if n.startswith("unused.") and a.grad is not None:
                    unused_grad.append(float(a.grad.abs().max()))
            model.zero_grad(set_to_none=True)
            ref_model.zero_grad(set_to_none=True)
        report[name] = dict(same_start=same_start, w0=w0, max_diff=max(diffs), nones=nones,
                            n_buckets=len(ours.buckets), timeline=ours.timeline,
                            temperature=temperature, unused_grad=unused_grad)
    return report


@pytest.mark.slow
def test_same_gradients_as_torch_ddp_with_tied_frozen_unused_and_per_rank_seeds():
    reports = launch(_vs_torch_ddp, 2, seed_per_rank=True)
    for report in reports:
        fu, ring, nofind = report["find_unused"], report["ring_hook"], report["no_find"]
        for rep in (fu, ring, nofind):
            assert rep["same_start"]
            assert rep["n_buckets"] >= 4
        # identical bucket order and op order as DDP: bitwise equal with gloo.
        # The ring hook too: at 2 ranks each entry is g0/2 + g1/2, one
        # addition (commutative in IEEE arithmetic) of the same halved values.
        assert fu["max_diff"] == 0.0
        assert ring["max_diff"] == 0.0
        assert nofind["max_diff"] == 0.0
        # frozen: no grad anywhere; unused: None in both with find_unused (DDP's behaviour)
        names = {n for n, a_none, b_none in fu["nones"] if a_none and b_none}
        assert names == {"frozen.weight", "frozen.bias", "unused.weight", "unused.bias"}
        assert all(a and b for _, a, b in fu["nones"])
        # without find_unused, an unused parameter gets a zero (averaged) gradient
        assert {n for n, a, _ in nofind["nones"] if not a} == {"unused.weight", "unused.bias"}
        assert nofind["unused_grad"] == [0.0] * 4  # 2 parameters x 2 steps, exactly zero
        assert fu["unused_grad"] == []
    # the broadcast made every rank start from rank 0's weights, though seeds differed
    assert torch.equal(reports[0]["find_unused"]["w0"], reports[1]["find_unused"]["w0"])
    assert not torch.equal(build_model("toy", seed=100).wte.weight,
                           build_model("toy", seed=101).wte.weight)
    # the buffer too (it was broadcast at construction, as DDP does)
    assert torch.equal(reports[0]["find_unused"]["temperature"],
                       reports[1]["find_unused"]["temperature"])
    assert not torch.equal(_Awkward(100).temperature, _Awkward(101).temperature)
    # timeline: each bucket ready <= launched <= finished, launched in bucket order
    tl = reports[0]["find_unused"]["timeline"]
    n = reports[0]["find_unused"]["n_buckets"]
    t = {(e["bucket"], e["event"]): e["t"] for e in tl}
    assert len(t) == 3 * n
    for b in range(n):
        assert t[b, "ready"] <= t[b, "launched"] <= t[b, "finished"]
    launched = [e["bucket"] for e in tl if e["event"] == "launched"]
    assert launched == list(range(n))
    # overlap: the first bucket went out before the last one was ready
    assert t[0, "launched"] < t[n - 1, "ready"]


class _SkippedOnOddRanks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if rank_info().rank % 2 == 0:  # b is used on even ranks only
            h = h + torch.tanh(self.b(h))
        return self.c(h).pow(2).mean()


def _unused_on_some_ranks():
    """b gets a gradient on rank 0 only; DDP (find_unused_parameters=True) averages it
    with rank 1's "no gradient" counted as zero, and gives it to both ranks."""
    r = rank_info().rank
    model = _SkippedOnOddRanks()  # seed_per_rank: different weights until the broadcast
    theirs_model = copy.deepcopy(model)
    ours = {k: BucketedDDP(copy.deepcopy(model), bucket_cap_mb=0, first_bucket_mb=0,
                           find_unused_parameters=k) for k in (True, False)}
    # a tiny positive cap, not 0: one bucket per parameter either way, but torch
    # 2.11's DDP raises on bucket_cap_mb=0 ("should be set by now")
    theirs = torch.nn.parallel.DistributedDataParallel(theirs_model, bucket_cap_mb=1e-6,
                                                       find_unused_parameters=True)
    g = torch.Generator().manual_seed(9)
    out = {"diff": {True: [], False: []}, "b_grad_nonzero": []}
    for step in range(2):
        x = torch.randn(8, 6, generator=g)[r * 4:(r + 1) * 4]
        theirs(x).backward()
        for k, ddp in ours.items():
            ddp(x).backward()
            for a, b in zip(ddp.module.parameters(), theirs_model.parameters()):
                assert a.grad is not None and b.grad is not None
                out["diff"][k].append(float((a.grad - b.grad).abs().max()))
            ddp.module.zero_grad(set_to_none=True)
        out["b_grad_nonzero"].append(bool(theirs_model.b.weight.grad.abs().max() > 0))
        theirs_model.zero_grad(set_to_none=True)
    return out


@pytest.mark.slow
def test_parameter_unused_on_some_ranks_matches_torch_ddp():
    for out in launch(_unused_on_some_ranks, 2, seed_per_rank=True):
        assert out["b_grad_nonzero"] == [True, True]  # rank 0's half reached rank 1 too
        # 2 ranks: (g0/2 + g1/2) rounds the same whatever the bucketing: bitwise equal
        assert max(out["diff"][True]) == 0.0
        assert max(out["diff"][False]) == 0.0  # the bucket just waits for the end of backward


STEPS = 3


def _train_bucketed(accum):
    """3 SGD steps; global batch of 8 = 2 ranks x (micro-batch x accum).

    Counts the all-reduces really issued per step by wrapping dist.all_reduce
    (the default comm hook calls it through the module attribute), not by
    reading the timeline, which each synced backward clears.
    """
    r, p = rank_info().rank, rank_info().world_size
    model = BucketedDDP(build_model("toy", seed=11 + r), bucket_cap_mb=0.01,
                        first_bucket_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    n_all_reduce = [0]
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*a, **kw):
        n_all_reduce[0] += 1
        return real_all_reduce(*a, **kw)

    calls = []
    per_rank = 8 // p
    micro = per_rank // accum
    dist.all_reduce = counting_all_reduce
    try:
        for step in range(STEPS):
            x, y = _batch(step, r, micro=per_rank)
            opt.zero_grad()
            before = n_all_reduce[0]
            for i in range(accum):
                ctx = model.no_sync() if i < accum - 1 else _null()
                with ctx:
                    sl = slice(i * micro, (i + 1) * micro)
                    (model(x[sl], y[sl])[1] / accum).backward()
            calls.append(n_all_reduce[0] - before)
            opt.step()
    finally:
        dist.all_reduce = real_all_reduce  # the rank process is pooled: leave it clean
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, calls, \
        len(model.buckets)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _reference_global_batch(dtype=torch.float32):
    model = build_model("toy", seed=11).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, 0, micro=8)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_training_equals_single_process_and_no_sync_accumulation():
    ref, ref64 = _reference_global_batch(), _reference_global_batch(torch.float64)
    for accum in (1, 2):
        results = launch(_train_bucketed, 2, accum, seed_per_rank=True)
        for state, calls, n_buckets in results:
            # one all-reduce per bucket per step, whatever accum is: the backwards
            # inside no_sync communicate nothing
            assert n_buckets >= 2 and calls == [n_buckets] * STEPS, (calls, n_buckets)
            # fp32 reduction order differs from one process: within the fp32
            # reference's own rounding noise (measured against float64)
            assert_within_fp32_noise(state, ref, ref64, f"accum={accum}")
        assert all(torch.equal(results[0][0][k], results[1][0][k]) for k in ref)


class _Raise(torch.autograd.Function):
    """Identity forward; backward raises, as an error (or Ctrl-C) mid-backward would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward interrupted on purpose")


class _ThreeLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, fail=False):
        h = torch.tanh(self.a(x))
        if fail:  # raises after c's and b's gradients are ready (their buckets launched)
            h = _Raise.apply(h)
        return self.c(torch.tanh(self.b(h))).pow(2).mean()


def _after_failed_backward():
    """One backward raises on every rank; the next two must still average gradients."""
    r, p = rank_info().rank, rank_info().world_size
    model = _ThreeLinear()
    ref = copy.deepcopy(model)  # seed 0 on every rank: the same start as after the broadcast
    ref64 = copy.deepcopy(model).double()  # the exact answer, to ~1e-16
    ddp = BucketedDDP(model, bucket_cap_mb=0, first_bucket_mb=0)  # one bucket per parameter
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(p * 3, 4, generator=g) for _ in range(3)]  # global batches
    mine = lambda x: x[r * 3:(r + 1) * 3]  # noqa: E731  (this rank's shard)
    try:
        ddp(mine(xs[0]), fail=True).backward()
        raise AssertionError("the backward was meant to raise")
    except RuntimeError as e:
        assert "on purpose" in str(e)
    launched_before_failure = sum(e["event"] == "launched" for e in ddp.timeline)
    checks = []
    for x in xs[1:]:
        for m in (model, ref, ref64):
            m.zero_grad(set_to_none=True)
        ddp(mine(x)).backward()
        ref(x).backward()  # single process, the whole global batch
        ref64(x.double()).backward()
        checks += [within_fp32_noise(a.grad, b.grad, c.grad) for a, b, c in
                   zip(model.parameters(), ref.parameters(), ref64.parameters())]
    return launched_before_failure, checks


@pytest.mark.slow
def test_gradients_still_averaged_after_a_backward_that_raised():
    for launched, checks in launch(_after_failed_backward, 2):
        assert launched >= 2  # c's buckets were in flight when backward raised
        # mean of two shard means vs one mean over the batch: fp32 rounding
        # only, so within the fp32 reference's own noise (helpers.tolerance);
        # a lost or un-averaged bucket would be off by half a gradient
        assert all(ok for ok, _, _ in checks), checks


# ------------------------------------- launch order vs the order gradients arrive
class _RankShuffled(nn.Module):
    """Branches run in the order given to forward, so gradients arrive in that order
    reversed: with a different order on every rank, every rank sees its gradients
    (one bucket each at a cap of 0) in a different order. The embedding and the head
    share one weight (tied), whose gradient is complete at a different point too."""

    def __init__(self, k=5, d=8, vocab=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.branches = nn.ModuleList(nn.Linear(d, d) for _ in range(k))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two uses

    def forward(self, tokens, x, order):
        h = 0
        for i in order:  # i == k: the embedding lookup; else branch i
            h = h + (self.emb(tokens) if i == len(self.branches)
                     else torch.tanh(self.branches[i](x)))
        return nn.functional.cross_entropy(self.head(h), tokens)


class _LaunchedWhenReady(BucketedDDP):
    """The mistake launch_bucket refuses: a bucket launched the moment it is complete,
    so the launch order is the arrival order, which differs between ranks."""

    def on_grad_ready(self, param):
        b = self.bucket_of_param[id(param)]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.launch_bucket(b)


def _events(ddp, event):
    return [e["bucket"] for e in ddp.timeline if e["event"] == event]


def test_buckets_go_in_bucket_order_whatever_order_gradients_arrive():
    def local(flat, group=None):  # no process group: the bucket comes back as it is
        return completed_future(flat)

    ddp = BucketedDDP(_RankShuffled(), bucket_cap_mb=0, first_bucket_mb=0, comm_hook=local)
    n = len(ddp.buckets)
    g = torch.Generator().manual_seed(0)
    tokens, x = torch.randint(0, 16, (4,), generator=g), torch.randn(4, 8, generator=g)
    ready = set()
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 5, 0, 4, 1, 3]):
        ddp(tokens, x, order).backward()
        ready.add(tuple(_events(ddp, "ready")))
        assert _events(ddp, "launched") == list(range(n))
    assert len(ready) == 3  # the model does reorder the arrivals
    # launching in arrival order is refused before any collective goes out
    bad = _LaunchedWhenReady(_RankShuffled(), bucket_cap_mb=0, first_bucket_mb=0,
                             comm_hook=local)
    with pytest.raises(RuntimeError, match="in the order 0, 1, 2"):
        bad(tokens, x, [2, 5, 0, 4, 1, 3]).backward()


def test_hooks_on_two_threads_launch_every_bucket_once():
    """Autograd runs each device's part of backward on its own thread, so a model
    spread over devices fires hooks on two threads at once (on CPU alone they all
    run on the caller's thread, so here two threads call the hook directly). The
    comm hook of bucket 0 takes a while, as issuing a collective can, and lets the
    other thread run: without the lock, that thread saw bucket 0 complete and not
    yet launched (next_bucket still 0) and launched it a second time."""
    in_flight = threading.Event()

    def slow(flat, group=None):
        if not in_flight.is_set():  # bucket 0: slow to issue, the GIL released meanwhile
            in_flight.set()
            time.sleep(0.2)
        return completed_future(flat)

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ddp = BucketedDDP(model, bucket_cap_mb=0, first_bucket_mb=0, comm_hook=slow)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    ddp._expect_hooks = ddp._in_backward = True  # what forward and the first hook set up
    ddp._reset_state()
    errors = []

    def fire(param):
        try:
            ddp._hook(param)
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    first = threading.Thread(target=fire, args=(ddp.buckets[0][0],))
    first.start()
    assert in_flight.wait(10)  # bucket 0's launch is under way on the first thread
    second = threading.Thread(target=fire, args=(ddp.buckets[1][0],))
    second.start()
    first.join()
    second.join()
    for bucket in ddp.buckets[2:]:
        ddp._hook(bucket[0])
    ddp._finalize()
    assert errors == []
    assert _events(ddp, "launched") == list(range(len(ddp.buckets)))


def _arrivals_differ_between_ranks(steps, cls=BucketedDDP):
    """Every step, every rank runs the branches in its own random order and sleeps a
    random time in each hook; one parameter per bucket, a tied weight, with and
    without find_unused_parameters. Gradients must be the exact average."""
    r, p = rank_info().rank, rank_info().world_size
    rng = random.Random(r)  # orders and delays differ between ranks
    out = {"launched": [], "max_diff": 0.0, "ready": set()}
    for find_unused in (False, True):
        torch.manual_seed(0)
        model = _RankShuffled()
        ref = copy.deepcopy(model)  # the same on every rank (same seed)
        ddp = cls(model, bucket_cap_mb=0, first_bucket_mb=0,
                  find_unused_parameters=find_unused)
        on_grad_ready = ddp.on_grad_ready

        def late(param):  # widens any window in which the ranks' timing matters
            time.sleep(rng.random() * 1e-3)
            on_grad_ready(param)

        ddp.on_grad_ready = late
        g = torch.Generator().manual_seed(1)  # one global batch per step, a shard each
        for _ in range(steps):
            order = list(range(len(model.branches) + 1))
            rng.shuffle(order)
            tokens = torch.randint(0, 16, (4 * p,), generator=g)[4 * r:4 * r + 4]
            x = torch.randn(4 * p, 8, generator=g)[4 * r:4 * r + 4]
            ddp(tokens, x, order).backward()
            out["ready"].add(tuple(_events(ddp, "ready")))
            out["launched"].append(_events(ddp, "launched"))
            ref(tokens, x, order).backward()
            for a, b in zip(model.parameters(), ref.parameters()):
                mean = b.grad / p  # as the default comm hook: divide, then sum
                dist.all_reduce(mean)
                out["max_diff"] = max(out["max_diff"], float((a.grad - mean).abs().max()))
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        out["n_buckets"] = len(ddp.buckets)
    return out


@pytest.mark.slow
def test_ranks_whose_gradients_arrive_in_different_orders_stay_paired():
    """Launched in arrival order (_LaunchedWhenReady without launch_bucket's check),
    this aborted a rank within the first steps: gloo's "Received data size doesn't
    match expected size" (pair.cc), SIGABRT. In bucket order it cannot."""
    steps = 30
    results = launch(_arrivals_differ_between_ranks, 3, steps)
    for out in results:
        assert out["launched"] == [list(range(out["n_buckets"]))] * (2 * steps)
        # each bucket's all-reduce has the same size and inputs as the reference's
        # own, so the gloo sums are the same arithmetic: bitwise equal
        assert out["max_diff"] == 0.0
        assert len(out["ready"]) > steps  # arrival orders really varied ...
    assert len({frozenset(out["ready"]) for out in results}) == 3  # ... and per rank

@pytest.mark.parametrize("argv, message", [
    (["--size", "bogus"], "--size must be one of"), (["--steps", "0"], "--steps must be >= 2"),
    (["--cap-mb", "-1"], "--cap-mb must be >= 0"), (["--ranks", "1"], "--ranks must be >= 2"),
    (["--micro", "0"], "--micro must be >= 1"), (["--seq", "1000"], "--seq must be in")])
def test_bench_ddp_refuses_bad_arguments_before_starting_ranks(
        argv, message, capsys, load_bench):
    bench = load_bench("bench_ddp")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
