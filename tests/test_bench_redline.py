"""benchmarks/bench_redline.py: one configuration on a tiny random model (CPU, eager)."""
from __future__ import annotations

import pytest
import torch

from redline import generate
from redline.model import ModelArgs
from redline.benchmarks import bench, bench_model, bench_redline


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Tiny ops on a shared, busy CPU run far faster on one thread than with threads waiting on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_llm() -> generate.LLM:
    model = bench_model.build_random_model(ModelArgs.from_name("debug-tiny"), torch.device("cpu"), torch.float32,
                                           "none")
    return generate.LLM(model, tokenizer=None, device=torch.device("cpu"), compile=False)


@pytest.mark.parametrize("batch", [1, 3])
def test_timed_generation_counts_every_token(batch):
    prompts = bench_model.random_prompts(ModelArgs.from_name("debug-tiny").vocab_size, batch, 5, seed=0)  # (B, T)
    timing = bench_redline.timed_generation(tiny_llm(), prompts, 6)
    assert timing.new_tokens == 6 and timing.ttft_s > 0 and timing.decode_tok_s > 0
    assert timing.wall_s >= timing.ttft_s and timing.peak_bytes is None
    assert (timing.engine_compile_s is not None) == (batch == 1)  # only LLM.generate reports it


def test_one_prompt_length_reuses_the_decode_runs_as_the_prefill_measurement():
    cfg = bench.parse_args(["--model", "debug-tiny", "--device", "cpu", "--prompt-lengths", "4", "--new-tokens", "5",
                            "--runs", "2"])
    logged = []
    record = bench_redline.bench_redline(cfg, "debug-tiny", "none", 1, None, logged.append)
    (prefill,) = record.prefill
    assert prefill.prompt_tokens == 4 and prefill.compiled_prefill is False
    assert prefill.ttft_s == record.ttft_s and prefill.decode_tok_s == record.decode_tok_s
    assert len(prefill.ttft_runs_s) == 2 and prefill.warmup_s == record.warmup_s
    assert record.limit_tok_s is None and record.kernels is False and record.fused is False
    assert any("warm-up generation" in line for line in logged)
