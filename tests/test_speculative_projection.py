"""benchmarks/speculative_projection.py: the projected speedup from hand-made reports, and from real CPU runs."""
from __future__ import annotations

import json

import pytest
import torch

from redline.benchmarks import speculative_projection as projection

MODEL = "Llama-2-7B"


def spec_report() -> dict:
    """bench.py --speculate-k 4 for bf16 and int8, and a plain bench.py run of int4 (the int4 draft's cost)."""
    return {
        "speculative": {
            "decode": [{"model": MODEL, "quant": "none", "decode_us": 5000.0},
                       {"model": MODEL, "quant": "int8", "decode_us": 2800.0}],
            "verify": [{"model": MODEL, "quant": "none", "k": 4, "decode_us": 5000.0, "verify_us": 5500.0},
                       {"model": MODEL, "quant": "int8", "k": 4, "decode_us": 2800.0, "verify_us": 3100.0}],
            "ceiling": [{"model": MODEL, "quant": "none", "k": 4, "speedup": 4.3, "mean_accepted": 4.0}]},
        "records": [{"model": MODEL, "quant": "int4", "batch_size": 1, "tp": 1, "decode_tok_s": 500.0}],
    }


def lookup_report() -> dict:
    def record(source, verify, plain, accepted, rate):
        return {"task": "summarize", "source": source, "verify_steps": verify, "plain_steps": plain,
                "mean_accepted": accepted, "acceptance_rate": rate}

    return {"speculate_k": 4, "records": [record("plain", None, None, None, None),
                                          record("prompt_lookup", 10, 5, 2.0, 0.6),
                                          record("int8_draft", 20, 0, 3.0, 0.75),
                                          record("int4-g64_draft", 20, 1, 2.5, 0.625)]}


def test_projection_follows_the_stated_model():
    costs = projection.step_costs([spec_report()], None)
    assert costs.decode_us == {"none": 5000.0, "int8": 2800.0, "int4": 2000.0}
    rows, notes = projection.project(costs, lookup_report())
    got = {(p.target, p.source): p.speedup for p in rows}
    assert got == pytest.approx({
        # tokens per step (V (1 + m) + P) / (V + P) over cost per step, against one decode step
        ("none", "prompt_lookup"): (35 / 15) * 5000 / ((10 * 5500 + 5 * 5000) / 15),
        ("none", "int8_draft"): 4 * 5000 / (5500 + 4 * 2800),
        ("none", "int4-g64_draft"): (71 / 21) * 5000 / ((20 * (5500 + 4 * 2000) + 5000) / 21),
        ("int8", "prompt_lookup"): (35 / 15) * 2800 / ((10 * 3100 + 5 * 2800) / 15),
        ("int8", "int4-g64_draft"): (71 / 21) * 2800 / ((20 * (3100 + 4 * 2000) + 2800) / 21),
    })  # an int8 draft of the int8 target itself is left out
    assert notes == []
    lookup = next(p for p in rows if (p.target, p.source) == ("none", "prompt_lookup"))
    assert lookup.iid_tokens_per_verify == pytest.approx((1 - 0.6 ** 5) / (1 - 0.6))
    assert lookup.plain_tok_s == pytest.approx(200.0)
    (check,) = projection.ceiling_checks(costs)
    assert "measured 4.30x" in check and f"predicts {5 * 5000 / 5500:.2f}x" in check


def test_missing_costs_are_notes_or_one_line_errors(tmp_path, capsys):
    report = spec_report()
    report["records"] = []  # no int4 decode step anywhere
    rows, notes = projection.project(projection.step_costs([report], MODEL), lookup_report())
    assert {p.source for p in rows} == {"prompt_lookup", "int8_draft"}
    assert notes == ["int4-g64_draft: no decode step of Llama-2-7B int4 in the --spec files; add a bench.py run "
                     "with --quant int4"]
    spec, lookup = tmp_path / "spec.json", tmp_path / "lookup.json"
    spec.write_text(json.dumps(spec_report()))
    lookup.write_text(json.dumps({**lookup_report(), "speculate_k": 8}))
    assert projection.main(["--spec", str(spec), "--acceptance", str(lookup)]) == 2
    assert "only for k = [4]; run bench.py --speculate-k with 8" in capsys.readouterr().err
    assert projection.main(["--spec", str(spec), "--acceptance", str(spec)]) == 2
    assert "not a bench_prompt_lookup.py report" in capsys.readouterr().err
    assert projection.main(["--spec", str(spec), "--acceptance", str(lookup), "--model", "Llama-3-8B"]) == 2
    assert "no step costs for Llama-3-8B" in capsys.readouterr().err
    assert projection.main(["--spec", str(tmp_path / "none.json"), "--acceptance", str(lookup)]) == 2
    err = capsys.readouterr().err
    assert "cannot read --spec file" in err and err.count("\n") == 1


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_scripts_json_files_chain(tiny_llm_checkpoint, chat_tokenizer, monkeypatch, tmp_path, capsys, one_thread):
    """bench.py --speculate-k and bench_prompt_lookup.py on the CPU write what the projection reads."""
    from redline import generate
    from redline.benchmarks import bench, bench_prompt_lookup

    spec, lookup, out = tmp_path / "spec.json", tmp_path / "lookup.json", tmp_path / "projection.json"
    assert bench.main(["--model", "debug-tiny", "--quant", "none,int8", "--device", "cpu", "--dtype", "float32",
                       "--speculate-k", "3", "--new-tokens", "8", "--runs", "1", "--json", str(spec)]) == 0
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    monkeypatch.setattr(bench_prompt_lookup, "TASKS", {"echo": "Repeat: the cat sat on the mat, the cat sat."})
    assert bench_prompt_lookup.main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--device", "cpu",
                                     "--max_new_tokens", "10", "--speculate_k", "3", "--runs", "1", "--drafts", "int8",
                                     "--json", str(lookup)]) == 0
    capsys.readouterr()
    assert projection.main(["--spec", str(spec), "--acceptance", str(lookup), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert {(p["target"], p["source"]) for p in result["projections"]} == {
        ("none", "prompt_lookup"), ("none", "int8_draft"), ("int8", "prompt_lookup")}
    assert all(p["speedup"] > 0 and p["k"] == 3 for p in result["projections"])
    assert "mean over tasks, none target, int8_draft" in printed
