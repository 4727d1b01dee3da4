"""scripts/bench_prompt_lookup.py: the task table on a tiny model with a chat template (CPU, small settings)."""
from __future__ import annotations

import json

import pytest
import torch

import generate
from scripts import bench_prompt_lookup


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
    code = bench_prompt_lookup.main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--device", "cpu",
                                     "--max_new_tokens", "12", "--speculate_k", "4", "--runs", "1", "--json", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    records = json.loads(out.read_text())["records"]
    assert len(records) == 3 * 2
    for r in records:
        assert r["same_output"], r  # greedy speculation never changes the output
        assert r["decode_tok_s"] > 0
        assert (r["mean_accepted"] is None) == (r["source"] == "plain")
    assert "mean over tasks, prompt_lookup" in printed and "int8_draft" in printed


@pytest.mark.parametrize("argv, message", [(["--speculate_k", "0"], "speculate_k"), (["--runs", "0"], "runs"),
                                           (["--checkpoint_path", "/nonexistent/x"], "does not exist")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert bench_prompt_lookup.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
