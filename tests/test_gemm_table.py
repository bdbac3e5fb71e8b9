"""The measured GEMM table and the matmul efficiency the planner can read from it."""

import csv

import pytest

from helpers.costs.gemm import MEASURED, TABLES, GemmTable, layer_gemms, matmul_efficiency
from helpers.modelspec import ModelSpec

H100_PEAK = 989e12   # dense BF16, H100 SXM datasheet (helpers.topology.gpus)


def test_table_rows_are_the_measured_file():
    table = GemmTable.load("h100")
    with open(MEASURED / TABLES["h100"][0]) as f:
        raw = list(csv.DictReader(f))
    assert len(raw) == 144 and table.torch == "2.11.0+cu130"
    by_shape = {}
    for r in raw:
        by_shape.setdefault((int(r["m"]), int(r["k"]), int(r["n"])), []).append(r)
    assert len(table.rows) == len(by_shape) < len(raw)      # some shapes measured twice
    for (m, k, n), rs in by_shape.items():
        # a measured shape is its own nearest neighbour, priced at its measurements' mean
        for col, dtype in (("bf16_tflops", "bf16"), ("fp8_tflops", "fp8")):
            mean = sum(float(r[col]) for r in rs) / len(rs) * 1e12
            assert table.rate(m, k, n, dtype) == pytest.approx(mean, rel=1e-12)


def test_nearest_is_by_log_ratio():
    table = GemmTable.load("h100")
    # 2100 tokens is nearer 2048 than 8192 in log terms; the other two sizes are exact
    assert table.nearest(2100, 4096, 12288) == table.nearest(2048, 4096, 12288)
    assert table.nearest(2100, 4096, 12288).m == 2048


def test_layer_gemms_shapes():
    llama8b = ModelSpec(layers=32, hidden=4096, heads=32, vocab=128256, seq=8192, ffn=14336,
                        kv_heads=8, gated_mlp=True)
    # TP 4: 8 query heads + 2 x 2 K/V heads of 128 per rank; SwiGLU's two up projections
    assert layer_gemms(llama8b, 4, 8192) == [
        ("qkv", 8192, 4096, (8 + 4) * 128), ("attn_out", 8192, 1024, 4096),
        ("mlp_up", 8192, 4096, 2 * 14336 // 4), ("mlp_down", 8192, 14336 // 4, 4096)]
    # TP 16 > 8 K/V heads: each rank keeps one (replicated), not half of one
    assert layer_gemms(llama8b, 16, 8192)[0] == ("qkv", 8192, 4096, (2 + 2) * 128)
    with pytest.raises(ValueError, match="heads 32 does not divide over tensor-parallel size 5"):
        layer_gemms(ModelSpec(layers=2, hidden=4000, heads=32, vocab=64, seq=8), 5, 8)


def test_thin_tp_shards_run_less_efficiently():
    gpt = ModelSpec(layers=2, hidden=4096, heads=32, vocab=50304, seq=2048)
    table = GemmTable.load("h100")
    eff = {t: matmul_efficiency(gpt, t, 2048, table, H100_PEAK) for t in (1, 2, 4, 8)}
    # measured: TP 1 about 0.77 of peak, TP 8 about 0.61 (attention-out at 288 TFLOP/s)
    assert 0.7 < eff[1] < 0.85 and 0.55 < eff[8] < 0.68 and eff[8] < eff[4] < eff[1]
    # the harmonic mean: FLOPs over seconds, each GEMM at its own rate
    gemms = layer_gemms(gpt, 8, 2048)
    flops = [2 * m * k * n for _, m, k, n in gemms]
    secs = [f / table.rate(m, k, n) for f, (_, m, k, n) in zip(flops, gemms)]
    assert eff[8] == pytest.approx(sum(flops) / sum(secs) / H100_PEAK, rel=1e-12)


def test_unknown_table_and_bad_sizes():
    with pytest.raises(ValueError, match="no measured GEMM table 'b200'"):
        GemmTable.load("b200")
    with pytest.raises(ValueError, match="must be positive"):
        GemmTable.load("h100").nearest(0, 4096, 4096)
    with pytest.raises(ValueError, match="'bf16' or 'fp8'"):
        GemmTable.load("h100").rate(2048, 4096, 4096, "fp16")


def test_benchmark_writes_a_table_the_planner_reads(tmp_path, load_bench):
    # The benchmark's CSV is the stored table's format: a table measured on another
    # GPU with bench_gemm.py can be added to TABLES as it is. (CPU figures: format only.)
    bench = load_bench("bench_gemm")
    out = tmp_path / "cpu.csv"
    assert bench.main(["--hidden", "256", "--tokens", "32", "--tp", "1", "2", "--reps", "1",
                       "--out", str(out)]) == 0
    table = GemmTable.from_csv(out, "test")
    assert [(r.m, r.k, r.n) for r in table.rows][:4] == [
        (32, 256, 768), (32, 256, 256), (32, 256, 1024), (32, 1024, 256)]
    with open(MEASURED / TABLES["h100"][0]) as f:
        assert f.readline() == out.read_text().splitlines(keepends=True)[0].replace("\r\n", "\n")
    with pytest.raises(ValueError, match="hidden 256 does not divide over tensor-parallel size 3"):
        bench.main(["--hidden", "256", "--tp", "3"])
