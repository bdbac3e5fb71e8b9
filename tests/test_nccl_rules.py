"""helpers.launch.nccl_rules: each rule triggers on CPU ranks, and leaves right code alone.

Every test here names ``nccl_rules=`` explicitly, so it means the same whether or not
the run has ``COURSE_NCCL_RULES=1`` in its environment (``make test`` sets it).
"""

import pytest
import torch
import torch.distributed as dist

from helpers import RankError, RankTimeout, launch, rank_info
from helpers.launch import nccl_rules

RULES = dict(nccl_rules=True)
GLOO = dict(nccl_rules=False)


def _lone_ring_step():
    """Lab 03's first exchange as it was handed out: a lone isend to the right, then a
    lone irecv from the left (fine on gloo; on nccl each is a pair's first call)."""
    r, p = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(1)
    reqs = [dist.isend(torch.tensor([float(r)]), (r + 1) % p),
            dist.irecv(got, (r - 1) % p)]
    for q in reqs:
        q.wait()
    return got.item()


def _batched_ring_step():
    r, p = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(r)]), (r + 1) % p),
           dist.P2POp(dist.irecv, got, (r - 1) % p)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    return got.item()


@pytest.mark.parametrize("p", [3, 4])
def test_a_ring_of_lone_sends_hangs_under_the_rules_and_the_timeout_names_the_cycle(p):
    assert launch(_lone_ring_step, p, **GLOO) == [float((r - 1) % p) for r in range(p)]
    with pytest.raises(RankTimeout) as err:
        launch(_lone_ring_step, p, timeout=3, **RULES)
    text = str(err.value)
    assert "Under NCCL's rules" in text and "batch_isend_irecv" in text
    for r in range(p):
        assert f"rank {r}: its first lone isend to rank {(r + 1) % p}" in text
        assert f"waits for rank {(r + 1) % p} to join their two-rank communicator" in text


def _exchange(order: str, numel: int = 1 << 20):
    """Two ranks swap 4 MiB with lone calls: "send first" on both ranks (the hang nccl
    users meet most), or rank 0 sending first and rank 1 receiving first (right)."""
    from torch.distributed import irecv, isend   # imported by name: the rules see it too

    r = dist.get_rank()
    x, y = torch.full((numel,), float(r)), torch.empty(numel)
    if order == "send first" or r == 0:
        works = [isend(x, 1 - r), irecv(y, 1 - r)]
    else:
        works = [irecv(y, 1 - r), isend(x, 1 - r)]
    for w in works:
        w.wait()
    return y[0].item()


def test_a_pairs_lone_calls_share_one_stream_so_two_sends_first_hang():
    """Rule 8: at p = 2 the pair's communicator forms, and then each rank's receive
    waits on its stream behind a send that waits for the peer's receive."""
    assert launch(_exchange, 2, "send first", **GLOO) == [1.0, 0.0]
    assert launch(_exchange, 2, "rank 1 receives first", **RULES) == [1.0, 0.0]
    with pytest.raises(RankTimeout) as err:
        launch(_exchange, 2, "send first", timeout=3, **RULES)
    text = str(err.value)
    for r in (0, 1):
        assert (f"rank {r}: its lone isend to rank {1 - r}" in text and
                f"waits for rank {1 - r}'s stream to reach the matching lone receive" in text)
    assert "one after another on one stream" in text and "batch_isend_irecv" in text
    # the lone ring of lab 03 at p = 2 is this exchange, 4 bytes each way
    with pytest.raises(RankTimeout, match="on one stream"):
        launch(_lone_ring_step, 2, timeout=3, **RULES)


def _post_as(calls, numel: int = 256):
    """Post one rank's calls (``p2p.comm_calls``) as nccl's host does: all of them, in
    order, without waiting (batched ones in one batch_isend_irecv); then wait for all."""
    from helpers.pipeline.p2p import post

    works, got = [], []
    for batched, ops in calls:
        tensors = []
        for kind, msg in ops:
            t = torch.full((numel,), float(hash(msg) % 1000)) if kind == "send" \
                else torch.empty(numel)
            tensors.append((kind, t, msg.dst if kind == "send" else msg.src, 0))
            if kind == "recv":
                got.append((msg, t))
        if batched:
            works += post(tensors)
        else:
            works += [(dist.isend if kind == "send" else dist.irecv)(t, peer)
                      for kind, t, peer, _ in tensors]
    for w in works:
        w.wait()
    return all(t[0].item() == float(hash(msg) % 1000) for msg, t in got)


def _schedules():
    from helpers.pipeline.schedules import gpipe, interleaved_1f1b, one_f_one_b

    return {"1F1B 2x4 separate": (one_f_one_b(2, 4), "separate"),
            "1F1B 2x4 steps": (one_f_one_b(2, 4), "steps"),
            "1F1B 3x3 separate": (one_f_one_b(3, 3), "separate"),
            "interleaved 2x4x2 steps": (interleaved_1f1b(2, 4, 2), "steps"),
            "GPipe 2x2 pairs": (gpipe(2, 2), "pairs")}


@pytest.mark.parametrize("name", list(_schedules()))
def test_the_rules_and_stream_model_agree_on_the_course_schedules(name):
    """The same posted calls, played by ``stream_model`` (no rank) and run on ranks under
    the rules: both stall or neither does. Lone calls stall 1F1B; batched pairs next to
    lone calls never meet (rule 9); the executor's steps never stall."""
    from helpers.pipeline.p2p import ScheduleDeadlock, comm_calls, plan_messages, stream_model

    sched, how = _schedules()[name]
    calls = [comm_calls(pl, how) for pl in plan_messages(sched)]
    try:
        stream_model(calls)
        stalls = False
    except ScheduleDeadlock:
        stalls = True

    def rank_fn(all_calls):
        return _post_as(all_calls[dist.get_rank()])
    if stalls:
        with pytest.raises(RankTimeout, match="Under NCCL's rules"):
            launch(rank_fn, len(calls), calls, timeout=4, **RULES)
    else:
        assert launch(rank_fn, len(calls), calls, **RULES) == [True] * len(calls)
    assert stalls == ("steps" not in name)


def _lone_meets_batched():
    r = dist.get_rank()
    dist.all_reduce(torch.ones(1))   # the group's communicator exists,
    t = torch.full((4,), float(r))
    if r == 0:                       # and so does the pair's: only rule 9 is left
        dist.send(t, 1)
        dist.isend(t, 1).wait()
        return None
    dist.recv(t, 0)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
        w.wait()
    return t[0].item()


def test_a_lone_send_never_meets_a_batched_receive():
    assert launch(_lone_meets_batched, 2, **GLOO) == [None, 0.0]
    with pytest.raises(RankTimeout, match="never matches a lone one"):
        launch(_lone_meets_batched, 2, timeout=3, **RULES)


def _unpack_batch():
    r = dist.get_rank()
    got = torch.zeros(2)
    send_req, recv_req = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 1 - r),
                                                 dist.P2POp(dist.irecv, got, 1 - r)])
    send_req.wait()
    recv_req.wait()
    return got.tolist()


def test_a_batch_is_one_work_as_on_nccl():
    """Rule 10: nccl coalesces a batch into one Work; unpacking two fails there."""
    assert launch(_unpack_batch, 2, **GLOO) == [[1.0, 1.0]] * 2
    with pytest.raises(RankError, match="not enough values to unpack"):
        launch(_unpack_batch, 2, **RULES)
    assert launch(_batched_ring_step, 2, **RULES) == [1.0, 0.0]


@pytest.mark.parametrize("p", [3, 4])
def test_a_batched_ring_runs_under_the_rules(p):
    assert launch(_batched_ring_step, p, **RULES) == [float((r - 1) % p) for r in range(p)]


def _pair_exchange_first(collective_first: str):
    """Ranks 0 and 1 of 3 exchange in a batch; rank 2 takes no part in it."""
    if collective_first == "all_reduce":
        dist.all_reduce(torch.ones(1))
    elif collective_first == "ddp":  # a collective torch issues from C++ (DDP's broadcast)
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    elif collective_first == "barrier":
        dist.barrier()
    elif collective_first == "all_gather_object":
        dist.all_gather_object([None] * dist.get_world_size(), dist.get_rank())
    r = dist.get_rank()
    if r < 2:
        got = torch.zeros(1)
        ops = [dist.P2POp(dist.isend, torch.tensor([float(r)]), 1 - r),
               dist.P2POp(dist.irecv, got, 1 - r)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        return got.item()
    return None


def test_a_first_batch_of_some_ranks_hangs_until_the_group_has_a_communicator():
    assert launch(_pair_exchange_first, 3, "none", **GLOO) == [1.0, 0.0, None]
    with pytest.raises(RankTimeout) as err:
        launch(_pair_exchange_first, 3, "none", timeout=3, **RULES)
    assert "first use of the group's communicator" in str(err.value)
    assert "include every rank in that first batch" in str(err.value)
    for first in ("all_reduce", "ddp"):
        assert launch(_pair_exchange_first, 3, first, **RULES) == [1.0, 0.0, None]
    # a barrier and an object collective run on gloo on a node: they create nothing
    for first in ("barrier", "all_gather_object"):
        with pytest.raises(RankTimeout, match="first use of the group's communicator"):
            launch(_pair_exchange_first, 3, first, timeout=3, **RULES)


def _monitored(on: str):
    group = dist.new_group(backend="gloo") if on == "gloo group" else None
    dist.monitored_barrier(group=group)
    return rank_info().nccl_rules


def test_monitored_barrier_is_refused_on_the_default_group_and_runs_on_a_gloo_group():
    assert launch(_monitored, 2, "default", **GLOO) == [False, False]
    with pytest.raises(RankError, match=r"ValueError: monitored_barrier is only implemented "
                                        r"for GLOO backend\."):
        launch(_monitored, 2, "default", **RULES)
    assert launch(_monitored, 2, "gloo group", **RULES) == [True, True]


def _reduce(dtype: str, op: str = "SUM"):
    t = torch.ones(3, dtype=getattr(torch, dtype))
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


@pytest.mark.parametrize("dtype, name", [("int16", "Short"), ("uint16", "UInt16")])
def test_a_dtype_nccl_has_no_type_for_is_refused_with_its_message(dtype, name):
    with pytest.raises(RankError, match="TypeError: Input tensor data type is not supported "
                                        f"for NCCL process group: {name}"):
        launch(_reduce, 2, dtype, **RULES)
    assert launch(_reduce, 2, "bfloat16", **RULES) == [[2.0] * 3] * 2


def test_bitwise_reductions_are_refused():
    assert launch(_reduce, 2, "int32", "BAND", **GLOO) == [[1] * 3] * 2
    with pytest.raises(RankError, match=r"ValueError: Cannot use ReduceOp\.BAND with NCCL"):
        launch(_reduce, 2, "int32", "BAND", **RULES)


def _recv_any():
    t = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.send(torch.ones(1), 1)
    else:
        dist.recv(t)
    return t.item()


def test_a_receive_from_any_source_is_refused():
    assert launch(_recv_any, 2, **GLOO) == [0.0, 1.0]
    with pytest.raises(RankError, match="NotImplementedError: ProcessGroupNCCL does not "
                                        "support recvAnysource"):
        launch(_recv_any, 2, **RULES)


def _tagged():
    """Rank 0 sends 1 (tag 1) then 2 (tag 2); rank 1 asks for tag 2 first."""
    if dist.get_rank() == 0:
        works = [dist.isend(torch.tensor([1.0]), 1, tag=1), dist.isend(torch.tensor([2.0]), 1, tag=2)]
        for w in works:
            w.wait()
        return None
    a, b = torch.zeros(1), torch.zeros(1)
    works = [dist.irecv(a, 0, tag=2), dist.irecv(b, 0, tag=1)]
    for w in works:
        w.wait()
    return a.item(), b.item()


def test_tags_are_ignored_messages_match_in_posting_order():
    assert launch(_tagged, 2, **GLOO)[1] == (2.0, 1.0)   # gloo matches by tag
    assert launch(_tagged, 2, **RULES)[1] == (1.0, 2.0)  # nccl: first posted, first matched


def test_the_environment_variable_turns_the_rules_on(monkeypatch):
    info = lambda: rank_info().nccl_rules  # noqa: E731
    monkeypatch.setenv(nccl_rules.ENV, "1")
    assert launch(info, 2) == [True, True]
    assert launch(info, 2, nccl_rules=False) == [False, False]
    monkeypatch.setenv(nccl_rules.ENV, "0")
    assert launch(info, 2) == [False, False]


def _recorded_ring():
    from helpers.debug import record_collectives

    with record_collectives() as rec:
        value = _batched_ring_step()
    return value, [c.op for c in rec.calls]


def test_the_rules_and_the_collective_recorder_stack():
    """The recorder wraps the rules' functions and puts them back: each batched send
    and receive is recorded once, and the rules still apply after it."""
    got = launch(_recorded_ring, 3, **RULES)
    assert [v for v, _ in got] == [2.0, 0.0, 1.0]
    assert all(ops == ["isend", "irecv"] for _, ops in got)


def _blocking_pair():
    """dist.send/recv post through the module's isend/irecv (torch 2.13): one operation,
    which the spy records once and the rules count once."""
    from helpers.checks.spy import communication_spy

    r = dist.get_rank()
    with communication_spy(keep_values=False) as spy:
        if r == 0:
            dist.send(torch.ones(3), 1)
        else:
            dist.recv(torch.zeros(3), 0)
    return len(spy.sends), len(spy.recvs)


def test_a_blocking_send_is_one_operation_for_the_spy_and_the_rules():
    assert launch(_blocking_pair, 2, **RULES) == [(1, 0), (0, 1)]
    assert launch(_blocking_pair, 2, **GLOO) == [(1, 0), (0, 1)]


def _strided_all_reduce():
    t = torch.ones(4, 4).t()          # a transposed view: not contiguous
    dist.all_reduce(t)
    return t.sum().item()


def test_a_non_contiguous_tensor_is_refused_as_nccl_does():
    """Rule 11: gloo copies it, nccl raises."""
    assert launch(_strided_all_reduce, 2, **GLOO) == [32.0, 32.0]
    with pytest.raises(RankError, match="ValueError: Tensors must be contiguous"):
        launch(_strided_all_reduce, 2, **RULES)


def _first_use_cycle():
    """Three groups of two; each rank's first collective on one group is asynchronous,
    then it goes on to the next group: 0 starts {0,1}, 1 starts {1,2}, 2 starts {0,2}."""
    groups = {k: dist.new_group(list(k)) for k in ((0, 1), (1, 2), (0, 2))}
    r = dist.get_rank()
    order = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}[r]
    first = dist.all_reduce(torch.ones(1), group=groups[order[0]], async_op=True)
    dist.all_reduce(torch.ones(1), group=groups[order[1]])
    first.wait()
    return r


def test_a_first_use_of_groups_in_a_circle_hangs_even_asynchronously():
    """Rule 2: a group's first collective blocks the host until its ranks all get there."""
    assert launch(_first_use_cycle, 3, **GLOO) == [0, 1, 2]
    with pytest.raises(RankTimeout, match="first use of the group's communicator"):
        launch(_first_use_cycle, 3, timeout=3, **RULES)


def _comm_reduce_scatter(dtype: str):
    from helpers.comm import reduce_scatter   # torch's function bound at import

    out = torch.empty(2, dtype=getattr(torch, dtype))
    reduce_scatter(out, torch.ones(2 * dist.get_world_size(), dtype=getattr(torch, dtype)))
    return out.tolist()


def test_the_rules_see_calls_through_names_bound_before():
    """helpers.comm binds torch's reduce_scatter_single at import: the rules see it."""
    with pytest.raises(RankError, match="not supported for NCCL process group: Short"):
        launch(_comm_reduce_scatter, 2, "int16", **RULES)
    assert launch(_comm_reduce_scatter, 2, "float32", **RULES) == [[2.0, 2.0]] * 2


def test_the_environment_leaves_a_launch_that_asks_for_gloo_alone(monkeypatch):
    """A node runs backend="gloo" on gloo: COURSE_NCCL_RULES=1 means no rules there;
    an explicit nccl_rules=True still turns them on."""
    info = lambda: rank_info().nccl_rules  # noqa: E731
    monkeypatch.setenv(nccl_rules.ENV, "1")
    assert launch(info, 2, backend="gloo") == [False, False]
    assert launch(info, 2, backend="gloo", nccl_rules=True) == [True, True]
    assert launch(info, 2) == [True, True]
