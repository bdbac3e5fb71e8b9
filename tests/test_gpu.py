"""On a GPU node: the launcher and the mechanisms of chapters 01-05 and 11-12 on nccl.

Skipped without CUDA (CI has none; an instructor runs them before a workshop).
With one GPU they run one rank on nccl (every tensor on cuda:0, every
collective through nccl, only the arithmetic of p = 1); with two or more, two
ranks, one per GPU. ZeRO, FSDP, compression and FP8 have their GPU tests
beside their CPU ones (tests/test_zero.py, test_fsdp.py, test_compression.py,
test_precision.py, test_memory.py).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from helpers import RankError, launch, rank_info
from helpers.collectives import ring_all_reduce, sweep
from helpers.ddp import BucketedDDP
from helpers.model import build_model
from helpers.pipeline import one_f_one_b
from helpers.pipeline.executor import chunk_grads, pipeline_step, reference_grads, split_model
from helpers.steptime import PARTS, dp_step_profile
from helpers.tolerance import within_fp32_noise

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
