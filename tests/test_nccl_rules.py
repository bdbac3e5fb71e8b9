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


def test_at_two_ranks_the_pair_is_the_same_so_the_lone_ring_runs():
    assert launch(_lone_ring_step, 2, **RULES) == [1.0, 0.0]


@pytest.mark.parametrize("p", [3, 4])
def test_a_batched_ring_runs_under_the_rules(p):
    assert launch(_batched_ring_step, p, **RULES) == [float((r - 1) % p) for r in range(p)]


def _pair_exchange_first(collective_first: str):
    """Ranks 0 and 1 of 3 exchange in a batch; rank 2 takes no part in it."""
    if collective_first == "all_reduce":
        dist.all_reduce(torch.ones(1))
    elif collective_first == "ddp":  # a collective torch issues from C++ (DDP's broadcast)
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
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
