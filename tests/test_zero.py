"""ZeRO stages 0-3 against torch.optim.AdamW, the memory formula and the ring cost model.

How close is "equal"? N ranks and one process on the global batch sum the
per-example gradients in different orders, so in fp32 they cannot be bitwise
equal (one process adds B*N examples in one reduction; N ranks add B each,
then the collective adds the N partial sums). Where the arithmetic is the same
(2 ranks against DDP's recipe: a + b is commutative in IEEE) we ask for exact
equality. Elsewhere every fp32 run is compared, element by element, with one
process in float64 on the global batch, within ``_F64Reference.bound``: the
rounding of the fp32 gradient carried through AdamW, derived below. Nothing
is tuned to one CPU: the bound scales with the fp32 unit roundoff and the
reference's own gradients and second moments.
"""

import copy
import random

import pytest
import torch
import torch.distributed as dist

from helpers import launch, rank_info
from helpers.data import make_dataset
from helpers.memory import model_state_bytes
from helpers.model import build_model
from helpers.zero import (PRECISION_DTYPES, FlatPartition, ShardedOptimizer, ZeroOptimizer,
                          adamw_update, ring_bytes_sent, size_buckets)

LR = 1e-3
STEPS = 3
B = 2  # sequences per rank


def _batches(world_size, steps=STEPS):
    ds = make_dataset(num_sequences=64, seq_len=16)
    G = B * world_size
    return [ds.batch(list(range(s * G, (s + 1) * G))) for s in range(steps)]


def _model_with_extras():
    """The toy GPT plus a frozen weight, a buffer and a parameter that never gets a gradient."""
    model = build_model("toy", seed=0)
    model.frozen = torch.nn.Linear(3, 3)
    model.frozen.requires_grad_(False)
    model.register_buffer("stat", torch.arange(4.0))  # replicated state, like BatchNorm's
    model.unused = torch.nn.Linear(5, 7)  # in the optimizer, never in forward: grad None
    return model


U32 = 2.0 ** -24  # fp32 unit roundoff: one rounding changes x by at most U32 * |x|


class _F64Reference:
    """One process, float64, torch's AdamW on the global batch, and for every
    element the bound on how far an fp32 run of the same training may land.

    Per step t and element i, an fp32 gradient differs from the exact one by
    Delta_t <= K * U32 * A_t, with A_t the largest |gradient| of the tensor in
    any step so far (the size of the terms being summed) and K the number of
    tokens summed in that gradient (the (n - 1) u bound of a sum of n terms,
    Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 4.2,
    eq. 4.4; the margin also covers the rounding inside each term and the
    small feedback of earlier weight errors through the next gradient).
    AdamW turns a gradient error Delta into an update error of at most
    2 * lr * Delta / (sqrt(v_hat) - Delta + eps): m_hat moves by <= Delta and
    sqrt(v_hat) by <= Delta (bias-corrected averages whose weights sum to 1),
    and |m_hat| <= sqrt(v_hat); never more than 2 * lr (two steps of opposite
    sign, the most an update can differ by for |m_hat| <= sqrt(v_hat)). The
    weight update itself rounds 3 times: + 3 * U32 * |w|. Summed over the
    steps, this is the bound for element i. It is tight (~lr) only where the
    exact gradient is ~0 (attention's key bias, whose exact gradient is 0) and
    some 1e-9..1e-6 elsewhere, while a lost step or micro-batch moves every
    element by ~lr = 1e-3: ``check_rejects_lost_step`` shows the bound
    catches that. ``max_norm``: clip the gradient first, as
    ``torch.nn.utils.clip_grad_norm_``. ``unit`` is the unit roundoff of the dtype the gradients are
    computed in (2**-8 for bf16: a loose bound, "it trains").
    """

    def __init__(self, base, batches, lr=LR, unit=U32, eps=1e-8, max_norm=None):
        ref = copy.deepcopy(base).double()
        params = dict((n, p) for n, p in ref.named_parameters() if p.requires_grad)
        opt = torch.optim.AdamW(params.values(), lr=lr, eps=eps, foreach=False)
        self.norms = []  # with max_norm: the gradient norm before clipping, per step
        beta2, eps = opt.defaults["betas"][1], opt.defaults["eps"]
        self.bound = {n: torch.zeros_like(p) for n, p in params.items()}
        scale = dict.fromkeys(params, 0.0)  # A: largest |grad| of each tensor so far
        for t, (x, y) in enumerate(batches, 1):
            ref(x, y)[1].backward()
            k = x.numel()  # tokens in the global batch: terms in each gradient sum
            if max_norm is not None:
                self.norms.append(torch.nn.utils.clip_grad_norm_(params.values(), max_norm))
                # c * g, both factors rounded: the error doubles (c <= 1; A below
                # is the clipped gradient's).
                k *= 2
            self.before_last = {n: p.detach().clone() for n, p in params.items()}
            opt.step()
            with torch.no_grad():
                for n, p in params.items():
                    if p.grad is None:  # skipped by AdamW: not touched at all
                        continue
                    scale[n] = max(scale[n], p.grad.abs().max().item())
                    delta = k * unit * scale[n]
                    v_hat = opt.state[p]["exp_avg_sq"] / (1 - beta2 ** t)
                    adam = 2 * lr * delta / ((v_hat.sqrt() - delta).clamp(min=0) + eps)
                    self.bound[n] += adam.clamp(max=2 * lr) + 3 * U32 * p.abs()
            opt.zero_grad()
        self.weights = {n: p.detach() for n, p in params.items()}

    def excess(self, full, other=None, times=1.0):
        """max over elements of |full - other| / (times * bound), ``other`` being
        the float64 reference by default: <= 1 means within the bound. Two fp32
        runs each within the bound of the reference differ by <= 2 bounds
        (``times=2``)."""
        other = self.weights if other is None else other
        worst = 0.0
        for n in self.weights:
            diff = (full[n].double() - other[n].double()).abs()
            ratio = diff / (times * self.bound[n])
            worst = max(worst, ratio[diff > 0].max().item() if (diff > 0).any() else 0.0)
        return worst

    def check_rejects_lost_step(self):
        """A plausible wrong answer (the last step lost) must break the bound."""
        assert self.excess(self.before_last) > 1, "the bound cannot tell a lost step"


# Stage 2 with a bucket cap of 1,000 fp32 elements: the toy GPT's gradients go
# out in 10 reduce-scatters, each launched during backward as its bucket fills
# (DDP's rule, helpers.ddp.assign_buckets: a bucket closes once it reaches the
# cap, so the small parameters before a 4,096-element matrix join its bucket).
SMALL_CAP_MB = 1000 * 4 / 2**20


def _equivalence(stages, precision="fp32"):
    """On every rank: ZeRO stage s vs (a) one process in float64 on the global
    batch and (b) DDP's recipe in the same rank (all-reduce of grad / N, then
    AdamW). Stage "2b" is stage 2 with many small buckets."""
    r = rank_info()
    N, lo, hi = r.world_size, r.rank * B, (r.rank + 1) * B
    batches = _batches(N)
    base = _model_with_extras()  # (its extra layers draw from the global RNG: build once)
    reference = _F64Reference(base, batches)
    reference.check_rejects_lost_step()
    out = {}
    for key in stages:
        stage = 2 if key == "2b" else key
        cap = SMALL_CAP_MB if key == "2b" else 25.0
        ddp_ref, model = copy.deepcopy(base), copy.deepcopy(base)
        # Rank-specific init: ZeroOptimizer must broadcast rank 0's weights,
        # frozen ones and buffers included.
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.add_(r.rank)
        opt = ZeroOptimizer(model, stage, lr=LR, precision=precision, bucket_cap_mb=cap)
        o_ddp = torch.optim.AdamW([p for p in ddp_ref.parameters() if p.requires_grad],
                                  lr=LR, foreach=False)
        for x, y in batches:
            model(x[lo:hi], y[lo:hi])[1].backward()
            ddp_ref(x[lo:hi], y[lo:hi])[1].backward()
            for p in ddp_ref.parameters():
                if p.grad is not None:
                    p.grad.div_(N)
                    dist.all_reduce(p.grad)
            opt.step()
            o_ddp.step()
            o_ddp.zero_grad(); opt.zero_grad()
        full = opt.full_parameters()
        named = dict(ddp_ref.named_parameters())
        d_ddp = max((full[n] - named[n]).abs().max().item() for n in full)
        frozen_same = (torch.equal(model.frozen.weight, base.frozen.weight)
                       and torch.equal(model.stat, base.stat))
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # No gradient on any rank: AdamW skips it (no weight decay, no state), as
        # torch.optim does after DDP left its .grad None.
        unused_same = all(torch.equal(full[f"unused.{w}"], getattr(base.unused, w))
                          for w in ("weight", "bias"))
        out[key] = dict(single=reference.excess(full), ddp=d_ddp, unused_same=unused_same,
                        ddp_excess=reference.excess(full, named, times=2),
                        frozen_same=frozen_same, n=n,
                        comm=opt.comm_bytes(), state=opt.state_bytes(),
                        buckets=len(opt.partition.buckets))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stages_equal_adamw_on_global_batch(world_size):
    results = launch(_equivalence, world_size, [0, 1, 2, "2b", 3], timeout=120)
    assert results[0]["2b"]["buckets"] >= 10, results[0]["2b"]["buckets"]
    for stage, res in results[0].items():
        # One process on the global batch sums the per-example gradients in
        # another order than N ranks do (each rank B examples, then a sum over
        # ranks), so in fp32 exact equality cannot hold: the bound is the fp32
        # rounding carried through AdamW (_F64Reference).
        assert res["single"] <= 1, (stage, res["single"])
        if world_size == 2:
            # Same reduction as DDP (a + b is commutative in IEEE), same AdamW
            # operations: bitwise equal.
            assert res["ddp"] == 0.0, (stage, res["ddp"])
        else:
            # Gloo may sum 3-4 terms in another order in a reduce-scatter than
            # in an all-reduce: two fp32 runs, each within the bound.
            assert res["ddp_excess"] <= 1, (stage, res["ddp_excess"])
    assert all(res["unused_same"] for rr in results for res in rr.values())
    # every rank started from rank 0's frozen weights and buffers
    assert all(res["frozen_same"] for rr in results for res in rr.values())
    # fp32 state bytes on every rank, and communication volume per stage
    _check_bytes([{s: (v["n"], v["state"], v["comm"]) for s, v in rr.items() if s != "2b"}
                  for rr in results], world_size, (4, 4, 8))


def _bytes_and_comm(precision):
    r = rank_info()
    x, y = _batches(r.world_size, steps=1)[0]
    lo, hi = r.rank * B, (r.rank + 1) * B
    out = {}
    for stage in (0, 1, 2, 3):
        model = build_model("toy", seed=0)
        if precision != "fp32":
            model = model.to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        opt = ZeroOptimizer(model, stage, lr=LR, precision=precision)
        model(x[lo:hi], y[lo:hi])[1].backward()
        opt.step()
        out[stage] = (n, opt.state_bytes(), opt.comm_bytes())
    return out


@pytest.mark.slow
def test_mixed_precision_state_bytes_and_comm_volume():
    # bf16 weights and grads, fp32 master + moments: the paper's 2 + 2 + 12.
    res = launch(_bytes_and_comm, 4, "bf16", timeout=120)
    _check_bytes(res, 4, (2, 2, 12))


def _check_bytes(res, world_size, bytes_per_param):
    pb, gb, ob = bytes_per_param
    for rank_res in res:
        for stage, (n, measured, comm) in rank_res.items():
            want = model_state_bytes(n, dp=world_size, zero_stage=stage, param_bytes=pb,
                                     grad_bytes=gb, optimizer_bytes=ob)
            # Padding: at most N-1 elements per bucket, and the toy GPT has at most
            # 16 buckets here (stage 3: 15 modules own parameters; stage 2: one
            # 25 MB bucket), against n / N elements of a rank's shard.
            padding = 16 * (world_size - 1) / (n / world_size)
            for part in ("params", "grads", "optimizer"):
                assert abs(getattr(measured, part) / getattr(want, part) - 1) <= padding, \
                    (stage, part, getattr(measured, part), getattr(want, part))
        comm = {s: res[0][s][2] for s in range(4)}
        dp = comm[0]["total"]
        # Stages 1-2: reduce-scatter + all-gather = one all-reduce (ZeRO sec. 7.2.1);
        # padding adds <= N-1 elements of ~28,500 (one bucket): < 0.1%.
        assert comm[1]["total"] == pytest.approx(dp, rel=1e-3)
        assert comm[2]["total"] == pytest.approx(dp, rel=1e-3)
        # Stage 3: two all-gathers + one reduce-scatter = 1.5x (sec. 7.2.2). The
        # tied embedding is gathered once more (for lm_head): +wte/(2 Psi) = +3.6%.
        assert 1.5 <= comm[3]["total"] / dp < 1.55
        assert set(comm[3]) == {"all_gather", "reduce_scatter", "total"}


def test_world_size_one_is_plain_adamw():
    """No process group at all: every stage is torch.optim.AdamW, bitwise."""
    assert not dist.is_initialized()
    x, y = _batches(1)[0]
    for stage in (0, 1, 2, 3):
        model, ref = build_model("toy", seed=0), build_model("toy", seed=0)
        opt = ZeroOptimizer(model, stage, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for _ in range(2):
            model(x, y)[1].backward(); opt.step(); opt.zero_grad()
            ref(x, y)[1].backward(); ropt.step(); ropt.zero_grad()
        full = opt.full_parameters()
        for n, p in ref.named_parameters():
            assert torch.equal(full[n], p), (stage, n)


def test_stage3_frees_weights_outside_forward():
    model = build_model("toy", seed=0)
    opt = ZeroOptimizer(model, 3)
    x, y = _batches(1)[0]
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    loss = model(x, y)[1]
    # after forward everything is freed again, and backward regathers
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    loss.backward()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    opt.step()


def test_partition_pads_each_bucket():
    part = FlatPartition([5, 3, 10], world_size=4, groups=[[2], [0, 1]])
    assert [b.padded for b in part.buckets] == [12, 8]
    assert [b.chunk for b in part.buckets] == [3, 2]
    assert part.total == 20 and part.shard_numel == 5 and part.padding == 2
    assert part.shard_range(part.buckets[1], 3) == (18, 20)
    assert part.buckets[1].offsets == (0, 5)
    assert size_buckets([4, 4, 4, 9], cap_numel=8) == [[3], [2, 1], [0]]
    # DDP's rule (helpers.ddp.assign_buckets): a bucket closes once it holds >= cap,
    # so it may pass the cap by one parameter (a "<= cap" rule gives [[3, 2], [1], [0]])
    assert size_buckets([9, 4, 4, 4], cap_numel=8) == [[3, 2], [1, 0]]
    with pytest.raises(ValueError, match="exactly once"):
        FlatPartition([1, 2], 2, [[0]])


def test_owned_ranges_are_each_ranks_chunk_of_each_parameter():
    """FlatPartition.owned_ranges against brute force: lay every parameter's
    elements out in the flat buffer, cut it into chunks, and read back which
    elements of which parameter land where in each rank's shard."""
    for numels, world, groups in [([5, 3, 10], 4, [[2], [0, 1]]), ([5, 3], 3, [[0, 1]]),
                                  ([1, 1, 7, 2], 5, [[3, 2], [1], [0]]), ([6], 1, [[0]])]:
        shapes = [(n, 1) for n in numels]
        part = FlatPartition(numels, world, groups, shapes=shapes)
        flat = [None] * part.total  # (parameter, element) at each flat position
        for b in part.buckets:
            for i, off in zip(b.params, b.offsets):
                for e in range(numels[i]):
                    flat[b.start + off + e] = (i, e)
        for rank in range(world):
            shard = [x for b in part.buckets for x in flat[slice(*part.shard_range(b, rank))]]
            want = sorted(x for x in shard if x is not None)
            got, listed = [], set()
            for o in part.owned_ranges(rank):
                assert o.lo < o.hi and o.shape == shapes[o.index]
                assert o.index in part.buckets[o.bucket].params
                assert shard[o.shard_slice] == [(o.index, e) for e in range(o.lo, o.hi)]
                got += shard[o.shard_slice]
                listed.add(o.index)
            assert sorted(got) == want, (numels, world, rank)
            every = part.owned_ranges(rank, empty=True)  # one entry per parameter
            assert sorted(o.index for o in every) == list(range(len(numels)))
            for o in every:
                b = part.buckets[o.bucket]
                assert b.shard_start <= o.at <= b.shard_start + b.chunk
                assert (o.lo < o.hi) == (o.index in listed)
    with pytest.raises(ValueError, match="shapes"):
        FlatPartition([4], 2, [[0]], shapes=[(3,)])


def test_adamw_update_is_bitwise_torch():
    torch.manual_seed(0)
    p = torch.randn(100)
    ref = p.clone().requires_grad_()
    o = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1, foreach=False)
    m, v = torch.zeros(100), torch.zeros(100)
    for step in range(1, 4):
        g = torch.randn(100)
        ref.grad = g.clone(); o.step()
        adamw_update(p, g, m, v, step, 0.1, 0.9, 0.999, 1e-8, 0.1)
    assert torch.equal(p, ref.detach())


def test_ring_cost_and_bad_input():
    assert ring_bytes_sent("all_reduce", 100, 4) == 150
    assert ring_bytes_sent("all_gather", 100, 4) == 75
    assert ring_bytes_sent("reduce_scatter", 100, 1) == 0
    model = build_model("toy")
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(model, 4)
    with pytest.raises(ValueError, match="precision"):
        ZeroOptimizer(model, 1, precision="fp8")
    with pytest.raises(ValueError, match="lr"):
        ZeroOptimizer(model, 1, lr=-1)
    with pytest.raises(ValueError, match="trainable"):
        ZeroOptimizer(model.requires_grad_(False), 1)


def _stage3_knobs(prefetch, reuse, reduce):
    """Stage 3 with DeepSpeed's prefetch and reduce buckets vs plain stage 3:
    same weights after several steps (one step leaves the trace with an
    evaluation forward), far fewer collectives per step."""
    from helpers.overlap import Timeline

    r = rank_info()
    lo, hi = r.rank * B, (r.rank + 1) * B
    base = build_model("toy", seed=0)
    runs = []
    for kwargs in ({}, dict(prefetch_bucket_numel=prefetch, max_reuse_numel=reuse,
                                 reduce_bucket_numel=reduce)):
        model, tl = copy.deepcopy(base), Timeline()
        opt = ZeroOptimizer(model, 3, lr=LR, timeline=tl, **kwargs)
        for step, (x, y) in enumerate(_batches(r.world_size, steps=4)):
            if step == 2:
                with torch.no_grad():
                    model(x[lo:hi], y[lo:hi])  # an evaluation pass between steps
            tl.clear()
            model(x[lo:hi], y[lo:hi])[1].backward()
            opt.step()
            opt.zero_grad()
        held = sum(u.full.untyped_storage().nbytes() > 0 for u in opt.units)
        comms = sum(e["lane"] == "comm" for e in tl.events)  # in the last step
        runs.append(dict(comms=comms, units=len(opt.units), held=held,
                         comm=opt.comm_bytes()["total"], full=opt.full_parameters()))
    plain, knobs = runs
    diff = max((plain["full"][n] - knobs["full"][n]).abs().max().item() for n in plain["full"])
    reference = _F64Reference(base, _batches(r.world_size, steps=4))
    excess = reference.excess(knobs["full"], plain["full"], times=2)
    return dict(diff=diff, excess=excess, plain=plain["comms"], knobs=knobs["comms"],
                units=plain["units"],
                held=knobs["held"], bytes=(plain["comm"], knobs["comm"]))


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_prefetch_and_reduce_buckets_same_result_fewer_collectives(world_size):
    # DeepSpeed's defaults (5e7, 1e9, 5e8 elements): the toy GPT fits in one of each
    for res in launch(_stage3_knobs, world_size, 5 * 10**7, 10**9, 5 * 10**8, timeout=120):
        # 2 ranks: every element is the same sum of two numbers: bitwise equal.
        # 3 ranks: a coalesced reduce-scatter cuts the ring's chunks elsewhere, so
        # gloo may add the 3 terms in another order: two fp32 runs, each within
        # the rounding bound of the float64 run (_F64Reference).
        if world_size == 2:
            assert res["diff"] == 0.0, res["diff"]
        else:
            assert res["excess"] <= 1, res["excess"]
        # per unit: gather, re-gather for backward, reduce-scatter; +1: the tied
        # embedding/head weight is gathered again for the head
        assert res["plain"] == 3 * res["units"] + 1
        assert res["knobs"] == 3, res  # all-gather 0, all-gather 1..14, one reduce-scatter
        assert res["held"] == 0  # nothing left gathered after step()
        # Reuse keeps the weights from forward to backward: no second gather, so
        # about 2/3 of plain stage 3's volume (the memory saving is what it costs).
        assert 0.6 < res["bytes"][1] / res["bytes"][0] < 0.7, res["bytes"]


def test_stage3_small_prefetch_window_frees_and_regathers_correctly():
    """Windows smaller than the model (units of 64..4224 elements): prefetch groups of
    a few units, weights freed between forward and backward, several reduce buckets."""
    for res in launch(_stage3_knobs, 2, 5000, 0, 6000, timeout=120):
        assert res["diff"] == 0.0
        assert res["held"] == 0
        assert res["knobs"] < res["plain"], res
        assert res["bytes"][1] == res["bytes"][0]  # same volume: every unit re-gathered


def test_stage3_knobs_validated_before_use():
    model = build_model("toy", seed=0)
    with pytest.raises(ValueError, match="prefetch_bucket_numel is a stage-3 knob"):
        ZeroOptimizer(model, 2, prefetch_bucket_numel=1000)
    with pytest.raises(ValueError, match="reduce_bucket_numel must be an int >= 0"):
        ZeroOptimizer(model, 3, reduce_bucket_numel=-1)


# --------------------------------------------------------------------------
# Training loops as people write them: accumulation, zero_grad idioms.
# --------------------------------------------------------------------------

LOOPS = ("opt.zero_grad first", "model.zero_grad first", "no zero_grad", "2 micro-batches")


def _loops(configs, steps=3):
    """Each (stage, loop) trains with ZeroOptimizer and returns how far its weights
    land from one process in float64 on the global batch, in units of the fp32
    rounding bound (``_F64Reference``: <= 1 is within it)."""
    r = rank_info()
    N = r.world_size
    ds = make_dataset(num_sequences=64, seq_len=16)
    out, references = {}, {}
    for stage, loop in configs:
        M = 2 if loop == "2 micro-batches" else 1  # micro-batches per rank per step
        G = N * M * B                              # global batch
        batches = [ds.batch(list(range(s * G, (s + 1) * G))) for s in range(steps)]
        if M not in references:
            references[M] = _F64Reference(build_model("toy", seed=0), batches)
            references[M].check_rejects_lost_step()
        model = build_model("toy", seed=0)
        cap = SMALL_CAP_MB if stage == 2 else 25.0  # stage 2: several buckets in flight
        opt = ZeroOptimizer(model, stage, lr=LR, bucket_cap_mb=cap)
        for x, y in batches:
            if loop == "opt.zero_grad first":
                opt.zero_grad()
            elif loop == "model.zero_grad first":
                model.zero_grad()  # set_to_none=True: p.grad = None
            for m in range(M):
                lo = (r.rank * M + m) * B  # this rank's m-th micro-batch of the global batch
                (model(x[lo:lo + B], y[lo:lo + B])[1] / M).backward()
            opt.step()
        out[(stage, loop)] = references[M].excess(opt.full_parameters())
    return out


def test_training_loops_and_gradient_accumulation_equal_adamw():
    """On 2 ranks, every stage: (a) the idiomatic loop opt.zero_grad(); backward;
    step, (b) the same with model.zero_grad() (p.grad set to None), (c) no
    zero_grad at all (step() consumes the gradients), (d) two backward() calls
    per step (gradient accumulation), each equal to AdamW on the global batch."""
    configs = [(s, loop) for s in range(4) for loop in LOOPS]
    for res in launch(_loops, 2, configs, timeout=120):
        for (stage, loop), excess in res.items():
            # Within the fp32 rounding bound of the float64 run (the micro-batch
            # losses are added as l1/2 + l2/2, another summation order again).
            # A lost micro-batch or a lost step moves weights by ~lr = 1e-3,
            # far outside it (check_rejects_lost_step).
            assert excess <= 1, (stage, loop, excess)


def _stage2_overlap():
    """Stage 2 with small buckets: how many reduce-scatters had been issued when
    the last gradient of the step (the tied embedding's) arrived."""
    r = rank_info()
    model = build_model("toy", seed=0)
    seen = []
    # Registered before ZeroOptimizer's hook, so it runs first: the embedding's
    # own bucket is not launched yet, every other bucket should be.
    model.wte.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(len(opt._handles)))
    opt = ZeroOptimizer(model, 2, lr=LR, bucket_cap_mb=SMALL_CAP_MB)
    x, y = _batches(r.world_size, steps=1)[0]
    model(x[r.rank * B:(r.rank + 1) * B], y[r.rank * B:(r.rank + 1) * B])[1].backward()
    opt.step()
    return dict(buckets=len(opt.partition.buckets), issued_before_last=seen,
                comm=opt.comm_bytes())


def test_stage2_buckets_are_reduce_scattered_during_backward():
    for res in launch(_stage2_overlap, 2, timeout=60):
        assert res["buckets"] >= 10
        # every bucket but the embedding's was already on its way
        assert res["issued_before_last"] == [res["buckets"] - 1], res
        assert set(res["comm"]) == {"reduce_scatter", "all_gather", "total"}


# --------------------------------------------------------------------------
# Mixed precision: 16-bit working weights and gradients, fp32 master + moments.
# --------------------------------------------------------------------------

MP_STEPS = 10


def _mixed_precision(precision):
    """Every stage in 16-bit vs the mixed-precision recipe written out in the
    same rank: 16-bit forward/backward, gradient / N and all-reduce in 16 bits
    (DDP's recipe), torch's AdamW on fp32 master weights, the new weights
    rounded back to 16 bits for the next forward (Micikevicius et al. 2018,
    "Mixed Precision Training", sec. 3.1)."""
    r = rank_info()
    N, lo, hi = r.world_size, r.rank * B, (r.rank + 1) * B
    base = build_model("toy", seed=0).to(PRECISION_DTYPES[precision])
    recipe = copy.deepcopy(base)
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in recipe.named_parameters()}
    o_ref = torch.optim.AdamW(masters.values(), lr=LR, foreach=False)
    batches = _batches(N, steps=MP_STEPS)
    for x, y in batches:
        recipe(x[lo:hi], y[lo:hi])[1].backward()
        with torch.no_grad():
            for n, p in recipe.named_parameters():
                p.grad.div_(N)
                dist.all_reduce(p.grad)  # in 16 bits, as the ZeRO paper communicates them
                masters[n].grad = p.grad.float()
                p.grad = None
            o_ref.step()
            for n, p in recipe.named_parameters():
                p.copy_(masters[n])  # fp32 -> 16-bit working copy
    out = {}
    for stage in range(4):
        model = copy.deepcopy(base)
        opt = ZeroOptimizer(model, stage, lr=LR, precision=precision)
        for x, y in batches:
            model(x[lo:hi], y[lo:hi])[1].backward()
            opt.step()
        full = opt.full_parameters()  # the fp32 master weights
        out[stage] = dict(same=[n for n in full if torch.equal(full[n], masters[n].detach())],
                          names=list(full), working=next(model.parameters()).dtype)
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_equals_the_recipe(precision):
    res = launch(_mixed_precision, 2, precision, timeout=120)[0]
    for stage, v in res.items():
        assert v["working"] == PRECISION_DTYPES[precision]
        # 2 ranks: the same 16-bit forward and backward, every reduction a + b in
        # 16 bits, AdamW on the same fp32 numbers (adamw_update is torch's, op for
        # op): bitwise equal, in every stage. Updating the 16-bit weights without
        # fp32 master weights (lr = 1e-3 is below bf16's spacing near 1, so
        # LayerNorm gains would not move) or reducing in fp32 would differ.
        assert v["same"] == v["names"], (stage, sorted(set(v["names"]) - set(v["same"])))


# --------------------------------------------------------------------------
# Bad input: clear errors before anything is sharded.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("betas", [(0.9,), (0.9, 1.0), (-0.1, 0.99), "ab", (0.9, None),
                                   (True, 0.9), 0.9])
def test_betas_validated(betas):
    with pytest.raises(ValueError, match=r"betas must be two floats in \[0, 1\)"):
        ZeroOptimizer(build_model("toy"), 1, betas=betas)


def test_parameters_on_two_devices_rejected():
    model = build_model("toy")
    model.extra = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="one device"):
        ZeroOptimizer(model, 2)


# --------------------------------------------------------------------------
# Devices: nothing may be hard-coded to the CPU.
# --------------------------------------------------------------------------

def test_every_buffer_on_the_parameters_device():
    """On the meta device (shapes and devices, no data) a buffer made on the CPU
    fails at its first copy from a parameter; so this runs the whole step
    without a GPU and checks where each tensor the optimizer holds lives."""
    x = torch.randint(0, 64, (2, 16), device="meta")
    for stage in range(4):
        model = build_model("toy", seed=0).to("meta")
        opt = ZeroOptimizer(model, stage)
        model(x, x)[1].backward()
        opt.step()
        held = [v for v in vars(opt).values() if isinstance(v, torch.Tensor)]
        held += [t for v in vars(opt).values() if isinstance(v, list)
                 for t in v if isinstance(t, torch.Tensor)]
        held += list(opt.full_parameters().values())
        assert {t.device.type for t in held} == {"meta"}, stage
        assert {p.device.type for p in model.parameters()} == {"meta"}, stage


# The same on a GPU (runs where CUDA is available).

def _on_gpu():
    """World size 1 on nccl: every stage (fp32 and bf16) on the rank's GPU vs
    one process in float64 on the same GPU."""
    r = rank_info()
    x, y = (t.to(r.device) for t in _batches(1)[0])
    out = {}
    for precision, unit in (("fp32", U32), ("bf16", 2.0 ** -8)):
        base = build_model("toy", seed=0).to(r.device, PRECISION_DTYPES[precision])
        reference = _F64Reference(base, [(x, y)] * 2, unit=unit)
        for stage in range(4):
            model = copy.deepcopy(base)
            opt = ZeroOptimizer(model, stage, lr=LR, precision=precision)
            for _ in range(2):
                model(x, y)[1].backward(); opt.step()
            full = opt.full_parameters()
            devices = {t.device.type for t in full.values()} | {p.device.type for p in
                                                                model.parameters()}
            out[(stage, precision)] = (devices, reference.excess(full))
    return out


@pytest.mark.gpu
def test_world_size_one_on_gpu_with_nccl():
    for (stage, precision), (devices, excess) in launch(_on_gpu, 1, backend="nccl",
                                                        timeout=120)[0].items():
        assert devices == {"cuda"}, (stage, precision, devices)
        # GPU kernels sum in their own orders (the embedding's backward uses
        # atomics): within the rounding bound of the float64 run, with the unit
        # roundoff of the dtype the gradients are computed in.
        assert excess <= 1, (stage, precision, excess)


# --------------------------------------------------------------------------
# Wrapping again: a notebook cell re-run.
# --------------------------------------------------------------------------

def _rewrap(first_stage):
    """Stage ``first_stage`` for one step, remove_hooks(), then stage 0 on the same
    model for two steps vs torch's AdamW from the same weights: max |difference|."""
    r = rank_info()
    lo, hi = r.rank * B, (r.rank + 1) * B
    batches = _batches(r.world_size)
    model = build_model("toy", seed=0)
    first = ZeroOptimizer(model, first_stage, lr=LR)
    x, y = batches[0]
    model(x[lo:hi], y[lo:hi])[1].backward()
    first.step()
    first.remove_hooks()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model, 0, lr=LR)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    for x, y in batches[1:]:
        model(x[lo:hi], y[lo:hi])[1].backward()
        opt.step()
        ref(x[lo:hi], y[lo:hi])[1].backward()
        for p in ref.parameters():  # DDP's recipe: the same arithmetic on 2 ranks
            p.grad.div_(r.world_size)
            dist.all_reduce(p.grad)
        o_ref.step()
        o_ref.zero_grad()
    full, named = opt.full_parameters(), dict(ref.named_parameters())
    return max((full[n] - named[n]).abs().max().item() for n in full)


def test_remove_hooks_then_wrap_again_equals_adamw():
    # Old hooks left in place add the stage-2 reduce-scatter (or stage 3's
    # gathers) to every later step: the weights would be off by ~lr per step.
    # With them removed, stage 0 on 2 ranks is DDP's recipe, bitwise.
    for res in launch(_rewrap, 2, 2, timeout=120) + launch(_rewrap, 2, 3, timeout=120):
        assert res == 0.0, res


def test_wrapping_a_wrapped_model_is_refused():
    model = build_model("toy", seed=0)
    opt = ZeroOptimizer(model, 2)
    with pytest.raises(ValueError, match=r"still wrapped by a ZeroOptimizer \(stage 2\).*"
                                         r"remove_hooks\(\)"):
        ZeroOptimizer(model, 0)
    opt.remove_hooks()
    ZeroOptimizer(model, 0)  # unwrapped: fine


# --------------------------------------------------------------------------
# Stage 3 on modules that are not the course's GPT.
# --------------------------------------------------------------------------

class _AttentionNet(torch.nn.Module):
    """nn.MultiheadAttention returns a tuple (output, attention weights) and reads
    out_proj.weight without calling out_proj: both trip a stage 3 that expects one
    Tensor out of each module, each module calling its children."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.inp = torch.nn.Linear(4, d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x, y):
        h = self.inp(x)
        h, weights = self.attn(h, h, h)  # (batch, seq, d), (batch, seq, seq)
        logits = self.head(h + weights.sum(-1, keepdim=True))  # both outputs get gradients
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _attention_net_vs_adamw(stage):
    """ZeroOptimizer on _AttentionNet vs DDP's recipe (grad / N, all-reduce, AdamW):
    max |difference| of the weights after 3 steps."""
    r = rank_info()
    N = r.world_size
    torch.manual_seed(0)
    base = _AttentionNet()
    data = [(torch.randn(2 * N, 5, 4), torch.randint(0, 3, (2 * N, 5))) for _ in range(3)]
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = ZeroOptimizer(model, stage, lr=LR)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    lo, hi = 2 * r.rank, 2 * r.rank + 2
    for x, y in data:
        model(x[lo:hi], y[lo:hi])[1].backward()
        opt.step()
        ref(x[lo:hi], y[lo:hi])[1].backward()
        if N > 1:
            for p in ref.parameters():
                p.grad.div_(N)
                dist.all_reduce(p.grad)
        o_ref.step()
        o_ref.zero_grad()
    full, named = opt.full_parameters(), dict(ref.named_parameters())
    return max((full[n] - named[n]).abs().max().item() for n in named)


def test_stage3_module_returning_a_tuple_equals_adamw():
    # World size 1: torch's AdamW on the same gradients, bitwise. 2 ranks: DDP's
    # recipe, every reduction a + b: bitwise too.
    assert _attention_net_vs_adamw(3) == 0.0
    for res in launch(_attention_net_vs_adamw, 2, 3, timeout=120):
        assert res == 0.0, res


# --------------------------------------------------------------------------
# Gradient clipping over the shards.
# --------------------------------------------------------------------------

MAX_NORM = 0.5  # the toy GPT's first gradient has norm ~1.6: every step clips
CLIP_EPS = 1e-3  # Adam's eps near the clipped |gradient| (median ~5e-4), so the
                 # update depends on the clipping factor (with eps = 1e-8, AdamW
                 # is nearly blind to a gradient's scale and a wrong norm would
                 # hardly show in the weights)


def _clipping(stages):
    """Every stage with clip_grad_norm_ before each step vs one float64 process
    with torch.nn.utils.clip_grad_norm_ + AdamW on the global batch."""
    r = rank_info()
    N, lo, hi = r.world_size, r.rank * B, (r.rank + 1) * B
    batches = _batches(N)
    base = build_model("toy", seed=0)
    reference = _F64Reference(base, batches, eps=CLIP_EPS, max_norm=MAX_NORM)
    # Plausible wrong answers the bound must reject: no clipping, or clipping by
    # a norm off by a factor (a rank that saw only part of the gradient).
    unclipped = _F64Reference(base, batches, eps=CLIP_EPS)
    half_norm = _F64Reference(base, batches, eps=CLIP_EPS, max_norm=MAX_NORM * 2 ** 0.5)
    out = dict(wrong=[reference.excess(w.weights) for w in (unclipped, half_norm)])
    for stage in stages:
        model = copy.deepcopy(base)
        opt = ZeroOptimizer(model, stage, lr=LR, eps=CLIP_EPS)
        norms = []
        for x, y in batches:
            model(x[lo:hi], y[lo:hi])[1].backward()
            norms.append(opt.clip_grad_norm_(MAX_NORM))
            opt.step()
        # First step: same weights, so the two norms differ by rounding only:
        # |norm32 - norm64| <= || g32 - g64 || <= K u sqrt(sum numel * A^2) over
        # tensors, at most K u sqrt(n) A_max (K: 2 x the tokens, as in _F64Reference).
        n = sum(p.numel() for p in model.parameters())
        g_max = reference.norms[0].item()  # >= every |g|: a loose A_max
        bound = 2 * batches[0][0].numel() * U32 * n ** 0.5 * g_max
        out[stage] = dict(excess=reference.excess(opt.full_parameters()),
                          norm_diff=abs(norms[0].item() - reference.norms[0].item()),
                          norm_bound=bound)
    return out


def test_clip_grad_norm_equals_torch_clip_on_one_process():
    for res in launch(_clipping, 2, [0, 1, 2, 3], timeout=120):
        assert all(w > 1 for w in res["wrong"]), res["wrong"]
        for stage in range(4):
            v = res[stage]
            assert v["excess"] <= 1, (stage, v)
            assert v["norm_diff"] <= v["norm_bound"], (stage, v)


# --------------------------------------------------------------------------
# The ZeroRedundancyOptimizer form: any optimizer over parameters or groups.
# --------------------------------------------------------------------------

def _groups(model):
    """The usual LLM recipe: weight decay on matrices, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]


def _sharded_vs_torch_zero(stage, optimizer_class, kwargs):
    """ShardedOptimizer on parameter groups vs torch's DDP + ZeroRedundancyOptimizer
    with the same groups: max |difference| of the weights after 3 steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    r = rank_info()
    lo, hi = r.rank * B, (r.rank + 1) * B
    base = build_model("toy", seed=0)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = ShardedOptimizer(_groups(model), optimizer_class, stage=stage,
                           bucket_cap_mb=SMALL_CAP_MB, **kwargs)
    ddp = DistributedDataParallel(ref)
    o_ref = ZeroRedundancyOptimizer(_groups(ref), optimizer_class=optimizer_class, **kwargs)
    for x, y in _batches(r.world_size):
        model(x[lo:hi], y[lo:hi])[1].backward()
        opt.step()
        ddp(x[lo:hi], y[lo:hi])[1].backward()
        o_ref.step()
        o_ref.zero_grad()
    full = opt.full_parameters()  # keyed by position in the groups
    ordered = [p for g in _groups(ref) for p in g["params"]]
    return max((full[str(i)] - p).abs().max().item() for i, p in enumerate(ordered))


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_optimizer_equals_torch_zero_redundancy_optimizer(stage):
    # 2 ranks: DDP divides by N and all-reduces (a/2 + b/2), as ZeRO does; the
    # optimizers run the same elementwise operations on a segment as on the
    # whole parameter: bitwise equal.
    for optimizer_class, kwargs in ((torch.optim.AdamW, dict(lr=LR, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9))):
        for res in launch(_sharded_vs_torch_zero, 2, stage, optimizer_class, kwargs,
                          timeout=120):
            assert res == 0.0, (optimizer_class.__name__, res)


def test_sharded_optimizer_refuses_stage_3_and_bad_input():
    model = build_model("toy", seed=0)
    with pytest.raises(ValueError, match="stage 3 needs the model"):
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=3)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own message
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=-1.0)
    with pytest.raises(ValueError, match="empty parameter list"):
        ShardedOptimizer([], torch.optim.AdamW)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # untouched


def test_zero_optimizer_is_a_factory_of_one_class_per_stage():
    from helpers.zero import ZeroStage0, ZeroStage1, ZeroStage2, ZeroStage3
    for stage, cls in enumerate((ZeroStage0, ZeroStage1, ZeroStage2, ZeroStage3)):
        opt = ZeroOptimizer(build_model("toy", seed=0), stage)
        assert type(opt) is cls and isinstance(opt, ZeroOptimizer) and opt.stage == stage
    opt = ShardedOptimizer(build_model("toy", seed=0).parameters(), torch.optim.AdamW, stage=2)
    assert isinstance(opt, ShardedOptimizer) and isinstance(opt, ZeroStage2)


class _TwoHeads(torch.nn.Module):
    """Rank 0 trains head ``a``, rank 1 head ``b``; head ``never`` is used by no rank."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.a, self.b, self.never = (torch.nn.Linear(8, 3) for _ in range(3))

    def forward(self, x, y, head):
        logits = getattr(self, head)(torch.tanh(self.body(x)))
        return logits, torch.nn.functional.cross_entropy(logits, y)


def _unused_like_ddp(stage):
    """ZeroOptimizer vs torch's DDP(find_unused_parameters=True) + AdamW when each
    rank leaves a different head unused and one head is unused everywhere."""
    from torch.nn.parallel import DistributedDataParallel

    r = rank_info()
    torch.manual_seed(0)
    base = _TwoHeads()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = ZeroOptimizer(model, stage, lr=LR)
    ddp = DistributedDataParallel(ref, find_unused_parameters=True)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    # Stage 3 gathers a module's weights with a collective when it runs, so every
    # rank must run the same modules (as in FSDP and DeepSpeed): there only the
    # head no rank uses differs from the plain case.
    head = "ab"[r.rank] if stage < 3 else "a"
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + r.rank)
        x, y = torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
        model(x, y, head)[1].backward()
        opt.step()
        ddp(x, y, head)[1].backward()
        o_ref.step()
        o_ref.zero_grad()
    full, named = opt.full_parameters(), dict(ref.named_parameters())
    return dict(diff=max((full[n] - named[n]).abs().max().item() for n in named),
                never_moved=not torch.equal(full["never.weight"], base.never.weight))


def test_unused_parameters_as_ddp():
    # 2 ranks: a head used on one rank is averaged with the other's zeros (a/2 + 0,
    # the same sum in both), the head no rank used is skipped by AdamW: bitwise.
    # (The old code decayed the unused head: never_moved.)
    for stage in range(4):
        for res in launch(_unused_like_ddp, 2, stage, timeout=120):
            assert res["diff"] == 0.0, (stage, res)
            assert not res["never_moved"], stage


# --------------------------------------------------------------------------
# Reduce-scatters in one order on every rank, whatever order gradients arrive in.
# --------------------------------------------------------------------------

class _Gate(torch.nn.Module):
    """One module, two parameters of its own (one stage-3 unit): ``extra`` is used
    only when forward is asked to, so it can be unused on one rank only."""

    def __init__(self, d):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(d))
        self.extra = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, h, use_extra):
        h = h * self.scale
        return h + torch.tanh(h @ self.extra) if use_extra else h


class _Branches(torch.nn.Module):
    """Branches run in the order given to forward, so their gradients arrive in that
    order reversed: with another order on every rank, every rank completes its
    buckets in another order. Embedding and head share one weight (tied), complete
    at yet another point. Sizes differ (128, 64 and 8 elements), so two ranks that
    reduce-scatter different buckets at once mostly mismatch in size (gloo aborts);
    where sizes agree the sums are silently wrong."""

    def __init__(self, k=4, d=8, vocab=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.branches = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))
        self.gate = _Gate(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens, x, order, use_extra):
        h = 0
        for i in order:  # i == k: the embedding lookup; else branch i
            h = h + (self.emb(tokens) if i == len(self.branches)
                     else torch.tanh(self.branches[i](x)))
        return torch.nn.functional.cross_entropy(self.head(self.gate(h, use_extra)), tokens)


def _arrivals_differ(stage, steps):
    """ZeroOptimizer vs torch's DDP(find_unused_parameters=True) + AdamW when each
    rank gets its gradients in its own order and ``gate.extra`` is used on rank 0
    only. Stage 2: a bucket per parameter, branches in a random order per rank and
    step. Stage 3 all-gathers a module's weights as it runs, so every rank runs the
    modules in one order (as FSDP requires): there the unit holding the extra
    parameter completes during backward on rank 0 and only at its end on rank 1."""
    from torch.nn.parallel import DistributedDataParallel

    from helpers.overlap import Timeline

    r = rank_info()
    rng = random.Random(r.rank)  # orders differ between ranks
    torch.manual_seed(0)
    base = _Branches()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    arrived = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: arrived.append(n))
    tl = Timeline()
    opt = ZeroOptimizer(model, stage, lr=LR, bucket_cap_mb=4 / 2**20, timeline=tl)  # 1 element
    ddp = DistributedDataParallel(ref, find_unused_parameters=True)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    g = torch.Generator().manual_seed(1)  # one global batch per step, a shard each
    out = {"arrivals": [], "issued": []}
    for _ in range(steps):
        order = list(range(len(base.branches) + 1))
        if stage == 2:
            rng.shuffle(order)
        tokens = torch.randint(0, 16, (4 * r.world_size,), generator=g)[4 * r.rank:4 * r.rank + 4]
        x = torch.randn(4 * r.world_size, 8, generator=g)[4 * r.rank:4 * r.rank + 4]
        arrived.clear()
        tl.clear()
        model(tokens, x, order, r.rank == 0).backward()
        out["arrivals"].append(tuple(arrived))
        # the waits at the end of backward, in the order the reduce-scatters were issued
        out["issued"].append([e["name"] for e in tl.events
                              if e["lane"] == "wait" and e["name"].startswith("reduce-scatter")])
        opt.step()
        ddp(tokens, x, order, r.rank == 0).backward()
        o_ref.step()
        o_ref.zero_grad()
    full = opt.full_parameters()
    out["diff"] = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    out["buckets"] = len(opt.partition.buckets)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_scatters_go_in_one_order_whatever_order_gradients_arrive(stage):
    """Launched as each bucket completed (the old code), the ranks issued their
    reduce-scatters in different orders: gloo aborted a rank ("Received data size
    doesn't match expected size", SIGABRT) or summed one rank's bucket with another
    bucket of the other. In one launch order the same collectives pair up, and a
    parameter used on one rank only is averaged with zeros from the other, as
    DDP(find_unused_parameters=True) does: 2 ranks, a/2 + 0, bitwise equal."""
    steps = 8
    results = launch(_arrivals_differ, 2, stage, steps, timeout=120)
    for res in results:
        assert res["diff"] == 0.0, res["diff"]
        assert all(len(names) == res["buckets"] for names in res["issued"])
    assert results[0]["issued"] == results[1]["issued"]  # same order, every step
    # the gradients did arrive in different orders on the two ranks
    assert all(a != b for a, b in zip(results[0]["arrivals"], results[1]["arrivals"]))
    if stage == 2:  # ... and in many orders
        assert len(set(results[0]["arrivals"])) > steps // 2


def _calls_after_one_step(stage):
    model = build_model("toy", seed=0)
    opt = ZeroOptimizer(model, stage)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank_info().rank))
    model(x, x)[1].backward()
    opt.step()
    return opt.comm_calls(), opt.comm_bytes(), len(opt.partition.buckets)


@pytest.mark.parametrize("stage", range(4))
def test_comm_calls_count_what_comm_bytes_prices(stage):
    """One collective per bucket and phase (chapter 14 prints these): DP one all-reduce of
    the flat buffer; stage 1 a reduce-scatter and an all-gather per bucket; stage 2 the same,
    the reduce-scatters in backward; stage 3 a gather per unit per use and a reduce-scatter
    per unit. Every kind priced by comm_bytes is counted, and nothing else."""
    calls, sent, buckets = launch(_calls_after_one_step, 2, stage)[0]
    assert set(calls) - {"total"} == set(sent) - {"total"}
    assert calls["total"] == sum(v for k, v in calls.items() if k != "total")
    if stage == 0:
        assert calls == {"all_reduce": 1, "total": 1}
    elif stage in (1, 2):
        assert calls["reduce_scatter"] == calls["all_gather"] == buckets
    else:   # each unit gathered for its forward and again for its backward (tied: more)
        assert calls["reduce_scatter"] == buckets and calls["all_gather"] >= 2 * buckets
