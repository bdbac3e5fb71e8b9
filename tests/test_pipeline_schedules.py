"""Schedules, simulator and partition: pure functions, no process group."""

import itertools

import pytest

from helpers.pipeline import (Action, B, F, ScheduleDeadlock, bubble_formula, format_schedule,
                              gpipe, interleaved_1f1b, one_f_one_b, partition, peak_stash,
                              pipeline_step_time, simulate, stage_costs, stash_memory,
                              validate_schedule)
from helpers.pipeline.schedules import microbatch_rounds, schedule_shape

GRID = [(p, m) for p in range(1, 7) for m in range(1, 17)]
GRID_INTERLEAVED = [(p, m, v) for p in range(1, 6) for v in range(1, 5)
                    for m in range(p, 5 * p + 1, p)]


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_every_action_once_and_no_deadlock(make):
    for p, m in GRID:
        sched = make(p, m)
        validate_schedule(sched)  # raises if an action is missing, repeated or deadlocks
        assert schedule_shape(sched) == (p, m, 1)
        for row in sched:
            assert sorted(row) == sorted([F(j) for j in range(m)] + [B(j) for j in range(m)])


def test_interleaved_every_action_once_and_no_deadlock():
    for p, m, v in GRID_INTERLEAVED:
        sched = interleaved_1f1b(p, m, v)
        validate_schedule(sched)
        assert schedule_shape(sched) == (p, m, v)
        assert all(len(row) == 2 * m * v for row in sched)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_bubble_closed_form(make):
    # Huang et al. 2019 sec. 2.2 / Narayanan et al. 2021 sec. 3.1: with t_b = 2 t_f,
    # balanced stages and free communication, idle / total = (p-1) / (m+p-1). Exact
    # up to float rounding of sums of small integers.
    for p, m in GRID:
        sim = simulate(make(p, m), t_forward=1.0, t_backward=2.0)
        assert sim.bubble_fraction == pytest.approx(bubble_formula(p, m), abs=1e-12)
        assert sim.total_time == pytest.approx(3.0 * (m + p - 1))


def test_interleaved_bubble_closed_form():
    # Narayanan et al. 2021 (SC21) sec. 2.2.2: bubble shrinks by v: (p-1) / (v*m + p-1)
    for p, m, v in GRID_INTERLEAVED:
        sim = simulate(interleaved_1f1b(p, m, v), t_forward=1.0, t_backward=2.0)
        assert sim.bubble_fraction == pytest.approx(bubble_formula(p, m, v), abs=1e-12), (p, m, v)


def test_bubble_scales_with_time_unit():
    sim = simulate(one_f_one_b(4, 8), t_forward=0.25, t_backward=0.5)
    assert sim.bubble_fraction == pytest.approx(bubble_formula(4, 8))
    assert sim.total_time == pytest.approx(0.75 * 11)


def test_peak_stash_closed_forms():
    for p, m in GRID:
        assert simulate(gpipe(p, m)).peak_stash == [m] * p
        assert simulate(one_f_one_b(p, m)).peak_stash == [min(p - i, m) for i in range(p)]
    # interleaving stashes more chunk-activations (each 1/v of a stage's layers)
    for p, m, v in GRID_INTERLEAVED:
        stash = peak_stash(interleaved_1f1b(p, m, v))
        if v > 1:  # rank 0 holds its warm-up forwards plus one (Megatron's warm-up count)
            assert stash[0] == min((p - 1) * 2 + (v - 1) * p + 1, m * v)
        assert stash == sorted(stash, reverse=True)


def test_one_f_one_b_order():
    assert one_f_one_b(2, 3) == [[F(0), F(1), B(0), F(2), B(1), B(2)],
                                 [F(0), B(0), F(1), B(1), F(2), B(2)]]
    assert gpipe(2, 2) == [[F(0), F(1), B(0), B(1)]] * 2
    # fewer micro-batches than stages: the warm-up is capped at m
    assert one_f_one_b(4, 1) == [[F(0), B(0)]] * 4
    assert interleaved_1f1b(3, 6, 1) == one_f_one_b(3, 6)


def test_interleaved_order_matches_megatron_layout():
    sched = interleaved_1f1b(2, 4, 2)
    # forwards of rank 0: micro-batches 0-1 on chunk 0, the same on chunk 1, then 2-3 ...
    fwd = [a for a in sched[0] if a.kind == "F"]
    assert fwd == [F(0), F(1), F(0, 1), F(1, 1), F(2), F(3), F(2, 1), F(3, 1)]
    bwd = [a for a in sched[0] if a.kind == "B"]
    assert bwd == [B(0, 1), B(1, 1), B(0), B(1), B(2, 1), B(3, 1), B(2), B(3)]


def test_communication_latency_adds_to_every_hop():
    p, m = 3, 4
    sim = simulate(gpipe(p, m), 1.0, 2.0, t_comm=0.5)
    # GPipe's critical path crosses p-1 links in the fill and p-1 in the drain
    assert sim.total_time == pytest.approx(3.0 * (m + p - 1) + 2 * (p - 1) * 0.5)
    # 1F1B also waits for round trips in its steady phase, so it suffers at least as much
    sim_1f1b = simulate(one_f_one_b(p, m), 1.0, 2.0, t_comm=0.5)
    assert sim_1f1b.total_time >= sim.total_time
    assert sim_1f1b.bubble_fraction > bubble_formula(p, m)


def test_imbalanced_stages_set_the_pace():
    # a stage twice as slow as the others: steady state runs at its pace
    sim = simulate(one_f_one_b(3, 12), t_forward=[1, 2, 1], t_backward=[2, 4, 2])
    assert sim.total_time >= 12 * 6
    balanced = simulate(one_f_one_b(3, 12), t_forward=4 / 3, t_backward=8 / 3)
    assert sim.total_time > balanced.total_time


def test_intervals_respect_dependencies():
    p, m, v = 3, 6, 2
    sim = simulate(interleaved_1f1b(p, m, v), 1.0, 2.0)
    end = {(r, a): e for r, row in enumerate(sim.intervals) for _, e, a in row}
    for r, row in enumerate(sim.intervals):
        for (s0, e0, _), (s1, _, _) in zip(row, row[1:]):
            assert s1 >= e0 - 1e-12  # one action at a time
        for s, _, a in row:
            stage = a.chunk * p + r
            if a.kind == "F" and stage > 0:
                prev = stage - 1
                assert s >= end[(prev % p, F(a.microbatch, prev // p))] - 1e-12
            if a.kind == "B" and stage < p * v - 1:
                nxt = stage + 1
                assert s >= end[(nxt % p, B(a.microbatch, nxt // p))] - 1e-12


def test_deadlock_is_detected_and_named():
    # warm-up counts reversed (rank r warms up r forwards): rank 0 waits for B0 that
    # rank 1 reaches only after F1, which rank 0 runs only after B0
    p, m = 2, 3
    bad = [[F(j) for j in range(r)] + [a for k in range(m - r) for a in (F(k + r), B(k))]
           + [B(j) for j in range(m - r, m)] for r in range(p)]
    with pytest.raises(ScheduleDeadlock, match="rank 0 at B0 waits for B0 on rank 1"):
        simulate(bad)
    assert issubclass(ScheduleDeadlock, ValueError)


def test_invalid_schedules_are_rejected():
    with pytest.raises(ValueError, match="missing"):
        validate_schedule([[F(0), B(0)], [F(0)]])
    with pytest.raises(ValueError, match="repeated"):
        validate_schedule([[F(0), F(0), B(0)]], num_microbatches=1)
    with pytest.raises(ValueError, match="before its forward"):
        validate_schedule([[B(0), F(0)]])
    with pytest.raises(ValueError, match="kind"):
        validate_schedule([[("X", 0)]])
    with pytest.raises(ValueError, match="list"):
        validate_schedule([])
    # tuples are accepted and normalized
    assert validate_schedule([[("F", 0), ("B", 0)]]) == [[Action("F", 0), Action("B", 0)]]


def _torch_interleaved_order(p, m, v, rank):
    """torch.distributed.pipelining's ScheduleInterleaved1F1B order for one rank,
    as (kind, micro-batch, chunk), computed by its own method without stages or
    a process group (its __init__ needs real stages; the order depends only on
    these five numbers)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    rounds = max(1, m // p)
    sched.pp_group_size, sched.n_local_stages, sched.rank = p, v, rank
    sched.number_of_rounds, sched.microbatches_per_round, sched._n_microbatches = \
        rounds, m // rounds, m
    out = []
    for a in sched._calculate_single_rank_operations(rank):
        if a is not None:  # None: an idle slot in torch's time-step grid
            kind = "F" if a.computation_type.name == "FORWARD" else "B"
            out.append((kind, a.microbatch_index, a.stage_index // p))
    return out


def test_interleaved_any_m_matches_torch_and_never_deadlocks():
    # torch's ScheduleInterleaved1F1B accepts m when max(1, m // p) rounds
    # divide it evenly (m = 6 on p = 4; not m = 9): there our order is its order.
    for p, m, v in [(4, 6, 2), (4, 10, 2), (4, 3, 2), (2, 3, 2), (3, 4, 3), (4, 8, 2),
                    (2, 1, 2), (3, 15, 2)]:
        ours = interleaved_1f1b(p, m, v)
        for r in range(p):
            assert [tuple(a) for a in ours[r]] == _torch_interleaved_order(p, m, v, r), \
                (p, m, v, r)
    # every m: a valid, deadlock-free schedule (simulate raises ScheduleDeadlock
    # otherwise) whose bubble is never worse than plain 1F1B's, and the closed
    # form whenever m >= p, divisible or not (sums of small integers: exact
    # up to float rounding)
    for p in (2, 3, 4, 5):
        for v in (2, 3):
            for m in range(1, 14):
                sched = interleaved_1f1b(p, m, v)
                validate_schedule(sched, num_microbatches=m)
                bubble = simulate(sched, 1.0, 2.0).bubble_fraction
                assert bubble <= simulate(one_f_one_b(p, m), 1.0, 2.0).bubble_fraction + 1e-12
                if m >= p:
                    assert bubble == pytest.approx(bubble_formula(p, m, v), abs=1e-12)
                else:  # one round shorter than the pipeline: less than a v-fold cut
                    assert bubble > bubble_formula(p, m, v)
    assert microbatch_rounds(4, 9) == [range(0, 5), range(5, 9)]
    assert microbatch_rounds(4, 3) == [range(0, 3)]


def test_bad_arguments_name_the_constraint():
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="num_chunks"):
        interleaved_1f1b(2, 4, 0)
    with pytest.raises(ValueError, match="3 entries for 2 ranks"):
        simulate(gpipe(2, 2), t_forward=[1, 1, 1])


def test_format_schedule():
    assert format_schedule(one_f_one_b(2, 2)) == ("rank 0 | F0   F1   B0   B1\n"
                                                 "rank 1 | F0   B0   F1   B1")
    assert repr(F(3, 1)) == "F3.1" and repr(B(2)) == "B2"


def test_gantt_labels_only_bars_they_fit():
    """Every drawn label lies inside its bar: a narrow action (interleaving's short
    chunks) goes unlabelled instead of printing over its neighbours."""
    import matplotlib.pyplot as plt

    from helpers.pipeline import gantt

    sim = simulate(interleaved_1f1b(2, 8, 2), t_forward=1.0, t_backward=2.0)
    wide = simulate(gpipe(2, 2), t_forward=1.0, t_backward=2.0)
    fig, (ax_narrow, ax_wide) = plt.subplots(2, 1, figsize=(3, 3))
    gantt(sim.intervals, ax=ax_narrow)
    gantt(wide.intervals, ax=ax_wide)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax, drawn_all in ((ax_narrow, False), (ax_wide, True)):
        bars = [b.get_window_extent(renderer) for b in ax.patches]
        texts = [t.get_window_extent(renderer) for t in ax.texts]
        assert (len(texts) == len(bars)) == drawn_all, (len(texts), len(bars))
        for t in texts:   # inside the bar it names, not across a neighbour
            assert any(b.x0 <= t.x0 and t.x1 <= b.x1 for b in bars), t
    plt.close(fig)


def _brute_force_best(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


def _brute_force_split(costs, k):
    """The documented tie rule, by brute force: among the cuts with the optimal slowest
    stage, the last stage starts as early as possible; the rest is split the same way."""
    n = len(costs)
    if k == 1:
        return [range(0, n)]
    opt = _brute_force_best(costs, k)
    j = min(j for j in range(k - 1, n)
            if max(_brute_force_best(costs[:j], k - 1), sum(costs[j:])) <= opt + 1e-9)
    return _brute_force_split(costs[:j], k - 1) + [range(j, n)]


def test_partition_is_optimal_and_contiguous():
    import random
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.5, 1, 1, 2, 3, 5]) for _ in range(n)]
        bounds = partition(costs, k)
        assert len(bounds) == k and all(len(r) > 0 for r in bounds)
        assert [i for r in bounds for i in r] == list(range(n))
        assert max(stage_costs(costs, bounds)) == pytest.approx(_brute_force_best(costs, k))
        # small integer-like costs tie often: the tie rule picks exactly one of them
        assert bounds == _brute_force_split(costs, k), (costs, k)


def test_partition_by_count():
    assert partition(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # ties leave the earlier stages lighter (the docstring's rule), not [3, 3, 1]
    assert partition(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert [len(r) for r in partition(10, 4)] == [2, 2, 3, 3]
    assert [len(r) for r in partition(8, 3)] == [2, 3, 3]
    assert partition([1, 1, 1, 5], 2) == [range(0, 3), range(3, 4)]
    assert partition(3, 1) == [range(0, 3)]


def test_partition_errors():
    with pytest.raises(ValueError, match="cannot split 3 layer.*4 stages"):
        partition(3, 4)
    with pytest.raises(ValueError, match="num_stages"):
        partition(3, 0)
    with pytest.raises(ValueError, match=">= 0"):
        partition([1, -1], 2)


# ---------------------------------------------------------------------------
# Messages: nccl-style streams, releases of sent tensors, step groups
# ---------------------------------------------------------------------------

def _all_schedules():
    for p in range(1, 6):
        for m in range(1, 10):
            yield gpipe(p, m)
            yield one_f_one_b(p, m)
        for v in (2, 3):
            for m in range(p, 3 * p + 1, p):
                yield interleaved_1f1b(p, m, v)


def test_step_groups_never_stall_on_nccl_streams():
    from helpers.pipeline.p2p import comm_calls, plan_messages, stream_model
    for sched in _all_schedules():
        plans = plan_messages(sched)
        for one_stream in (False, True):
            stream_model([comm_calls(pl, "steps") for pl in plans], one_stream=one_stream)


def test_separate_calls_and_plain_pairs_stall():
    from helpers.pipeline.p2p import comm_calls, plan_messages, stream_model
    # 1F1B steady phase, send then receive as separate calls: both sends wait for
    # receives queued behind the other rank's send
    plans = plan_messages(one_f_one_b(2, 4))
    with pytest.raises(ScheduleDeadlock, match="stall"):
        stream_model([comm_calls(pl, "separate") for pl in plans])
    # pairing a send with the next receive from the same peer fixes 1F1B when every call
    # shares one communicator...
    stream_model([comm_calls(pl, "pairs") for pl in plans], one_stream=True)
    # ...but not interleaving on two ranks (a rank sends one chunk's gradient before it
    # receives the other's, on both ranks)
    plans = plan_messages(interleaved_1f1b(2, 4, 2))
    with pytest.raises(ScheduleDeadlock, match="rank 0 at send grad0"):
        stream_model([comm_calls(pl, "pairs") for pl in plans], one_stream=True)
    # and mixing batched pairs with lone isend/irecv puts the two ends of a message on
    # different communicators (PyTorch's two-rank one vs the group's), even for GPipe
    plans = plan_messages(gpipe(2, 2))
    with pytest.raises(ScheduleDeadlock):
        stream_model([comm_calls(pl, "pairs") for pl in plans])


def test_steps_order_messages():
    from helpers.pipeline.p2p import plan_messages
    for sched in _all_schedules():
        plans = plan_messages(sched)
        for r, pl in enumerate(plans):
            steps = pl.step
            assert steps == sorted(steps) and len(set(steps)) == len(steps)
            for step, ops in pl.groups.items():
                for kind, msg in ops:
                    peer = plans[msg.dst if kind == "send" else msg.src]
                    other = "recv" if kind == "send" else "send"
                    assert (other, msg) in peer.groups[step]  # partner: same step
            for i, msg in enumerate(pl.recv):  # received at its sender's step, used later
                if msg is not None and not msg.local:
                    sender = plans[msg.src]
                    k = sender.send.index(msg)
                    assert sender.step[k] < steps[i]
    # 1F1B's steady phase is Megatron's send_forward_recv_backward: one group holds
    # "send activation, receive gradient" for the same peer
    pl = plan_messages(one_f_one_b(2, 4))[0]
    assert any([(k, m.direction) for k, m in ops] == [("send", 0), ("recv", 1)]
               for ops in pl.groups.values())


def test_sends_are_released_only_once_delivered():
    # Under any timing (random per-rank speeds and latency), a send released after
    # action i's receive was already taken by its consumer: the consumer started first.
    import random
    from helpers.pipeline.p2p import plan_messages
    rng = random.Random(0)
    for sched in _all_schedules():
        plans = plan_messages(sched)
        p = len(sched)
        for _ in range(3):
            tf = [rng.uniform(0.2, 3) for _ in range(p)]
            tb = [rng.uniform(0.2, 6) for _ in range(p)]
            sim = simulate(sched, tf, tb, t_comm=rng.uniform(0, 2))
            start = {(r, a): s for r, row in enumerate(sim.intervals) for s, _, a in row}
            for r, pl in enumerate(plans):
                for i, released in enumerate(pl.release):
                    for k in released:
                        msg = pl.send[k]
                        q = msg.dst
                        consumer = next(c for c, m in enumerate(plans[q].recv) if m == msg)
                        assert start[(q, sched[q][consumer])] <= start[(r, sched[r][i])]


def test_released_sends_bound_memory():
    from helpers.pipeline.p2p import plan_messages
    for p in (2, 3, 4):
        for m in (p, 4 * p):
            # 1F1B: at most p sends wait for the end of the step, whatever m
            assert max(len(pl.unreleased) for pl in plan_messages(one_f_one_b(p, m))) <= p
            # GPipe: each rank's m gradients go out after the previous stage's last word
            assert [len(pl.unreleased) for pl in plan_messages(gpipe(p, m))] == [0] + [m] * (p - 1)


# ---------------------------------------------------------------------------
# StashMeter: bytes autograd really keeps
# ---------------------------------------------------------------------------

def test_stash_meter_counts_saved_activations():
    import torch
    from helpers.pipeline.stash import StashMeter

    lin = torch.nn.Linear(8, 16)
    x1, x2 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    one = (4 * 8 + 4 * 16) * 4          # x (4, 8) and relu's output (4, 16), float32
    meter = StashMeter(exclude=list(lin.parameters()))   # W^T is saved too: not counted
    with meter.saving(("a", 0)):
        h = torch.relu(lin(x1))
    assert meter.live_bytes == one
    with meter.saving(("b", 0)):
        g = torch.relu(lin(x2))
        g2 = torch.relu(lin(x2))        # x2 saved again: one region, counted once
    assert meter.live_bytes == 2 * one + 4 * 16 * 4
    del g2                               # never backpropagated: dropping it frees it
    h.sum().backward(retain_graph=True)  # a kept graph keeps its bytes
    assert meter.live_bytes == 2 * one
    del h                                # graph dropped: its saved tensors go
    assert meter.live_bytes == one
    g.sum().backward()
    assert meter.live_bytes == 0
    # per chunk (0 here) the unit is the largest owner's forward; the peak counted
    # owner "a" (1) and owner "b" (its full forward, incl. g2: 1)
    assert meter.unit_bytes() == {0: one + 4 * 16 * 4}
    peak_bytes, peak_mb = meter.peaks()
    assert peak_bytes == 2 * one + 4 * 16 * 4
    assert peak_mb == pytest.approx(one / (one + 4 * 16 * 4) + 1)


def test_stash_meter_holds_until_the_tensor_dies():
    import torch
    from helpers.pipeline.stash import StashMeter

    meter = StashMeter()
    t = torch.zeros(10)
    meter.hold((0, 0), t)
    meter.hold((0, 0), t[:])            # the same region twice: counted once
    assert meter.live_bytes == 40
    del t
    import gc
    gc.collect()
    assert meter.live_bytes == 0


def test_step_time_formula_matches_the_simulator():
    """(m - 1) max t + sum t is the simulated makespan of GPipe when every stage's
    backward is twice its forward, and of 1F1B when the slowest stage is last
    (otherwise 1F1B is at most that); (m + p - 1) max t only bounds it."""
    import random
    rng = random.Random(1)
    for _ in range(30):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        t = [float(rng.choice([3, 6, 9, 12, 15])) for _ in range(p)]
        tf, tb = [x / 3 for x in t], [2 * x / 3 for x in t]
        formula = pipeline_step_time(t, m)
        # sums of a few dozen integers held in float64: exact up to a few roundings
        assert simulate(gpipe(p, m), tf, tb).total_time == pytest.approx(formula, rel=1e-12)
        ofob = simulate(one_f_one_b(p, m), tf, tb).total_time
        assert ofob <= formula * (1 + 1e-12)
        if t[-1] == max(t):
            assert ofob == pytest.approx(formula, rel=1e-12)
        assert formula <= (m + p - 1) * max(t)
    # the chapter 11 quiz: 10, 10, 10, 16 ms and m = 8 is 158 ms, not (8 + 3) x 16 = 176
    assert pipeline_step_time([10, 10, 10, 16], 8) == 158
    with pytest.raises(ValueError, match="num_microbatches"):
        pipeline_step_time([1.0], 0)


def test_partition_under_a_memory_limit():
    import itertools
    import random
    rng = random.Random(2)
    for _ in range(150):
        n = rng.randint(2, 8)
        k = rng.randint(1, min(n, 4))
        costs = [rng.choice([1, 2, 3, 5]) for _ in range(n)]
        mem = [rng.choice([1, 2, 3]) for _ in range(n)]
        limit = rng.choice([4, 6, 8, 12, 100])
        feasible = []
        for cuts in itertools.combinations(range(1, n), k - 1):
            b = [range(a, z) for a, z in zip((0, *cuts), (*cuts, n))]
            if max(stash_memory(mem, b)) <= limit:
                feasible.append(max(stage_costs(costs, b)))
        if not feasible:
            with pytest.raises(ValueError, match="memory_limit"):
                partition(costs, k, layer_memory=mem, memory_limit=limit)
            continue
        bounds = partition(costs, k, layer_memory=mem, memory_limit=limit)
        assert max(stash_memory(mem, bounds)) <= limit
        assert max(stage_costs(costs, bounds)) == min(feasible)
    # stage 0 stashes p micro-batches: the same layers cost it p times the memory
    assert stash_memory([1] * 8, partition(8, 4)) == [8, 6, 4, 2]
    # a limit of 6 moves a layer off stage 0: 1, 2, 2, 3 layers (stash 4, 6, 4, 3)
    assert partition(8, 4, layer_memory=[1] * 8, memory_limit=6) == \
        [range(0, 1), range(1, 3), range(3, 5), range(5, 8)]
    with pytest.raises(ValueError, match="together"):
        partition(8, 4, layer_memory=[1] * 8)


def test_a_stash_that_fills_the_limit_exactly_fits():
    """The limit is compared with a stated relative tolerance (partition.RTOL): sums of
    the same layer bytes in another order differ in the last bits, and without it a split
    whose stash fills the limit exactly was refused and a slower one returned."""
    from helpers.memory import activation_bytes_per_layer
    from helpers.pipeline.partition import RTOL

    layer = activation_bytes_per_layer(1024, 8, 768, 12, recompute="selective") / 1e9
    mem = [layer] * 12
    # chapter 11's case: 8 layers' worth of stash fits stage 2's 4 layers x 2 micro-batches
    bounds = partition(12, 4, layer_memory=mem, memory_limit=8 * layer)
    assert [len(r) for r in bounds] == [2, 2, 4, 4]
    assert max(stash_memory(mem, bounds)) == pytest.approx(8 * layer, rel=1e-12)
    # just outside the tolerance it no longer fits, and the split changes
    tighter = partition(12, 4, layer_memory=mem, memory_limit=8 * layer * (1 - 10 * RTOL))
    assert [len(r) for r in tighter] != [2, 2, 4, 4]
    assert max(stash_memory(mem, tighter)) <= 8 * layer
    # any split's own stash, computed by the caller's sums, is always a limit it fits
    import random
    rng = random.Random(5)
    for _ in range(100):
        n, k = rng.randint(2, 10), rng.randint(1, 4)
        k = min(k, n)
        mem = [rng.uniform(0.01, 1.0) for _ in range(n)]
        want = partition([1.0] * n, k)
        limit = max(stash_memory(mem, want))
        assert max(stash_memory(mem, partition([1.0] * n, k, layer_memory=mem,
                                               memory_limit=limit))) <= limit * (1 + RTOL)
        assert partition([1.0] * n, k, layer_memory=mem, memory_limit=limit) == want


def test_the_same_costs_in_any_unit_give_the_same_split():
    """Ties are compared relative to the costs (RTOL), so seconds, milliseconds or FLOPs
    give one split, broken by the stated rule (earlier stages lighter)."""
    costs = [0.1, 0.2, 0.3, 0.3, 0.2, 0.1]
    scaled = [c * 1e12 for c in costs]          # the same split in other units
    assert partition(costs, 3) == partition(scaled, 3) == partition([1, 2, 3, 3, 2, 1], 3)


def test_zb_h1_fills_the_drain_with_weight_gradients():
    """ZB-H1 (Qi et al. 2023, sec. 3.1) with T_F = T_B = T_W = 1: for m >= p the step is
    3m + (p-1)(T_F + T_B - T_W) units, a bubble of (p-1)/(3m+p-1), a third of 1F1B's idle
    time; in flight (F done, W not yet) at most p on every rank, 1F1B's rank-0 peak."""
    from helpers.pipeline import W, zb_h1

    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 16):
            sched = validate_schedule(zb_h1(p, m))
            sim = simulate(sched, 1.0, 2.0, t_weight=1.0)
            ref = simulate(one_f_one_b(p, m), 1.0, 2.0)
            assert sim.peak_stash == [min(p, m)] * p
            assert sim.bubble_fraction <= ref.bubble_fraction + 1e-12
            if m >= p:  # exact: small integers in binary floating point
                assert sim.total_time == 3 * m + (p - 1)
                assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-15)
                assert (p - 1) * 1 == ((ref.total_time - 3 * m) / 3)  # 1F1B idles 3x longer
            for row in sched:  # every W after its own B
                for i, a in enumerate(row):
                    if a.kind == "W":
                        assert Action("B", a.microbatch) in row[:i]
    # rank i lags i slots: rank 0 runs W right after B, rank 1 one slot later
    assert zb_h1(2, 3)[0][:4] == [F(0), F(1), B(0), W(0)]
    assert zb_h1(2, 3)[1][:4] == [F(0), B(0), F(1), B(1)]
    assert W(2) == Action("W", 2)


def test_weight_gradient_actions_are_checked():
    from helpers.pipeline import W

    with pytest.raises(ValueError, match="comes before its input-gradient backward B0"):
        validate_schedule([[F(0), W(0), B(0)]])
    with pytest.raises(ValueError, match="missing"):  # W for one micro-batch but not the other
        validate_schedule([[F(0), B(0), W(0), F(1), B(1)]])
    with pytest.raises(ValueError, match="cannot be larger"):
        simulate([[F(0), B(0), W(0)]], 1.0, 2.0, t_weight=3.0)
    # the split keeps the work: one rank, F + B + W = t_forward + t_backward
    assert simulate([[F(0), B(0), W(0)]], 1.0, 2.0, t_weight=0.5).total_time == 3.0
    from helpers.pipeline.executor import pipeline_step
    with pytest.raises(ValueError, match="simulator only"):
        pipeline_step([], [[F(0), B(0), W(0)]], None, None)
