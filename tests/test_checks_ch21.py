"""Chapter 21's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch21


def _route(logits, k, capacity, renorm=True, token_major=False, off_by_one=False, dim=-1,
           fp32=True):
    probs = F.softmax(logits.float() if fp32 else logits, dim=dim)
    top_p, experts = probs.topk(k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if renorm and k > 1 else top_p
    if capacity is None:
        return gates, experts, torch.ones_like(experts, dtype=torch.bool)
    T, E = logits.shape
    order = experts.reshape(-1) if token_major else experts.t().reshape(-1)
    one_hot = F.one_hot(order, E)
    slot = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    keep = slot <= capacity if off_by_one else slot < capacity
    return gates, experts, keep.reshape(T, k) if token_major else keep.reshape(k, T).t()


def _no_exchange(rows, counts, group):
    # assumes every rank receives what it sends: the receive sizes are guessed
    P = dist.get_world_size(group)
    send = counts.view(P, -1).sum(1).tolist()
    received = rows.new_empty(sum(send), rows.size(1))
    dist.all_to_all_single(received, rows, send, send, group=group)
    return received, counts.view(P, -1)


def _equal_splits(rows, counts, group):  # exchanges counts but ignores them for the rows
    P = dist.get_world_size(group)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    n = rows.size(0) - rows.size(0) % P
    received = torch.empty_like(rows[:n])
    dist.all_to_all_single(received, rows[:n].contiguous(), group=group)
    return received, recv_counts.view(P, -1)


def _halves(rows, counts, group):
    # right for 2 ranks only: the experts cut into two halves, whatever the world size
    P = dist.get_world_size(group)
    send = counts.view(2, -1).sum(1).tolist()
    send = send + [0] * (P - 2)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv = recv_counts.view(P, -1).sum(1).tolist()
    received = rows.new_empty(sum(recv), rows.size(1))
    dist.all_to_all_single(received, rows, recv, send, group=group)
    return received, recv_counts.view(P, -1)


def _course_router(logits, k, capacity):  # the chapter's helpers, one call each
    from helpers.moe import capacity_keep, route
    _, gates, experts = route(logits.float(), k)
    return gates, experts, capacity_keep(experts, logits.size(1), capacity)


def _course_exchange(rows, counts, group):  # the chapter's exchange_splits for the counts
    from helpers.moe import exchange_splits
    P = dist.get_world_size(group)
    recv_counts = exchange_splits(counts, group)
    received = rows.new_empty(int(recv_counts.sum()), rows.size(1))
    dist.all_to_all_single(received, rows, recv_counts.sum(1).tolist(),
                           counts.view(P, -1).sum(1).tolist(), group=group)
    return received, recv_counts


def _no_group(rows, counts, group):  # right, but every collective on the whole world
    P = dist.get_world_size(group)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    recv_counts = recv_counts.view(dist.get_world_size(), -1)
    send = counts.view(P, -1).sum(1).tolist()
    received = rows.new_empty(int(recv_counts.sum()), rows.size(1))
    dist.all_to_all_single(received, rows, recv_counts.sum(1).tolist(), send)
    return received, recv_counts


def _flat_counts(rows, counts, group):  # right rows; recv_counts left flat (P * E/P,)
    P = dist.get_world_size(group)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send = counts.view(P, -1).sum(1).tolist()
    received = rows.new_empty(int(recv_counts.sum()), rows.size(1))
    dist.all_to_all_single(received, rows, recv_counts.view(P, -1).sum(1).tolist(), send,
                           group=group)
    return received, recv_counts


def _no_gates(out, token_ids, gates, T):
    return out.new_zeros(T, out.size(1)).index_add_(0, token_ids, out)


def _overwrite(out, token_ids, gates, T):  # assignment keeps only one choice per token
    y = out.new_zeros(T, out.size(1))
    y[token_ids] = out * gates.unsqueeze(1)
    return y


def _balance(logits, k, bias, rate, choose="biased", weigh="s", affinity="sigmoid", norm=True,
             update="sign", at_mean=True, in_place=False, minlength=True, center=False):
    """The right balance step with one mistake switched on."""
    a = logits.float()
    s = torch.sigmoid(a) if affinity == "sigmoid" else torch.softmax(a, -1)
    experts = (s + bias if choose == "biased" else s).topk(k, dim=-1).indices
    chosen = (s if weigh == "s" else s + bias).gather(-1, experts)
    gates = chosen / chosen.sum(-1, keepdim=True) if norm else chosen
    load = torch.bincount(experts.reshape(-1), minlength=bias.numel() if minlength else 0)
    load = load.to(bias.dtype)
    gap = load.mean() - load
    if update == "sign":
        step = rate * torch.sign(gap)
    elif update == "flipped":
        step = -rate * torch.sign(gap)
    else:  # proportional
        step = rate * gap
    if not at_mean:   # a two-way where: an expert at the mean gains rate too
        step = torch.where(load > load.mean(), -rate, rate)
    if center:        # torchtitan's variant
        step = step - step.mean()
    if in_place:
        return gates, experts, bias.add_(step)
    return gates, experts, bias + step


def _balance_other_style(logits, k, bias, rate):
    """Right, written another way: one-hot loads, choices in ascending expert order."""
    s = logits.float().sigmoid()
    experts = torch.sort((s + bias).topk(k, dim=-1).indices, dim=-1).values
    chosen = torch.gather(s, 1, experts)
    load = F.one_hot(experts, bias.numel()).sum(dim=(0, 1)).float()
    new = bias.clone()
    new[load > load.mean()] -= rate
    new[load < load.mean()] += rate
    return chosen / chosen.sum(1, keepdim=True), experts, new


def _course_balance(logits, k, bias, rate):  # the chapter's helpers, one call each
    from helpers.moe.router import route_with_bias, update_expert_bias
    _, gates, experts = route_with_bias(logits, k, bias)
    return gates, experts, update_expert_bias(bias, experts, rate)


class TestChapter21(ChapterChecks):
    lab = "labs/21_expert_parallelism_lab.ipynb"
    sol = "solutions/21_expert_parallelism_solution.ipynb"
    checks = {
        "route_top_k": Check(ch21.check_route_top_k),
        "dispatch": Check(ch21.check_dispatch, wire=True),
        "combine": Check(ch21.check_combine, wire=True),
        "balance_step": Check(ch21.check_balance_step),
    }
    right = [
        Right("balance_step", _balance_other_style,
              "one-hot loads, masks for the update, choices in expert order"),
    ]
    wrong = [
        Wrong("route_top_k", lambda lg, k, c: _route(lg, k, c, renorm=False),
              "gates not renormalized", says="renormalize"),
        # token 0's 2nd choice placed before token 1's 1st
        Wrong("route_top_k", lambda lg, k, c: _route(lg, k, c, fp32=False),
              "softmax in the logits' dtype", says="softmax in float32"),
        Wrong("route_top_k", lambda lg, k, c: _route(lg, k, c, token_major=True),
              "capacity filled token-major", says="first choice"),
        Wrong("route_top_k", lambda lg, k, c: (torch.ones(lg.size(0), k),) + _route(lg, k, c)[1:],
              "top-1 renormalized: gate 1", says="raw probability"),
        Wrong("route_top_k", lambda lg, k, c: _route(lg, k, c, off_by_one=True),
              "capacity off by one (slot <= C)", says="kept choices differ"),
        Wrong("route_top_k", lambda lg, k, c: _route(lg, k, c, dim=0),
              "softmax over the tokens", says="experts differ"),
        Wrong("route_top_k", lambda lg, k, c: None, "returns None", says="must return"),
        Wrong("route_top_k", _course_router, "calls helpers.moe.route + capacity_keep",
              says="switched off in this check"),
        Wrong("route_top_k", lambda lg, k, c: ch21._ref_route(lg.float(), k, c),
              "returns the check's own reference", says="this check's reference"),
        Wrong("dispatch", _course_exchange, "calls helpers.moe.exchange_splits",
              says="switched off in this check"),
        Wrong("dispatch", _no_group, "collectives without group=", says="two EP groups of 2"),
        Wrong("dispatch", _flat_counts, "recv_counts left flat", says=r"return it shaped"),
        Wrong("dispatch", _halves, "two halves hard-coded", says=None),
        Wrong("dispatch", _no_exchange, "receive sizes guessed, counts not exchanged",
              says="Exchange the counts first"),
        Wrong("dispatch", _equal_splits, "counts exchanged but rows split equally",
              says="Exchange the counts first|received rows differ"),
        Wrong("combine", _no_gates, "a plain sum, no gates", says="plain sum"),
        Wrong("combine", _overwrite, "assignment keeps one choice per token", says=None),
        Wrong("combine", lambda out, ids, gates, T: out.new_zeros(
              int(ids.max()) + 1, out.size(1)).index_add_(0, ids, out * gates.unsqueeze(1)),
              "token count from the rows", says="num_tokens rows"),
        Wrong("combine", lambda out, ids, gates, T: None, "returns None",
              says="must be a tensor"),
        Wrong("balance_step", lambda *a: _balance(*a, choose="plain"), "choice without the bias",
              says="the choice without the bias"),
        Wrong("balance_step", lambda *a: _balance(*a, weigh="s+b"), "gates from s + b",
              says="bias went into the gates"),
        Wrong("balance_step", lambda *a: _balance(*a, affinity="softmax"), "softmax affinities",
              says="experts differ|gates differ"),
        Wrong("balance_step", lambda *a: _balance(*a, norm=False), "gates not normalised",
              says="Normalise the chosen affinities"),
        Wrong("balance_step", lambda *a: _balance(*a, update="flipped"), "update's sign flipped",
              says="sign is flipped"),
        Wrong("balance_step", lambda *a: _balance(*a, update="proportional"),
              "update proportional to the imbalance", says="in proportion to the imbalance"),
        Wrong("balance_step", lambda *a: _balance(*a, at_mean=False),
              "an expert at the mean moved (two-way where)", says="exactly at the mean"),
        Wrong("balance_step", lambda *a: _balance(*a, center=True),
              "torchtitan's mean-subtracted update", says="torchtitan's variant"),
        Wrong("balance_step", lambda *a: _balance(*a, in_place=True), "bias changed in place",
              says="changed the bias it was given"),
        Wrong("balance_step", lambda *a: _balance(*a, minlength=False),
              "loads of the picked experts only", says="minlength"),
        Wrong("balance_step", _course_balance, "calls route_with_bias + update_expert_bias",
              says="switched off in this check"),
        Wrong("balance_step", lambda lg, k, b, r: ch21._ref_balance(lg, k, b, r),
              "returns the check's own reference", says="this check's reference"),
        Wrong("balance_step", lambda *a: None, "returns None", says="must return"),
    ]
