"""benchmarks/bench.py on the CPU: a tiny random model end to end, its JSON, table and plot, merging, bad arguments."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import pytest
import torch

from redline.model import ModelArgs
from redline.benchmarks import bench, bench_model, bench_redline

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--model", "debug-tiny", "--device", "cpu", "--prompt-lengths", "4,8"]


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Tiny ops on a shared, busy CPU run far faster on one thread than with threads waiting on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench.main(argv)
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run over two quant modes, two batch sizes and the HF comparison: (rc, stdout, report, folder)."""
    folder = tmp_path_factory.mktemp("bench")
    argv = TINY + ["--new-tokens", "16", "--runs", "3", "--quant", "none,int8", "--batch-size", "1,2",
                   "--compare", "hf", "--json", str(folder / "out.json"), "--profile", str(folder / "traces"),
                   "--profile-steps", "4"]
    if HAS_MATPLOTLIB:
        argv += ["--plot", str(folder / "out.png")]
    rc, stdout = run_main(argv)
    report = json.loads((folder / "out.json").read_text()) if rc == 0 else None
    return rc, stdout, report, folder


def test_one_record_per_model_quant_batch_with_sane_numbers(full_run):
    rc, _, report, _ = full_run
    assert rc == 0
    records = report["records"]
    assert sorted((r["model"], r["quant"], r["batch_size"]) for r in records) == [
        ("debug-tiny", "int8", 1), ("debug-tiny", "int8", 2), ("debug-tiny", "none", 1), ("debug-tiny", "none", 2)]
    args = ModelArgs.from_name("debug-tiny")
    for r in records:
        assert r["decode_tok_s"] > 0 and len(r["decode_tok_s_runs"]) == 3 and r["ttft_s"] > 0
        assert r["new_tokens"] == 16 and r["prompt_tokens"] == 4 and r["compiled"] is False
        # On the CPU there is no bandwidth measure, so no limit and no GPU memory figures.
        assert r["bandwidth_gb_s"] is None and r["limit_tok_s"] is None and r["pct_of_limit"] is None
        assert r["peak_memory_bytes"] is None and r["overhead_bytes"] is None
        assert r["kv_cache_bytes"] > 0 and r["weights_bytes"] > r["bytes_per_token"] > 0
        assert r["n_params"] == bench_model.param_counts(args)["total"]
        assert sorted(p["prompt_tokens"] for p in r["prefill"]) == [4, 8]
        for p in r["prefill"]:
            assert p["ttft_s"] > 0 and p["decode_tok_s"] > 0 and p["compiled_prefill"] is False
            assert p["flops"] == bench_model.prefill_flops(args, p["prompt_tokens"], r["batch_size"])
            assert p["tflops"] == pytest.approx(p["flops"] / p["ttft_s"] / 1e12)
    by_key = {(r["quant"], r["batch_size"]): r for r in records}
    assert by_key[("int8", 1)]["bytes_per_token"] < by_key[("none", 1)]["bytes_per_token"]
    assert report["bandwidth_gb_s"] is None and report["bandwidth_runs_gb_s"] == []
    env = report["env"]
    assert env["torch_version"] == torch.__version__ and env["device_type"] == "cpu"
    assert "--model debug-tiny" in env["command"] and "--batch-size 1,2" in env["command"]


def test_profile_writes_one_trace_per_configuration(full_run):
    _, _, report, folder = full_run
    from redline.scripts.trace_summary import summarize_trace

    traced = [r for r in report["records"] if r["profile_path"]]
    assert {(r["quant"], r["batch_size"]) for r in traced} == {("none", 1), ("int8", 1), ("none", 2), ("int8", 2)}
    for record in traced:
        summary = summarize_trace(record["profile_path"])
        assert summary.steps == 4 and summary.tok_s == pytest.approx(record["profile_decode_tok_s"])


def test_hf_comparison_times_both_modes_and_reports_ratios(full_run):
    _, _, report, _ = full_run
    hf = {h["mode"]: h for h in report["hf"]}
    assert set(hf) == {"eager", "static+compiled"}
    assert hf["eager"]["cache_implementation"] == "dynamic"
    assert hf["static+compiled"]["cache_implementation"] == "static"
    assert hf["static+compiled"]["compiled"] is False  # transformers compiles on GPUs only
    redline = {r["quant"]: r["decode_tok_s"] for r in report["records"] if r["batch_size"] == 1}
    for h in hf.values():
        assert h["new_tokens"] == 16 and h["short_tokens"] == 8
        assert h["t_long_s"] > h["t_short_s"] > 0
        assert h["decode_tok_s"] == pytest.approx(8 / (h["t_long_s"] - h["t_short_s"]))
        assert h["redline_tok_s"] == redline
        assert h["ratio"] == pytest.approx({q: v / h["decode_tok_s"] for q, v in redline.items()})


def test_markdown_tables_are_printed(full_run):
    _, stdout, _, _ = full_run
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model | quant | batch | decode tok/s |"))
    assert "% of limit" in lines[header] and "peak GB" in lines[header] and "compile s" in lines[header]
    assert lines[header + 1].startswith("| --- |")
    rows = lines[header + 2:header + 6]
    assert [row.split(" | ")[1:3] for row in rows] == [["bf16", "1"], ["bf16", "2"], ["int8", "1"], ["int8", "2"]]
    assert any(line.startswith("| debug-tiny | HF eager |") for line in lines)
    assert any(line.startswith("ratio debug-tiny: Redline int8") for line in lines)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_is_a_png(full_run):
    _, _, _, folder = full_run
    data = (folder / "out.png").read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # written atomically


def test_merge_reports_saved_runs_together(full_run, tmp_path):
    _, _, report, folder = full_run
    saved = folder / "out.json"
    rc, stdout = run_main(["--merge", f"{saved},{saved}", "--json", str(tmp_path / "merged.json")])
    assert rc == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert len(merged["records"]) == 2 * len(report["records"]) and len(merged["hf"]) == 2 * len(report["hf"])
    assert [s["path"] for s in merged["env"]["merged_from"]] == [str(saved), str(saved)]
    assert "| model | quant | batch | decode tok/s |" in stdout


def test_a_failed_configuration_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    build = bench_redline.build_random_model

    def build_or_fail(args, device, dtype, quant, seed=0, group_size=128):
        if quant == "int8":
            raise RuntimeError("CUDA out of memory (simulated)")
        return build(args, device, dtype, quant, seed, group_size)

    monkeypatch.setattr(bench_redline, "build_random_model", build_or_fail)
    out = tmp_path / "partial.json"
    rc, stdout = run_main(TINY + ["--new-tokens", "4", "--runs", "1", "--quant", "int8,none", "--json", str(out)])
    assert rc == 1
    report = json.loads(out.read_text())
    assert [r["quant"] for r in report["records"]] == ["none"]
    assert report["errors"] == [{"what": "debug-tiny int8 batch 1",
                                 "error": "RuntimeError: CUDA out of memory (simulated)"}]
    assert "FAILED" in stdout and "simulated" in capsys.readouterr().err


def test_compile_time_runs_child_processes_cold_then_warm(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children inherit the environment
    rc, stdout = run_main(TINY + ["--new-tokens", "4", "--compile-time-only", "--probe-new-tokens", "3",
                                  "--json", str(tmp_path / "ct.json")])
    assert rc == 0
    report = json.loads((tmp_path / "ct.json").read_text())
    assert report["records"] == [] and report["bandwidth_gb_s"] is None
    (record,) = report["compile_times"]
    assert (record["model"], record["quant"], record["prompt_tokens"]) == ("debug-tiny", "none", 4)
    for probe in (record["cold"], record["warm"]):
        assert probe["ok"], probe["error"]
        assert 0 < probe["main_s"] <= probe["built_s"] <= probe["first_token_s"] <= probe["end_s"] <= probe["wall_s"]
    assert "Time to first token after process start" in stdout


BAD_ARGUMENTS = [
    (["--model", "Llama-9-1T"], "unknown model name"),
    (["--quant", "int3"], "unknown --quant mode"),
    (["--quant", "int4", "--groupsize", "48"], "power of two"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--prompt-lengths", "4,-1"], "--prompt-lengths"),
    (["--batch-size", "0"], "--batch-size"),
    (["--runs", "many"], "--runs"),
    (["--prompt-lengths", "300"], "context"),
    (["--compare", "vllm"], "--compare"),
    (["--compile-prefill"], "--compile-prefill"),
    (["--no-such-flag"], "unrecognized"),
    (["--merge", "missing.json"], "does not exist"),
]


@pytest.mark.parametrize("extra, message", BAD_ARGUMENTS, ids=[e[0][0] + "=" + e[0][-1] for e in BAD_ARGUMENTS])
def test_bad_arguments_give_one_error_line_and_exit_2(extra, message, capsys):
    argv = extra if extra[0] == "--merge" else TINY + extra
    if extra[0] == "--model":
        argv = ["--device", "cpu"] + extra
    assert bench.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert captured.out == ""


def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bench.main(TINY + ["--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --device cuda was asked for, but no CUDA/ROCm GPU is visible; use --device cpu")


def test_fp8_weights_are_benchmarked(tmp_path):
    """--quant fp8 builds the model with random e4m3 weights and reports a row for it."""
    path = tmp_path / "fp8.json"
    rc, out = run_main(TINY + ["--new-tokens", "4", "--runs", "1", "--quant", "fp8", "--batch-size", "1",
                               "--json", str(path)])
    assert rc == 0, out
    records = json.loads(path.read_text())["records"]
    assert [(r["model"], r["quant"], r["batch_size"]) for r in records] == [("debug-tiny", "fp8", 1)]
