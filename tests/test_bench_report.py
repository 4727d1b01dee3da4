"""benchmarks/bench_report.py: the tables, the plot and merged reports, from hand-made reports."""
from __future__ import annotations

import importlib.util
import json

import pytest

from redline.benchmarks import bench_report

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_report() -> dict:
    def record(model, quant, tok_s, limit):
        return {"model": model, "quant": quant, "dtype": "bfloat16", "batch_size": 1, "decode_tok_s": tok_s,
                "limit_tok_s": limit}

    def hf(model, mode, tok_s):
        return {"model": model, "mode": mode, "compiled": True, "decode_tok_s": tok_s}

    return {"bandwidth_gb_s": 4200.0, "env": {}, "compile_times": [],
            "records": [record("A", "none", 280.0, 318.0), record("A", "int8", 520.0, 620.0),
                        record("B", "none", 250.0, 290.0), record("B", "int8", 470.0, 560.0)],
            "hf": [hf("A", "eager", 64.0), hf("A", "static+compiled", 165.0), hf("B", "eager", 60.0),
                   hf("B", "static+compiled", None)]}


def test_plot_series_groups_engines_per_model_with_limits():
    models, series, limits = bench_report.plot_series(synthetic_report())
    assert models == ["A", "B"]
    assert series == {"Redline bf16": [280.0, 250.0], "Redline int8": [520.0, 470.0],
                      "HF eager": [64.0, 60.0], "HF static+compiled": [165.0, None]}
    assert limits == {"Redline bf16": [318.0, 290.0], "Redline int8": [620.0, 560.0]}


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_with_limit_lines_and_a_missing_bar(tmp_path):
    path = tmp_path / "plot.png"
    bench_report.write_plot(synthetic_report(), path)
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_fmt_scales_and_dashes_a_missing_value():
    assert bench_report.fmt(0.0123, ".1f", 1e3) == "12.3"
    assert bench_report.fmt(None, ".1f") == "–"


def test_hf_mode_labels():
    assert bench_report.hf_mode_label({"mode": "eager", "compiled": False}) == "HF eager"
    assert bench_report.hf_mode_label({"mode": "static+compiled", "compiled": True}) == "HF static+compiled"
    assert bench_report.hf_mode_label({"mode": "static+compiled", "compiled": False}) == "HF static (not compiled)"


def probe(first_token_s, error=None):
    return {"ok": error is None, "first_token_s": first_token_s, "main_s": 1.0, "built_s": 2.0, "end_s": 5.0,
            "wall_s": 6.0, "error": error}


def test_compile_time_table_has_a_cold_and_a_warm_row():
    record = {"model": "A", "quant": "int8", "cold": probe(40.0), "warm": probe(None, "exit 1: boom")}
    lines = bench_report.compile_time_table([record])
    rows = [line for line in lines if line.startswith("| A |")]
    assert rows == ["| A | int8 | cold | 40.0 | 1.0 | 2.0 | 6.0 |  |",
                    "| A | int8 | warm | – | 1.0 | 2.0 | 6.0 | exit 1: boom |"]


def test_format_report_lists_failures_and_notes():
    report = {"env": {"device": "cpu", "torch_version": "2.x", "command": "python benchmarks/bench.py"},
              "records": [], "hf": [], "compile_times": [], "notes": ["a note"],
              "errors": [{"what": "A int8 batch 1", "error": "RuntimeError: out of memory"}]}
    text = bench_report.format_report(report)
    assert text.startswith("# Redline benchmark (cpu, torch 2.x)")
    assert "- A int8 batch 1: RuntimeError: out of memory" in text and text.endswith("- a note")


@pytest.mark.parametrize("content, message", [("{not json", "cannot read"), ('{"records": []}', "not a bench.py")])
def test_merge_rejects_files_that_are_not_reports(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        bench_report.merge_reports([path])


def test_merge_keeps_the_first_environment_and_every_record(tmp_path):
    paths = []
    for i, bandwidth in enumerate((3000.0, 4000.0)):
        report = {"env": {"command": f"run {i}"}, "bandwidth_gb_s": bandwidth, "records": [{"n": i}], "hf": [],
                  "compile_times": [], "errors": []}
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(report))
    merged = bench_report.merge_reports(paths)
    assert merged["records"] == [{"n": 0}, {"n": 1}] and merged["bandwidth_gb_s"] == 3000.0
    assert [(s["bandwidth_gb_s"], s["command"]) for s in merged["env"]["merged_from"]] == [(3000.0, "run 0"),
                                                                                          (4000.0, "run 1")]


def test_all_reduce_table_gives_the_all_reduces_share_of_a_step():
    def record(mode, trace):
        return {"model": "M", "quant": "none", "dtype": "bfloat16", "batch_size": 1, "decode_tok_s": 50.0, "tp": 2,
                "all_reduce_mode": mode, "all_reduce": {"all_reduces_per_token": 160, "bytes_each": 16384,
                                                        "us_per_token": {"nccl": 3000.0, "oneshot": 1000.0},
                                                        "errors": {}, "trace": trace}}

    untraced = {"us_per_token": None, "exclusive_us_per_token": None}
    lines = bench_report.all_reduce_table([record("oneshot", untraced), record("nccl", untraced),
                                           record("oneshot", {"us_per_token": 1500.0, "exclusive_us_per_token": 800.0})])
    rows = [line for line in lines if line.startswith("| M TP2")]
    # A step is 20,000 µs: the graph of the mode the model ran, or the time its kernels add in the trace.
    assert [row.split("|")[-3].strip() for row in rows] == ["5.0", "15.0", "4.0"]
    assert "all-reduce % of a step" in "\n".join(lines)
