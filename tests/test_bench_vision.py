"""benchmarks/bench_vision.py on the CPU with a tiny model of each family (the GPU runs the published shapes)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_the_benchmark_times_each_stage(family, tmp_path, monkeypatch):
    from redline.benchmarks import bench_vision

    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=3000, max_position_embeddings=512)
    if family == "gemma3":
        config = dict(architectures=["Gemma3ForConditionalGeneration"], boi_token_index=2900, eoi_token_index=2901,
                      image_token_index=2902, mm_tokens_per_image=4,
                      text_config=dict(tiny, head_dim=16, sliding_window=8),
                      vision_config=dict(hidden_size=32, image_size=56, intermediate_size=48, num_attention_heads=2,
                                         num_hidden_layers=1, patch_size=14))
    else:
        config = dict(tiny, architectures=["Qwen2_5_VLForConditionalGeneration"], image_token_id=2902,
                      rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                      vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                         patch_size=14, spatial_merge_size=2, window_size=56,
                                         fullatt_block_indexes=[1], temporal_patch_size=2))
    monkeypatch.setitem(bench_vision.PUBLISHED_CONFIGS, "tiny", config)
    out = tmp_path / "vision.json"
    assert bench_vision.main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--image-size", "112",
                              "--repeats", "1", "--json", str(out)]) == 0
    row, = json.loads(out.read_text())
    assert row["image_tokens"] == (4 if family == "gemma3" else 16)
    assert row["prompt_tokens"] == 33 + row["image_tokens"] + (2 if family == "gemma3" else 0)  # start, end
    for key in ("preprocess_ms", "encoder_ms", "prefill_ms", "ttft_ms"):
        assert row[key] > 0
    assert row["ttft_ms"] >= row["encoder_ms"] + row["prefill_ms"]
