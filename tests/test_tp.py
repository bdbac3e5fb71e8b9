"""helpers.tp against the dense layers, the dense GPT, F.cross_entropy and PyTorch's DTensor TP.

Tolerances. Tensor parallelism changes only the order of additions: a
row-parallel layer adds t partial sums with an all-reduce, a column-parallel
layer's input gradient likewise. Two kinds of comparison:

* single layers in fp32 against a float64 reference computed from the same
  fp32 numbers (their products are exact in float64): each result is a sum of
  n terms, so for ANY summation order |error| <= gamma_n * sum|terms| with
  gamma_n = n u / (1 - n u), u = 2^-24 (Higham 2002, "Accuracy and Stability
  of Numerical Algorithms", sec. 3.1, eq. 3.5). That bound holds on every CPU
  and BLAS, however they block or vectorize the sum.
* whole blocks / GPTs in float64 on both sides: each sum of n <= 512 terms
  errs by at most ~n 2^-53 ~ 6e-14 of the terms' magnitude per layer; we allow
  1e-9 of max|reference|, 4 orders above that, while any wrong split,
  missing or doubled reduction errs by O(1) of it.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import launch, rank_info
from helpers.model import GPTConfig, build_model
from helpers.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                        count_collectives, gather_dense, padded_vocab_size, shard,
                        tensor_parallel_block, tensor_parallel_gpt, tp_comm_bytes, tp_plan,
                        unshard, vocab_parallel_cross_entropy)

U32 = 2.0 ** -24
REL64 = 1e-9  # float64 comparisons, see the module docstring


def gamma(n):
    return n * U32 / (1 - n * U32)


def assert_within(got, ref64, bound, what):
    err = (got.double() - ref64).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g}"


def assert_close64(got, want, what):
    scale = max(want.abs().max().item(), 1e-300)
    err = (got - want).abs().max().item()
    assert err <= REL64 * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


# --------------------------------------------------------------------------
# Pure functions: no ranks.
# --------------------------------------------------------------------------

def test_shard_unshard_round_trip_and_qkv_parts():
    w = torch.arange(24.0).reshape(12, 2)
    shards = [shard(w, 0, 2, r, parts=3) for r in range(2)]
    # parts=3: rank 0 has the first half of each of the 3 blocks of 4 rows
    assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert torch.equal(unshard(shards, 0, parts=3), w)
    cols = [shard(w.T, 1, 4, r) for r in range(4)]
    assert torch.equal(unshard(cols, 1), w.T)
    # the refusal names the parts only where there are several (chapter 09's QKV)
    with pytest.raises(ValueError,
                       match=r"^dim 0 of size 10 does not divide over tensor-parallel size 4$"):
        shard(torch.zeros(10, 4), 0, 4, 0)
    with pytest.raises(ValueError,
                       match="does not divide into 3 parts over tensor-parallel size 2"):
        shard(torch.zeros(9, 4), 0, 2, 0, parts=3)


def test_tp_plan_names_the_constraint_before_any_rank_starts():
    cfg = GPTConfig(n_head=24, n_embd=48 * 24, vocab_size=64)
    with pytest.raises(ValueError, match="24 heads do not divide over tensor-parallel size 5"):
        tp_plan(cfg, 5)
    with pytest.raises(ValueError, match="tensor-parallel size must be a positive int"):
        tp_plan(cfg, 0)
    with pytest.raises(ValueError, match="dropout"):
        tp_plan(GPTConfig(dropout=0.1), 2)
    plan = tp_plan(GPTConfig(vocab_size=10, n_head=4, n_embd=32), 4)  # vocab padded, not refused
    assert (plan.vocab_padded, plan.vocab, plan.heads, plan.mlp) == (12, 3, 1, 32)
    assert padded_vocab_size(50257, 8, divisible_by=128) == 51200  # Megatron's GPT-2 padding
    assert tp_comm_bytes(GPTConfig(), 2, 8, 1) == {}


@pytest.mark.parametrize("argv, message", [
    (["--size", "huge"], "--size must be one of"), (["--seq", "0"], "--seq must be in"),
    (["--steps", "1"], "--steps must be >= 2"), (["--world", "1"], "--world must be >= 2"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--world", "3"], "4 heads do not divide over tensor-parallel size 3")])
def test_benchmark_refuses_bad_arguments_before_any_rank(argv, message, load_bench):
    with pytest.raises(ValueError, match=message):
        load_bench("bench_tp").main(argv)


def test_world_size_one_is_the_plain_layer():
    # No process group: t = 1, every operator is the identity, same arithmetic as dense.
    torch.manual_seed(0)
    lin, x = nn.Linear(6, 4), torch.randn(3, 6)
    col, row = ColumnParallelLinear.from_dense(lin), RowParallelLinear.from_dense(lin)
    assert torch.equal(col(x), lin(x)) and torch.equal(row(x), lin(x))
    # The whole GPT at t = 1, forward and every gradient. The loss is computed by a
    # different formula (vocab_parallel_cross_entropy vs F.cross_entropy), so compare
    # in float64 (module docstring).
    model = build_model("toy").double()
    idx = torch.randint(0, 64, (2, 8))
    tp = tensor_parallel_gpt(model)
    lt, ld = tp(idx, idx)[1], model(idx, idx)[1]
    assert_close64(lt.detach(), ld.detach(), "loss at t = 1")
    lt.backward()
    ld.backward()
    got = gather_dense(tp, grads=True)
    for name, p in model.named_parameters():
        assert_close64(got[name], p.grad, f"t = 1 grad {name}")


def test_tied_lm_head_shares_the_vocab_parallel_embedding_weight():
    """One tensor, two uses, as wte / lm_head in the dense GPT; built through
    ColumnParallelLinear's public ``weight=``, drawing no random numbers."""
    from helpers.tp import tied_lm_head
    wte = VocabParallelEmbedding(10, 4, padded_num_embeddings=12)
    state = torch.random.get_rng_state()
    head = tied_lm_head(wte)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert head.weight is wte.weight and head.bias is None and head.name == "lm_head"
    assert (head.in_features, head.out_features, head.gather_output) == (4, 12, False)
    x = torch.randn(3, 4)
    assert torch.equal(head(x), F.linear(x, wte.weight))
    with pytest.raises(ValueError, match="shared weight of shape"):
        ColumnParallelLinear(4, 10, bias=False, weight=wte.weight)
    with pytest.raises(ValueError, match="no dense layer, no bias"):
        ColumnParallelLinear(4, 12, weight=wte.weight)


# --------------------------------------------------------------------------
# Single layers in fp32, bounded against float64 (t = 2, 4).
# --------------------------------------------------------------------------

def _layers_fp32():
    r = rank_info()
    t = r.world_size
    torch.manual_seed(1)  # same on every rank: same dense layers, inputs, upstream grads
    lin = nn.Linear(16, 8 * t)
    x = torch.randn(5, 16)
    dy = torch.randn(5, 8 * t)
    out = {}
    # Column-parallel, output gathered: forward, dx, dW (gathered), db (gathered)
    col = ColumnParallelLinear.from_dense(lin, gather_output=True)
    xc = x.clone().requires_grad_()
    y = col(xc)
    y.backward(dy)
    g = gather_dense(col, grads=True)
    out["col"] = (y.detach(), xc.grad, g["weight"], g["bias"])
    # Row-parallel on the whole input (it keeps its slice): y = g(x_r W_r^T) + b
    row_lin = nn.Linear(8 * t, 16)
    xr = dy.clone().requires_grad_()  # reuse (5, 8t) as input
    dz = torch.randn(5, 16)
    row = RowParallelLinear.from_dense(row_lin, input_is_parallel=False)
    z = row(xr)
    z.backward(dz)
    g = gather_dense(row, grads=True)
    out["row"] = (z.detach(), xr.grad, g["weight"], g["bias"])
    # Layer sizes that do not divide are refused, naming the constraint
    errors = []
    for make in (lambda: ColumnParallelLinear(4, 8 * t + 1),
                 lambda: RowParallelLinear(8 * t + 1, 4),
                 lambda: VocabParallelEmbedding(8 * t + 1, 4)):
        try:
            make()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["dense"] = (lin.weight.detach(), lin.bias.detach(), row_lin.weight.detach(),
                    row_lin.bias.detach(), x, dy, dz)
    return out


def test_column_and_row_parallel_match_dense_within_fp32_bound(ranks):
    t, res = ranks["t"], ranks["layers"]
    W, b, W2, b2, x, dy, dz = (v.double() for v in res[0]["dense"])
    n_tok = x.size(0)
    for out in res:
        y, dx, dW, db = out["col"]
        # forward: each output is a dot of length 16 plus the bias (no reduction over ranks)
        assert_within(y, x @ W.T + b, gamma(17) * (x.abs() @ W.abs().T + b.abs()), "col y")
        # dx sums over 8t output features: 8 per rank, then t partials by all-reduce
        assert_within(dx, dy @ W, gamma(8 * t + t) * (dy.abs() @ W.abs()), "col dx")
        assert_within(dW, dy.T @ x, gamma(n_tok) * (dy.abs().T @ x.abs()), "col dW")
        assert_within(db, dy.sum(0), gamma(n_tok) * dy.abs().sum(0), "col db")
        z, dxr, dW2, db2 = out["row"]
        # forward: 8t products split over t ranks, partials all-reduced, bias added once
        assert_within(z, dy @ W2.T + b2, gamma(8 * t + t + 1) * (dy.abs() @ W2.abs().T + b2.abs()),
                      "row y")
        assert_within(dxr, dz @ W2, gamma(16) * (dz.abs() @ W2.abs()), "row dx")
        assert_within(dW2, dz.T @ dy, gamma(n_tok) * (dz.abs().T @ dy.abs()), "row dW")
        assert_within(db2, dz.sum(0), gamma(n_tok) * dz.abs().sum(0), "row db")
    assert len(res[0]["errors"]) == 3
    assert all(f"divide over tensor-parallel size {t}" in e for e in res[0]["errors"])
    # The bound is tight enough to see a bias added on every rank: that adds (t-1) b.
    assert ((t - 1) * b2.abs() > gamma(8 * t + t + 1) * (dy.abs() @ W2.abs().T + b2.abs())).any()


# --------------------------------------------------------------------------
# Embedding and the vocab-parallel loss (t = 2, 4).
# --------------------------------------------------------------------------

def _embedding_and_loss():
    torch.manual_seed(2)
    t = rank_info().world_size
    V, h, N = 10, 4, 12  # V = 10 does not divide over 4: padded to 12
    emb = nn.Embedding(V, h)
    idx = torch.randint(0, V, (3, 4))
    pe = VocabParallelEmbedding.from_dense(emb, padded_num_embeddings=padded_vocab_size(V, t))
    e = pe(idx)
    e.backward(torch.ones_like(e))
    emb_grad = gather_dense(pe, grads=True)["weight"]
    # Loss on large logits (fp32 exp overflows past 88.7) with ignored targets
    logits = torch.randn(N, 2 * t) * 1e4
    targets = torch.randint(0, 2 * t, (N,))
    targets[::4] = -100
    n = 2
    mine = logits[:, rank_info().rank * n:(rank_info().rank + 1) * n].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets)
    loss.backward()
    return dict(e=e.detach(), emb_grad=emb_grad, emb=emb.weight.detach(), idx=idx,
                loss=loss.detach(), grad=mine.grad, logits=logits, targets=targets)


def test_vocab_parallel_embedding_and_cross_entropy(ranks):
    res = ranks["embedding"]
    r0 = res[0]
    # Embedding: a lookup plus adding t-1 zeros: exact
    want = F.embedding(r0["idx"], r0["emb"])
    want_grad = torch.zeros_like(r0["emb"]).index_add_(0, r0["idx"].reshape(-1),
                                                       torch.ones(r0["idx"].numel(), 4))
    logits = r0["logits"].double().requires_grad_()
    ref = F.cross_entropy(logits, r0["targets"])
    ref.backward()
    assert torch.isinf(torch.logsumexp(r0["logits"][:1].exp(), -1)).item() or \
        torch.isinf(r0["logits"].exp()).any()  # the naive formula overflows here
    # Loss = log(sum exp(z - m)) - (z_t - m): shift, exp, a sum of V terms, log:
    # each step is off by <= a few u of a quantity <= max|z| + log V; V + 4 of them.
    V = logits.size(1)
    bound = gamma(V + 4) * (logits.abs().max().item() + torch.log(torch.tensor(V * 1.0)).item())
    for r, out in enumerate(res):
        assert torch.equal(out["e"], want)
        assert torch.equal(out["emb_grad"], want_grad)
        assert abs(out["loss"].item() - ref.item()) <= bound, (out["loss"], ref)
        # grad = (softmax - onehot) / n_valid: each entry within a few u of 1 / n_valid
        mine = logits.grad[:, r * 2:(r + 1) * 2]
        assert_within(out["grad"], mine, gamma(V + 4) * torch.ones_like(mine), f"rank {r} dlogits")
        assert torch.equal(out["grad"][::4], torch.zeros_like(out["grad"][::4]))  # ignored rows


# --------------------------------------------------------------------------
# Blocks and the GPT in float64 (t = 2, 4), counted collectives.
# --------------------------------------------------------------------------

CFG = dict(vocab_size=30, block_size=16, n_layer=2, n_head=4, n_embd=16)  # 30 pads over 4


def _gpt_steps(steps=3, lr=0.1):
    t = rank_info().world_size
    dense = build_model(GPTConfig(**CFG), seed=3).double()
    tp = tensor_parallel_gpt(dense)
    opt_d = torch.optim.SGD(dense.parameters(), lr=lr, momentum=0.9)
    opt_t = torch.optim.SGD(tp.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    B, T = 2, 8
    losses, counted = [], None
    for step in range(steps):
        idx = torch.randint(0, CFG["vocab_size"], (B, T), generator=gen)
        targets = torch.randint(0, CFG["vocab_size"], (B, T), generator=gen)
        if step == 1:
            targets[0, :2] = -100  # ignored tokens (the dense loss ignores them too)
        for opt in (opt_d, opt_t):
            opt.zero_grad()
        _, ld = dense(idx, targets)
        ld.backward()
        with count_collectives() as c:
            _, lt = tp(idx, targets)
            lt.backward()
        if step == 0:
            counted = c.table()
        grads = (gather_dense(tp, grads=True), {n: p.grad for n, p in dense.named_parameters()})
        opt_d.step()
        opt_t.step()
        losses.append((lt.item(), ld.item()))
    params = (gather_dense(tp), {n: p.detach() for n, p in dense.named_parameters()})
    return dict(losses=losses, grads=grads, params=params, counted=counted, t=t, B=B, T=T)


def test_tp_gpt_equals_dense_over_sgd_steps_and_counts_collectives(ranks):
    t, res = ranks["t"], ranks["gpt"]
    for r, out in enumerate(res):
        for lt, ld in out["losses"]:
            assert abs(lt - ld) <= REL64 * abs(ld), (r, lt, ld)
        for kind in ("grads", "params"):
            got, want = out[kind]
            assert got.keys() == want.keys()
            for name in want:
                assert_close64(got[name], want[name], f"rank {r} {kind} {name}")
        # Collectives: exactly the formula, per layer and direction (Shoeybi et al. 2019, sec. 3)
        formula = tp_comm_bytes(GPTConfig(**CFG), out["B"], out["T"], t, dtype_bytes=8)
        got = {}
        for (layer, direction, op), (n, nbytes) in out["counted"].items():
            got[(layer, direction)] = got.get((layer, direction), 0) + nbytes
        assert got == formula
        for i in range(CFG["n_layer"]):
            per_block = {k: v for k, v in out["counted"].items() if k[0].startswith(f"blocks.{i}.")}
            fwd = sum(n for (_, d, op), (n, _) in per_block.items() if d == "forward")
            bwd = sum(n for (_, d, op), (n, _) in per_block.items() if d == "backward")
            assert (fwd, bwd) == (2, 2) and all(op == "all_reduce" for _, _, op in per_block)


# --------------------------------------------------------------------------
# PyTorch's own tensor parallelism (DTensor) on the same block, and in a sub-group.
# --------------------------------------------------------------------------

def _vs_dtensor():
    from helpers.tp.transformer import torch_tp_block
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(5)
    block = build_model(GPTConfig(**CFG), seed=3).blocks[0].double()
    with torch.no_grad():  # non-zero biases and LayerNorm affines (GPT init has zeros / ones)
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 8, CFG["n_embd"], dtype=torch.float64)
    dy = torch.randn_like(x)
    out = {}
    for name, make in (("ours", tensor_parallel_block), ("dtensor", torch_tp_block)):
        m = make(block)
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy)
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 for n, p in m.named_parameters()}
        if name == "ours":
            grads = gather_dense(m, grads=True)
        else:  # back to the dense row order of c_attn
            for key in ("attn.c_attn.weight", "attn.c_attn.bias"):
                g = torch.empty_like(grads[key])
                g[m.attn.qkv_perm] = grads[key]
                grads[key] = g
        out[name] = (y.detach(), xi.grad, grads)
    # loss_parallel: cross-entropy on vocab-sharded logits
    t, r = rank_info().world_size, rank_info().rank
    logits = torch.randn(6, 4 * t, dtype=torch.float64)
    targets = torch.tensor([0, 1, 4 * t - 1, -100, 3, 2])
    mine = logits[:, 4 * r:4 * (r + 1)].clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(mine, targets)
    ours.backward()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (t,))
    theirs_in = logits[:, 4 * r:4 * (r + 1)].clone().requires_grad_()
    dt = DTensor.from_local(theirs_in, mesh, [Shard(1)])
    with loss_parallel():
        theirs = F.cross_entropy(dt, targets)
        theirs.backward()
    out["loss"] = (ours.detach(), mine.grad, theirs.full_tensor().detach(), theirs_in.grad)
    return out


def test_same_block_as_pytorch_dtensor_tp_and_loss_parallel(ranks):
    res = ranks["dtensor"]
    for out in res:
        y, dx, grads = out["ours"]
        y2, dx2, grads2 = out["dtensor"]
        assert_close64(y, y2, "output")
        assert_close64(dx, dx2, "input grad")
        assert grads.keys() == grads2.keys()
        for name in grads:
            assert_close64(grads[name], grads2[name], name)
        ours, g, theirs, g2 = out["loss"]
        assert_close64(ours, theirs, "loss")
        assert_close64(g, g2, "loss grad")


def _in_subgroups():
    import torch.distributed as dist
    r = rank_info().rank
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[r // 2]
    torch.manual_seed(10 + r // 2)  # each TP pair has its own block and data
    block = build_model(GPTConfig(**CFG), seed=3 + r // 2).blocks[1].double()
    x = torch.randn(2, 4, CFG["n_embd"], dtype=torch.float64)
    with count_collectives() as c:
        y = tensor_parallel_block(block, group)(x)
    return y.detach(), block(x).detach(), c.count(op="all_reduce")


def test_tp_in_a_sub_group_of_a_larger_world(ranks):
    if ranks["t"] != 4:
        pytest.skip("two groups of 2 need a world of 4")
    res = ranks["subgroups"]
    for y, want, n in res:
        assert_close64(y, want, "block output")
        assert n == 2
    assert not torch.allclose(res[0][0], res[2][0])  # the two pairs really differ


def _everything():
    out = dict(layers=_layers_fp32(), embedding=_embedding_and_loss(), gpt=_gpt_steps(),
               dtensor=_vs_dtensor())
    if rank_info().world_size == 4:
        out["subgroups"] = _in_subgroups()
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    """Every rank function above, in one launch per world size (a pool of ranks
    costs seconds to start; pytest groups the tests by this fixture's t)."""
    t = request.param
    res = launch(_everything, t, timeout=240)
    return {"t": t, **{k: [r[k] for r in res] for k in res[0]}}


def test_tp_comm_time_is_nccls_ring_from_the_network_model():
    # chapter 09 prices TP with the one network model (helpers.costs.network): inside a
    # node it is chapter 03's ring on NVLink; across nodes NCCL's ring per NIC, and a
    # group strided one GPU per node gets one NIC (every hop over the network)
    from helpers.costs import network
    from helpers.tp.cost import (LINKS, tp_comm_time, tp_efficiency, tp_layer_comm_time,
                                 tp_topology)

    h, tokens = 4096, 4096
    for t in (2, 4, 8):
        assert tp_comm_time(h, tokens, t) == pytest.approx(
            tp_layer_comm_time(h, tokens, t, LINKS["nvlink"]), rel=1e-12)
    for t, stride in ((16, 1), (16, 8), (32, 1)):
        topo = tp_topology(t, stride)
        assert topo.world_size >= (t - 1) * stride + 1
        want = 4 * network.ring_time(topo, "all_reduce", tokens * h * 2, t, stride)
        assert tp_comm_time(h, tokens, t, stride=stride) == pytest.approx(want, rel=1e-12)
        lat, bw = tp_comm_time(h, tokens, t, stride=stride, parts=True)
        assert lat == pytest.approx(4 * network.ring_latency(topo, "all_reduce", t, stride))
        assert lat + bw == pytest.approx(want)
    # one NIC per group costs more than a NIC per GPU of the node
    assert tp_efficiency(16, h, tokens, 2048, stride=8) < tp_efficiency(16, h, tokens, 2048)
    assert tp_comm_time(h, tokens, 1) == 0.0
