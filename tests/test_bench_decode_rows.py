"""benchmarks/bench_decode_rows.py on the CPU: the steps run and are costed, kernels are grouped, bad rows refused."""
from __future__ import annotations

import json

from redline.benchmarks import bench_decode_rows
from redline.benchmarks.bench_model import param_counts
from redline.model import ModelArgs


def test_steps_run_and_report(tmp_path, capsys):
    path = tmp_path / "rows.json"
    code = bench_decode_rows.main(["--model", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--rows", "2,1",
                                   "--context", "40", "--repeats", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "   1 rows:" in out and "   2 rows:" in out
    report = json.loads(path.read_text())
    assert sorted(report["rows"]) == ["1", "2"] and report["context"] == 40
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in report["rows"].values())


def test_step_costs_count_weights_once_and_keys_per_row():
    args = ModelArgs.from_name("Llama-3-8B")
    counts = param_counts(args)
    one_bytes, one_flops = bench_decode_rows.step_costs(args, 16_000_000_000, 2, 1, 191)
    two_bytes, two_flops = bench_decode_rows.step_costs(args, 16_000_000_000, 2, 2, 191)
    # 192 keys and values read (the new token's among them) and the new token's written, of 32 layers, 8 KV heads
    # of 128, bf16
    kv_bytes = 193 * 2 * 32 * 8 * 128 * 2
    assert one_bytes == 16_000_000_000 + kv_bytes and two_bytes - one_bytes == kv_bytes
    assert two_flops == 2 * one_flops and one_flops > 2 * (counts["block_matmuls"] + counts["head"])


def test_kernels_are_grouped_by_name():
    group = bench_decode_rows.kernel_group
    assert group("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN") == "cublas matmul"
    assert group("_paged_split_kernel") == "attention" and group("_small_m_dot_kernel") == "triton matmul"
    assert group("triton_poi_fused_linear_mul_silu_split_3") == "other"


def test_bad_rows_are_one_line(capsys):
    assert bench_decode_rows.main(["--rows", "0,600"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rows takes comma-separated integers in 1..512, got '0,600'"
