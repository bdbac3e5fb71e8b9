"""On a GPU node: the launcher, the collectives and the course's mechanisms on CUDA.

Skipped without CUDA (CI has none; an instructor runs them before a workshop
with ``make test-gpu``). What one GPU checks:

* nccl with one rank (``WORLD`` = 1): every tensor on cuda:0, every collective
  through nccl, only the arithmetic of p = 1; with two or more GPUs, two ranks,
  one per GPU;
* gloo with CUDA tensors, 2-4 ranks sharing the one GPU, for the collectives
  gloo runs on CUDA tensors that the course uses: all_reduce, broadcast and
  all_gather (torch.distributed's backend table, docs/source/distributed.md,
  as updated by pytorch/pytorch#149869 in 2025; broadcast and all_reduce have
  had a CUDA path since PyTorch 1.0);
* the model at SIZE "small" on the rank's GPU, built by the default device
  (``build_model`` and ``MarkovDataset.batch`` follow ``rank_info().device``),
  through the helpers' rank functions that the notebooks use: a data-parallel
  step (naive and bucketed), tensor-parallel GPT, a pipeline step, an FSDP
  step, ring attention and an expert-parallel MoE GPT, each against the
  unsplit model on the same GPU.

What needs a node with several GPUs: nccl with more than one rank (the same
tests then run on 2 GPUs), NVLink and topology (chapter 07), and any timing.
ZeRO, FSDP, compression and FP8 also have GPU tests beside their CPU ones
(tests/test_zero.py, test_fsdp.py, test_compression.py, test_precision.py,
test_memory.py).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from helpers import RankError, RankTimeout, launch, rank_info
from helpers.collectives import ring_all_reduce, sweep
from helpers.data import make_dataset
from helpers.ddp import BucketedDDP
from helpers.fsdp import FSDP
from helpers.model import GPTConfig, build_model
from helpers.moe import apply_ep, apply_moe
from helpers.naive_dp import average_gradients, broadcast_parameters
from helpers.pipeline import one_f_one_b
from helpers.pipeline.executor import chunk_grads, pipeline_step, reference_grads, split_model
from helpers.sp.attention.ring import ring_attention
from helpers.sp.layout import shard_sequence
from helpers.steptime import PARTS, dp_step_profile
from helpers.tolerance import within_fp32_noise
from helpers.tp import gather_dense, tensor_parallel_gpt

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = min(GPUS, 2)
pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_auto_picks_nccl_with_one_rank_per_gpu():
    def fn():
        info = rank_info()
        t = torch.full((1,), float(info.rank + 1), device=info.device)
        dist.all_reduce(t)
        return info.backend, info.device, t.item(), torch.cuda.current_device()

    total = WORLD * (WORLD + 1) / 2
    assert launch(fn, WORLD) == [("nccl", f"cuda:{r}", total, r) for r in range(WORLD)]


def test_cpu_tensors_still_reduce_in_an_nccl_job():
    # A notebook's rank function that keeps the tiny model on the CPU runs on
    # a GPU node too: CPU tensors go over the group's gloo side.
    def fn():
        cpu, gpu = torch.ones(3), torch.ones(3, device=rank_info().device)
        dist.all_reduce(cpu)
        dist.all_reduce(gpu)
        return rank_info().backend, cpu.tolist(), gpu.tolist()

    assert launch(fn, WORLD) == [("nccl", [float(WORLD)] * 3, [float(WORLD)] * 3)] * WORLD


def test_more_ranks_than_gpus_nccl_refused_auto_falls_back_to_gloo():
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        launch(print, GPUS + 1, backend="nccl")
    assert launch(lambda: rank_info().backend, GPUS + 1) == ["gloo"] * (GPUS + 1)


def test_rank_that_raises_on_nccl_is_named():
    def fn():
        if rank_info().rank == WORLD - 1:
            raise ValueError("on purpose")
        return 1

    with pytest.raises(RankError, match=f"rank {WORLD - 1} raised ValueError: on purpose"):
        launch(fn, WORLD)
    assert launch(lambda: rank_info().backend, WORLD) == ["nccl"] * WORLD  # a fresh pool


def _data_parallel_on_gpu():
    """Ring all-reduce vs nccl's; BucketedDDP vs one process on the global batch."""
    info = rank_info()
    dev, p = torch.device(info.device), info.world_size
    x = torch.arange(1001, dtype=torch.float32, device=dev) + info.rank
    want = x.clone()
    dist.all_reduce(want)
    ring_diff = (ring_all_reduce(x) - want).abs().max().item()

    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 64, (4 * p, 16), generator=g).to(dev)
    lo, hi = 4 * info.rank, 4 * (info.rank + 1)
    ref = build_model("toy", seed=0).to(dev)
    ref(idx, idx)[1].backward()
    ref64 = build_model("toy", seed=0).to(dev, torch.float64)  # the exact answer
    ref64(idx, idx)[1].backward()
    ddp = BucketedDDP(build_model("toy", seed=info.rank).to(dev), bucket_cap_mb=0.02,
                      first_bucket_mb=0.02)
    ddp(idx[lo:hi], idx[lo:hi])[1].backward()
    ref_grads, ref64_grads = dict(ref.named_parameters()), dict(ref64.named_parameters())
    grad_ok = all(within_fp32_noise(q.grad, ref_grads[n].grad, ref64_grads[n].grad)[0]
                  for n, q in ddp.module.named_parameters())
    on_gpu = all(q.grad.is_cuda for q in ddp.module.parameters())
    rows = sweep([2**10, 2**20], iters=2)
    return ring_diff, grad_ok, on_gpu, len(ddp.buckets), [r["impl"] for r in rows]


def test_ring_and_bucketed_ddp_on_nccl():
    for ring_diff, grad_ok, on_gpu, n_buckets, impls in launch(_data_parallel_on_gpu, WORLD):
        assert ring_diff == 0  # integers in float32: exact in any summation order
        # the mean of per-rank gradients vs the gradient of the global batch:
        # equal up to float32 summation order (GPU kernels may reorder too), so
        # as close to float64 as the float32 reference is (helpers.tolerance)
        assert grad_ok and on_gpu and n_buckets > 1
        assert sorted(set(impls)) == ["ring", "torch"]


def test_step_profile_on_nccl():
    for prof in launch(dp_step_profile, WORLD, batch_size=4, steps=3):
        assert set(PARTS) <= set(prof) and all(prof[k] >= 0 for k in PARTS)


def _pipeline_on_gpu():
    """1F1B across the ranks (one stage per GPU) vs the unsplit model."""
    info = rank_info()
    dev = torch.device(info.device)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (8, 16), generator=g).to(dev) for _ in range(2))
    chunks = [c.to(dev) for c in split_model(build_model("toy", n_layer=4), info.world_size)[
        info.rank]]
    res = pipeline_step(chunks, one_f_one_b(info.world_size, 4), x, y)
    ref_loss, ref = reference_grads(build_model("toy", n_layer=4).to(dev), x, y)
    ref64_loss, ref64 = reference_grads(build_model("toy", n_layer=4).to(dev, torch.float64),
                                        x, y)
    grads = chunk_grads(chunks)
    grads_ok = all(within_fp32_noise(grads[n], ref[n], ref64[n])[0] for n in grads)
    loss_ok = res.loss is None or within_fp32_noise(
        torch.tensor(res.loss), torch.tensor(ref_loss), torch.tensor(ref64_loss))[0]
    return loss_ok, grads_ok, res.peak_stash


def test_pipeline_executor_on_nccl():
    results = launch(_pipeline_on_gpu, WORLD)
    # float32, same ops split across stages and micro-batches: rounding only,
    # so within the float32 reference's own noise against float64; the loss
    # lives on the last stage
    for loss_ok, grads_ok, stash in results:
        assert loss_ok and grads_ok
        assert stash >= 1


def test_torchrun_with_nccl(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from helpers import launch, rank_info

        def fn():
            t = torch.ones(1, device=rank_info().device)
            dist.all_reduce(t)
            return rank_info().backend, t.item()

        if __name__ == "__main__":
            sys.stdout.write(f"RESULT {launch(fn, int(sys.argv[1]))}\\n")
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        torchrun = "torchrun"
    out = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={WORLD}", str(script),
                          str(WORLD)], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"RESULT {[('nccl', float(WORLD))] * WORLD}" in out.stdout, out.stdout


# --------------------------------------------------------------------------
# gloo with CUDA tensors: several ranks on the one GPU
# --------------------------------------------------------------------------

def _gloo_collectives_on_cuda():
    info = rank_info()
    dev = torch.device("cuda", 0)  # every rank on the same GPU: gloo copies through the host
    x = torch.arange(5, dtype=torch.float32, device=dev) + info.rank
    summed, sent = x.clone(), x.clone()
    dist.all_reduce(summed)
    dist.broadcast(sent, src=0)
    parts = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(parts, x)
    on_cuda = all(t.is_cuda for t in (summed, sent, *parts))
    return info.backend, on_cuda, summed, sent, torch.stack(parts)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_collectives_on_cuda_tensors(world):
    base = torch.arange(5, dtype=torch.float32)
    for backend, on_cuda, summed, sent, gathered in launch(_gloo_collectives_on_cuda, world,
                                                           backend="gloo"):
        assert backend == "gloo" and on_cuda
        # small integers in float32: every sum is exact, in any order
        assert torch.equal(summed, world * base + sum(range(world)))
        assert torch.equal(sent, base)
        assert torch.equal(gathered, torch.stack([base + r for r in range(world)]))


# --------------------------------------------------------------------------
# The helpers' rank functions with the "small" model on the rank's GPU
# --------------------------------------------------------------------------

SIZE = "small"  # 6 layers, 6 heads, 384 wide: GPU kernels, not Python, do the work
B, T = 4, 64    # sequences per rank, tokens per sequence
# float64 results computed in another order (sharded, on other kernels): float64
# rounding (u = 1.1e-16) over sums of a few thousand terms stays below 1e-12
# relative to the result's scale; 1e-9 leaves room, while a wrong shard, mask or
# route is off by O(1) of the scale
REL64 = 1e-9


def _batch(p: int):
    """The global batch (x, y) of p ranks: the same on every rank, drawn on the
    CPU, handed over on the rank's device (``batch``'s default)."""
    return make_dataset(vocab_size=64, seq_len=T, num_sequences=B * p).batch(range(B * p))


def _references(x, y, build=lambda: build_model(SIZE)):
    """The unsplit model's gradients on the whole batch, in float32 and float64."""
    return [reference_grads(build().to(dtype), x, y)[1] for dtype in (torch.float32, torch.float64)]


def _outside_fp32_noise(got: dict, ref32: dict, ref64: dict) -> str:
    """The first gradient of ``got`` farther from the float64 answer than float32
    rounding allows (helpers.tolerance), or "" if none."""
    if not got:
        return "no gradients"
    for name, g in got.items():
        ok, err, bound = within_fp32_noise(g, ref32[name], ref64[name])
        if not ok:
            return f"{name}: {err:.3g} > {bound:.3g}"
    return ""


def _rel64(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() / max(want.abs().max().item(), 1e-300)


def _devices(*tensors) -> set:
    return {t.device.type for t in tensors}


def _data_parallel_small():
    info = rank_info()
    x, y = _batch(info.world_size)
    mine = slice(info.rank * B, (info.rank + 1) * B)
    naive = build_model(SIZE, seed=info.rank)  # each rank starts elsewhere: the broadcast fixes it
    broadcast_parameters(naive)
    naive(x[mine], y[mine])[1].backward()
    average_gradients(naive)
    ddp = BucketedDDP(build_model(SIZE))
    ddp(x[mine], y[mine])[1].backward()
    ref32, ref64 = _references(x, y)
    grads = [{n: q.grad for n, q in m.named_parameters()} for m in (naive, ddp.module)]
    return (_devices(x, *naive.parameters(), *ddp.module.parameters()),
            [_outside_fp32_noise(g, ref32, ref64) for g in grads])


def test_data_parallel_step_of_the_small_model_on_the_gpu():
    for devices, problems in launch(_data_parallel_small, WORLD, timeout=180):
        assert devices == {"cuda"}
        # the mean of per-rank gradients vs the global batch's: float32 summation
        # order only, so within the float32 reference's own noise
        assert problems == ["", ""], problems


def _tensor_parallel_small():
    x, y = _batch(1)  # tensor parallelism: every rank sees the whole batch
    # float64: the vocab-parallel loss is another formula than F.cross_entropy
    dense = build_model(SIZE).double()
    tp = tensor_parallel_gpt(build_model(SIZE).double())
    loss_tp, loss = tp(x, y)[1], dense(x, y)[1]
    loss_tp.backward()
    loss.backward()
    got = gather_dense(tp, grads=True)
    worst = max(_rel64(got[n], q.grad) for n, q in dense.named_parameters())
    return _devices(*tp.parameters()), _rel64(loss_tp.detach(), loss.detach()), worst


def test_tensor_parallel_gpt_small_on_the_gpu():
    for devices, loss_err, grad_err in launch(_tensor_parallel_small, WORLD, timeout=180):
        assert devices == {"cuda"}
        assert loss_err <= REL64 and grad_err <= REL64, (loss_err, grad_err)


def _pipeline_small():
    info = rank_info()
    x, y = _batch(2)  # 8 sequences, 4 micro-batches of 2
    chunks = split_model(build_model(SIZE), info.world_size)[info.rank]
    pipeline_step(chunks, one_f_one_b(info.world_size, 4), x, y)
    ref32, ref64 = _references(x, y)
    return (_devices(*(q for c in chunks for q in c.parameters())),
            _outside_fp32_noise(chunk_grads(chunks), ref32, ref64))


def test_pipeline_step_of_the_small_model_on_the_gpu():
    for devices, problem in launch(_pipeline_small, WORLD, timeout=180):
        assert devices == {"cuda"}
        # the same float32 ops split across stages and micro-batches: rounding only
        assert problem == "", problem


def _fsdp_small():
    info = rank_info()
    x, y = _batch(info.world_size)
    mine = slice(info.rank * B, (info.rank + 1) * B)
    fsdp = FSDP(build_model(SIZE))
    fsdp(x[mine], y[mine])[1].backward()
    grads = fsdp.full_grads()
    torch.optim.AdamW(fsdp.parameters(), lr=1e-3).step()  # the optimizer steps the GPU shards
    ref32, ref64 = _references(x, y)
    return (_devices(*fsdp.parameters(), *fsdp.full_parameters().values()),
            _outside_fp32_noise(grads, ref32, ref64))


def test_fsdp_step_of_the_small_model_on_the_gpu():
    for devices, problem in launch(_fsdp_small, WORLD, timeout=180):
        assert devices == {"cuda"}
        assert problem == "", problem  # averaged shards vs the global batch: rounding only


def _ring_attention_small():
    dev = rank_info().device
    cfg = GPTConfig.from_name(SIZE)
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(2, cfg.n_head, cfg.block_size, cfg.head_dim, generator=g,
                                  dtype=torch.float64).to(dev) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    want.backward(d_out)
    errs, devices = {}, set()
    for layout in ("contiguous", "zigzag"):
        local = [shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, layout=layout)
        out.backward(shard_sequence(d_out, layout=layout))
        errs[layout] = max([_rel64(out, shard_sequence(want.detach(), layout=layout))]
                           + [_rel64(a.grad, shard_sequence(b.grad, layout=layout))
                              for a, b in zip(local, full)])
        devices |= _devices(out, *(a.grad for a in local))
    return devices, errs


def test_ring_attention_at_the_small_model_shape_on_the_gpu():
    for devices, errs in launch(_ring_attention_small, WORLD, timeout=180):
        assert devices == {"cuda"}
        assert all(e <= REL64 for e in errs.values()), errs  # float64 vs float64 SDPA


def _moe_small():
    info = rank_info()
    p = info.world_size
    x, y = _batch(p)
    mine = slice(info.rank * B, (info.rank + 1) * B)

    def moe_gpt():  # float64: a top-2 route must not flip on a rounding difference
        return apply_moe(build_model(SIZE), num_experts=4, top_k=2, every=2).double()

    model = apply_ep(moe_gpt(), dist.group.WORLD)
    logits, loss = model(x[mine], y[mine])
    (loss / p).backward()  # equal-sized ranks: the global mean is the mean of the ranks' means
    ref = moe_gpt()
    ref_logits, ref_loss = ref(x, y)
    ref_loss.backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    ids = model.blocks[1].mlp.expert_ids  # this rank's experts, the same in every MoE block
    worst = 0.0
    for name, q in model.named_parameters():
        grad = q.grad.clone()
        if ".experts." in name:  # rank-local expert j is global expert ids[j]
            head, rest = name.split(".experts.")
            j, tail = rest.split(".", 1)
            name = f"{head}.experts.{ids[int(j)]}.{tail}"
        else:
            dist.all_reduce(grad)  # replicated weights: the data-parallel sum
        worst = max(worst, _rel64(grad, ref_grads[name]))
    return (_devices(*model.parameters()), _rel64(logits.detach(), ref_logits.detach()[mine]),
            worst)


def test_expert_parallel_moe_small_on_the_gpu():
    for devices, logit_err, grad_err in launch(_moe_small, WORLD, timeout=180):
        assert devices == {"cuda"}
        assert logit_err <= REL64 and grad_err <= REL64, (logit_err, grad_err)


def _ring_on_gpus(batched: bool, numel: int):
    """One ring step on the rank's GPU: a lone isend then irecv, or the two batched."""
    dev = rank_info().device
    r, p = dist.get_rank(), dist.get_world_size()
    mine, got = torch.full((numel,), float(r), device=dev), torch.empty(numel, device=dev)
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (r + 1) % p),
                                        dist.P2POp(dist.irecv, got, (r - 1) % p)])
    else:
        works = [dist.isend(mine, (r + 1) % p), dist.irecv(got, (r - 1) % p)]
    for w in works:
        w.wait()
    return got[0].item()


@pytest.mark.skipif(GPUS < 2, reason="nccl point-to-point needs 2 GPUs")
@pytest.mark.parametrize("p", sorted({2, min(GPUS, 3), GPUS} - {0, 1}))
def test_what_the_rules_say_of_a_ring_is_what_nccl_does(p):
    """NCCL's rules (helpers/launch/nccl_rules.py) on real nccl, at every size up to the
    node's GPUs: the batched ring runs; the lone ring hangs (p >= 3: the pairs'
    communicators form in a circle; p = 2: both sends first on the pair's one stream,
    with 64 MiB messages, beyond what NCCL buffers), and the launch's timeout ends it."""
    assert launch(_ring_on_gpus, p, True, 1 << 24) == [float((r - 1) % p) for r in range(p)]
    with pytest.raises(RankTimeout):
        launch(_ring_on_gpus, p, False, 1 << 24, timeout=30)
