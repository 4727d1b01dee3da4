"""benchmarks/bench_cpu.py on a tiny registry model: the table and JSON it writes, a model's first layers, bad flags."""
from __future__ import annotations

import json

from redline.benchmarks import bench_cpu


def test_registry_model_first_layers_table_and_json(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    code = bench_cpu.main(["--model", "debug-tiny-moe", "--layers", "1", "--configs", "float32,int8,int4-g32",
                           "--rounds", "1", "--tokens", "3", "--read_mb", "8", "--threads", "1", "--prompt-tokens",
                           "20", "--out", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "debug-tiny-moe (first 1 layers)" in out and "| int4-g32 |" in out
    result = json.loads(path.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"float32", "int8", "int4-g32"} and rows["float32"]["vs_float32"] == 1.0
    assert rows["int4-g32"]["bytes_per_token"] < rows["int8"]["bytes_per_token"] < rows["float32"]["bytes_per_token"]
    assert all(r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 for r in rows.values()) and result["prompt_tokens"] == 20


def test_layers_and_prompt_tokens_are_refused_for_the_demo_model(capsys):
    for argv, message in ((["--model", "demo", "--layers", "2"], "--layers takes"),
                          (["--model", "debug-tiny", "--layers", "0"], "--layers takes"),
                          (["--model", "demo", "--prompt-tokens", "9"], "--prompt-tokens takes")):
        try:
            bench_cpu.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2
        err = capsys.readouterr().err
        assert message in err
