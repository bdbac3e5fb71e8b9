"""The short 1F1B loop (helpers/pipeline/plain_1f1b.py) equals the executor running
``one_f_one_b(p, m)`` bit for bit (loss and every gradient), on 2-4 stages with
m = 1, p - 1, p and 2p + 1 micro-batches, and the unsplit model within float32
rounding; the sends and receives it posts do not stall under nccl's rules
(``p2p.stream_model``), and would if it did not pair them; it refuses bad input
before any message moves. One launch per world size runs all its cases."""

import collections

import pytest
import torch

from helpers import launch, rank_info
from helpers.model import build_model
from helpers.pipeline import one_f_one_b
from helpers.pipeline.executor import chunk_grads, pipeline_step, reference_grads, split_model
from helpers.pipeline.p2p import ACTIVATION, GRADIENT, Message, stream_model
from helpers.pipeline.simulate import ScheduleDeadlock
from helpers.pipeline.plain_1f1b import one_f_one_b_step
from helpers.tolerance import assert_within_fp32_noise

N_LAYER, MICROBATCH, SEQ = 8, 2, 16  # the executor tests' toy GPT with 8 blocks


def _microbatch_counts(p):
    return sorted({1, p - 1, p, 2 * p + 1})  # m < p, m = p, odd m > p


def _batch(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (MICROBATCH * m, SEQ), generator=g)
    y = torch.randint(0, 64, (MICROBATCH * m, SEQ), generator=g)
    return x, y


def _both(ms):
    """Rank function: per m, the executor and the short loop, each on a fresh split
    of the same model; (loss, grads) of each, and the short loop's posted calls."""
    from helpers.pipeline import plain_1f1b
    info = rank_info()
    torch.set_num_threads(1)  # tiny ops; 4 ranks share the cores
    real_post, calls = plain_1f1b.post, []

    def recording_post(ops, group=None):  # each call: ((kind, peer), ...) posted together
        if ops:  # an empty call posts nothing (a neighbour past the pipeline's end)
            calls.append(tuple((kind, peer) for kind, _, peer, _ in ops))
        return real_post(ops, group)

    plain_1f1b.post = recording_post  # this rank process is thrown away after the launch
    out = []
    for m in ms:
        x, y = _batch(m)
        chunks = split_model(build_model("toy", n_layer=N_LAYER), info.world_size)[info.rank]
        loss = pipeline_step(chunks, one_f_one_b(info.world_size, m), x, y).loss
        stage = split_model(build_model("toy", n_layer=N_LAYER), info.world_size)[info.rank][0]
        calls.clear()
        loss2 = one_f_one_b_step(stage, x, y, m)
        out.append(((loss, chunk_grads(chunks)), (loss2, chunk_grads([stage])), list(calls)))
    return out


def _as_messages(recorded):
    """Per rank, its posted calls as ``stream_model`` takes them: the k-th send from a to
    b is the k-th receive at b from a (nccl matches a rank pair's messages in order)."""
    count = collections.Counter()
    out = []
    for r, rank_calls in enumerate(recorded):
        row = []
        for call in rank_calls:
            ops = []
            for kind, peer in call:
                src, dst = (r, peer) if kind == "send" else (peer, r)
                k = count[(kind, src, dst)]
                count[(kind, src, dst)] += 1
                ops.append((kind, Message(ACTIVATION if dst == src + 1 else GRADIENT, k,
                                          src, dst, src, dst, 0)))
            row.append((True, tuple(ops)))  # batched: all on the group's communicator
        out.append(row)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("p", [4, 3, 2])
def test_equals_executor_bit_for_bit_and_unsplit_model(p):
    ms = _microbatch_counts(p)
    results = launch(_both, p, ms, backend="gloo", nccl_rules=True, timeout=120)
    for i, m in enumerate(ms):
        (exec_loss, _), (loss, _), _ = results[-1][i]
        assert loss == exec_loss and loss is not None, (p, m)
        assert all(results[r][i][1][0] is None for r in range(p - 1))
        ours, theirs = {}, {}
        for r in range(p):
            theirs.update(results[r][i][0][1])
            ours.update(results[r][i][1][1])
        assert set(ours) == set(theirs)
        for name, g in theirs.items():
            assert torch.equal(ours[name], g), f"p = {p}, m = {m}: {name}"
        # and the unsplit model, within float32 rounding (as the executor's tests)
        x, y = _batch(m)
        ref_loss, ref = reference_grads(build_model("toy", n_layer=N_LAYER), x, y)
        ref64_loss, ref64 = reference_grads(build_model("toy", n_layer=N_LAYER).double(), x, y)
        assert set(ours) == set(ref)
        assert_within_fp32_noise(loss, ref_loss, ref64_loss, f"loss p={p} m={m}")
        assert_within_fp32_noise(ours, ref, ref64, f"grads p={p} m={m}")
        # what it posted, played on nccl's streams: no stall; each call alone: a stall
        calls = _as_messages([results[r][i][2] for r in range(p)])
        assert sum(op[0] == "send" for row in calls for _, ops in row for op in ops) \
            == 2 * m * (p - 1)
        stream_model(calls)
        if m >= 2:
            unpaired = [[(True, (op,)) for _, ops in row for op in ops] for row in calls]
            with pytest.raises(ScheduleDeadlock):
                stream_model(unpaired)


def test_one_rank_without_process_group():
    # p = 1: no warm-up, no messages; the same operations as the executor, so bit-equal
    x, y = _batch(3)
    stage = split_model(build_model("toy", n_layer=N_LAYER), 1)[0][0]
    loss = one_f_one_b_step(stage, x, y, 3)
    chunks = split_model(build_model("toy", n_layer=N_LAYER), 1)[0]
    assert loss == pipeline_step(chunks, one_f_one_b(1, 3), x, y).loss
    ours, theirs = chunk_grads([stage]), chunk_grads(chunks)
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], g) for n, g in theirs.items())


@pytest.mark.parametrize("stage,m,message", [
    ("chunk", 0, "num_microbatches must be a positive int, got 0"),
    ("chunk", -2, "num_microbatches must be a positive int, got -2"),
    ("chunk", 2.0, "num_microbatches must be a positive int, got 2.0"),
    ("chunk", True, "num_microbatches must be a positive int, got True"),
    ("chunk", 4, "batch size 6 is not divisible by 4 micro-batches"),
    ("list", 3, r"stage must be this rank's StageChunk \(split_model\(model, p\)\[rank\]\[0\]\), "
                "got list"),
    ("first of two", 3, r"rank 0 of 1 holds a stage with first=True, last=False: cut the model "
                        r"into 1 stages"),
])
def test_refuses_bad_input_before_any_message(stage, m, message):
    x, y = _batch(3)  # 6 sequences
    model = build_model("toy", n_layer=N_LAYER)
    stage = {"chunk": lambda: split_model(model, 1)[0][0],
             "list": lambda: split_model(model, 1)[0],
             "first of two": lambda: split_model(model, 2)[0][0]}[stage]()
    with pytest.raises(ValueError, match=message):
        one_f_one_b_step(stage, x, y, m)
    stages = stage if isinstance(stage, list) else [stage]
    assert all(q.grad is None for st in stages for q in st.parameters())  # nothing ran
