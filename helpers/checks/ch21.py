"""Checks for chapter 21: top-k routing with capacity, the EP dispatch, the combine, and the
bias that balances the experts without a loss.

Learner contracts:

* ``route_top_k(logits, k, capacity) -> (gates, experts, keep)``: logits
  (T, E); probabilities by softmax; the k largest per token (best first);
  gates = the probability for k = 1, renormalized over the k for k > 1;
  ``keep`` (T, k) bool: each expert takes at most ``capacity`` choices, first
  choices of all tokens before any second choice, each in token order
  (``capacity`` None: keep all). Reference: ``helpers.moe.route`` +
  ``capacity_keep``.
* ``dispatch(rows, counts, group) -> (received, recv_counts)`` on every rank:
  ``rows`` (N, H) sorted by expert, ``counts`` (E,) rows per expert. Rank q
  owns experts [q E/P, (q+1) E/P). Exchange the counts first (each rank must
  learn ``recv_counts`` (P, E/P): rows rank q sends to each of my experts),
  then ``dist.all_to_all_single`` the rows. ``received`` is ordered by source
  rank, then by expert.
* ``combine(expert_out, token_ids, gates, num_tokens) -> y``: expert_out
  (N, H) results of the kept choices, token_ids (N,) and gates (N,) of each;
  y (num_tokens, H) = sum over a token's choices of gate * output.
* ``balance_step(logits, k, bias, rate) -> (gates, experts, new_bias)``: DeepSeek-V3's
  routing without a balance loss: s = sigmoid(logits) in float32, the k experts of the
  largest s + bias per token, gates s normalised over the k chosen (no bias), and
  new_bias = bias + rate * sign(mean load - load) from the choices' loads, a new
  tensor. Reference: ``helpers.moe.router.route_with_bias`` + ``update_expert_bias``.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.checks.course_answers import refusing

# (T, E, k, capacity, seed)
ROUTE_CASES = [(6, 4, 1, None, 0), (6, 4, 2, None, 1), (16, 4, 1, 3, 2), (16, 4, 2, 5, 3),
               (12, 3, 2, 4, 4), (10, 5, 3, 4, 5)]


def _tensor(x, what: str) -> torch.Tensor:
    """``x`` as a tensor, or a CheckFailed naming what it was (None, a list of lists...)."""
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckFailed(f"{what} must be a tensor, got {type(x).__name__} ({exc})") from None


# the course's answers to the exercises, switched off while the learner's code runs
_ROUTERS = {"helpers.moe.router.route": "", "helpers.moe.router.capacity_keep": "",
            "helpers.moe.router.capacity_slots": "",
            "helpers.checks.ch21._ref_route": "it is this check's reference"}
_DISPATCHERS = {"helpers.moe.dispatch.exchange_splits": "",
                "helpers.collectives.alltoall.all_to_all": "",
                "helpers.moe.layer.MoELayer": ""}


def _ref_route(logits, k, capacity):
    from helpers.moe import capacity_keep, route
    _, gates, experts = route(logits, k)
    return gates, experts, capacity_keep(experts, logits.size(1), capacity)


def check_route_top_k(route_top_k) -> None:
    """``route_top_k`` against ``helpers.moe.route`` + ``capacity_keep`` on ROUTE_CASES
    (k = 1, 2, 3; E = 3, 4, 5; capacities that drop and that do not).

    Mistakes it is built to catch: top-k gates not renormalized (k > 1); top-1
    renormalized to a gate of 1 (the router loses its gradient); softmax over the
    tokens instead of the experts; capacity filled token-major (token 0's second
    choice before token 1's first); capacity off by one (slot <= C keeps C + 1);
    experts not best-first; a wrong return shape or type; a softmax in the logits' own
    dtype (the bfloat16 case: its probabilities are off by up to 2^-8, 1e-6 allows
    float32 rounding only); the course's own ``helpers.moe.route`` / ``capacity_keep`` /
    ``capacity_slots`` (or this check's reference) called instead of written: switched
    off while it runs."""
    _route_cases(route_top_k)
    _bf16_softmax(route_top_k)
    passed("routing right: top-1 raw gates, top-k renormalized, capacity first choices first, "
           "softmax in float32")


def _bf16_softmax(route_top_k) -> None:
    logits = (torch.randn(16, 6, generator=torch.Generator().manual_seed(7)) * 2).bfloat16()
    want_g, _, _ = _ref_route(logits.float(), 2, None)
    with refusing(exercise="route_top_k", paths=_ROUTERS):
        got = attempt(route_top_k, logits.clone(), 2, None, what="route_top_k on bfloat16 logits")
    if not (isinstance(got, tuple) and len(got) == 3):
        raise CheckFailed("route_top_k must return (gates, experts, keep)")
    g = _tensor(got[0], "gates")
    if tuple(g.shape) != tuple(want_g.shape) or (g.float() - want_g).abs().max() > 1e-6:
        raise CheckFailed("gates differ for bfloat16 logits (T=16, E=6, k=2): take the "
                          "softmax in float32 (logits.float()) whatever the logits' dtype")


def _route_cases(route_top_k) -> None:
    for T, E, k, cap, seed in ROUTE_CASES:
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2
        want_g, want_e, want_keep = _ref_route(logits, k, cap)
        with refusing(exercise="route_top_k", paths=_ROUTERS):
            got = attempt(route_top_k, logits.clone(), k, cap, what="route_top_k")
        if not (isinstance(got, tuple) and len(got) == 3):
            raise CheckFailed("route_top_k must return (gates, experts, keep)")
        g, e, keep = (_tensor(t, name) for t, name in zip(got, ("gates", "experts", "keep")))
        case = f"(T={T}, E={E}, k={k}, capacity={cap})"
        if tuple(e.shape) != (T, k) or not torch.equal(e.long(), want_e):
            raise CheckFailed(f"experts differ for {case}: expected the k most probable "
                              f"per token, best first")
        # fp32 softmax and a division: a few ulps of values <= 1
        if tuple(g.shape) != (T, k) or (g.float() - want_g).abs().max() > 1e-6:
            hint = ""
            p = torch.softmax(logits, -1).gather(1, want_e)
            if k > 1 and (g.float() - p).abs().max() <= 1e-6:
                hint = " For k > 1 renormalize the chosen probabilities to sum to 1 (GShard)."
            elif k == 1 and (g.float() - 1).abs().max() <= 1e-6:
                hint = (" For k = 1 keep the raw probability (Switch): a gate of 1 gives "
                        "the router no gradient.")
            raise CheckFailed(f"gates differ for {case}.{hint}")
        if tuple(keep.shape) != (T, k) or not torch.equal(keep.bool(), want_keep):
            hint = ""
            if cap is not None and keep.bool().sum() == want_keep.sum():
                hint = (" The count is right but not which choices: every token's first "
                        "choice gets a slot before any second choice, in token order.")
            raise CheckFailed(f"kept choices differ for {case} (expected "
                              f"{int(want_keep.sum())} kept of {T * k}).{hint}")


def _dispatch_rank(dispatch, E, H, split=False):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.moe import exchange_splits
    r = rank_info()
    group = dist.group.WORLD
    if split:  # two EP groups of 2, each rank in one: every collective must take group=
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group = pairs[r.rank // 2]
    P = dist.get_world_size(group)
    El = E // P
    g = torch.Generator().manual_seed(10 + r.rank)
    # uneven on purpose: what a rank sends differs from what it receives
    counts = torch.randint(0, 4, (E,), generator=g) + torch.arange(E) * (r.rank + 1) % 5
    rows = torch.randn(int(counts.sum()), H, generator=g)
    want_counts = exchange_splits(counts.clone(), group)
    want = torch.empty(int(want_counts.sum()), H)
    dist.all_to_all_single(want, rows, want_counts.sum(1).tolist(),
                           counts.view(P, El).sum(1).tolist(), group=group)
    with refusing(exercise="dispatch", paths=_DISPATCHERS):
        got = dispatch(rows.clone(), counts.clone(), group)
    return dict(got=got, want=want, want_counts=want_counts)


# (ranks, experts, two groups of 2): an odd world (3 ranks, 2 experts each) and 4 ranks,
# so that two halves hard-coded, or a size that only works for P = 2, fail; then 4 ranks
# in two EP groups of 2, so that a collective without group= (on every rank) fails
DISPATCH_CASES = [(3, 6, False), (4, 8, False), (4, 8, True)]


def check_dispatch(dispatch) -> None:
    """``dispatch`` on real ranks (DISPATCH_CASES) against the counts exchange of
    ``helpers.moe.exchange_splits`` and one ``all_to_all_single`` of the rows.

    Mistakes it is built to catch: receive sizes guessed from one's own send sizes
    (the counts not exchanged: gloo aborts, the hint says why); counts exchanged but
    the rows split equally; the experts split into two halves whatever the world
    size; recv_counts not shaped (P, E/P) by source rank; a collective without
    ``group=`` (4 ranks in two EP groups of 2: it would pair the wrong ranks); the course's
    ``exchange_splits`` / ``all_to_all`` (or an ``MoELayer``) called instead of written:
    switched off on the ranks while it runs."""
    H = 3
    probe_rows = torch.zeros(0, H)
    for P, E, split in DISPATCH_CASES:
        _dispatch_on(dispatch, P, E, H, probe_rows, split)
    passed("dispatch right: counts exchanged first, variable-split all-to-all on 3 and 4 ranks, "
           "and in two EP groups of 2")


def _dispatch_on(dispatch, P, E, H, probe_rows, split=False) -> None:
    where = f"{P} ranks" + (" in two EP groups of 2" if split else "")
    res = on_ranks(_dispatch_rank, P, dispatch, E, H, split, what=f"dispatch on {where}",
                   probe=lambda: dispatch(probe_rows, torch.zeros(E, dtype=torch.long), None),
                   hints={"SIGABRT": "gloo aborts when an all-to-all receives more or fewer "
                          "bytes than the sender sends. Exchange the counts first and size "
                          "each receive from what that rank sends you, not from what you send.",
                          "split": "exchange the counts first: the receive sizes are the "
                          "other ranks' send sizes.",
                          "group": "pass group=group to every collective: the EP group is "
                          "not the whole world"}, timeout=30)
    for r, out in enumerate(res):
        got = out["got"]
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed("dispatch must return (received, recv_counts)")
        received, recv_counts = got
        rc, want_rc = _tensor(recv_counts, "recv_counts"), out["want_counts"]
        if rc.numel() == want_rc.numel() and tuple(rc.shape) != tuple(want_rc.shape) and \
                torch.equal(rc.reshape(want_rc.shape).long(), want_rc):
            raise CheckFailed(f"{where}, {E} experts, rank {r}: recv_counts has the right "
                              f"numbers in shape {tuple(rc.shape)}; return it shaped "
                              f"{tuple(want_rc.shape)} (P, E/P): row q is what rank q sends "
                              f"to each of my experts, which combine and the expert layer "
                              f"index by source rank (recv_counts.view(P, -1))")
        if rc.numel() != want_rc.numel() or not torch.equal(rc.long(), want_rc):
            raise CheckFailed(f"{where}, {E} experts, rank {r}: recv_counts "
                              f"{torch.as_tensor(recv_counts).tolist()}, "
                              f"expected {out['want_counts'].tolist()}: row q is what rank q "
                              f"sends to each of my experts. Exchange the counts first.")
        # the same floats moved, not computed: exact equality
        if tuple(received.shape) != tuple(out["want"].shape) or \
                not torch.equal(received, out["want"]):
            raise CheckFailed(f"{where}, {E} experts, rank {r}: received rows differ "
                              f"(shape {tuple(received.shape)}, "
                              f"expected {tuple(out['want'].shape)}). Split the send by "
                              f"destination rank (E/P experts each) and size the receive "
                              f"from the exchanged counts.")


# (tokens, hidden, k, kept choices as indices into the token-major (T*k) list, seed)
COMBINE_CASES = [
    (6, 4, 2, [0, 1, 2, 4, 5, 7, 8, 9, 11], 7),   # second choices of tokens 1, 3, 5 dropped
    (5, 3, 3, [0, 1, 2, 3, 6, 7, 9, 12, 13], 8),  # k = 3; token 2 lost two, token 3 one
    (4, 2, 1, [0, 1, 2], 9),                      # top-1, the last token dropped: a zero row
]


def check_combine(combine) -> None:
    """``combine`` against ``index_add_`` of gate * output (COMBINE_CASES: k = 1, 2, 3,
    rows in expert order, not token order, some choices dropped, one token with none).

    Mistakes it is built to catch: the plain sum without gates; assignment
    (``y[ids] = ...``) that keeps one choice per token; rows assumed in token order;
    a token count taken from the rows instead of ``num_tokens`` (the dropped last
    token); a wrong shape or a non-tensor result."""
    for T, H, k, kept, seed in COMBINE_CASES:
        g = torch.Generator().manual_seed(seed)
        token_ids = torch.arange(T).repeat_interleave(k)[torch.tensor(kept)]
        N = token_ids.numel()
        out = torch.randn(N, H, generator=g)
        gates = torch.rand(N, generator=g)
        order = torch.randperm(N, generator=g)   # rows come back sorted by expert
        out, token_ids, gates = out[order], token_ids[order], gates[order]
        want = torch.zeros(T, H).index_add_(0, token_ids, out * gates.unsqueeze(1))
        case = f"T={T}, k={k}, {T * k - N} of {T * k} choices dropped"
        got = attempt(combine, out.clone(), token_ids.clone(), gates.clone(), T,
                      what=f"combine ({case})")
        got = _tensor(got, "combine's result")
        # at most k = 3 products summed per token: a few fp32 ulps of values below ~10
        if tuple(got.shape) != (T, H) or (got - want).abs().max() > 1e-5:
            hint = ""
            plain = torch.zeros(T, H).index_add_(0, token_ids, out)
            if got.shape == plain.shape and (got - plain).abs().max() <= 1e-5:
                hint = " That is the plain sum: multiply each expert's output by its gate."
            elif tuple(got.shape) != (T, H):
                hint = f" Expected shape {(T, H)}, got {tuple(got.shape)}: num_tokens rows."
            raise CheckFailed(f"{case}: combine differs from sum over choices of gate * "
                              f"output.{hint}")
    passed(f"combine right on {len(COMBINE_CASES)} cases (k = 1, 2, 3): gate-weighted sum per "
           f"token, dropped choices contribute nothing")


# -- exercise 4: balance without a loss (DeepSeek-V3's bias) ----------------------------

_BALANCERS = {"helpers.moe.router.route_with_bias": "", "helpers.moe.router.update_expert_bias": "",
              "helpers.moe.router.expert_load": "",
              "helpers.checks.ch21._ref_balance": "it is this check's reference"}


def _ref_balance(logits, k, bias, rate):
    from helpers.moe.router import route_with_bias, update_expert_bias
    _, gates, experts = route_with_bias(logits, k, bias)
    return gates, experts, update_expert_bias(bias, experts, rate)


def _balance_cases() -> list[tuple[str, torch.Tensor, int, torch.Tensor, float]]:
    """(what, logits, k, bias, rate): random routers whose bias changes choices, one with an
    expert nobody picks, and one where two experts sit exactly at the mean load."""
    cases = []
    for T, E, k, seed in ((12, 4, 1, 0), (16, 6, 2, 1), (10, 8, 3, 2)):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(T, E, generator=g) + 0.8 * torch.arange(E)   # skewed to the last
        bias = -0.6 * torch.rand(E, generator=g) * torch.arange(E) / E
        cases.append((f"T={T}, E={E}, k={k}", logits, k, bias, 0.01))
    # 4 tokens, 4 experts, k = 1: choices 0, 0, 1, 2 give loads 2, 1, 1, 0 around a mean of 1
    logits = torch.tensor([[3.0, 0, 0, 0], [3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
    cases.append(("T=4, E=4, k=1, loads 2, 1, 1, 0 (mean 1)", logits, 1, torch.zeros(4), 0.001))
    return cases


def _by_expert(gates: torch.Tensor, experts: torch.Tensor):
    """A token's k choices in expert order, so that any order of the top k compares."""
    order = experts.argsort(dim=-1)
    return gates.gather(-1, order), experts.gather(-1, order)


def check_balance_step(balance_step) -> None:
    """``balance_step(logits, k, bias, rate) -> (gates, experts, new_bias)`` against
    ``helpers.moe.router.route_with_bias`` + ``update_expert_bias`` (DeepSeek-V3, sec.
    2.1.2): choices by sigmoid(logits) + bias, gates from the sigmoid alone normalised over
    the k chosen, each bias moved by rate towards the mean load.

    Mistakes it is built to catch: the gates taken from s + b; the choice made without the
    bias; softmax affinities; gates not normalised; the update's sign flipped; an update
    proportional to the imbalance; an expert exactly at the mean moved (a two-way
    ``where``); the mean subtracted from the update (torchtitan's variant, not the rule
    asked for); ``bias`` changed in place; the course's own functions (or this check's
    reference) called: switched off while it runs."""
    for what, logits, k, bias, rate in _balance_cases():
        want_g, want_e, want_b = _ref_balance(logits, k, bias, rate)
        given = bias.clone()
        try:
            with refusing(exercise="balance_step", paths=_BALANCERS):
                got = attempt(balance_step, logits.clone(), k, given, rate,
                              what=f"balance_step ({what})")
        except CheckFailed as exc:
            if "must match the size of tensor" not in str(exc):
                raise
            raise CheckFailed(f"{exc}. Count a load for every expert, the unpicked ones too "
                              f"(torch.bincount(..., minlength=E)), so that it lines up with "
                              f"the bias") from None
        if not (isinstance(got, tuple) and len(got) == 3):
            raise CheckFailed("balance_step must return (gates, experts, new_bias)")
        g, e, b = (_tensor(t, name) for t, name in zip(got, ("gates", "experts", "new_bias")))
        if not torch.equal(given, bias):
            raise CheckFailed(f"{what}: balance_step changed the bias it was given; return the "
                              f"new bias as a new tensor (the caller keeps the old one)")
        _check_choice(what, logits, k, bias, g, e, want_g, want_e)
        _check_update(what, logits, k, bias, rate, e, b, want_b)
    passed(f"balance step right on {len(_balance_cases())} routers (k = 1, 2, 3): chosen by "
           f"sigmoid + bias, weighed by the sigmoid alone, each bias moved by rate towards "
           f"the mean load, an expert at the mean left alone")


def _check_choice(what, logits, k, bias, g, e, want_g, want_e) -> None:
    T = logits.size(0)
    if tuple(e.shape) != (T, k) or tuple(g.shape) != (T, k):
        raise CheckFailed(f"{what}: gates and experts must be ({T}, {k}), got "
                          f"{tuple(g.shape)} and {tuple(e.shape)}")
    g, e = _by_expert(g.float(), e.long())
    want_g, want_e = _by_expert(want_g, want_e)
    if not torch.equal(e, want_e):
        plain = torch.sigmoid(logits).topk(k, dim=-1).indices.sort(dim=-1).values
        soft = (torch.softmax(logits, -1) + bias).topk(k, dim=-1).indices.sort(dim=-1).values
        hint = (" That is the choice without the bias: pick the top k of s + b."
                if torch.equal(e, plain) else
                " That is the choice by softmax probabilities: the affinities are sigmoids."
                if torch.equal(e, soft) else "")
        raise CheckFailed(f"{what}: experts differ (expected the top k of sigmoid(logits) + "
                          f"bias per token).{hint}")
    # float32 sigmoid, a sum of at most 3 and a division: a few ulps of values <= 1
    if (g - want_g).abs().max() > 1e-6:
        s = torch.sigmoid(logits.float())
        biased = (s + bias).gather(-1, want_e)
        raw = s.gather(-1, want_e)
        hint = (" The bias went into the gates: it decides which experts, never how much; "
                "weigh by s alone." if (g - biased / biased.sum(-1, keepdim=True)).abs().max()
                <= 1e-6 or (g - biased).abs().max() <= 1e-6 else
                " Normalise the chosen affinities to sum to 1 per token (eq. 13)."
                if (g - raw).abs().max() <= 1e-6 else "")
        raise CheckFailed(f"{what}: gates differ (expected s / sum of the chosen s).{hint}")


def _check_update(what, logits, k, bias, rate, e, b, want_b) -> None:
    E = bias.numel()
    if tuple(b.shape) != (E,):
        raise CheckFailed(f"{what}: new_bias must have one value per expert, shape ({E},), "
                          f"got {tuple(b.shape)}: count every expert's load, the unpicked "
                          f"ones too (torch.bincount(..., minlength=E))")
    # bias + rate x (-1, 0, 1) in float32: exact to an ulp of the bias
    if (b.float() - want_b).abs().max() <= 1e-7:
        return
    load = torch.bincount(e.long().reshape(-1), minlength=E).float()
    step = b.float() - bias
    hint = ""
    if torch.allclose(step, -(want_b - bias), atol=1e-7):
        hint = " The sign is flipped: an overloaded expert's bias must drop, so it is chosen less."
    elif torch.allclose(step, rate * (load.mean() - load), atol=1e-7):
        hint = (" The bias moved in proportion to the imbalance: the rule moves it by rate "
                "exactly, by the sign of mean load - load.")
    elif torch.allclose(step, (want_b - bias) - (want_b - bias).mean(), atol=1e-7):
        hint = (" The mean of the update was subtracted (torchtitan's variant); here the rule "
                "is DeepSeek-V3's: bias + rate * sign(mean load - load).")
    elif bool((load == load.mean()).any()) and torch.allclose(
            step[load != load.mean()], (want_b - bias)[load != load.mean()], atol=1e-7):
        hint = " An expert exactly at the mean load keeps its bias (sign(0) = 0)."
    raise CheckFailed(f"{what}: new_bias differs (loads {load.long().tolist()}, expected "
                      f"{[round(v, 4) for v in want_b.tolist()]}).{hint}")
