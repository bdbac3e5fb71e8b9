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
]


@pytest.mark.parametrize("name, argv, message", CASES)
def test_benchmark_refuses_bad_arguments(name, argv, message, load_bench, monkeypatch):
    bench = load_bench(name)
    if hasattr(bench, "build_model"):  # no model may be built either
        monkeypatch.setattr(bench, "build_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(ValueError, match=message):
        bench.main(argv)
