"""helpers.moe: routing, capacity, the aux losses, and expert parallelism vs one process.

Equality tests run in float64 on both sides: the EP layer and the single
process compute the same sums, possibly in another order (a GEMM over T/P
rows instead of T, router gradients summed over ranks). Reordering a sum of
n terms of size <= S moves it by at most ~n * eps64 * S; n is a few hundred
here, so 1e-12 relative to the largest magnitude is 10x above that bound and
far below any real mistake (a wrong gate or a lost row changes values by O(1)).
"""

import math

import pytest
import torch
import torch.distributed as dist

from helpers import launch, rank_info
from helpers.moe import (MoEConfig, MoELayer, capacity_keep, expert_capacity,
                         load_balancing_loss, moe_aux_loss, route, router_z_loss)

H, F, T_RANK = 8, 16, 12   # hidden, expert hidden, tokens per rank


def _close(a, b, what):
    tol = 1e-12 * max(1.0, b.abs().max().item())   # see the module docstring
    err = (a - b).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


# --------------------------------------------------------------------------- single process

def _loop_reference(layer, x):
    """Token by token, from the definitions (no sorting, no index_add)."""
    logits = layer.router(x)
    probs, gates, experts = route(logits, layer.cfg.top_k)
    C = None if layer.cfg.capacity_factor is None else expert_capacity(
        x.size(0), layer.cfg.num_experts, layer.cfg.top_k, layer.cfg.capacity_factor)
    keep = capacity_keep(experts, layer.cfg.num_experts, C)
    rows = []
    for t in range(x.size(0)):
        y = torch.zeros_like(x[t])
        for j in range(layer.cfg.top_k):
            if keep[t, j]:
                y = y + gates[t, j] * layer.experts[int(experts[t, j])](x[t])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k, cf, padded", [(1, None, False), (2, None, False),
                                               (1, 1.0, False), (2, 0.5, False),
                                               (1, 1.0, True), (2, 0.5, True)])
def test_layer_equals_token_loop(top_k, cf, padded):
    torch.manual_seed(0)
    layer = MoELayer(H, F, 4, top_k=top_k, capacity_factor=cf, padded=padded).double()
    x = torch.randn(20, H, dtype=torch.float64)
    y, stats = layer(x)
    _close(y, _loop_reference(layer, x), "layer vs token loop")
    assert stats.dropped == int((~stats.kept).sum())
    if cf is not None:
        assert stats.dropped > 0  # the cases are chosen so capacity bites


def test_top2_gates_renormalized_top1_raw():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs, g1, e1 = route(logits, 1)
    assert e1.tolist() == [[0]] and torch.equal(g1, probs[:, :1])  # Switch: raw probability
    _, g2, e2 = route(logits, 2)
    assert e2.tolist() == [[0, 1]]
    assert torch.allclose(g2, probs[:, :2] / probs[:, :2].sum(), rtol=0, atol=1e-7)  # fp32 ulps
    assert abs(g2.sum().item() - 1) < 1e-6


def test_capacity_first_choices_first_in_token_order():
    # 4 tokens, 2 experts, top-2; capacity 2 per expert.
    experts = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    keep = capacity_keep(experts, 2, 2)
    # expert 0: first choices of tokens 0, 1 fill it; token 2's first choice dropped,
    # token 3's second choice dropped. expert 1: token 3's first choice comes before
    # any second choice, then token 0's second choice; tokens 1, 2 second choices dropped.
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    assert expert_capacity(tokens=10, num_experts=4, top_k=2, capacity_factor=1.25) == 7  # ceil(6.25)


def test_load_balancing_loss_by_hand_and_uniform_minimum():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    idx = torch.tensor([[0], [1], [0], [2]])
    # f = (2/4, 1/4, 1/4); P = (1.5/4, 1.25/4, 1.25/4); 3 * sum f_i P_i
    want = 3 * (0.5 * 0.375 + 0.25 * 0.3125 + 0.25 * 0.3125)
    assert abs(load_balancing_loss(probs, idx, 3).item() - want) < 1e-6  # fp32 of 4 products
    # uniform router, every expert picked equally often: the minimum, 1 (exact in binary)
    E = 4
    uniform = torch.full((8, E), 1 / E)
    assert load_balancing_loss(uniform, torch.arange(8).remainder(E).view(8, 1), E).item() == 1.0
    # collapsed routing onto expert 0 with a confident router: E * 1 * p
    collapsed = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).repeat(8, 1)
    got = load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), E).item()
    assert abs(got - 4 * 0.97) < 1e-6
    # top-2: f counts both choices
    idx2 = torch.tensor([[0, 1]] * 8)
    assert abs(load_balancing_loss(uniform, idx2, E).item() - 1.0) < 1e-6


def test_z_loss_formula():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    want = (math.log(2) ** 2 + math.log(math.e + math.e ** 2) ** 2) / 2  # ST-MoE eq. 5
    assert abs(router_z_loss(logits).item() - want) < 1e-14


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=6, ep_size=4), "6 experts do not divide over expert-parallel size 4"),
    (dict(num_experts=4, top_k=5), "top_k=5 is larger than num_experts=4"),
    (dict(num_experts=4, capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(num_experts=4, capacity_factor=-1.0), "capacity_factor must be > 0"),
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(num_experts=4, padded=True), "padded dispatch needs a capacity_factor"),
])
def test_bad_config_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(hidden=H, ffn_hidden=F, **kwargs)
    if "ep_size" not in kwargs:
        with pytest.raises(ValueError, match=match):
            MoELayer(H, F, **kwargs)


def test_aux_loss_reaches_router():
    torch.manual_seed(0)
    layer = MoELayer(H, F, 4)
    layer(torch.randn(16, H))
    moe_aux_loss(layer).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in layer.experts.parameters())  # aux losses touch only the router


# --------------------------------------------------------------------------- expert parallelism

def _inputs(world, T=T_RANK):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    w = torch.randn(world * T, H, generator=g, dtype=torch.float64)  # loss = sum(y * w)
    return x, w


def _ep_rank(E, top_k, cf, padded=False):
    r = rank_info()
    x, w = _inputs(r.world_size)
    lo, hi = r.rank * T_RANK, (r.rank + 1) * T_RANK
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, top_k=top_k, capacity_factor=cf, ep_group=dist.group.WORLD,
                     padded=padded).double()
    xs = x[lo:hi].clone().requires_grad_()
    y, st = layer(xs)
    (y * w[lo:hi]).sum().backward()
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)       # replicated weight: partial gradients summed, as DP does
    # expected bytes: kept choices whose expert lives on another rank, hidden * 8 bytes each
    _, _, experts = route(layer.router(xs.detach()), top_k)
    owner = experts // (E // r.world_size)
    remote = int(((owner != r.rank) & st.kept).sum())
    return dict(y=y.detach(), xgrad=xs.grad, router_grad=router_grad, kept=st.kept,
                ids=layer.expert_ids, dropped=st.dropped,
                expert_grads=[[p.grad for p in e.parameters()] for e in layer.experts],
                bytes=(st.dispatch_bytes, st.combine_bytes), want_bytes=remote * H * 8,
                recv=st.recv_splits, send=st.send_splits, padding=st.padding_bytes,
                capacity=st.capacity)


def _single(world, E, top_k, cf):
    x, w = _inputs(world)
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, top_k=top_k, capacity_factor=cf).double()
    x = x.clone().requires_grad_()
    # capacity counts one rank's batch (a GShard group): one call per rank's chunk
    outs = [layer(chunk) for chunk in x.split(T_RANK)]
    y = torch.cat([o for o, _ in outs])
    (y * w).sum().backward()
    return layer, x, y.detach(), torch.cat([s.kept for _, s in outs])


def _compare_ep(world, E, top_k, cf, padded=False):
    res = launch(_ep_rank, world, E, top_k, cf, padded)
    layer, x, y, kept = _single(world, E, top_k, cf)
    _close(torch.cat([r["y"] for r in res]), y, "output")
    _close(torch.cat([r["xgrad"] for r in res]), x.grad, "input gradient")
    for r in res:
        _close(r["router_grad"], layer.router.weight.grad, "router gradient")
        for e, grads in zip(r["ids"], r["expert_grads"]):
            for g, p in zip(grads, layer.experts[e].parameters()):
                if padded and p.grad is None:  # padded: every expert ran, on zeros at least
                    assert not g.any(), f"expert {e}: gradient from padding alone"
                    continue
                assert (g is None) == (p.grad is None), f"expert {e}: gradient presence differs"
                if g is not None:
                    _close(g, p.grad, f"expert {e} gradient")
        if padded:  # every rank sends E/P * C rows to every other rank, whatever the routing
            C = r["capacity"]
            assert r["send"] == r["recv"] == [E // world * C] * world
            assert r["bytes"] == ((world - 1) * (E // world) * C * H * 8,) * 2
            assert r["padding"] == r["bytes"][0] - r["want_bytes"] >= 0  # full buffers: none
            continue
        assert r["bytes"][0] == r["want_bytes"], (r["bytes"], r["want_bytes"])
        assert sum(r["send"]) == int(r["kept"].sum())
    assert torch.equal(torch.cat([r["kept"] for r in res]), kept), "different tokens dropped"
    if padded:
        return res
    # what rank q sends to rank p is what p receives from q; combine returns it
    for p, r in enumerate(res):
        assert r["recv"] == [res[q]["send"][p] for q in range(world)]
        assert r["bytes"][1] == sum(n for q, n in enumerate(r["recv"]) if q != p) * H * 8
    return res


@pytest.mark.parametrize("top_k, cf", [(1, None), (2, None), (1, 1.0), (2, 0.75)])
def test_ep_two_ranks_equals_single_process(top_k, cf):
    res = _compare_ep(2, 4, top_k, cf)
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0   # capacity really dropped tokens
    assert all(r["want_bytes"] > 0 for r in res)    # and tokens really crossed ranks


@pytest.mark.parametrize("world, E, top_k, cf", [(2, 4, 2, 0.75), (4, 8, 1, 1.0)])
def test_padded_ep_equals_single_process_and_counts_padding(world, E, top_k, cf):
    """Fixed (E, C, H) buffers and equal all-to-alls: the kept tokens' outputs and every
    gradient equal the single process's dropless layer with the same capacity (float64,
    the module docstring's bound); bytes and padding bytes equal the formula exactly."""
    res = _compare_ep(world, E, top_k, cf, padded=True)
    assert sum(r["dropped"] for r in res) > 0 and sum(r["padding"] for r in res) > 0


@pytest.mark.parametrize("top_k, cf", [(2, None), (1, 1.0)])
def test_ep_four_ranks_equals_single_process(top_k, cf):
    res = _compare_ep(4, 8, top_k, cf)
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0


# --------------------------------------------------------------------------- in the course GPT

def _gpt_ep_rank():
    from helpers.model import build_model
    from helpers.moe import apply_ep, apply_moe
    r = rank_info()
    idx = torch.randint(0, 64, (2 * r.world_size, 16), generator=torch.Generator().manual_seed(3))
    mine = idx.chunk(r.world_size)[r.rank]
    model = apply_moe(build_model("toy", n_layer=2), num_experts=4, top_k=2, every=2)
    model = apply_ep(model.double(), dist.group.WORLD)
    logits, loss = model(mine, mine)
    (loss / r.world_size).backward()   # the global mean loss is the mean of equal-sized ranks'
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if ".experts." not in name:
            dist.all_reduce(g)         # replicated: DP's gradient sum
        grads[name] = g
    return logits.detach(), grads, model.blocks[1].mlp.expert_ids


def test_gpt_moe_switch_and_ep_equal_single_process():
    from helpers.model import build_model
    from helpers.moe import apply_moe, moe_n_params
    dense = build_model("toy")
    sparse = apply_moe(build_model("toy", n_layer=2), num_experts=4, every=2)
    assert type(sparse.blocks[0].mlp).__name__ == "MLP"            # block 0 stays dense
    assert isinstance(sparse.blocks[1].mlp, MoELayer)               # every 2nd block is MoE
    n_moe = moe_n_params(sparse.config, num_experts=4, every=2)
    assert sum(p.numel() for p in sparse.parameters()) == n_moe
    assert n_moe > dense.config.n_params() == sum(p.numel() for p in dense.parameters())
    with pytest.raises(ValueError, match="top_k=3 is larger than num_experts=2"):
        apply_moe(build_model("toy"), num_experts=2, top_k=3)

    res = launch(_gpt_ep_rank, 2)
    model = apply_moe(build_model("toy", n_layer=2), num_experts=4, top_k=2, every=2).double()
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    logits, loss = model(idx, idx)
    loss.backward()
    _close(torch.cat([r[0] for r in res]), logits.detach(), "GPT logits")
    for logits_r, grads, ids in res:
        for name, p in model.named_parameters():
            if ".experts." in name:   # rank-local index j -> global expert ids[j]
                head, rest = name.split(".experts.")
                j, tail = rest.split(".", 1)
                name_r = f"{head}.experts.{ids.index(int(j))}.{tail}" if int(j) in ids else None
                if name_r is None:
                    continue
                _close(grads[name_r], p.grad, name)
            else:
                _close(grads[name], p.grad, name)


def test_apply_moe_is_seeded_and_touches_only_the_mlps_it_replaces():
    from helpers.model import build_model
    from helpers.moe import apply_moe
    dense = build_model("toy", n_layer=4)
    torch.manual_seed(123)     # the global RNG does not matter
    a = apply_moe(build_model("toy", n_layer=4), num_experts=4, every=2, seed=1)
    b = apply_moe(build_model("toy", n_layer=4), num_experts=4, every=2, seed=1)
    assert [isinstance(blk.mlp, MoELayer) for blk in a.blocks] == [False, True, False, True]
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    for name, p in dense.named_parameters():   # the dense weights are the dense model's
        if not name.startswith(("blocks.1.mlp", "blocks.3.mlp")):
            assert torch.equal(p, a.get_parameter(name)), name
    with pytest.raises(ValueError, match="already an MoE layer"):
        apply_moe(a, num_experts=4, every=2)
    with pytest.raises(ValueError, match="every must be a positive int"):
        apply_moe(dense, every=0)


def test_aux_loss_evens_out_the_load_of_a_trained_router():
    """The course's collapse demo, measured: 300 steps of a one-block, 16-wide toy GPT
    (its MLP 8 experts, top-1) on the Markov language without and with the aux loss
    (alpha = 1e-2). This is a property of training dynamics, not arithmetic; here the
    load's coefficient of variation over the last 20 steps is ~0.8 without and ~0.6
    with it, so we assert only the direction."""
    from helpers.data import make_dataset
    from helpers.model import build_model
    from helpers.moe import apply_moe, moe_stats

    def last_cv(aux_weight, steps=300):
        data = make_dataset(num_sequences=512, seq_len=16)
        model = apply_moe(build_model("toy", seed=0, n_layer=1, n_embd=16, n_head=1),
                          num_experts=8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        g = torch.Generator().manual_seed(0)
        shares = []
        for _ in range(steps):
            x, y = data.batch(torch.randint(0, len(data), (8,), generator=g))
            _, loss = model(x, y)
            (loss + moe_aux_loss(model, aux_weight=aux_weight, z_weight=1e-3)).backward()
            opt.step()
            opt.zero_grad()
            load = moe_stats(model)[0].tokens_per_expert.float()
            shares.append(load / load.sum())
        last = torch.stack(shares[-20:]).mean(0)
        return (last.std() / last.mean()).item()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a toy model: threads only add synchronization
    try:
        without, with_aux = last_cv(0.0), last_cv(1e-2)
    finally:
        torch.set_num_threads(threads)
    assert with_aux < without, (with_aux, without)


# --------------------------------------------------------------------------- bias balancing
from helpers.moe.router import expert_load, route_with_bias, update_expert_bias  # noqa: E402


def _skewed_logits(T=512, E=8, seed=0):
    """Router logits whose experts differ by a fixed offset: expert e is favoured by 0.5 e."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g, dtype=torch.float64) + 0.5 * torch.arange(E)


def test_bias_moves_the_choice_not_the_gates():
    logits = _skewed_logits(T=64)
    scores, gates0, experts0 = route_with_bias(logits, 2, torch.zeros(8, dtype=torch.float64))
    # zero bias: plain sigmoid top-k, gates the chosen affinities normalized
    assert torch.equal(experts0, torch.sigmoid(logits).topk(2, dim=-1).indices)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[7] = -10.0          # expert 7 can no longer be chosen ...
    _, gates, experts = route_with_bias(logits, 2, bias)
    assert not (experts == 7).any()
    chosen = scores.gather(-1, experts)   # ... and the gates are its rivals' unbiased affinities
    _close(gates, chosen / chosen.sum(-1, keepdim=True), "gates")
    _close(gates.sum(-1), torch.ones(64, dtype=torch.float64), "gates sum to 1")


def test_bias_update_direction():
    experts = torch.tensor([[0], [0], [0], [1], [2], [2]])   # loads 3, 1, 2; mean 2
    new = update_expert_bias(torch.zeros(3), experts, 0.1)
    assert new.tolist() == pytest.approx([-0.1, 0.1, 0.0])
    assert torch.equal(expert_load(experts, 3), torch.tensor([3, 1, 2]))


def test_bias_balances_a_skewed_router():
    """No training, only the bias: the busiest expert's load falls from 3x the mean to
    near the mean. The experts' affinities differ by at most ~0.5 (sigmoid of logits 3.5
    apart), which a bias moving 0.005 a step crosses in ~100 steps; 300 leave room. A
    sign update never settles: each bias keeps stepping by +-gamma, moving a few of the
    1024 choices, hence a bound of 1.25 rather than 1 (without the bias it stays 3.0)."""
    logits, E, k = _skewed_logits(), 8, 2
    bias = torch.zeros(E, dtype=torch.float64)
    before = expert_load(route_with_bias(logits, k, bias)[2], E).double()
    for _ in range(300):
        bias = update_expert_bias(bias, route_with_bias(logits, k, bias)[2], 0.005)
    after = expert_load(route_with_bias(logits, k, bias)[2], E).double()
    assert before.max() / before.mean() > 2.0
    assert after.max() / after.mean() < 1.25, after.tolist()


def test_bias_shape_is_checked():
    with pytest.raises(ValueError, match="one value per expert"):
        route_with_bias(torch.zeros(4, 8), 2, torch.zeros(7))
