"""helpers.checkpoint: bitwise resume, killed ranks, crashes mid-save, corruption, resharding.

Launch sizes are grouped (2, then 4, then 2, then 3 ranks) so that pools are
reused; every checkpoint lives in a pytest tmp_path.
"""

import os
import random
import signal

import numpy as np
import pytest
import torch

from helpers import RankError, launch, rank_info
from helpers.checkpoint import (AsyncSaver, CheckpointMismatch, Shard, load_latest,
                                load_scaler_state, load_zero_state, rng_state, save,
                                scaler_state, set_rng_state, zero_request, zero_state)
from helpers.checkpoint import failures
from helpers.checkpoint.train import resumable_run
from helpers.model import build_model
from helpers.precision import DynamicLossScaler


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The first torch.optim optimizer built in a fresh rank imports torch._dynamo
# (12.6 s in one process on a 2-core machine shared with other jobs); 4 such
# ranks on 2 busy cores can pass launch's default 60 s. Launches of runs with a
# torch.optim optimizer below get room for that; a deadlock still ends in 300 s.
SLOW = dict(timeout=300)


# --------------------------------------------------------------------------
# Single process: the state tree, RNG, scaler, shape checks.
# --------------------------------------------------------------------------

def test_rng_state_round_trip_covers_every_stream():
    s = rng_state()
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99); random.seed(99); np.random.seed(99)  # noqa: E702
    set_rng_state(s)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_scaler_state_round_trip(tmp_path):
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3)
    scaler.update(found_inf=True)
    scaler.update(found_inf=False)
    save(str(tmp_path), {"scaler": scaler_state(scaler)}, 1)
    fresh = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3)
    load_scaler_state(fresh, load_latest(str(tmp_path)).state["scaler"])
    assert (fresh.scale_value, fresh.clean_steps) == (2.0 ** 9, 1)


def test_save_refuses_objects_weights_only_cannot_load(tmp_path):
    with pytest.raises(RuntimeError, match=r"/extra/fn: a builtin_function_or_method cannot be saved"):
        save(str(tmp_path), {"extra": {"fn": print}}, 1)
    assert os.listdir(tmp_path) == []  # refused before any file was written


def _outputs_at(threads: int) -> tuple:
    """A matmul with a long inner dimension and LayerNorm's forward and backward,
    on ``threads`` intra-op threads (the caller's count is put back), with the
    inputs, for the bounds below."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(32, 4096, generator=g), torch.randn(4096, 32, generator=g)
        # LayerNorm over 4096 rows of 256: many rows, so that per-thread partial sums
        # of the weight and bias gradients cover many additions each
        x, dy = torch.randn(4096, 256, generator=g), torch.randn(4096, 256, generator=g)
        w, bias = torch.randn(256, generator=g), torch.randn(256, generator=g)
        w.requires_grad_(), bias.requires_grad_()
        y = torch.nn.functional.layer_norm(x, (256,), w, bias)
        y.backward(dy)
        return (a @ b, y.detach(), w.grad, bias.grad), (a, b, x, dy)
    finally:
        torch.set_num_threads(before)


def _two_orders_bound(terms: torch.Tensor, dim: int) -> torch.Tensor:
    """How far apart two float32 sums of the same n terms can be, whatever order each
    adds them in: each is within gamma(n) * sum|term| of the exact sum (Higham,
    Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 4.2, eq. 4.4, with
    gamma(n) = n u / (1 - n u), u = 2^-24 the unit roundoff), so the two are within
    twice that. Holds for any summation order and blocking, with or without FMA, so
    for any CPU and any thread count. The terms are taken in float64."""
    n = terms.shape[dim]
    u = torch.finfo(torch.float32).eps / 2
    gamma = n * u / (1 - n * u)
    return 2 * gamma * terms.abs().sum(dim)


def test_the_intra_op_thread_count_changes_the_bits():
    """Why resumable_run pins its thread count: the same inputs, 1 thread or 4.

    What holds on every CPU (ATen's own kernel, torch 2.13's
    aten/src/ATen/native/cpu/layer_norm_kernel.cpp): LayerNorm's backward adds the
    rows' contributions to the weight and bias gradients into one buffer per thread
    and then adds the buffers, so 1 and 4 threads add in other orders. 4096 rows
    of 256 columns: for all 256 column sums of 4096 random terms to round alike in
    two orders would take a coincidence far below anything a test run can meet.
    LayerNorm's forward is per row and does not change with the threads.

    What depends on the CPU: whether the BLAS splits a matmul's inner dimension
    over the threads (MKL on an Intel Xeon splits K = 4096, on an AMD EPYC the same
    torch build gave equal bits). So the matmul is only held to the rounding
    bound that any order obeys, as are the gradients."""
    (mm1, out1, w1, b1), (a, b, x, dy) = _outputs_at(1)
    (mm4, out4, w4, b4), _ = _outputs_at(4)
    assert torch.equal(out1, out4)
    assert not torch.equal(w1, w4) and not torch.equal(b1, b4)
    a64, b64, dy64 = a.double(), b.double(), dy.double()
    xhat = torch.nn.functional.layer_norm(x.double(), (256,))
    products = a64[:, :, None] * b64[None, :, :]                  # (32, 4096, 32)
    for got1, got4, bound in (
            (mm1, mm4, _two_orders_bound(products, 1)),
            # dgamma's terms dy * xhat; xhat in float32 is within a few u of float64's,
            # which the factor 2 on the bound covers many times over
            (w1, w4, 2 * _two_orders_bound(dy64 * xhat, 0)),
            (b1, b4, _two_orders_bound(dy64, 0))):
        assert ((got1.double() - got4.double()).abs() <= bound).all()


def test_load_into_another_model_config_names_the_tensor(tmp_path):
    model = build_model("toy")
    save(str(tmp_path), {"model": model.state_dict()}, 5)
    wider = build_model("toy", n_embd=48)
    with pytest.raises(CheckpointMismatch, match=r"/model/wte.weight: the checkpoint has shape "
                                                 r"\(64, 32\), this run expects \(64, 48\)"):
        load_latest(str(tmp_path), like={"model": wider.state_dict()})


def test_latest_complete_wins_and_partials_are_named(tmp_path):
    d = str(tmp_path)
    for step in (2, 4):
        save(d, {"x": torch.full((3,), float(step))}, step)
    os.makedirs(os.path.join(d, "step00000006.partial"))  # a save that never finished
    got = load_latest(d)
    assert got.step == 4 and torch.equal(got.state["x"], torch.full((3,), 4.0))
    assert len(got.skipped) == 1 and "step00000006.partial: partial save" in got.skipped[0]
    assert load_latest(str(tmp_path / "none")).state is None


def test_keep_retains_only_the_newest(tmp_path):
    for step in range(1, 5):
        save(str(tmp_path), {"x": torch.zeros(1)}, step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step00000003", "step00000004"]


def test_async_save_writes_the_snapshot_not_later_changes(tmp_path):
    w = torch.arange(1000.0)
    saver = AsyncSaver()
    saver.save(str(tmp_path), {"w": w, "piece": Shard(w[10:20], (1000,), 10)}, 3)
    w.add_(1.0)  # the next optimizer step, while the write may still be running
    saver.wait()
    state = load_latest(str(tmp_path)).state
    assert torch.equal(state["w"], torch.arange(1000.0))
    assert torch.equal(state["piece"].data, torch.arange(10.0, 20.0))


# --------------------------------------------------------------------------
# 2 ranks: bitwise resume, what breaks without RNG / data position, kills.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["ddp", "zero2"])
def test_resume_is_bitwise_and_needs_rng_and_data_position(tmp_path, optimizer):
    """Dropout 0.1, a warm-up LR schedule (DDP): 6 steps in one go equal 3 steps,
    a new launch (fresh processes seeded differently), and 3 more."""
    full = launch(resumable_run, 2, str(tmp_path / "full"), 6, optimizer=optimizer)[0]
    cut = str(tmp_path / "cut")
    launch(resumable_run, 2, cut, 3, save_every=3, optimizer=optimizer)
    resumed = launch(resumable_run, 2, cut, 6, save_every=100, optimizer=optimizer, seed=123)[0]
    assert resumed["start"] == 3
    assert _same_params(full["params"], resumed["params"])
    assert all(full["losses"][s] == resumed["losses"][s] for s in (4, 5, 6))
    assert all(full["samples"][s] == resumed["samples"][s] for s in (4, 5, 6))
    seen = [i for s in range(1, 7) for i in full["samples"][s]]
    assert len(seen) == len(set(seen))  # 6 x 8 samples of a 128-sample epoch: none twice

    # The same resume without the RNG states: dropout masks drawn afresh.
    no_rng = launch(resumable_run, 2, cut, 6, save_every=100, optimizer=optimizer,
                    forget=("rng",), seed=123)[0]
    assert no_rng["losses"][4] != full["losses"][4]
    assert not _same_params(full["params"], no_rng["params"])
    # ... and without the sampler's position: steps 4-6 see the data of steps 1-3 again.
    no_pos = launch(resumable_run, 2, cut, 6, save_every=100, optimizer=optimizer,
                    forget=("sampler",), seed=123)[0]
    assert [no_pos["samples"][s] for s in (4, 5, 6)] == [full["samples"][s] for s in (1, 2, 3)]


def test_killed_rank_then_resume_matches_uninterrupted(tmp_path):
    full = launch(resumable_run, 2, str(tmp_path / "full"), 6)[0]
    d = str(tmp_path / "run")
    with pytest.raises(RankError, match="rank 1 was killed by SIGKILL"):
        launch(resumable_run, 2, d, 6, crash=(5, 1))  # checkpoints at 2 and 4 exist
    resumed = launch(resumable_run, 2, d, 6)[0]
    assert resumed["start"] == 4 and _same_params(full["params"], resumed["params"])


def test_async_saves_resume_like_blocking_ones(tmp_path):
    full = launch(resumable_run, 2, str(tmp_path / "full"), 6)[0]
    d = str(tmp_path / "async")
    launch(resumable_run, 2, d, 4, async_save=True)
    resumed = launch(resumable_run, 2, d, 6, async_save=True)[0]
    assert resumed["start"] == 4 and _same_params(full["params"], resumed["params"])


def test_loss_scaler_state_keeps_an_fp16_resume_bitwise(tmp_path):
    """fp16 autocast with a dynamic loss scaler (init 2^20, growth every 2 clean
    steps): overflowing steps are skipped and the scale backs off. Cut at step 3,
    after the scale has changed, the resume goes on bitwise; a resume that drops
    the scaler's state starts again at 2^20, skips other steps and drifts."""
    kw = dict(fp16=True, save_every=100, **SLOW)
    full = launch(resumable_run, 2, str(tmp_path / "full"), 6, **kw)[0]
    cut = str(tmp_path / "cut")
    first = launch(resumable_run, 2, cut, 3, fp16=True, save_every=3, **SLOW)[0]
    resumed = launch(resumable_run, 2, cut, 6, seed=123, **kw)[0]
    no_scaler = launch(resumable_run, 2, cut, 6, seed=123, forget=("scaler",), **kw)[0]
    # the scale did change before the cut: some of steps 1-3 overflowed and some stepped
    assert len({first["stepped"][s] for s in (1, 2, 3)}) == 2
    assert first["stepped"] == {s: full["stepped"][s] for s in (1, 2, 3)}
    assert resumed["start"] == 3 and resumed["stepped"] == {s: full["stepped"][s] for s in (4, 5, 6)}
    assert _same_params(full["params"], resumed["params"])  # exact: the same arithmetic
    assert [full["losses"][s] for s in (4, 5, 6)] == [resumed["losses"][s] for s in (4, 5, 6)]
    assert no_scaler["stepped"] != resumed["stepped"]
    assert not _same_params(full["params"], no_scaler["params"])


def _fp16_run_warnings(directory):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = resumable_run(directory, 4, fp16=True, save_every=100)
    return [str(w.message) for w in caught], out["stepped"]


def test_a_step_the_scaler_skips_does_not_step_the_lr_schedule(tmp_path):
    """The scale starts at 2^20 and the toy's first step overflows: the scaler skips
    it, so the LR schedule must not advance there (Megatron steps its scheduler only
    after a successful update); stepping it anyway is what torch warns about ("Detected
    call of `lr_scheduler.step()` before `optimizer.step()`")."""
    messages, stepped = launch(_fp16_run_warnings, 2, str(tmp_path))[0]
    assert stepped[1] is False              # the case is there: step 1 was skipped
    assert not [m for m in messages if "lr_scheduler.step()" in m], messages


def _save_then_die_mid_save(directory):
    r = rank_info().rank
    save(directory, {"w": torch.full((4,), 2.0 + r)}, 2)

    def die(path):  # rank 1's file is on disk, the manifest is not
        if r == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    save(directory, {"w": torch.full((4,), 4.0 + r)}, 4, on_written=die)


def _load(directory):
    got = load_latest(directory)
    return got.step, got.state["w"] if got.state else None, got.skipped


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    d = str(tmp_path)
    with pytest.raises(RankError, match="rank 1 was killed by SIGKILL"):
        launch(_save_then_die_mid_save, 2, d)
    assert sorted(os.listdir(d)) == ["step00000002", "step00000004.partial"]
    results = launch(_load, 2, d)
    for r, (step, w, skipped) in enumerate(results):
        assert step == 2 and torch.equal(w, torch.full((4,), 2.0 + r))
        assert skipped == ["step00000004.partial: partial save (no manifest.json; never "
                           "renamed into place)"]


def _save_two(directory):
    r = rank_info().rank
    for step in (2, 4):
        save(directory, {"w": torch.full((256,), float(step + r))}, step)


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
    d = str(tmp_path)
    launch(_save_two, 2, d)
    path = os.path.join(d, "step00000004", "rank1.pt")
    with open(path, "r+b") as f:  # one bit of one float in the middle of the file
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    results = launch(_load, 2, d)
    for r, (step, w, skipped) in enumerate(results):
        # rank 0's own file is intact, but it must not resume from step 4 alone
        assert step == 2 and torch.equal(w, torch.full((256,), 2.0 + r))
        assert len(skipped) == 1 and skipped[0].startswith("step00000004: rank1.pt fails its "
                                                           "checksum")
        assert skipped[0].endswith("(rank 1)")


def test_torchrun_restarts_after_a_kill_mid_save_and_resumes_bitwise(tmp_path):
    """torchrun --standalone --nproc_per_node=2 --max-restarts=2 on CPU: rank 1 is
    SIGKILLed inside the step-4 save on the first attempt; the restarted group
    resumes from step 2 and ends with the uninterrupted run's weights."""
    from helpers.checkpoint.job import run_torchrun
    # The reference's ranks start with 3 intra-op threads, torchrun's workers with
    # OMP_NUM_THREADS=1: equal weights only because resumable_run pins its own.
    reference, before, _ = launch(_run_with_threads, 2, 3, str(tmp_path / "ref"), 6,
                                  save_every=100)[0]
    assert (before, reference["threads"]) == (3, 1)
    # bounded: two attempts of a 6-step toy job took 37-70 s on the shared 2-core
    # machine at load average ~25; 200 s stays under pytest-timeout's 300 s with
    # room for the reference launch, and a timeout raises with torchrun's output
    job = run_torchrun(str(tmp_path / "ckpt"), str(tmp_path / "result.pt"), steps=6,
                       kill_in_save="4:1", timeout=200)
    assert job["returncode"] == 0, job["log"][-3000:]
    r = job["result"]
    assert (r["attempt"], r["start"], r["threads"]) == (1, 2, 1)
    assert r["skipped"] == ["step00000004.partial: partial save (no manifest.json; never "
                            "renamed into place)"]
    assert _same_params(reference["params"], r["params"])


def _run_with_threads(rank_threads, *args, **kwargs):
    """Rank function: set this rank's intra-op thread count (as another launcher,
    OMP_NUM_THREADS or a bigger machine would), then resumable_run. Returns its
    result and the rank's thread count before and after it."""
    torch.set_num_threads(rank_threads)
    before = torch.get_num_threads()
    out = resumable_run(*args, **kwargs)
    return out, before, torch.get_num_threads()


def test_resume_is_bitwise_whatever_thread_count_the_ranks_start_with(tmp_path):
    """The uninterrupted run's ranks start with 3 intra-op threads, the cut run's
    with 1, the resumed run's with 2: still bitwise, because resumable_run trains
    on 1 thread in each (and gives the rank its count back). The control: the
    uninterrupted run left on its ranks' 3 threads (threads=None) ends elsewhere."""
    full, before, after = launch(_run_with_threads, 2, 3, str(tmp_path / "full"), 6,
                                 save_every=100)[0]
    assert (before, full["threads"], after) == (3, 1, 3)
    cut = str(tmp_path / "cut")
    launch(_run_with_threads, 2, 1, cut, 3, save_every=3)
    resumed, before, _ = launch(_run_with_threads, 2, 2, cut, 6, save_every=100, seed=123)[0]
    assert (before, resumed["start"], resumed["threads"]) == (2, 3, 1)
    assert _same_params(full["params"], resumed["params"])
    assert [full["losses"][s] for s in (4, 5, 6)] == [resumed["losses"][s] for s in (4, 5, 6)]

    unpinned = launch(_run_with_threads, 2, 3, str(tmp_path / "unpinned"), 6, save_every=100,
                      threads=None)[0][0]
    assert unpinned["threads"] == 3
    assert not _same_params(full["params"], unpinned["params"])


# --------------------------------------------------------------------------
# Resharding ZeRO-2 shards: 4 -> 2 and 2 -> 3 ranks load the same full state.
# --------------------------------------------------------------------------

def _zero_train_and_save(directory, steps=3):
    from helpers.data import make_dataset
    from helpers.zero import ZeroOptimizer
    info = rank_info()
    model = build_model("toy")
    opt = ZeroOptimizer(model, stage=2, lr=1e-2, bucket_cap_mb=2000 * 4 / 2**20)  # 8 buckets
    data = make_dataset(seq_len=16, num_sequences=64)
    b = 12 // info.world_size  # a global batch of 12 splits over 2, 3 and 4 ranks
    for s in range(steps):
        x, y = data.batch(range(s * 12 + info.rank * b, s * 12 + (info.rank + 1) * b))
        model(x, y)[1].backward()
        opt.step()
    save(directory, {"zero": zero_state(opt)}, steps)
    return zero_state(opt)


def _zero_load(directory):
    from helpers.zero import ZeroOptimizer
    model = build_model("toy", seed=7)  # other weights: the load must overwrite them
    opt = ZeroOptimizer(model, stage=2, lr=1e-2, bucket_cap_mb=1.0)  # another bucket layout
    got = load_latest(directory, like={"zero": zero_request(opt)})
    load_zero_state(opt, got.state["zero"])
    return zero_state(opt)


def _full(states: list[dict]) -> dict:
    """Per-rank zero_state pieces -> full tensors, checking every element is covered once."""
    out = {}
    for part in ("weights", "exp_avg", "exp_avg_sq"):
        pieces = {name: s for st in states for name, s in st[part].items()}
        for name, any_piece in pieces.items():
            shape = any_piece.global_shape
            full = torch.full((int(np.prod(shape)),), float("nan"))
            for st in states:
                if name in st[part]:
                    s = st[part][name]
                    assert full[s.offset:s.offset + s.data.numel()].isnan().all()
                    full[s.offset:s.offset + s.data.numel()] = s.data
            assert not full.isnan().any()
            out[f"{part}/{name}"] = full
    out["step_count"] = torch.tensor([st["step_count"] for st in states])
    return out


def _fsdp2_save(directory):
    from helpers.checkpoint.dcp import dcp_save, fsdp2_job, fsdp2_state, full_state
    from helpers.data import make_dataset
    model, opt = fsdp2_job()
    data = make_dataset(seq_len=16, num_sequences=64)
    r = rank_info()
    b = 8 // r.world_size
    for s in range(2):  # two steps, so Adam's moments and step count are not trivial
        x, y = data.batch(range(s * 8 + r.rank * b, s * 8 + (r.rank + 1) * b))
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    dcp_save(os.path.join(directory, "dcp"), model, opt)
    save(os.path.join(directory, "ours"), fsdp2_state(model, opt), 2)
    return full_state(model, opt)


def _fsdp2_load(directory):
    from helpers.checkpoint.dcp import (dcp_load, fsdp2_job, fsdp2_request, full_state,
                                        load_fsdp2_state)
    model, opt = fsdp2_job(seed=5)  # other weights: the loads must overwrite them
    dcp_load(os.path.join(directory, "dcp"), model, opt)
    via_dcp = full_state(model, opt)
    model, opt = fsdp2_job(seed=6)
    got = load_latest(os.path.join(directory, "ours"), like=fsdp2_request(model, opt))
    load_fsdp2_state(model, opt, got.state)
    return via_dcp, full_state(model, opt)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}
    return {prefix: tree} if isinstance(tree, torch.Tensor) else {}


def test_reshard_4_to_2_and_2_to_3_same_full_state_same_loss_curve(tmp_path):
    """ZeRO-2 shards saved by 2 and 4 ranks load on 3 and 2 ranks as the exact
    same full state (weights, both moments); and a run moved from 4 to 2 ranks
    at step 3 continues the loss curve of a run that stayed on 4.

    The loss curves: same data (the global batch is fixed), same weights and
    moments at step 3; what differs is only the order of additions: per-rank
    mean losses over 32 vs 64 tokens and an all-reduce over 4 vs 2 partial
    gradients. And PyTorch's DCP next to ours on an FSDP2 job: saved on 4 ranks,
    loaded on 2, the same full state. (Launch sizes ordered 2, 4, 2, 3 so pools
    are reused.)"""
    two, four = str(tmp_path / "two"), str(tmp_path / "four")
    kw = dict(optimizer="zero2", dropout=0.0)
    saved2 = _full(launch(_zero_train_and_save, 2, two))
    saved4 = _full(launch(_zero_train_and_save, 4, four))
    steady = launch(resumable_run, 4, str(tmp_path / "a"), 6, **kw)[0]
    d = str(tmp_path / "b")
    launch(resumable_run, 4, d, 3, save_every=3, **kw)
    fsdp2 = str(tmp_path / "fsdp2")
    fsdp2_saved = launch(_fsdp2_save, 4, fsdp2)[0]
    on2 = _full(launch(_zero_load, 2, four))
    moved = launch(resumable_run, 2, d, 6, **kw)[0]
    via_dcp, via_ours = launch(_fsdp2_load, 2, fsdp2)[0]
    on3 = _full(launch(_zero_load, 3, two))

    # PyTorch's DCP and ours, same FSDP2 state saved on 4 ranks, loaded on 2:
    # both give back every tensor exactly (no arithmetic, only copies).
    want, a, b = _flat(fsdp2_saved), _flat(via_dcp), _flat(via_ours)
    assert len(want) > 100 and want.keys() == a.keys() == b.keys()
    for k in want:
        assert torch.equal(want[k], a[k]) and torch.equal(want[k], b[k]), k

    for saved, loaded in ((saved4, on2), (saved2, on3)):
        assert saved.keys() == loaded.keys()
        for k in saved:
            if k != "step_count":
                assert torch.equal(saved[k], loaded[k]), k
        assert set(loaded["step_count"].tolist()) == {3}

    assert moved["start"] == 3
    # Step 4's loss is computed from identical weights: it differs only in how 128
    # token losses are summed, at most 128 roundings: <= 128 * eps_fp32 relative.
    eps = torch.finfo(torch.float32).eps
    assert abs(moved["losses"][4] - steady["losses"][4]) <= 128 * eps * steady["losses"][4]
    # Later steps apply gradients rounded differently (relative ~1e-7); Adam moves a
    # weight by at most about lr = 1e-2 per step whatever the gradient's size, so
    # a sign flip of a near-zero gradient entry is the worst rounding can do; such
    # entries are few, and a 1e-4 relative band on the loss holds them.
    for s in (5, 6):
        assert abs(moved["losses"][s] - steady["losses"][s]) <= 1e-4 * steady["losses"][s]
    assert moved["samples"] == {s: steady["samples"][s] for s in (4, 5, 6)}


# --------------------------------------------------------------------------
# Sharded weights: ZeRO-3 and helpers.fsdp (2 ranks, then 4 -> 2).
# --------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["zero3", "fsdp"])
def test_sharded_weights_resume_bitwise(tmp_path, optimizer):
    """Only the shards hold the weights: 4 steps in one go equal 2 steps, a new
    launch (other seed) and 2 more, with dropout (RNG) and, for FSDP, the
    warm-up schedule that has moved the optimizer's LR."""
    full = launch(resumable_run, 2, str(tmp_path / "full"), 4, optimizer=optimizer, **SLOW)[0]
    cut = str(tmp_path / "cut")
    launch(resumable_run, 2, cut, 2, save_every=2, optimizer=optimizer, **SLOW)
    resumed = launch(resumable_run, 2, cut, 4, save_every=100, optimizer=optimizer, seed=123,
                     **SLOW)[0]
    assert resumed["start"] == 2
    assert _same_params(full["params"], resumed["params"])  # exact: the same arithmetic
    assert [full["losses"][s] for s in (3, 4)] == [resumed["losses"][s] for s in (3, 4)]


@pytest.mark.parametrize("optimizer", ["zero3", "fsdp"])
def test_sharded_weights_reshard_4_to_2_on_the_loss_curve(tmp_path, optimizer):
    """Saved by 4 ranks at step 3, loaded by 2: exactly the saved weights (copies,
    no arithmetic), and the loss curve of a run that stayed on 4 ranks."""
    kw = dict(optimizer=optimizer, dropout=0.0, **SLOW)  # dropout masks depend on the rank layout
    steady = launch(resumable_run, 4, str(tmp_path / "steady"), 5, save_every=100, **kw)[0]
    d = str(tmp_path / "moved")
    cut = launch(resumable_run, 4, d, 3, save_every=3, **kw)[0]
    loaded = launch(resumable_run, 2, d, 3, **kw)[0]  # resumes at 3 and trains no step
    moved = launch(resumable_run, 2, d, 5, save_every=100, **kw)[0]
    assert loaded["start"] == moved["start"] == 3
    assert _same_params(cut["params"], loaded["params"])
    # The same bounds as the ZeRO-2 test below: step 4's loss comes from identical
    # weights and differs only in how 128 token losses are summed (<= 128 roundings);
    # step 5 follows an AdamW step whose gradient was summed in another order.
    eps = torch.finfo(torch.float32).eps
    assert abs(moved["losses"][4] - steady["losses"][4]) <= 128 * eps * steady["losses"][4]
    assert abs(moved["losses"][5] - steady["losses"][5]) <= 1e-4 * steady["losses"][5]
    assert moved["samples"] == {s: steady["samples"][s] for s in (4, 5)}


def _one_process_job(kind):
    """World size 1, in this process: a model wrapped by ``kind`` after one step."""
    from helpers.data import make_dataset
    from helpers.fsdp import FSDP
    from helpers.zero import ZeroOptimizer
    model = build_model("toy", dropout=0.0)
    if kind == "fsdp":
        model = FSDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = ZeroOptimizer(model, stage=int(kind[-1]), lr=1e-2)
    x, y = make_dataset(seq_len=16, num_sequences=8).batch(range(4))
    model(x, y)[1].backward()
    opt.step()
    return model, opt


def test_mismatched_or_corrupt_sharded_layout_is_refused(tmp_path):
    """A checkpoint of another sharding scheme, a shard table that disagrees with
    the pieces in the files, a piece missing: each refused, naming why."""
    import json
    from helpers.checkpoint import fsdp_request, fsdp_state, load_fsdp_state
    model, opt = _one_process_job("fsdp")
    d = str(tmp_path)
    save(d, {"fsdp": fsdp_state(model, opt)}, 1)
    other, other_opt = _one_process_job("zero3")
    with pytest.raises(CheckpointMismatch, match="the checkpoint has no sharded tensor /zero/weights/wte.weight"):
        load_latest(d, like={"zero": zero_request(other_opt)})
    with pytest.raises(CheckpointMismatch, match="holds fsdp state and this run is zero3"):
        load_zero_state(other_opt, load_latest(d).state["fsdp"])
    # the round trip itself is exact
    fresh, fresh_opt = _one_process_job("fsdp")
    load_fsdp_state(fresh, fresh_opt, load_latest(d, like={"fsdp": fsdp_request(fresh, fresh_opt)}).state["fsdp"])
    assert _same_params(model.full_parameters(), fresh.full_parameters())

    path = os.path.join(d, "step00000001", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    key = "/fsdp/exp_avg/blocks.0.attn.c_attn.weight"
    good = json.dumps(manifest)
    manifest["shards"][key]["pieces"][0]["offset"] += 8  # the table moves the piece
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointMismatch, match=f"{key}: the manifest places rank0.pt's piece "
                                                 f"at .* the layout table is corrupt"):
        load_latest(d, like={"fsdp": fsdp_request(fresh, fresh_opt)})
    manifest = json.loads(good)
    manifest["shards"][key]["pieces"] = []  # the table lost the piece
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointMismatch, match=f"{key}: the saved pieces cover 0 of"):
        load_latest(d, like={"fsdp": fsdp_request(fresh, fresh_opt)})


# --------------------------------------------------------------------------
# Failure arithmetic.
# --------------------------------------------------------------------------

def test_llama3_figures_and_mtbf_scaling():
    L = failures.LLAMA3
    hours = L["days"] * 24
    assert hours / L["unexpected"] == pytest.approx(3.093, abs=1e-3)  # one every ~3.1 h
    m = failures.per_gpu_mtbf(hours, L["unexpected"], L["gpus"])
    assert m == pytest.approx(50_675, rel=1e-4)  # ~5.8 years per GPU
    assert failures.job_mtbf(m, L["gpus"]) == pytest.approx(hours / L["unexpected"])
    assert failures.job_mtbf(m, 2 * L["gpus"]) == pytest.approx(hours / L["unexpected"] / 2)
    with pytest.raises(ValueError, match="n_gpus must be > 0"):
        failures.job_mtbf(m, 0)


def test_young_interval_minimizes_the_lost_fraction_and_matches_a_replay():
    C, M = 60.0, 3 * 3600.0  # a 1-minute save, a failure every 3 hours
    tau = failures.young_interval(C, M)
    grid = [tau * f for f in np.linspace(0.5, 2.0, 31)]
    best = min(grid, key=lambda t: failures.lost_fraction(t, C, M))
    assert best == pytest.approx(tau)
    # Daly's correction is small when C << M: C / (2M) = 0.3%.
    assert failures.daly_interval(C, M) == pytest.approx(tau, rel=0.05)
    # A replay of ~2000 exponential failures: the lost fraction's relative
    # sampling error is ~1/sqrt(2000) = 2.2%, and the first-order formula drops
    # terms of order tau / M = 11% of the failure part; 15% covers both.
    lost_sim = 1 - failures.simulate_goodput(tau, C, M, seed=1)
    assert lost_sim == pytest.approx(failures.lost_fraction(tau, C, M), rel=0.15)
    # Without failures the replay is exact arithmetic: work / (work + saves).
    assert failures.simulate_goodput(100.0, 10.0, 1e30, work=1000.0) == pytest.approx(1000 / 1100)


def test_saving_a_step_again_replaces_it_and_leaves_nothing_aside(tmp_path):
    d = str(tmp_path)
    save(d, {"w": torch.zeros(2)}, 2)
    save(d, {"w": torch.ones(2)}, 2)
    assert torch.equal(load_latest(d).state["w"], torch.ones(2))
    assert sorted(os.listdir(d)) == ["step00000002"]


def test_a_crash_while_replacing_a_step_keeps_both_copies_and_loads_the_one_before(
        tmp_path, monkeypatch):
    """The old copy moves aside before the new one takes its name: a crash between the
    two renames leaves neither under the step's name, both on disk, and the loader
    uses the checkpoint before."""
    d = str(tmp_path)
    save(d, {"w": torch.full((2,), 1.0)}, 1)
    save(d, {"w": torch.full((2,), 2.0)}, 2)
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old copy is aside; the new one is not in place yet
            raise OSError("simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save(d, {"w": torch.full((2,), 3.0)}, 2)
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == ["step00000001", "step00000002.partial",
                                     "step00000002.replaced"]
    got = load_latest(d)
    assert got.step == 1 and torch.equal(got.state["w"], torch.full((2,), 1.0))


def test_the_checksum_is_of_the_bytes_on_disk(tmp_path):
    """A rank's file is written by torch.save straight into it and hashed from the page
    cache while fsync runs: the manifest's size and sha256 are the file's, and the file
    is what torch.load(weights_only=True) reads back."""
    import hashlib
    import json
    d = str(tmp_path)
    state = {"w": torch.arange(3000.0), "s": Shard(torch.ones(5), (10,), 5), "n": 3}
    final = save(d, state, 7)
    manifest = json.load(open(os.path.join(final, "manifest.json")))
    raw = open(os.path.join(final, "rank0.pt"), "rb").read()
    assert manifest["files"]["rank0.pt"]["bytes"] == len(raw)
    assert manifest["files"]["rank0.pt"]["sha256"] == hashlib.sha256(raw).hexdigest()
    got = load_latest(d).state
    assert torch.equal(got["w"], state["w"]) and got["n"] == 3
    assert torch.equal(got["s"].data, torch.ones(5)) and got["s"].offset == 5


def _one_rank_cannot_write(directory, error):
    from helpers.checkpoint.store import write

    if rank_info().rank == 1:
        def failing(path, tree):
            raise error
        write.write_tree = failing
    save(directory, {"w": torch.ones(4)}, 3)


@pytest.mark.parametrize("error, said", [
    (OSError(28, "No space left on device"), r"\[Errno 28\] No space left on device"),
    (RuntimeError("file write failed"), "RuntimeError: file write failed")])
def test_a_rank_that_cannot_write_its_file_stops_every_rank(tmp_path, error, said):
    # every rank raises at once, naming rank 1; none waits in the next collective
    # until the timeout (a RankTimeout would fail the match)
    with pytest.raises(RankError, match=r"writing the files\) failed on rank 1: writing "
                                        r".*rank1\.pt: " + said):
        launch(_one_rank_cannot_write, 2, str(tmp_path), error, timeout=30)
    assert os.listdir(tmp_path) == ["step00000003.partial"]  # never committed


def test_a_failed_checksum_is_raised_not_lost(tmp_path, monkeypatch):
    # the hash runs in a thread beside fsync: its error must reach the caller
    from helpers.checkpoint.store import format as fmt

    def broken(data):
        raise MemoryError("no room to hash")
    monkeypatch.setattr(fmt.hashlib, "sha256", broken)
    with pytest.raises(MemoryError, match="no room to hash"):
        fmt.write_tree(str(tmp_path / "rank0.pt"), {"w": torch.ones(3)})
