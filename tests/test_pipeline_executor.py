"""The executor on real ranks equals the unsplit model, for every schedule, on 2-4
stages; its measured stash (bytes autograd really holds) equals the simulator's
count; sent tensors are released early; torch.distributed.pipelining gives the same
loss and gradients. One launch per world size runs all the cases (ranks are
pooled, so each launch after the first is cheap)."""

import pytest
import torch

from helpers import launch, rank_info
from helpers.model import build_model
from helpers.pipeline import gpipe, interleaved_1f1b, one_f_one_b, simulate
from helpers.pipeline.executor import (chunk_grads, pipeline_step, reference_grads,
                                       split_model)
from helpers.tolerance import assert_within_fp32_noise

N_LAYER, BATCH, SEQ = 8, 24, 16  # 8 blocks: room for 4 stages x 2 chunks


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (BATCH, SEQ), generator=g)
    y = torch.randint(0, 64, (BATCH, SEQ), generator=g)
    return x, y


def _references(x, y):
    """The unsplit model's loss and gradients in float32 and in float64 (the
    exact answer, to ~1e-16): the pipeline's float32 sums run in another order,
    so it must be as close to float64 as the float32 reference is
    (helpers.tolerance), whatever the machine's kernels."""
    ref_loss, ref = reference_grads(build_model("toy", n_layer=N_LAYER), x, y)
    ref64_loss, ref64 = reference_grads(build_model("toy", n_layer=N_LAYER).double(), x, y)
    return (ref_loss, ref), (ref64_loss, ref64)


def _cases(p):
    cases = [(gpipe(p, m), 1) for m in (1, p, 12)] + [(one_f_one_b(p, m), 1) for m in (2, 4, 6)]
    cases += [(interleaved_1f1b(p, p * k, 2), 2) for k in (1, 2)]
    # and an m that p does not divide (interleaving no longer needs it to)
    cases.append((interleaved_1f1b(p, {2: 3, 3: 8, 4: 6}[p], 2), 2))
    return cases


def _run_cases(cases):
    """Rank function: each case from a fresh copy of the same model."""
    info = rank_info()
    torch.set_num_threads(1)  # tiny ops; 4 ranks share 2 cores
    x, y = _batch()
    out = []
    for sched, v in cases:
        chunks = split_model(build_model("toy", n_layer=N_LAYER), info.world_size, v)[info.rank]
        res = pipeline_step(chunks, sched, x, y)
        assert len(res.timeline) == len(sched[info.rank])
        out.append((res.loss, chunk_grads(chunks), res.peak_stash, res.messages_sent,
                    res.peak_stash_bytes, res.stash_unit_bytes, res.peak_pending_sends))
    return out


def _train_two_steps(schedule_name):
    """Two SGD steps through the pipeline; returns this rank's final weights."""
    info = rank_info()
    torch.set_num_threads(1)
    p = info.world_size
    chunks = split_model(build_model("toy", n_layer=N_LAYER), p)[info.rank]
    params = [q for c in chunks for q in c.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    sched = {"gpipe": gpipe, "1f1b": one_f_one_b}[schedule_name](p, 4)
    losses = []
    for step in range(2):
        x, y = _batch(seed=10 + step)
        opt.zero_grad(set_to_none=False)
        for q in params:  # .grad must exist (zeros) before the step accumulates into it
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        losses.append(pipeline_step(chunks, sched, x, y).loss)
        opt.step()
    weights = {}
    for c in chunks:
        names = c.global_names()
        weights.update({names[n]: q.detach().clone() for n, q in c.named_parameters()})
    return losses, weights


def _two_pipelines():
    """4 ranks as 2 independent 2-stage pipelines (groups [0, 1] and [2, 3]), as a
    data x pipeline layout would use them; pipeline k gets batch k."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    group = groups[rank // 2]
    chunks = split_model(build_model("toy", n_layer=N_LAYER), 2)[dist.get_rank(group)]
    x, y = _batch(seed=rank // 2)
    res = pipeline_step(chunks, one_f_one_b(2, 4), x, y, group=group)
    return res.loss, chunk_grads(chunks)


@pytest.mark.slow
def test_pipelines_on_subgroups():
    results = launch(_two_pipelines, 4, backend="gloo", nccl_rules=True, timeout=120)
    for k in range(2):
        x, y = _batch(seed=k)
        (ref_loss, ref), (ref64_loss, ref64) = _references(x, y)
        first, last = results[2 * k], results[2 * k + 1]
        assert first[0] is None
        assert_within_fp32_noise(last[0], ref_loss, ref64_loss, "loss")
        assert_within_fp32_noise({**first[1], **last[1]}, ref, ref64, "grad")


@pytest.mark.slow
@pytest.mark.parametrize("p", [4, 3, 2])  # 2 last: the next test reuses its ranks
def test_pipeline_equals_unsplit_model(p):
    cases = _cases(p)
    results = launch(_run_cases, p, cases, backend="gloo", nccl_rules=True, timeout=120)
    x, y = _batch()
    (ref_loss, ref), (ref64_loss, ref64) = _references(x, y)
    for i, (sched, v) in enumerate(cases):
        grads = {}
        for r in range(p):
            grads.update(results[r][i][1])
        assert set(grads) == set(ref)
        # the loss is the mean of per-micro-batch means; equal sizes make it the batch
        # mean, but the sum order differs: float32 rounding, hence the bound
        assert_within_fp32_noise(results[-1][i][0], ref_loss, ref64_loss, f"loss {i}")
        assert all(results[r][i][0] is None for r in range(p - 1))
        # accumulation over micro-batches reorders float32 sums: rounding only
        assert_within_fp32_noise(grads, ref, ref64, f"case {i}")
        # the stash measured from the bytes autograd holds equals the schedule's count
        # (exactly: at the peak every live micro-batch holds all of its bytes)
        sim = simulate(sched)
        assert [results[r][i][2] for r in range(p)] == sim.peak_stash
        # every stage boundary carries one activation forward and one gradient back
        m = len(sched[0]) // (2 * v)
        assert sum(results[r][i][3] for r in range(p)) == 2 * m * (p * v - 1)
        for r in range(p):
            peak_bytes, units = results[r][i][4], results[r][i][5]
            assert all(u > 0 for u in units)
            if v == 1:  # one chunk: bytes = micro-batches x bytes of one micro-batch
                assert peak_bytes == sim.peak_stash[r] * units[0]
            # sent tensors are let go once delivered: 1F1B keeps at most p alive, not 2m
            if sim.peak_stash == [min(p - k, m) for k in range(p)] and v == 1:
                assert results[r][i][6] <= p, (r, results[r][i][6])


@pytest.mark.slow
def test_training_steps_match_single_process():
    results = launch(_train_two_steps, 2, "1f1b", backend="gloo", nccl_rules=True, timeout=120)
    ref = {}
    for dtype in (torch.float32, torch.float64):  # float64: the exact answer
        model = build_model("toy", n_layer=N_LAYER).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(2):
            x, y = _batch(seed=10 + step)
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        ref[dtype] = torch.tensor(losses, dtype=dtype), \
            {n: w.detach() for n, w in model.named_parameters()}
    (l32, w32), (l64, w64) = ref[torch.float32], ref[torch.float64]
    # other float32 summation order than one process: within its rounding noise
    assert_within_fp32_noise(torch.tensor(results[1][0]), l32, l64, "losses")
    assert_within_fp32_noise({**results[0][1], **results[1][1]}, w32, w64, "weights")
    # both copies of the tied weight stayed equal: the same update, bit for bit
    assert torch.equal(results[0][1]["wte.weight"], results[1][1]["wte.weight"])


def test_world_size_one_without_process_group():
    # p = 1, v = 2: both chunks on one rank; messages between them stay local
    model = build_model("toy", n_layer=N_LAYER)
    chunks = split_model(model, 1, 2)[0]
    x, y = _batch()
    res = pipeline_step(chunks, interleaved_1f1b(1, 4, 2), x, y)
    (ref_loss, ref), (ref64_loss, ref64) = _references(x, y)
    assert_within_fp32_noise(res.loss, ref_loss, ref64_loss, "loss")
    grads = chunk_grads(chunks)
    assert_within_fp32_noise(grads, ref, ref64, "grad")
    assert res.messages_sent == 0
    # without the stash meter (timing runs): the same gradients, no stash figures
    import math
    model2 = split_model(build_model("toy", n_layer=N_LAYER), 1, 2)[0]
    res2 = pipeline_step(model2, interleaved_1f1b(1, 4, 2), x, y, measure_stash=False)
    assert math.isnan(res2.peak_stash) and res2.peak_stash_bytes == 0
    for name, g in chunk_grads(model2).items():
        assert torch.equal(g, grads[name]), name  # the same operations: bit-equal


def test_split_by_measured_cost():
    model = build_model("toy", n_layer=4)
    # a heavy last block (it also runs the head): the last stage gets it alone
    stages = split_model(model, 2, layer_costs=[1, 1, 1, 5])
    assert [s[0].layers for s in stages] == [range(0, 3), range(3, 4)]
    assert stages[0][0].first and not stages[0][0].last and stages[1][0].last
    # interleaved: rank r holds virtual stages r, p + r
    chunks = split_model(model, 2, 2)
    assert [[c.layers for c in row] for row in chunks] == [[range(0, 1), range(2, 3)],
                                                           [range(1, 2), range(3, 4)]]


@pytest.mark.slow
@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_same_loss_and_grads_as_torch_pipelining(kind, v):
    from helpers.pipeline.measure import time_schedule
    args = (kind, 4, v)
    common = dict(steps=1, n_layer=4, return_grads=True)
    ours = launch(time_schedule, 2, *args, engine="ours", backend="gloo", **common)
    theirs = launch(time_schedule, 2, *args, engine="torch", backend="gloo", **common)
    assert ours[0]["loss"] is None and ours[1]["loss"] is not None
    # Same modules, same micro-batches, float32 sums in the same order: bit-equal.
    # PyTorch scales the summed micro-batch gradients by 1/m at the end, we scale
    # each loss by 1/m; with m = 4 that is a power of two, and multiplying by a
    # power of two commutes with rounding (it only changes the exponent), so
    # the two orders give the same bits. (With m = 3 they would differ by ulps.)
    assert ours[1]["loss"] == theirs[1]["loss"]
    for r in range(2):
        assert set(ours[r]["grads"]) == set(theirs[r]["grads"]) and ours[r]["grads"]
        for name, g in theirs[r]["grads"].items():
            assert torch.equal(ours[r]["grads"][name], g), f"rank {r} {name}"


def test_time_schedules_runs_each_run_as_its_own_launch_would():
    """Several runs in one launch (chapter 12's grid) give each run what a launch of
    that run alone gives: the same loss and gradients, bit for bit (each run builds its
    own model from the same seed), and the stash it measured."""
    from helpers.pipeline.measure import time_schedule, time_schedules
    runs = [dict(kind="1f1b", m=4, return_grads=True), dict(kind="interleaved", m=4, v=2)]
    together = launch(time_schedules, 2, runs, steps=1, n_layer=4, backend="gloo")
    for i, run in enumerate(runs):
        alone = launch(time_schedule, 2, steps=1, n_layer=4, backend="gloo", **run)
        for r in range(2):
            got, want = together[r][i], alone[r]
            assert (got["loss"], got["peak_stash"]) == (want["loss"], want["peak_stash"])
            for name, g in want.get("grads", {}).items():
                assert torch.equal(got["grads"][name], g), f"run {i} rank {r} {name}"


def _leaky_then_outsider():
    """Rank function (2 ranks): 1F1B with a loss function that keeps every loss (and so
    every micro-batch's graph and received input) alive, then a call from outside the
    pipeline's group."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    info = rank_info()
    kept = []

    def leaky_loss(logits, targets):
        from helpers.model import lm_loss
        kept.append(lm_loss(logits, targets))
        return kept[-1]

    chunks = split_model(build_model("toy", n_layer=N_LAYER), 2)[info.rank]
    x, y = _batch()
    res = pipeline_step(chunks, one_f_one_b(2, 4), x, y, loss_fn=leaky_loss)
    alone = dist.new_group([0])          # every rank creates it; rank 1 is not in it
    whole = split_model(build_model("toy", n_layer=N_LAYER), 1)[0]
    try:
        pipeline_step(whole, one_f_one_b(1, 4), x, y, group=alone)
        err = None
    except ValueError as exc:
        err = str(exc)
    return res.peak_stash, res.stash_unit_bytes[0], err


@pytest.mark.slow
def test_measured_stash_sees_what_is_alive_and_outsiders_are_refused():
    (stash0, _, err0), (stash1, unit1, err1) = launch(_leaky_then_outsider, 2,
                                                      backend="gloo")
    # The schedule's count says [2, 1]. The kept losses keep each micro-batch's graph,
    # and with it the received activation (6, 16, 32) float32 it was built on: at the
    # last forward, the other 3 micro-batches' inputs are still alive on rank 1.
    assert stash0 == 2
    assert stash1 == pytest.approx(1 + 3 * (BATCH // 4) * SEQ * 32 * 4 / unit1, rel=1e-9)
    # rank 0 is in the one-rank group (p = 1 runs fine there), rank 1 is not
    assert err0 is None
    assert err1 is not None and "rank 1 is not a member of the process group" in err1


def test_errors_before_any_rank_starts():
    model = build_model("toy", n_layer=2)
    with pytest.raises(ValueError, match="2 transformer block.*4 stages x 1 chunk"):
        split_model(model, 4)
    with pytest.raises(ValueError, match="2 stages x 2 chunk"):
        split_model(build_model("toy", n_layer=3), 2, 2)
    chunks = split_model(model, 1)[0]
    x, y = _batch()
    with pytest.raises(ValueError, match="not divisible by 5 micro-batches"):
        pipeline_step(chunks, gpipe(1, 5), x, y)
    with pytest.raises(ValueError, match="holds 1 chunk"):
        pipeline_step(chunks, interleaved_1f1b(1, 2, 2), x, y)
    # a schedule that would hang is refused before any message is sent
    from helpers.pipeline import B, F
    reversed_warmup = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]]
    with pytest.raises(ValueError, match="deadlocks: rank 0 at B0 waits for B0 on rank 1"):
        pipeline_step(split_model(model, 2)[0], reversed_warmup, x, y)
    with pytest.raises(ValueError, match="before its forward"):
        pipeline_step(chunks, [[B(0), F(0)]], x, y)


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--size", "huge"], "--size must be one of"),
    (["--seq-len", "65"], r"--seq-len must be in \[1, 64\] for size 'tiny'"),
    (["--n-layer", "3"], "--n-layer must be >= 2 x --stages = 4"),
    (["--stages", "3", "--n-layer", "5"], "--n-layer must be >= 2 x --stages = 6"),
    (["--stages", "1"], "--stages must be >= 2"),
    (["--tries", "0"], "--tries must be >= 1"),
])
def test_benchmark_refuses_bad_arguments_before_any_rank_starts(argv, message, load_bench):
    bench = load_bench("bench_pipeline")
    with pytest.raises(ValueError, match=message):
        bench.main(argv)


def test_a_stage_compute_time_is_one_forward_and_backward_and_leaves_no_gradient():
    """What solution 11 reads as a GPU stage's busy time (its compute by the course clock)."""
    from helpers.model import build_model
    from helpers.pipeline.executor import split_model
    from helpers.pipeline.measure import stage_compute_seconds

    x = torch.randint(0, 64, (4, 16))
    for chunks in split_model(build_model("toy", n_layer=4), 2):
        seconds = stage_compute_seconds(chunks[0], x, x)
        assert 0 < seconds < 5
        assert all(p.grad is None for p in chunks[0].parameters())
