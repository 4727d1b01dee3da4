"""benchmarks/bench_speculative.py via benchmarks/bench.py --speculate-k on a tiny random model (CPU, eager)."""
from __future__ import annotations

import json

import pytest
import torch

from redline.benchmarks import bench


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops on a shared, busy CPU run far faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_speculate_k_times_verify_steps_and_the_ceiling(tmp_path, capsys):
    out = tmp_path / "spec.json"
    code = bench.main(["--model", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--speculate-k", "1,4",
                       "--new-tokens", "20", "--runs", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.read_text())["speculative"]
    (decode,) = report["decode"]
    assert decode["model"] == "debug-tiny" and decode["decode_us"] > 0
    assert [r["k"] for r in report["verify"]] == [1, 4]
    assert all(r["decode_us"] == decode["decode_us"] for r in report["verify"])
    for r in report["verify"]:
        assert r["decode_us"] > 0 and r["verify_us"] > 0
        assert r["ratio"] == pytest.approx(r["verify_us"] / r["decode_us"])
    (ceiling,) = report["ceiling"]
    assert ceiling["k"] == 4 and ceiling["speculative_tok_s"] > 0
    # 19 tokens after the prefill's: three steps keep 4 drafts + 1, the last one 3 + 1 (capped by --new-tokens).
    assert ceiling["mean_accepted"] == pytest.approx((4 + 4 + 4 + 3) / 4) and ceiling["acceptance_rate"] == 1.0
    assert "verify step (k+1 rows)" in printed and "Ceiling" in printed and "Decode step" in printed


def test_a_failure_after_the_decode_step_keeps_what_was_measured(tmp_path, monkeypatch, capsys):
    from redline.benchmarks import bench_speculative

    def broken_ceiling(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bench_speculative, "ceiling", broken_ceiling)
    out = tmp_path / "spec.json"
    code = bench.main(["--model", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--speculate-k", "2",
                       "--new-tokens", "8", "--runs", "1", "--json", str(out)])
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert code == 1 and "out of memory" in report["errors"][0]["error"]
    assert len(report["speculative"]["decode"]) == 1 and len(report["speculative"]["verify"]) == 1


def test_speculate_k_beyond_the_kernel_rows_is_refused(capsys):
    assert bench.main(["--model", "debug-tiny", "--device", "cpu", "--speculate-k", "64"]) == 2
    assert "1..63" in capsys.readouterr().err


def test_the_ceiling_bias_decides_every_step_and_is_removed_afterwards():
    from redline.generate import LLM
    from redline.model import ModelArgs
    from redline.benchmarks import bench_speculative
    from redline.benchmarks.bench_model import build_random_model, random_prompts

    args = ModelArgs.from_name("debug-tiny")
    llm = LLM(build_random_model(args, torch.device("cpu"), torch.float32, "none", 0, 128), tokenizer=None,
              device="cpu", compile=False)
    prompt = random_prompts(args.vocab_size, 1, 8, 0)[0].tolist()
    plain, fast = bench_speculative.ceiling(llm, prompt, 12, [3], runs=1)
    assert plain > 0 and fast[3][2] == 1.0 and fast[3][1] > 0
    assert llm.runner.vocab_bias is None
    assert set(llm.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids) != {args.vocab_size // 2}
