"""Benchmarks of chapters 13-18 refuse bad arguments with a message naming the
flag, before any rank starts or any model is built (chapters 02-04 and 12 test
theirs beside their mechanisms)."""

import pytest

CASES = [
    ("bench_compression", ["--size", "huge"], "--size must be one of"),
    ("bench_compression", ["--seq", "0"], "--seq must be in"),
    ("bench_compression", ["--world", "1"], "--world must be >= 2"),
    ("bench_compression", ["--steps", "1"], "--steps must be >= 2"),
    ("bench_zero_fsdp", ["--size", "huge"], "--size must be one of"),
    ("bench_zero_fsdp", ["--seq", "100000"], "--seq must be in"),
    ("bench_zero_fsdp", ["--steps", "0"], "--steps must be >= 2"),
    ("bench_recompute", ["--size", "huge"], "--size must be one of"),
    ("bench_recompute", ["--batch", "0"], "--batch must be >= 1"),
    ("bench_recompute", ["--steps", "0"], "--steps must be >= 1"),
    ("bench_fp8", ["--sizes", "100"], "--sizes must be multiples of 16"),
    ("bench_fp8", ["--reps", "0"], "--reps must be >= 1"),
    ("bench_moe", ["--world", "1"], "--world must be >= 2"),
    ("bench_moe", ["--steps", "1"], "--steps must be >= 2"),
    ("bench_moe", ["--experts", "6", "--world", "4"], "6 experts do not divide"),
    ("bench_moe", ["--top-k", "9"], "top_k=9 is larger than num_experts=8"),
    ("bench_moe", ["--capacity-factor", "0"], "capacity_factor must be > 0"),
    ("bench_checkpoint", ["--size", "huge"], "--size must be one of"),
    ("bench_checkpoint", ["--world", "1"], "--world must be >= 2"),
    ("bench_checkpoint", ["--reps", "0"], "--reps must be >= 1"),
    ("bench_parallel3d", ["--size", "huge"], "--size must be one of"),
    ("bench_parallel3d", ["--steps", "1"], "--steps must be >= 2"),
    ("bench_parallel3d", ["--tp", "3"], "4 heads do not divide over tensor-parallel size 3"),
    ("bench_parallel3d", ["--pp", "3"], "4 layers do not divide over pipeline size 3"),
    ("bench_parallel3d", ["--batch", "12"], "--batch 12 does not divide over the 8 DDP ranks"),
    ("bench_debug", ["--size", "huge"], "--size must be one of"),
    ("bench_debug", ["--steps", "1"], "--steps must be >= 2"),
    ("bench_debug", ["--ranks", "1"], "--ranks must be >= 2"),
    ("bench_debug", ["--calls", "0"], "--calls must be >= 1"),
    ("bench_launch", ["--repeats", "0"], "--repeats must be >= 1"),
    ("bench_first_check", ["--kernels", "0"], "--kernels must be >= 1"),
    ("bench_first_check", ["--lab", "99"], "no solutions/99_"),
]


@pytest.mark.parametrize("name, argv, message", CASES)
def test_benchmark_refuses_bad_arguments(name, argv, message, load_bench, monkeypatch):
    bench = load_bench(name)
    if hasattr(bench, "build_model"):  # no model may be built either
        monkeypatch.setattr(bench, "build_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(ValueError, match=message):
        bench.main(argv)


@pytest.mark.parametrize("cuda, flag, want", [
    (False, "auto", "cpu"), (True, "auto", "gpu"), (False, "gpu", "gpu"), (True, "cpu", "cpu")])
def test_shapes_follow_the_device_unless_forced(cuda, flag, want, load_bench, monkeypatch):
    import argparse

    import torch
    load_bench("bench_gemm")  # puts benchmarks/ on sys.path for _args
    from _args import shapes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert shapes(argparse.Namespace(shapes=flag)) == want


def _gemm_rows(bench, argv, capsys):
    """(hidden, tokens, tp) of every row bench_gemm prints, its GEMMs not run."""
    bench.gemm_rates = lambda m, k, n, device, reps: (1e12, float("nan"))
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return lines[0], {tuple(int(v) for v in line.split()[:3]) for line in lines[2:]}


def test_gemm_sizes_by_shapes(load_bench, monkeypatch, capsys):
    import torch
    bench = load_bench("bench_gemm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    head, rows = _gemm_rows(bench, [], capsys)  # a laptop: seconds, not the H100's hours
    assert "cpu shapes" in head and "x 2 calls" in head
    assert {h for h, _, _ in rows} == {512, 1024} and {t for _, t, _ in rows} == {256}
    head, rows = _gemm_rows(bench, ["--shapes", "gpu"], capsys)
    assert "gpu shapes" in head and "x 10 calls" in head
    assert {h for h, _, _ in rows} == {4096, 8192} and {p for _, _, p in rows} == {1, 2, 4, 8}
    _, rows = _gemm_rows(bench, ["--shapes", "gpu", "--hidden", "256", "--tp", "2"], capsys)
    assert rows == {(256, t, 2) for t in (2048, 8192)}  # a flag given wins, the others follow --shapes


def test_fp8_cpu_shapes_by_default(load_bench, monkeypatch, capsys):
    import torch
    bench = load_bench("bench_fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "timeit", lambda *a, **k: 1e-3)  # nothing is timed
    bench.main([])
    out = capsys.readouterr().out
    assert "cpu shapes" in out
    gemms, layers = out.split("\n\n")[:2]  # two tables: n^3 GEMMs, then layers
    assert [int(line.split()[0]) for line in gemms.splitlines()[2:]] == [64, 128, 256]
    assert len(layers.splitlines()) == 3 and "64 x 128, 256" in layers  # header, 1 layer, paths
    # (--shapes gpu: 8192^3 and a 70B-class MLP, not run here: gigabytes)  # 1024^3 on the CPU's reference FP8 kernel: ~17 s a call on a laptop
