"""helpers.sp: sequence layouts and context-parallel attention against full causal attention.

Tolerances.
* float64 on both sides (every function, forward and q/k/v gradients): the
  distributed versions only reorder sums and rescale by exp of log-sum-exp
  differences, each step erring by a few 2^-53 relative to the terms'
  magnitude; sums have <= 64 terms here, so errors stay below ~1e-13 of
  max|reference|. We allow 1e-9 of it, 4 orders above, while a wrong mask,
  a merge that averages, or a lost gradient block errs by O(1) of it.
* fp32 ring forward against a float64 reference computed from the same fp32
  inputs: a score s = q.k / sqrt(d) errs by at most E = gamma_d sum|q_i k_i| / sqrt(d)
  (Higham 2002, eq. 3.5); a softmax weight exp(s - lse) then errs relatively by
  at most 2E (its score and the log-sum-exp, which is a convex mix of scores)
  plus the rounding of exp, log and each merge (a few u per step, cp steps);
  the weighted sum of S values by gamma_S. So
  |o - o64| <= (2E + gamma(S + 8 cp + 8)) * sum_j p_j |v_j|, on any CPU / BLAS.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import launch, rank_info
from helpers.memory import SavedTensorCounter
from helpers.model import Block, GPTConfig
from helpers.tp import count_collectives, gather_dense, tensor_parallel_block
from helpers.sp import (allgather_attention, allreduce_replicated_grads, attention_saved_bytes,
                        block_attention, check_layout, check_ulysses, gather_sequence,
                        merge_partials, positions, ring_attention, ring_forward, ring_wire_bytes,
                        sequence_parallel_block, shard_sequence, ulysses_attention,
                        unmasked_scores)

U32 = 2.0 ** -24
REL64 = 1e-9  # float64 comparisons, see the module docstring
B, H, D = 1, 12, 8  # 12 heads divide over 2, 3 and 4 ranks (Ulysses)
FUNCS = {"allgather": allgather_attention, "ring": ring_attention, "ulysses": ulysses_attention}


def gamma(n, u=U32):
    return n * u / (1 - n * u)


def assert_close64(got, want, what):
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= REL64 * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def inputs(seq, dtype=torch.float64):
    g = torch.Generator().manual_seed(seq)
    return [torch.randn(B, H, seq, D, generator=g, dtype=dtype) for _ in range(4)]  # q k v dO


def reference(q, k, v, d_out, causal=True):
    q, k, v = (x.double().clone().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(d_out.double())
    return o.detach(), q.grad, k.grad, v.grad


# --------------------------------------------------------------------------
# Pure functions: no ranks.
# --------------------------------------------------------------------------

def test_layouts_and_their_errors():
    assert positions(8, 2, 0, "contiguous").tolist() == [0, 1, 2, 3]
    assert positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]   # one early, one late chunk
    assert positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    every = torch.cat([positions(24, 3, r, "zigzag") for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))               # a partition
    with pytest.raises(ValueError, match="sequence length 12 does not divide into 8 chunks"):
        check_layout(12, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        check_layout(8, 2, "striped")
    with pytest.raises(ValueError, match="6 heads do not divide over context-parallel size 4"):
        check_ulysses(6, 4)
    x = torch.arange(8.0).view(1, 1, 8, 1)
    assert shard_sequence(x).tolist() == x.tolist()  # one rank: the whole sequence


def test_zigzag_balances_the_causal_work():
    # Contiguous: rank r computes c(c+1)/2 + r c^2 entries (c = S / cp), growing with r.
    S, cp = 64, 4
    c = S // cp
    assert unmasked_scores(S, cp, "contiguous") == [c * (c + 1) // 2 + r * c * c for r in range(cp)]
    zz = unmasked_scores(S, cp, "zigzag")
    assert len(set(zz)) == 1 and sum(zz) == S * (S + 1) // 2      # equal, and all of them


def test_online_softmax_merge_is_exact_and_averaging_is_not():
    q, k, v, _ = inputs(12)
    full, _, _, _ = reference(q, k, v, torch.zeros_like(q), causal=False)
    o1, l1 = block_attention(q, k[..., :5, :], v[..., :5, :])
    o2, l2 = block_attention(q, k[..., 5:, :], v[..., 5:, :])
    merged, lse = merge_partials(o1, l1, o2, l2)
    assert_close64(merged, full, "merged output")
    assert_close64(lse, torch.logsumexp(q @ k.transpose(-2, -1) / D ** 0.5, -1), "merged lse")
    assert (((o1 + o2) / 2 - full).abs().max() > 1e3 * REL64 * full.abs().max())
    # An empty block (all masked: lse = -inf) contributes nothing.
    none = torch.zeros(12, 5, dtype=torch.bool)
    oe, le = block_attention(q, k[..., :5, :], v[..., :5, :], none)
    assert torch.isinf(le).all() and not oe.any()
    assert torch.equal(merge_partials(oe, le, o2, l2)[0], o2)


@pytest.mark.parametrize("argv, message", [
    (["--world", "1"], "--world must be >= 2"), (["--steps", "0"], "--steps must be >= 1"),
    (["--head-dim", "0"], "--head-dim must be >= 1"),
    (["--seq", "100", "--world", "4"], "sequence length 100 does not divide into 8 chunks"),
    (["--layout", "striped"], "layout must be one of")])
def test_benchmark_refuses_bad_arguments_before_any_rank(argv, message, load_bench, monkeypatch):
    bench = load_bench("bench_sp")
    monkeypatch.setattr(bench, "launch", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(ValueError, match=message):
        bench.main(argv)


# --------------------------------------------------------------------------
# On ranks: every function, both layouts (t = 2, 3, 4; one launch each).
# --------------------------------------------------------------------------

def _run(fn, q, k, v, d_out, layout, causal=True):
    local = [shard_sequence(x, None, layout).requires_grad_() for x in (q, k, v)]
    o = fn(*local, causal=causal, layout=layout)
    o.backward(shard_sequence(d_out, None, layout))
    return [gather_sequence(x, None, layout) for x in (o.detach(), *(t.grad for t in local))]


def _everything():
    t = rank_info().world_size
    out = {}
    q, k, v, d_out = inputs(4 * t)  # zigzag needs 2t chunks: 2 positions each
    for layout in ("contiguous", "zigzag"):
        for name, fn in FUNCS.items():
            out[(name, layout)] = _run(fn, q, k, v, d_out, layout)
    out["ring_no_mask"] = _run(ring_attention, q, k, v, d_out, "zigzag", causal=False)[0]
    q32, k32, v32, d32 = (x.float() for x in (q, k, v, d_out))
    out["ring_fp32"] = _run(ring_attention, q32, k32, v32, d32, "zigzag")[0]
    qb, kb, vb, db = (x.bfloat16() for x in (q, k, v, d_out))
    out["ring_bf16"] = _run(ring_attention, qb, kb, vb, db, "zigzag")[0]
    errors = []
    for fn, args in ((ring_attention, (q[..., :3, :],) * 3),             # local 3: 3t not into 2t
                     (ulysses_attention, (q[:, :t + 1, :4, :],) * 3)):  # t + 1 heads over t
        try:
            fn(*args, layout="zigzag")
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["sp_block"] = _sp_block()
    out["timeline"], out["ring_forward"] = _timeline(q, k, v)
    out["compute_only"] = _compute_only(q, k, v)
    out["saved"] = _saved(q, k, v)
    return out


def _timeline(q, k, v):
    local = [shard_sequence(x, None, "zigzag") for x in (q, k, v)]
    spans = []
    o, _ = ring_forward(*local, layout="zigzag", timeline=spans)
    return spans, gather_sequence(o, None, "zigzag")


def _compute_only(q, k, v):
    """ring_forward(communicate=False): its spans, how many send/receive pairs it posted
    (and the ring, to show the counter counts), and its non-causal output with this
    rank's own Q, K, V next to the local non-causal attention."""
    import helpers.sp.attention.ring as ring_module
    local = [shard_sequence(x, None, "zigzag") for x in (q, k, v)]
    posted, real = [], ring_module.post_pair

    def counting(*args, **kwargs):
        posted.append(args)
        return real(*args, **kwargs)

    ring_module.post_pair = counting          # this rank's fresh process only
    try:
        spans = []
        ring_forward(*local, layout="zigzag", timeline=spans, communicate=False)
        alone = len(posted)
        ring_forward(*local, layout="zigzag")
        ring = len(posted) - alone
    finally:
        ring_module.post_pair = real
    o, _ = ring_forward(*local, causal=False, layout="zigzag", communicate=False)
    want = F.scaled_dot_product_attention(*local)
    return dict(spans=spans, posted=alone, ring_posted=ring, out=o, want=want)


def _saved(q, k, v):
    """Saved bytes per rank: all-gather with materialised scores, and the ring."""
    local = [shard_sequence(x, None, "contiguous").requires_grad_() for x in (q, k, v)]
    out = {}
    for name, fn in (("materialized", lambda: allgather_attention(*local, materialize=True)),
                     ("ring", lambda: ring_attention(*local))):
        with SavedTensorCounter() as c:
            fn()
        out[name] = c.total_bytes
    return out


SP_NAMES = {"c_attn": "attn.c_attn", "attn_proj": "attn.c_proj", "c_fc": "mlp.c_fc",
            "mlp_proj": "mlp.c_proj"}


def _dense_block_and_data(t):
    torch.manual_seed(3)  # same on every rank
    block = Block(GPTConfig(n_head=12, n_embd=48)).double()  # 12 heads: t = 2, 3, 4
    x, dy = torch.randn(2, 4 * t, 48, dtype=torch.float64), torch.randn(2, 4 * t, 48,
                                                                        dtype=torch.float64)
    return block, x, dy


def _sp_block():
    r, t = rank_info().rank, rank_info().world_size
    block, x, dy = _dense_block_and_data(t)
    sp = sequence_parallel_block(block)
    x_local = x.chunk(t, dim=1)[r].clone().requires_grad_()          # (B, T/t, h)
    with count_collectives() as sp_log:
        y = sp(x_local)
        y.backward(dy.chunk(t, dim=1)[r])
    replicated = allreduce_replicated_grads(sp)
    grads = {}
    for name, g in gather_dense(sp, grads=True).items():
        head, _, leaf = name.rpartition(".")
        grads[f"{SP_NAMES.get(head, head)}.{leaf}"] = g
    tp = tensor_parallel_block(block)
    with count_collectives() as tp_log:
        tp(x).backward(dy)
    with SavedTensorCounter(sp) as sp_saved:
        sp(x_local)
    with SavedTensorCounter(tp) as tp_saved:
        tp(x)
    return dict(y=y.detach(), replicated=replicated,
                dx=x_local.grad, grads=grads, sp_log=sp_log.log, tp_log=tp_log.log,
                sp_saved=sp_saved.by_module(), tp_saved=tp_saved.by_module())


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request):
    t = request.param
    res = launch(_everything, t, timeout=120)
    return t, res


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_equals_full_causal_attention_forward_and_gradients(ranks, name, layout):
    t, res = ranks
    want = reference(*inputs(4 * t))
    for rank, out in enumerate(res):
        for what, got, ref in zip(("output", "dq", "dk", "dv"), out[(name, layout)], want):
            assert_close64(got, ref, f"{name} {layout} t={t} rank {rank} {what}")


def fp32_bound(q, k, v, t):
    """The module docstring's bound on |ring fp32 output - float64 reference|."""
    S = q.size(-2)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    p = torch.softmax((q64 @ k64.transpose(-2, -1) / D ** 0.5).masked_fill(
        torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")), -1)
    E = gamma(D) * (q64.abs() @ k64.abs().transpose(-2, -1)).amax(-1, keepdim=True) / D ** 0.5
    return (2 * E + gamma(S + 8 * t + 8)) * (p @ v64.abs())


def test_ring_fp32_and_bf16_within_bound_and_the_mask_matters(ranks):
    t, res = ranks
    q, k, v, d_out = (x.float() for x in inputs(4 * t))  # the ranks' fp32 inputs
    ref, bound = reference(q, k, v, d_out)[0], fp32_bound(q, k, v, t)
    for out in res:
        assert ((out["ring_fp32"].double() - ref).abs() <= bound).all()
    # bf16 inputs: computed in fp32 from the bf16 values, then rounded once to bf16
    # (unit roundoff 2^-8): |o - o64| <= 2^-8 (|o64| + b32) + b32, b32 the fp32 bound.
    qb, kb, vb, db = (x.bfloat16() for x in inputs(4 * t))
    ref, b32 = reference(qb, kb, vb, db)[0], fp32_bound(qb, kb, vb, t)
    for out in res:
        assert out["ring_bf16"].dtype == torch.bfloat16
        assert ((out["ring_bf16"].double() - ref).abs() <= 2 ** -8 * (ref.abs() + b32) + b32).all()
    # The same ring without the causal mask is far outside the float64 tolerance.
    want64 = reference(*inputs(4 * t))[0]
    assert (res[0]["ring_no_mask"] - want64).abs().max() > 1e6 * REL64 * want64.abs().max()


def test_bad_shapes_are_refused_on_every_rank_naming_the_constraint(ranks):
    t, res = ranks
    for out in res:
        assert len(out["errors"]) == 2
        assert f"does not divide into {2 * t} chunks" in out["errors"][0]
        assert f"{t + 1} heads do not divide over context-parallel size {t}" in out["errors"][1]


def test_megatron_sp_block_equals_the_dense_block(ranks):
    t, res = ranks
    block, x, dy = _dense_block_and_data(t)
    x = x.clone().requires_grad_()
    y = block(x)
    y.backward(dy)
    for r, out in enumerate(res):
        sp = out["sp_block"]
        assert_close64(sp["y"], y.detach().chunk(t, dim=1)[r], f"SP output rank {r}")
        assert_close64(sp["dx"], x.grad.chunk(t, dim=1)[r], f"SP dx rank {r}")
        for name, p in block.named_parameters():
            assert_close64(sp["grads"][name], p.grad, f"SP grad {name} rank {r}")
        # the all-reduce of what every rank holds whole: two LayerNorms' weight and bias
        # and the two row-parallel biases, 6h float64 values
        assert sp["replicated"] == 6 * 48 * 8


def test_megatron_sp_same_wire_bytes_as_tp_and_layernorm_activations_split(ranks):
    t, res = ranks
    sp, B, T, h = res[0]["sp_block"], 2, 4 * t, 48
    act = B * T * h * 8                                     # one whole (B, T, h) float64 tensor
    ops = [(c.op, c.direction, c.nbytes) for c in sp["sp_log"]]
    # Per direction: 2 all-gathers of the local piece, 2 reduce-scatters of the whole tensor.
    for direction in ("forward", "backward"):
        assert sorted(o for o in ops if o[1] == direction) == sorted(
            [("all_gather", direction, act // t)] * 2 + [("reduce_scatter", direction, act)] * 2)
    assert [c.op for c in sp["tp_log"]] == ["all_reduce"] * 4
    wire = [sum(ring_wire_bytes(c.op, c.nbytes, t) for c in sp[k]) for k in ("sp_log", "tp_log")]
    assert wire[0] == wire[1] == 4 * 2 * (t - 1) / t * act  # Korthikanti sec. 4.2.2
    # The LayerNorms save their input: (B, T/t, h) under SP, (B, T, h) under TP.
    for ln in ("ln_1", "ln_2"):
        assert sp["tp_saved"][ln] == t * sp["sp_saved"][ln] > 0


def test_ring_timeline_has_one_compute_span_per_block_and_waits_inside_transfers(ranks):
    t, res = ranks
    want = reference(*inputs(4 * t))[0]
    for rank, out in enumerate(res):
        # ring_forward is RingAttention's forward: the same output
        assert_close64(out["ring_forward"], want, f"ring_forward t={t} rank {rank}")
        spans = out["timeline"]
        lanes = [e["lane"] for e in spans]
        assert lanes.count("compute") == t and lanes.count("comm") == lanes.count("wait") == t - 1
        assert all(e["start"] <= e["end"] for e in spans)
        comm = [e for e in spans if e["lane"] == "comm"]
        for c, w in zip(comm, [e for e in spans if e["lane"] == "wait"]):
            assert c["start"] <= w["start"] and w["end"] == c["end"]  # blocked inside the transfer
        names = [e["name"] for e in spans if e["lane"] == "compute"]
        assert names == [f"block of rank {(rank - i) % t}" for i in range(t)]
        # each compute span carries its process's CPU seconds, and only compute spans do
        import os
        threads = os.cpu_count() or 1
        for e in spans:
            assert ("cpu" in e) == (e["lane"] == "compute")
            if "cpu" in e:   # at most every core the whole span (+ 11 ms: a coarse CPU clock)
                assert 0 <= e["cpu"] <= threads * (e["end"] - e["start"]) + 0.011


def test_ring_compute_only_runs_the_same_blocks_without_sending(ranks):
    t, res = ranks
    for rank, out in enumerate(res):
        c = out["compute_only"]
        # the ring posts a send/receive pair per hop; compute-only posts none
        assert c["ring_posted"] == t - 1 and c["posted"] == 0
        # the same blocks in the same order (same names, as the ring's timeline), no transfers
        assert [e["lane"] for e in c["spans"]] == ["compute"] * t
        assert [e["name"] for e in c["spans"]] == [e["name"] for e in out["timeline"]
                                                   if e["lane"] == "compute"]
        # without the causal mask every block is this rank's own K/V, unmasked: merging t
        # equal partial results is the local attention itself (float64 rounding)
        assert_close64(c["out"], c["want"], f"compute-only t={t} rank {rank}")


def test_saved_bytes_per_rank_equal_the_formula_with_and_without_the_scores(ranks):
    t, res = ranks
    S = 4 * t
    for out in res:  # exact: the counter sums storage sizes, the formula counts the same tensors
        assert out["saved"]["materialized"] == attention_saved_bytes(S, t, B, H, D, 8,
                                                                     materialize=True)
        assert out["saved"]["ring"] == attention_saved_bytes(S, t, B, H, D, 8)
    # a formula without the s^2 probabilities would not match the materialised count
    assert attention_saved_bytes(S, t, B, H, D, 8, materialize=True) != \
        attention_saved_bytes(S, t, B, H, D, 8)


# --------------------------------------------------------------------------
# PyTorch's own context parallelism (CUDA only).
# --------------------------------------------------------------------------

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torch_cp_vs_ring():
    from helpers.sp import torch_context_parallel
    t, dev = rank_info().world_size, rank_info().device
    q, k, v, _ = (x.float().to(dev) for x in inputs(4 * t))
    theirs, their_q = torch_context_parallel(q, k, v)
    local = [shard_sequence(x, None, "zigzag") for x in (q, k, v)]
    ours = ring_attention(*local, layout="zigzag")
    return dict(same_layout=torch.equal(their_q, local[0]),
                theirs=gather_sequence(theirs, None, "zigzag"),
                ours=gather_sequence(ours, None, "zigzag"))


@pytest.mark.skipif(GPUS < 2, reason="torch's context_parallel shards SDPA's CUDA kernels only "
                    "(on CPU: 'aten._scaled_dot_product_flash_attention_for_cpu.default does not "
                    "have a sharding strategy registered'); needs 2 GPUs")
def test_equals_pytorch_context_parallel_on_gpus():
    res = launch(_torch_cp_vs_ring, 2, backend="nccl", timeout=120)
    q, k, v, _ = (x.float() for x in inputs(8))
    ref = reference(q, k, v, torch.zeros_like(q))[0]
    # Both are fp32 blocked online softmaxes: the fp32 bound of the module docstring, doubled
    # for the CUDA kernel's own tiles (its merges inside a block add as many roundings as ours).
    bound = 2 * fp32_bound(q, k, v, 2)
    for out in res:
        assert out["same_layout"]  # PyTorch's head-tail layout is our zigzag
        for name in ("theirs", "ours"):
            assert ((out[name].double() - ref).abs() <= bound).all(), name
