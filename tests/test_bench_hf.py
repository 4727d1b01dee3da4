"""benchmarks/bench_hf.py: the transformers model built from a registry config, and Redline/HF ratios."""
from __future__ import annotations

import pytest
import torch

from redline.model import ModelArgs
from redline.benchmarks import bench_hf
from redline.benchmarks.bench_redline import RedlineRecord


def test_hf_config_matches_the_registry_model():
    pytest.importorskip("transformers")
    args = ModelArgs.from_name("debug-tiny-llama3")
    config = bench_hf.hf_llama_config(args)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["rope_theta"] == args.rope_base
    assert config.num_key_value_heads == args.n_kv_heads and config.head_dim == args.head_dim
    hf = bench_hf.build_hf_model(args, torch.device("cpu"), torch.float32)  # raises if the parameter counts differ
    assert hf.dtype == torch.float32


def hf_record(model: str, decode_tok_s: float | None, dtype: str = "bfloat16") -> bench_hf.HFRecord:
    return bench_hf.HFRecord(
        model=model, mode="eager", dtype=dtype, cache_implementation="dynamic", compiled=False, fullgraph=None,
        prompt_tokens=8, new_tokens=16, short_tokens=8, runs=1, t_long_s=1.0, t_short_s=0.5, t_long_runs_s=[1.0],
        t_short_runs_s=[0.5], decode_tok_s=decode_tok_s, first_call_s=1.0, warmup_calls_s=[1.0])


def redline_record(model: str, quant: str, batch: int, decode_tok_s: float) -> RedlineRecord:
    return RedlineRecord(
        model=model, quant=quant, dtype="bfloat16", batch_size=batch, compiled=True, prompt_tokens=8, new_tokens=16,
        runs=1, decode_tok_s=decode_tok_s, decode_tok_s_runs=[decode_tok_s], ttft_s=0.01, cache_len=32, n_params=10,
        bytes_per_token=20, weights_bytes=20, kv_cache_bytes=4, bandwidth_gb_s=None, limit_tok_s=None,
        pct_of_limit=None, limit_with_kv_tok_s=None, peak_memory_bytes=None, peak_memory_warmup_bytes=None,
        overhead_bytes=None, compile_s=0.0, warmup_s=0.0)


def test_ratios_use_batch_one_records_of_the_same_model_and_dtype():
    records = [redline_record("A", "none", 1, 200.0), redline_record("A", "int8", 1, 300.0),
               redline_record("A", "none", 4, 700.0), redline_record("B", "none", 1, 90.0)]
    (a, b, c) = bench_hf.attach_ratios([hf_record("A", 50.0), hf_record("B", None), hf_record("A", 50.0, "float16")],
                                       records)
    assert a.redline_tok_s == {"none": 200.0, "int8": 300.0}
    assert a.ratio == pytest.approx({"none": 4.0, "int8": 6.0})
    assert b.redline_tok_s == {"none": 90.0} and b.ratio == {}  # no HF rate, no ratio
    assert c.redline_tok_s == {} and c.ratio == {}  # Redline ran in bf16 only
