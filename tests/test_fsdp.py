"""helpers.fsdp against one process on the global batch, PyTorch FSDP2 and DDP.

Exact equality with one process on the full batch cannot hold in fp32: one
process sums the per-example gradients inside its matmuls, N ranks sum their
own halves and then add the ranks' results in the collective's order, and
fp32 addition is not associative. (PyTorch's FSDP2 misses it the same way, by
about 1.5e-8 after one SGD step on a small model.) So each run is compared with
a float64 run of the same single-process training, the closest we have to
exact arithmetic, and must be no further from it than the fp32 single process
itself is (times a small factor, see ``_check_against_single``). Exact
equality is asserted only where the arithmetic is the same operation for
operation: world size 1, and 2 ranks (one addition per reduction) against DDP
and FSDP2.
"""

import pytest
import torch

from helpers import launch, rank_info
from helpers.data import make_dataset
from helpers.ddp import BucketedDDP
from helpers.fsdp import FSDP, hybrid_grid, hybrid_groups, torch_fsdp2
from helpers.model import Block, build_model
from helpers.overlap import Timeline

LR, STEPS, B = 1e-3, 3, 2


def _single(batches, dtype):
    """The reference: one process, the global batch, AdamW, in ``dtype``."""
    model = build_model("toy", seed=0).to(dtype)  # fp64: the fp32 initial weights, exactly
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for x, y in batches:
        model(x, y)[1].backward(); opt.step(); opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _err(params, ref):
    """max |w - w_ref| over every weight, computed in float64."""
    return max((params[n].double() - ref[n].double()).abs().max().item() for n in ref)


def _train(configs):
    """Each config trains the toy GPT for STEPS steps on this rank's slice;
    returns its max |w - w_single| (fp32 and fp64 references), the fp32
    single process's own distance from fp64 and the per-rank measurements."""
    r = rank_info()
    N, lo, hi = r.world_size, r.rank * B, (r.rank + 1) * B
    ds = make_dataset(num_sequences=64, seq_len=16)
    batches = [ds.batch(list(range(s * B * N, (s + 1) * B * N))) for s in range(STEPS)]
    ref, ref64 = _single(batches, torch.float32), _single(batches, torch.float64)
    out = {"_floor": _err(ref, ref64)}
    for name in configs:
        model = build_model("toy", seed=r.rank)  # ranks start different: broadcast needed
        kind = name.split(":")[0]
        tl = Timeline()
        if kind == "fsdp2":
            model = build_model("toy", seed=0)  # FSDP2 does not broadcast
            wrapped = torch_fsdp2(model)
            params = model.parameters()
        elif kind == "ddp":
            wrapped = BucketedDDP(model)
            params = model.parameters()
        elif kind == "wrong-local":  # a plausible wrong answer: gradients never averaged
            wrapped = model = build_model("toy", seed=0)
            params = model.parameters()
        else:
            kw = {"nopf": dict(prefetch=False), "keep": dict(reshard_after_forward=False),
                  "keep-eval": dict(reshard_after_forward=False),
                  "fsdp": {}}.get(kind, {})
            if kind == "hybrid":
                sg, rg = hybrid_groups(2)
                kw = dict(shard_group=sg, replicate_group=rg)
            if kind == "tied":  # wte (tied to the root's lm_head) and wpe picked as units too
                kw = dict(policy=lambda m: isinstance(m, (Block, torch.nn.Embedding)))
            if kind == "ignored":  # LayerNorms replicated, DDP-style
                kw = dict(ignored_params=[p for n, p in model.named_parameters() if ".ln" in n
                                          or n.startswith("ln")])
            wrapped = FSDP(model, timeline=tl, **kw)
            params = wrapped.parameters()
        opt = torch.optim.AdamW(params, lr=LR, foreach=False)
        held_after_eval = 0
        for x, y in batches:
            wrapped(x[lo:hi], y[lo:hi])[1].backward()
            # An evaluation pass between backward() and step(): under no_grad,
            # or (a common slip) with grad enabled and no backward.
            if kind in ("eval", "keep-eval"):
                with torch.no_grad():
                    wrapped(x[lo:hi], y[lo:hi])
                held_after_eval += sum(u.full.untyped_storage().nbytes()
                                       for u in wrapped.all_units)
            elif kind == "eval-grad":
                wrapped(x[lo:hi], y[lo:hi])
            opt.step(); opt.zero_grad()
        if kind == "fsdp2":
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
        elif kind in ("ddp", "wrong-local"):
            full = dict(model.named_parameters())
        elif kind == "unwrap":  # the model's own parameters again, trained
            full = dict(wrapped.unwrap().named_parameters())
        else:
            full = wrapped.full_parameters()
        res = {n: full[n].detach() for n in ref}
        out[name] = dict(
            diff=_err(res, ref), diff64=_err(res, ref64), params=res,
            comm=getattr(wrapped, "comm_bytes", dict)(),
            peak=getattr(wrapped, "peak_gathered_bytes", None),
            shard=getattr(wrapped, "sharded_numel", lambda: None)(),
            lanes={e["lane"] for e in tl.events}, held_after_eval=held_after_eval,
            units=[(u.name, len(u.params)) for u in getattr(wrapped, "all_units", [])],
            # ignored parameters keep their own full storage: bytes of each
            ignored_bytes=[p.untyped_storage().nbytes()
                           for p in getattr(wrapped, "ignored_params", [])])
    return out


def _check_against_single(results):
    """Every run is as close to exact (float64) arithmetic as one fp32 process is.

    Each fp32 run, sharded or not, adds the same terms in its own order; its
    distance from the float64 run is a maximum over ~13k weights of rounding
    that AdamW carried through STEPS steps, with the same statistics whatever
    the order (measured: the sharded runs at 0.5x to 1.1x the single fp32
    process's distance, at 2, 3 and 4 ranks). The factor 4 covers the spread
    between two such maxima; it scales with the CPU's own rounding, so another
    summation order or kernel (AVX-512, arm64) moves the bound with it. A
    wrong answer (a gradient not averaged, stale weights) moves weights by
    about one AdamW step, lr = 1e-3: hundreds of times the bound.
    """
    for rank_res in results:
        floor = rank_res["_floor"]
        # fp32 rounding moves a weight by a small fraction of one AdamW step
        # (lr; measured ~0.002 lr); were it not so, the bound below would be
        # too loose to catch a wrong answer.
        assert floor < 0.05 * LR, floor
        for name, res in rank_res.items():
            if name.startswith("wrong"):  # the bound must catch it
                assert res["diff64"] > 4 * floor, (name, res["diff64"], floor)
            elif name != "_floor":
                assert res["diff64"] <= 4 * floor, (name, res["diff64"], floor)


@pytest.mark.slow
def test_fsdp_two_ranks_equals_single_fsdp2_and_ddp():
    results = launch(_train, 2, ["fsdp", "nopf", "keep", "fsdp2", "ddp", "unwrap", "tied",
                                 "ignored", "wrong-local"], timeout=120)
    _check_against_single(results)
    r0 = results[0]
    # A weight shared by two units (the policy picks wte, whose weight the
    # root's lm_head shares) goes to the root; wpe is a unit of its own.
    assert r0["tied"]["units"] == [("wpe", 1), ("blocks.0", 12), ("blocks.1", 12), ("root", 3)]
    # Ignored parameters (10 LayerNorm weights and biases, 32 elements each)
    # are in no unit and stay full on every rank; their gradients are
    # averaged as DDP does, a / 2 + b / 2, the same sum: bitwise below.
    assert r0["ignored"]["units"] == [("blocks.0", 8), ("blocks.1", 8), ("root", 2)]
    assert r0["ignored"]["ignored_bytes"] == [32 * 4] * 10
    for name in ("nopf", "keep", "fsdp2", "ddp", "unwrap", "tied", "ignored"):
        for n, p in r0["fsdp"]["params"].items():
            # Two ranks: the same arithmetic operation for operation. Each rank
            # runs the same kernels on the same shapes (every toy parameter has
            # a multiple of 16 elements, so a view into a flat buffer is 64-byte
            # aligned like a tensor of its own, and no kernel takes another
            # path), every reduction is a + b (commutative in IEEE), the
            # division by 2 is exact, the optimizer is torch's AdamW: bitwise.
            assert torch.equal(p, r0[name]["params"][n]), (name, n)
    n = sum(p.numel() for p in build_model("toy").parameters())
    # Memory: a rank holds a shard of every unit (~Psi / N) plus the units
    # gathered at once. Without prefetch: root + one block; DDP holds Psi.
    # (element counts, exact: 3 units, each padded by at most N - 1 = 1 element)
    assert r0["fsdp"]["shard"] * 2 <= n + 2 * 3 * 2
    toy = build_model("toy")
    block = sum(p.numel() for p in toy.blocks[0].parameters())
    root = n - 2 * block
    assert r0["nopf"]["peak"] <= 4 * (root + block + 4)
    assert r0["nopf"]["peak"] < 4 * n
    # Volume: gather in forward and backward + reduce-scatter; the root stays
    # gathered from forward to backward so it is gathered once:
    # (2 Psi + 2 blocks) / (2 Psi) of DP's all-reduce. Byte counts, not
    # rounding: rel=2e-3 is the padding (at most 1 element per unit and
    # collective, ~10 elements of 13k).
    dp = 2 * (2 - 1) / 2 * 4 * n
    ratio = r0["fsdp"]["comm"]["total"] / dp
    assert ratio == pytest.approx((2 * n + 2 * block) / (2 * n), rel=2e-3)
    assert r0["keep"]["comm"]["total"] / dp == pytest.approx(1.0, rel=2e-3)
    assert {"compute", "comm", "wait"} <= r0["fsdp"]["lanes"]


def test_evaluation_forward_between_backward_and_step_uses_fresh_weights():
    """The next forward must not run on units gathered before the optimizer
    step (FSDP cannot free them in step(), as ZeRO-3 does, so the root's
    pre-forward drops leftovers)."""
    results = launch(_train, 2, ["fsdp", "eval", "eval-grad", "keep-eval"], timeout=120)
    _check_against_single(results)
    for rank_res in results:
        for name in ("eval", "eval-grad", "keep-eval"):
            # evaluation passes change nothing: bitwise the plain run
            for n, p in rank_res["fsdp"]["params"].items():
                assert torch.equal(p, rank_res[name]["params"][n]), (name, n)
            # a forward under no_grad leaves nothing gathered
            assert rank_res[name]["held_after_eval"] == 0, name


def test_world_size_one_and_grid():
    model, ref = build_model("toy", seed=0), build_model("toy", seed=0)
    f = FSDP(model)
    assert [u.module for u in f.units] == list(model.blocks)
    opt = torch.optim.AdamW(f.parameters(), lr=1e-2, foreach=False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        f(x, x)[1].backward(); opt.step(); opt.zero_grad()
        ref(x, x)[1].backward(); ropt.step(); ropt.zero_grad()
    full = f.full_parameters()
    for n, p in ref.named_parameters():
        # world size 1: the same kernels on the same shapes and alignment (see
        # the 2-rank test), nothing reduced: bitwise equal
        assert torch.equal(full[n], p), n
    assert hybrid_grid(4, 2) == [[0, 1], [2, 3]]
    assert hybrid_grid(6, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="divide"):
        hybrid_grid(4, 3)
    with pytest.raises(ValueError, match="trainable"):
        FSDP(build_model("toy").requires_grad_(False))
    with pytest.raises(ValueError, match="hybrid"):
        FSDP(build_model("toy"), replicate_group=object())


def _hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + \
        sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_rewrap_refused_until_unwrapped():
    """Re-running a cell ``fsdp = FSDP(model)`` wraps the same model again. The
    first wrapper's hooks would stay and its weights are views into freed
    buffers: refused, naming the way out; ``unwrap()`` removes every hook and
    gives the parameters their trained values back, so the model trains on."""
    model, ref = build_model("toy", seed=0), build_model("toy", seed=0)
    assert _hooks(model) == 0
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    f = FSDP(model)
    with pytest.raises(ValueError, match="this model is still wrapped .* unwrap()"):
        FSDP(model)
    with pytest.raises(ValueError, match="still wrapped"):  # a unit of it, too
        FSDP(model.blocks[0])
    with pytest.raises(ValueError, match="submodule 'inner' is still wrapped"):
        FSDP(torch.nn.ModuleDict({"inner": model}))

    def train(m, params, steps):
        opt = torch.optim.AdamW(params, lr=LR, foreach=False)
        for _ in range(steps):
            m(x, x)[1].backward(); opt.step(); opt.zero_grad()
    train(f, f.parameters(), 2)
    assert f.unwrap() is model
    assert _hooks(model) == 0 and all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="unwrapped"):
        f(x, x)
    train(model, model.parameters(), 1)   # on its own
    f2 = FSDP(model)                      # and wrapped again
    train(f2, f2.parameters(), 2)
    for steps in (2, 1, 2):  # the reference: a fresh AdamW at the same points
        train(ref, ref.parameters(), steps)
    full = f2.full_parameters()
    for n, p in ref.named_parameters():
        assert torch.equal(full[n], p), n  # world size 1: bitwise (see above)
    assert model.lm_head.weight is model.wte.weight  # the tie survives the unwrap


class TupleNet(torch.nn.Module):
    """Units that return a tuple: two nn.MultiheadAttention layers, (out, weights)."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.attn = torch.nn.ModuleList(torch.nn.MultiheadAttention(dim, 2, batch_first=True)
                                        for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x, y):
        h = self.emb(x)                                   # (B, T, D)
        out, w = self.attn[0](h, h, h)                    # (B, T, D), (B, T, T)
        h = h + out + w.mean(-1, keepdim=True)            # both outputs reach the loss
        out, none = self.attn[1](h, h, h, need_weights=False)  # (B, T, D), None
        logits = self.head(h + out)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _train_tuple_net(kind, steps=3):
    """TupleNet, each attention layer an FSDP unit, or under BucketedDDP, or alone;
    this rank's slice of a global batch of 4; the weights after ``steps`` steps."""
    r = rank_info()
    torch.manual_seed(0)
    model = TupleNet()
    g = torch.Generator().manual_seed(1)
    B = 4 // r.world_size
    if kind == "fsdp":
        wrapped = FSDP(model, policy=lambda m: isinstance(m, torch.nn.MultiheadAttention))
        params = wrapped.parameters()
    else:
        wrapped = BucketedDDP(model) if kind == "ddp" else model
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 8), generator=g)
        sl = slice(r.rank * B, (r.rank + 1) * B)
        wrapped(x[sl], x[sl].roll(1, 1))[1].backward(); opt.step(); opt.zero_grad()
    if kind == "fsdp":
        assert [u.name for u in wrapped.units] == ["attn.0", "attn.1"]
        return wrapped.full_parameters()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_units_that_return_a_tuple():
    """The gather before a unit's backward hangs on its outputs' gradients:
    with a tuple (or any pytree) of outputs, one hook over all of them. Without
    it the unit's backward reads freed weights ("setStorage ... size 0")."""
    ref = _train_tuple_net("single")
    got = _train_tuple_net("fsdp")
    for n, p in ref.items():
        assert torch.equal(got[n], p), n  # world size 1: same arithmetic (see above)
    # 2 ranks against DDP: a + b, exact halving, same kernels: bitwise (see above)
    ddp, fsdp = (launch(_train_tuple_net, 2, k, timeout=120)[0] for k in ("ddp", "fsdp"))
    for n, p in ddp.items():
        assert torch.equal(fsdp[n], p), n
    assert max((ddp[n] - ref[n]).abs().max().item() for n in ref) > 0  # the data did split


MAX_NORM, SGD_LR = 0.5, 0.1
EPS32 = torch.finfo(torch.float32).eps


def _train_clip(hybrid=False):
    """STEPS steps of SGD with the gradient clipped to MAX_NORM: one process
    (torch's clip_grad_norm_, fp32 and fp64), FSDP.clip_grad_norm_, and the
    plausible wrong answer, torch's clip over this rank's shards. SGD, not
    AdamW: AdamW's first step is blind to a gradient's scale, SGD's update is
    the clipped gradient itself, so a wrong clipping factor shows at once."""
    r = rank_info()
    N, lo, hi = r.world_size, r.rank * B, (r.rank + 1) * B
    ds = make_dataset(num_sequences=64, seq_len=16)
    batches = [ds.batch(list(range(s * B * N, (s + 1) * B * N))) for s in range(STEPS)]
    out = {}
    for kind in ("single32", "single64", "fsdp", "fsdp-ignored", "wrong-local-norm"):
        model = build_model("toy", seed=0)
        if kind.startswith("single"):
            wrapped = model = model.to(torch.float64 if kind == "single64" else torch.float32)
            params = list(model.parameters())
            clip = lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM)  # noqa: E731
            sl = slice(None)
        else:
            kw = dict(zip(("shard_group", "replicate_group"), hybrid_groups(2))) if hybrid else {}
            if kind == "fsdp-ignored":  # replicated LayerNorms: their norm counts once
                kw["ignored_params"] = [p for n, p in model.named_parameters() if "ln" in n]
            wrapped = FSDP(model, **kw)
            params = list(wrapped.parameters())
            clip = (lambda: wrapped.clip_grad_norm_(MAX_NORM)) if kind != "wrong-local-norm" else \
                (lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
            sl = slice(lo, hi)
        opt = torch.optim.SGD(params, lr=SGD_LR)
        norms = []
        for x, y in batches:
            wrapped(x[sl], y[sl])[1].backward()
            norms.append(clip().item())
            opt.step(); opt.zero_grad()
        full = wrapped.full_parameters() if isinstance(wrapped, FSDP) else \
            dict(model.named_parameters())
        out[kind] = dict(params={n: p.detach() for n, p in full.items()}, norms=norms)
    return out


def _check_clip(res):
    ref32, ref64 = res["single32"], res["single64"]
    # every step clips (else the test would not test clipping)
    assert min(res["fsdp"]["norms"]) > 2 * MAX_NORM, res["fsdp"]["norms"]
    # The norm before clipping, step 1 (same weights everywhere): the gradients
    # differ by fp32 rounding (bounded as the weights are, by the single fp32
    # process's own distance from fp64), plus each side's fp32 sum of ~13k
    # squares, pairwise: at most ~log2(13k) = 14 ulps relative each.
    n64 = ref64["norms"][0]
    slack = 4 * abs(ref32["norms"][0] - n64) + 2 * 14 * EPS32 * n64
    for kind in ("fsdp", "fsdp-ignored"):
        assert abs(res[kind]["norms"][0] - n64) <= slack, (kind, res[kind]["norms"][0], n64)
    # the weights after STEPS clipped steps: as in _check_against_single
    floor = _err(ref32["params"], ref64["params"])
    assert floor < 0.05 * SGD_LR * MAX_NORM, floor  # rounding, far below one clipped step
    for kind in ("fsdp", "fsdp-ignored"):
        assert _err(res[kind]["params"], ref64["params"]) <= 4 * floor, kind
    # torch's clip over the shards: each rank clips by its own chunks' norm
    assert _err(res["wrong-local-norm"]["params"], ref64["params"]) > 4 * floor


def test_clip_grad_norm_equals_one_process():
    for rank_res in launch(_train_clip, 2, timeout=120):
        _check_clip(rank_res)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        FSDP(build_model("toy")).clip_grad_norm_(0.0)


def _train_mixed(param_dtype, reduce_dtype):
    """Our FSDP with a mixed-precision policy, PyTorch's FSDP2 with the same
    ``MixedPrecisionPolicy``, and ours in plain fp32 (what a policy that did
    nothing would give): weights after STEPS AdamW steps, gradients after
    the first backward (full, and this rank's per-parameter views)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    r = rank_info()
    g = torch.Generator().manual_seed(r.rank)
    xs = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(STEPS)]
    out = {}
    for kind in ("ours", "fsdp2", "fp32"):
        model = build_model("toy", seed=0)
        if kind == "fsdp2":
            wrapped = torch_fsdp2(model, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))
            params = list(model.parameters())
        else:
            kw = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if kind == "ours" else {}
            wrapped = FSDP(model, **kw)
            params = list(wrapped.parameters())
        opt = torch.optim.AdamW(params, lr=LR, foreach=False)
        res = out[kind] = {}
        for x in xs:
            loss = wrapped(x, x)[1]
            loss.backward()
            if "grads" not in res:
                res["loss_dtype"] = loss.dtype
                if kind == "fsdp2":  # each parameter's gradient: a DTensor, dim-0 sharded
                    res["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                else:
                    res["grads"] = wrapped.full_grads()
                    res["views"] = {n: (s.start, s.grad.clone(), s.grad.untyped_storage().data_ptr()
                                        in {u.shard.grad.untyped_storage().data_ptr()
                                            for u in wrapped.all_units})
                                    for n, s in wrapped.sharded_grads().items()}
                    res["comm"] = wrapped.comm_bytes()
                    res["full_dtypes"] = {u.full.dtype for u in wrapped.all_units}
            opt.step(); opt.zero_grad()
        res["params"] = ({n: p.full_tensor() for n, p in model.named_parameters()}
                         if kind == "fsdp2" else wrapped.full_parameters())
    return out


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_mixed_precision_equals_fsdp2(reduce_dtype):
    """bf16 compute, fp32 sharded master weights, gradients reduced in fp32
    (or in bf16 with reduce_dtype None), against FSDP2 with the same policy.

    Bitwise: the two do the same operations. Each rounds the same fp32
    master weights to bf16 (round-to-nearest-even), runs the same kernels on
    them, and reduces: in fp32, a + b of two bf16 values is exact and the
    halving too; in bf16 both halve (exact) and add once. AdamW then updates
    the same fp32 shards. Plain fp32 training is ~1e-3 away, so the check
    fails on a policy that does nothing."""
    r0, r1 = launch(_train_mixed, 2, torch.bfloat16, reduce_dtype, timeout=120)
    ours, fsdp2, fp32 = r0["ours"], r0["fsdp2"], r0["fp32"]
    assert ours["loss_dtype"] == fsdp2["loss_dtype"] == torch.bfloat16
    assert ours["full_dtypes"] == {torch.bfloat16}  # gathered, and computed, in bf16
    # bf16 all-gathers send half the bytes of fp32; the reduce-scatter is in reduce_dtype
    assert ours["comm"]["all_gather"] == fp32["comm"]["all_gather"] / 2
    rs = 1 if reduce_dtype == torch.float32 else 2
    assert ours["comm"]["reduce_scatter"] == fp32["comm"]["reduce_scatter"] / rs
    for what in ("params", "grads"):
        for n, p in fsdp2[what].items():
            assert ours[what][n].dtype == p.dtype == torch.float32, (what, n)
            assert ours[what][n].shape == p.shape, (what, n)
            assert torch.equal(ours[what][n], p), (what, n)
    assert _err(fp32["params"], fsdp2["params"]) > 1e-4  # ~lr: the policy matters
    # Per-parameter gradient views (FSDP.sharded_grads): fp32 views into each
    # rank's shard.grad; the two ranks' slices tile the full averaged gradient.
    for n, full in fsdp2["grads"].items():
        flat = torch.full((full.numel(),), float("nan"))
        for rank_res in (r0, r1):
            start, g, is_view = rank_res["ours"]["views"][n]
            assert is_view and g.dtype == torch.float32 and g.dim() == 1, n
            flat[start:start + g.numel()] = g
        assert torch.equal(flat.view(full.shape), full), n


def test_parameters_grad_views_through_steps_zero_grad_and_unwrap():
    """World size 1, against the same model trained alone (bitwise: the same
    kernels, nothing reduced; see test_world_size_one_and_grid). Outside a
    unit's run each parameter is its piece of the shard (here the whole
    parameter, flattened) and its .grad the same piece of shard.grad:
    accumulated over two backwards, updated by the optimizer in place,
    dropped by model.zero_grad() (written back at the next gather, as FSDP1
    does) and by optimizer.zero_grad() (the views follow at the next forward)."""
    model, ref = build_model("toy", seed=0), build_model("toy", seed=0)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    f = FSDP(model)
    opt = torch.optim.AdamW(f.parameters(), lr=LR, foreach=False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    params, refs = dict(model.named_parameters()), dict(ref.named_parameters())

    def same(what, grads=True):
        for n, p in params.items():
            assert p.data.shape == (shapes[n].numel(),), (what, n)
            want = refs[n].grad if grads else refs[n].detach()
            got = p.grad if grads else p.data
            if want is None:
                assert got is None, (what, n)
            else:
                assert got.shape == p.data.shape and torch.equal(got, want.reshape(-1)), (what, n)

    same("wrapped: the weights, no gradient", grads=False)
    same("wrapped: no gradient")
    for m in (f, ref):
        m(x, x)[1].backward()
    same("one backward")
    for m in (f, ref):
        m(x, x)[1].backward()
    same("two backwards, accumulated")
    opt.step(); ropt.step()
    same("after step: the updated weights", grads=False)
    params["wte.weight"].grad = None  # dropped for one parameter: zeroed, the rest accumulate
    refs["wte.weight"].grad = None
    for m in (f, ref):
        m(x, x)[1].backward()
    same("one parameter's .grad set to None, then backward")
    model.zero_grad(); ref.zero_grad()  # every .grad dropped
    for m in (f, ref):
        m(x, x)[1].backward()
    same("model.zero_grad(), then backward")
    opt.zero_grad(); ropt.zero_grad()   # the shards' gradients dropped
    f(x, x)
    assert all(p.grad is None for p in params.values())  # after the forward, the views follow
    for m in (f, ref):
        m(x, x)[1].backward()
    same("optimizer.zero_grad(), then backward")
    f.unwrap()
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert all(p.grad is None for p in model.parameters())


def test_bad_policy_and_ignored_params_refused():
    with pytest.raises(ValueError, match="param_dtype must be a floating-point"):
        FSDP(build_model("toy"), param_dtype=torch.int8)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        FSDP(build_model("toy"), ignored_params=[torch.nn.Parameter(torch.zeros(3))])


# --------------------------------------------------------------------------
# Peak memory, measured from the tensors each rank holds.
# --------------------------------------------------------------------------

def held_bytes(*roots) -> int:
    """Bytes of every distinct tensor storage reachable from ``roots`` (modules,
    optimizers, wrappers, their attributes, lists and dicts; a tensor's .grad
    too). Independent of any counter the wrappers keep; activations saved by
    autograd are not reachable from here and are the same in every run."""
    seen_obj, storages = set(), {}
    stack = list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen_obj or o is None or isinstance(o, (str, bytes, int, float, bool)):
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes():
                storages[st.data_ptr()] = st.nbytes()
            stack.append(o.grad)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (torch.nn.Module, torch.optim.Optimizer)) or \
                type(o).__module__.startswith("helpers"):
            stack.extend(vars(o).values())
    return sum(storages.values())


def _peak(kind, n_layer=2):
    """Peak over one training step of the bytes held, probed at every module's
    forward (before and after) and after every parameter's gradient arrives."""
    r = rank_info()
    model = build_model("toy", seed=0, n_layer=n_layer)
    originals = list(model.parameters())
    if kind == "ddp":
        wrapped = BucketedDDP(model)
        params = model.parameters()
    else:
        wrapped = FSDP(model, prefetch=kind == "fsdp")
        params = wrapped.parameters()
    opt = torch.optim.AdamW(params, lr=LR)
    peak = [0]

    def probe(*_):
        peak[0] = max(peak[0], held_bytes(wrapped, model, opt))
    # registered after the wrapper's hooks: they see what the wrapper just gathered
    for m in model.modules():
        m.register_forward_pre_hook(probe)
        m.register_forward_hook(probe)
    for p in originals:
        p.register_post_accumulate_grad_hook(probe)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(r.rank))
    for _ in range(2):  # the second step has Adam's moments from the start
        wrapped(x, x)[1].backward()
        probe()
        opt.step()
        probe()
        opt.zero_grad()
    n = sum(p.numel() for p in originals)
    shard = getattr(wrapped, "sharded_numel", lambda: None)()
    return dict(peak=peak[0], n=n, shard=shard)


@pytest.mark.slow
@pytest.mark.parametrize("n_layer", [2, 6])
def test_fsdp_peak_memory_below_ddp_as_predicted(n_layer):
    res = {k: launch(_peak, 2, k, n_layer, timeout=120)[0]
           for k in ("ddp", "fsdp", "fsdp-noprefetch")}
    n = res["ddp"]["n"]
    toy = build_model("toy", n_layer=n_layer)
    block = sum(p.numel() for p in toy.blocks[0].parameters())
    root = n - n_layer * block
    # DDP: weights, gradients, the bucket buffers they are copied through, and
    # Adam's two moments, all full: 5 x 4 bytes x Psi.
    assert res["ddp"]["peak"] == pytest.approx(20 * n, rel=0.01), res["ddp"]
    for kind in ("fsdp", "fsdp-noprefetch"):
        S = res[kind]["shard"]  # elements of this rank's shards, ~Psi / 2
        # FSDP, predicted peak (during block 0's backward): the shard, its
        # gradient and Adam's two moments (4 S); the root, full from forward
        # to the end of backward; a block full, its full gradients, and the
        # previous block's reduce-scatter input still in flight (with
        # prefetch, the next block may be the third). Measured with 2 blocks:
        # ~3.2 x 4 Psi bytes against DDP's 5 x 4 Psi. The bound does not grow
        # with depth: a finished reduce-scatter's input is dropped when the
        # next unit's starts (6 blocks checks that).
        predicted = 4 * (4 * S + root + 3 * block)
        # at the very least, in forward: shard and moments, the root and one block
        floor = 4 * (3 * S + root + block)
        assert floor <= res[kind]["peak"] <= predicted, (kind, res[kind]["peak"], predicted)
        assert res[kind]["peak"] < 0.7 * res["ddp"]["peak"], (kind, res)


def test_units_on_the_parameters_device():
    """On the meta device a unit buffer made on the CPU fails at its first copy
    (see test_zero's twin): a whole step, then where every unit tensor lives."""
    model = build_model("toy", seed=0).to("meta")
    f = FSDP(model)
    opt = torch.optim.AdamW(f.parameters(), lr=LR)
    x = torch.randint(0, 64, (2, 16), device="meta")
    f(x, x)[1].backward()
    opt.step()
    held = [t for u in f.all_units for t in (u.full, u.shard, u.shard.grad)]
    held += list(f.full_parameters().values())
    assert {t.device.type for t in held} == {"meta"}


def _fsdp_on_gpu():
    r = rank_info()
    x = torch.randint(0, 64, (2, 16), device=r.device)
    model = build_model("toy", seed=0).to(r.device)
    refs = [build_model("toy", seed=0).to(r.device, dt) for dt in (torch.float32, torch.float64)]
    f = FSDP(model)
    opt = torch.optim.AdamW(f.parameters(), lr=1e-2)
    ropts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in refs]
    for _ in range(2):
        for m, o in [(f, opt), *zip(refs, ropts)]:
            m(x, x)[1].backward(); o.step(); o.zero_grad()
    full = f.full_parameters()
    devices = {p.device.type for p in f.parameters()} | {t.device.type for t in full.values()}
    ref32, ref64 = (dict(m.named_parameters()) for m in refs)
    return devices, _err(full, ref64), _err(ref32, ref64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_world_size_one_on_gpu_with_nccl():
    devices, err, floor = launch(_fsdp_on_gpu, 1, backend="nccl", timeout=120)[0]
    assert devices == {"cuda"}
    # GPU kernels may pick another algorithm for a view into a flat buffer:
    # rounding only, so the same bound as the CPU runs (_check_against_single)
    assert floor < 0.05 * 1e-2, floor
    assert err <= 4 * floor, (err, floor)


def _single_grads(x, y, dtype):
    """The reference gradient: one process, the global batch, in ``dtype``."""
    model = build_model("toy", seed=0).to(dtype)
    model(x, y)[1].backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def _orig_param_grads():
    """One backward of our FSDP on this rank's slice of a global batch, in fp32
    and with bf16 compute (fp32 reduction): each parameter's own .grad and
    .data, where sharded_grads() says they start in the flattened parameter,
    and the single process's gradients (fp64; fp32 or bf16) and weights."""
    r = rank_info()
    N, lo, hi = r.world_size, r.rank * B, (r.rank + 1) * B
    x, y = make_dataset(num_sequences=64, seq_len=16).batch(list(range(B * N)))
    out = {"ref64": _single_grads(x, y, torch.float64),
           "weights": {n: p.detach() for n, p in build_model("toy", seed=0).named_parameters()}}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model("toy", seed=0)
        mixed = dtype != torch.float32
        f = FSDP(model, param_dtype=dtype if mixed else None,
                 reduce_dtype=torch.float32 if mixed else None)
        loss = f(x[lo:hi], y[lo:hi])[1]
        loss.backward()
        starts = {n: s.start for n, s in f.sharded_grads().items()}
        out[dtype] = dict(
            loss_dtype=loss.dtype, ref=_single_grads(x, y, dtype),
            local=_single_grads(x[lo:hi], y[lo:hi], dtype),  # a wrong answer: not averaged
            params={n: (p.requires_grad, p.data.clone(),
                        None if p.grad is None else p.grad.clone(), starts[n])
                    for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_parameters_grad_after_backward_is_this_ranks_piece(ranks):
    """What a suite written for FSDP1 (use_orig_params=True) reads: after
    backward every trainable parameter of the wrapped model has a .grad of
    the shape of its .data (this rank's 1-D piece of the flattened parameter;
    3 ranks: uneven pieces, some empty), fp32 under bf16 compute, equal to
    that piece of one process's gradient on the global batch, within rounding:
    no further from float64 than the single process's own gradient in the same
    compute dtype is, times 4 (as _check_against_single; measured <= 1x at 2
    and 3 ranks). This rank's own gradient, not averaged, is ~0.2 away: 30x
    the bf16 bound, 10^6 x the fp32 one.
    The pieces of all ranks tile each parameter, and .data is the same piece
    of the fp32 weights (the master weights, before any step)."""
    results = launch(_orig_param_grads, ranks, timeout=120)
    ref64, weights = results[0]["ref64"], results[0]["weights"]
    for dtype in (torch.float32, torch.bfloat16):
        assert results[0][dtype]["loss_dtype"] == dtype  # bf16: the compute ran in bf16
        floor = max((g - ref64[n]).abs().max().item()
                    for n, g in results[0][dtype]["ref"].items())
        for n, want in ref64.items():
            covered = torch.zeros(want.numel(), dtype=torch.int)
            for rank_res in results:
                requires_grad, data, grad, start = rank_res[dtype]["params"][n]
                assert requires_grad and grad is not None, (dtype, n)
                assert grad.shape == data.shape and data.dim() == 1, (dtype, n)
                assert grad.dtype == data.dtype == torch.float32, (dtype, n)
                k = grad.numel()
                piece = slice(start, start + k)
                err = (grad.double() - want.reshape(-1)[piece]).abs().max().item() if k else 0.0
                assert err <= 4 * floor, (dtype, n, err, floor)
                assert torch.equal(data, weights[n].reshape(-1)[piece]), (dtype, n)
                covered[piece] += 1
            assert (covered == 1).all(), (dtype, n)  # every element on exactly one rank
        wrong = max((g - ref64[n]).abs().max().item()
                    for n, g in results[0][dtype]["local"].items())
        assert wrong > 4 * floor, (dtype, wrong, floor)  # the bound would catch it
    if ranks == 3:  # the toy's parameters do not split evenly over 3 ranks
        assert any(grad.numel() == 0 for rank_res in results
                   for _, _, grad, _ in rank_res[torch.float32]["params"].values())


# Last: 3 and 4 ranks start new pools of ranks; the 2-rank tests above share one.
@pytest.mark.slow
def test_fsdp_three_and_four_ranks_and_hybrid():
    # 3 ranks: unit sizes do not divide by 3, so every unit is padded.
    _check_against_single(launch(_train, 3, ["fsdp"], timeout=120))
    results = launch(_train, 4, ["fsdp", "hybrid"], timeout=120)
    _check_against_single(results)
    for rank_res in launch(_train_clip, 4, True, timeout=120):  # hybrid: shard group of 2
        _check_clip(rank_res)
    # hybrid: shards over 2 ranks, so each rank holds twice the shard of full
    # sharding (element counts; rel=1e-2 covers the padding, < 4 per unit)
    assert results[0]["hybrid"]["shard"] == pytest.approx(2 * results[0]["fsdp"]["shard"], rel=1e-2)
    for name in ("fsdp", "hybrid"):  # every rank ends with the same weights
        for n, p in results[0][name]["params"].items():
            for rr in results[1:]:
                assert torch.equal(p, rr[name]["params"][n])
