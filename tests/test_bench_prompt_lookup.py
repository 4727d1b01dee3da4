"""benchmarks/bench_prompt_lookup.py: the task table on a tiny model with a chat template (CPU, small settings)."""
from __future__ import annotations

import json

import pytest
import torch

from redline import generate
from redline.benchmarks import bench_prompt_lookup


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops on a shared, busy CPU run far faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_script_measures_every_task_and_source(tiny_llm_checkpoint, chat_tokenizer, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    # The same kinds of task, short enough for the tiny model's 256-token context.
    monkeypatch.setattr(bench_prompt_lookup, "TASKS", {
        "code_edit": "Rename fib to fibonacci:\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
        "summarize": "Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox jumps again."})
    out = tmp_path / "lookup.json"
    # The folder, not the file: a pre-converted checkpoint directory is what a machine without gguf gets.
    code = bench_prompt_lookup.main(["--checkpoint_path", str(tiny_llm_checkpoint[0].parent), "--device", "cpu",
                                     "--max_new_tokens", "12", "--speculate_k", "4", "--runs", "1", "--json", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out.read_text())
    records = report["records"]
    # plain, prompt lookup, int8 and int4 (the largest group size that divides the tiny model's layers: 32)
    assert [r["source"] for r in records[:4]] == ["plain", "prompt_lookup", "int8_draft", "int4-g32_draft"]
    assert len(records) == 4 * 2 and report["speculate_k"] == 4 and report["errors"] == []
    assert report["gate_cost_ratio"] > 0 and "cost gate" in printed
    for r in records:
        assert r["same_output"], r  # greedy speculation never changes the output
        assert r["decode_tok_s"] > 0
        assert (r["mean_accepted"] is None) == (r["source"] == "plain")
        if r["source"] != "plain":  # the prefill's token, 1 + accepted per verify step, 1 per plain step
            assert 1 + r["verify_steps"] * (1 + r["mean_accepted"]) + r["plain_steps"] == pytest.approx(r["new_tokens"])
    assert {r["draft_quantize"] for r in records} == {None, "int8", "int4-g32"}
    for source in ("prompt_lookup", "int8_draft", "int4-g32_draft"):
        assert f"mean over tasks, {source}" in printed


def test_a_failing_source_is_recorded_and_the_others_run(tiny_llm_checkpoint, chat_tokenizer, monkeypatch, capsys):
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    llm = generate.LLM.load(tiny_llm_checkpoint[0], device="cpu")

    class Broken:  # not a draft: the engine refuses it in one line
        pass

    cfg = bench_prompt_lookup.LookupBenchConfig(max_new_tokens=6, speculate_k=2, runs=1)
    errors = []
    records = bench_prompt_lookup.bench_tasks(llm, {"broken": Broken()}, cfg, {"t": "Say hi"}, errors)
    assert [r.source for r in records] == ["plain", "prompt_lookup"]
    assert errors and errors[0]["what"] == "t broken_draft" and "draft must be" in errors[0]["error"]
    capsys.readouterr()


def test_a_gguf_is_converted_once_beside_it(tmp_path, monkeypatch):
    import importlib.util

    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(path, out, dtype, dequantize):
        calls.append((path, out, dtype, dequantize))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"x")
        (out.parent / "tokenizer_config.json").write_text("{}")
        return out

    from redline.scripts import convert_gguf

    monkeypatch.setattr(convert_gguf, "convert_gguf", convert)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    cfg = bench_prompt_lookup.LookupBenchConfig(checkpoint_path=gguf)
    first = bench_prompt_lookup.checkpoint_for(cfg)
    assert first == tmp_path / "Model.Q4_1-float32" / "model.safetensors"
    assert calls == [(gguf, first, "float32", True)]
    assert bench_prompt_lookup.checkpoint_for(cfg) == first and len(calls) == 1  # up to date: not converted again


def test_a_gguf_without_the_gguf_package_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert bench_prompt_lookup.main(["--checkpoint_path", str(gguf), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs the gguf package" in err and "pass DIR" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [(["--speculate_k", "0"], "speculate_k"), (["--runs", "0"], "runs"),
                                           (["--checkpoint_path", "/nonexistent/x"], "does not exist"),
                                           (["--drafts", "int4-g48"], "power of two"),
                                           (["--drafts", "int8,int8"], "twice"), (["--bogus"], "unrecognized"),
                                           (["--tasks", "code_edit,poetry"], "unknown --tasks poetry")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert bench_prompt_lookup.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_draft_group_size_that_does_not_divide_is_one_line(tiny_llm_checkpoint, capsys):
    code = bench_prompt_lookup.main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--device", "cpu",
                                     "--drafts", "int4-g128"])
    err = capsys.readouterr().err
    assert code == 2 and "does not divide a layer's 64 inputs" in err and err.count("\n") == 1
