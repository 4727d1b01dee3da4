"""benchmarks/bench_serving.py on the CPU: the workloads run, count what they should, and bad flags are one line."""
from __future__ import annotations

import json

from redline.benchmarks import bench_serving


def test_fixed_workload_report_and_json(tmp_path, capsys):
    path = tmp_path / "serving.json"
    code = bench_serving.main(["--model", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--num-requests",
                               "4", "--max-kv-tokens", "512", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "debug-tiny fixed: 4 requests, 512 output tokens" in out
    report = json.loads(path.read_text())
    r = report["redline"]
    assert r["output_tokens"] == 512 and r["prompt_tokens"] == 512 and r["peak_kv_pages"] <= 32
    assert r["steps"] >= 128 and r["step_ms"]["p50"] <= r["step_ms"]["max"] and r["roofline_pct"] is None
    kinds = r["steps_by_kind"]  # every step is decode-only or prefills; 4 prompts of 128 need at least one prefill
    assert kinds["decode"]["steps"] + kinds["with_prefill"]["steps"] == r["steps"]
    assert kinds["with_prefill"]["steps"] >= 1 and kinds["decode"]["steps"] >= 127


def test_mixed_lengths_stay_in_range():
    requests = bench_serving.make_requests("mixed", 50, 1000, 0)
    lengths = [len(r.prompt) for r in requests] + [r.output_len for r in requests]
    assert min(lengths) >= 100 and max(lengths) <= 1024 and len(set(lengths)) > 20


def test_bad_flags_are_one_line(capsys):
    assert bench_serving.main(["--num-requests", "0"]) == 2
    want = "error: --num-requests, --prompt-tokens and --hf-requests must be positive"
    assert capsys.readouterr().err.strip() == want


def test_prefix_workload_serves_the_second_turn_from_the_cache(tmp_path, capsys):
    path = tmp_path / "prefix.json"
    code = bench_serving.main(["--model", "debug-tiny-llama3", "--device", "cpu", "--dtype", "float32", "--workload",
                               "prefix", "--max-kv-tokens", "8192", "--json", str(path)])
    assert code == 0 and "prefix cache: first turn (512 tokens)" in capsys.readouterr().out
    prefix = json.loads(path.read_text())["prefix"]
    # every full page of the first turn's prompt is a hit for the second turn
    assert prefix["second_turn_cached_tokens"] == [512, 512, 512]
    assert prefix["first_turn_ttft_s"] > 0 and prefix["second_turn_ttft_s"] > 0


def test_step_costs_of_a_mixture_read_the_experts_their_tokens_choose():
    from redline.benchmarks.bench_model import param_counts
    from redline.engine.batch import Chunk, Sequence
    from redline.model import ModelArgs

    args = ModelArgs.from_name("Qwen3-30B-A3B")
    counts = param_counts(args)
    assert round(counts["total"] / 1e9, 1) == 30.5 and round((counts["block_matmuls"] + 2 * counts["head"]) / 1e9, 1) \
        == 3.4  # the published 30.5B, of which 3.3B active (norms and the untied embedding row aside)
    experts, one_token = 4e9, 6e9  # all experts' bytes; what one token reads (8 of 128 experts)
    costs = bench_serving.StepCosts(args, int(one_token), 2, bandwidth=1e12, peak_flops=1e30,
                                    expert_bytes=int(experts))

    def step_bytes(tokens: int) -> float:
        seq = Sequence("r", [1] * tokens, tokens, 1)
        return costs.min_seconds([Chunk(seq, 0, tokens)]) * 1e12 - (tokens + tokens) * costs.kv_token_bytes

    assert abs(step_bytes(1) - one_token) < 1e3  # a single token: the router's top_k share of the experts
    assert abs(step_bytes(4096) - (one_token + experts * (1 - 8 / 128))) < 1e3  # many: all of them
    assert one_token < step_bytes(16) < step_bytes(64) < one_token + experts * (1 - 8 / 128)


def test_a_mixture_of_experts_runs_the_fixed_workload(tmp_path, capsys):
    path = tmp_path / "moe.json"
    code = bench_serving.main(["--model", "debug-tiny-moe", "--device", "cpu", "--dtype", "float32", "--num-requests",
                               "3", "--max-kv-tokens", "1024", "--json", str(path)])
    assert code == 0 and "debug-tiny-moe fixed: 3 requests, 384 output tokens" in capsys.readouterr().out
    assert json.loads(path.read_text())["redline"]["output_tokens"] == 384


def test_fixed_workload_runs_fp8_weights(capsys):
    """--quant fp8: the model is built with random e4m3 weights (W8A8) and the report names the weights."""
    code = bench_serving.main(["--model", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--num-requests",
                               "2", "--max-kv-tokens", "512", "--quant", "fp8"])
    out = capsys.readouterr().out
    assert code == 0 and "debug-tiny fp8 fixed: 2 requests, 256 output tokens" in out


def test_long_workload_with_an_fp8_kv_cache_reports_its_capacity_and_decode_itl(tmp_path, capsys):
    """--workload long --kv-cache-dtype fp8: long prompts through e4m3 pages; the report names the pool's dtype and
    capacity, and the decode inter-token latency of the steps that only decode."""
    path = tmp_path / "long.json"
    code = bench_serving.main(["--model", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--workload", "long",
                               "--num-requests", "2", "--prompt-tokens", "100", "--max-kv-tokens", "512",
                               "--kv-cache-dtype", "fp8", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "debug-tiny long: 2 requests, 256 output tokens" in out
    assert "KV cache float8_e4m3fn: 512 tokens" in out and "decode ITL p50" in out
    r = json.loads(path.read_text())["redline"]
    assert r["kv_cache_dtype"] == "float8_e4m3fn" and r["kv_capacity_tokens"] == 512
    assert r["prompt_tokens"] == 200 and 0 < r["decode_itl_ms_p50"] <= r["step_ms"]["max"]
    assert bench_serving.main(["--model", "debug-tiny", "--device", "cpu", "--kv-cache-dtype", "fp16x"]) == 2
    assert "kv_cache_dtype must be one of auto, fp8" in capsys.readouterr().err


def test_fixed_workload_under_torchrun_runs_on_two_ranks(tmp_path):
    """Tensor parallel: rank 0's engine runs the workload on its slices while rank 1 follows every step; one
    report, from rank 0."""
    from pathlib import Path

    from tests.test_tensor_parallel import torchrun

    path = tmp_path / "serving.json"
    script = Path(bench_serving.__file__).resolve()
    proc = torchrun([str(script), "--model", "debug-tiny", "--device", "cpu", "--dtype", "float32",
                     "--num-requests", "4", "--max-kv-tokens", "512", "--json", str(path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("debug-tiny fixed: 4 requests, 512 output tokens") == 1
    report = json.loads(path.read_text())
    assert report["tp"] == 2 and report["env"]["command"].startswith("torchrun --nproc_per_node 2 ")
    assert report["redline"]["output_tokens"] == 512
    refused = torchrun([str(script), "--model", "debug-tiny", "--device", "cpu", "--workload", "single"])
    assert refused.returncode != 0 and refused.stderr.count("error: --compare hf and --workload single") == 1
