"""The registry of named model shapes: the real published sizes of every supported family, and tiny debug configs.
Each entry is ModelArgs' fields as plain data (ModelArgs.from_name builds one)."""
from __future__ import annotations

import math
from typing import Any

_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA32_SCALING = {**_LLAMA31_SCALING, "factor": 32.0}
_LLAMA3_COMMON = {"vocab_size": 128256, "rope_base": 500000.0, "n_kv_heads": 8}

_QWEN25_SMALL = {"vocab_size": 151936, "block_size": 32768, "rope_base": 1e6, "norm_eps": 1e-6, "qkv_bias": True}
_QWEN25 = {**_QWEN25_SMALL, "vocab_size": 152064}
_QWEN3 = {"n_kv_heads": 8, "head_dim": 128, "vocab_size": 151936, "block_size": 40960, "rope_base": 1e6,
          "norm_eps": 1e-6, "qk_norm": "head"}
_QWEN3_MOE = {**_QWEN3, "n_kv_heads": 4, "n_experts": 128, "n_experts_per_tok": 8, "norm_topk_prob": True,
              "router_weights_rounded": True}
_GEMMA3 = {"head_dim": 256, "rope_base": 1e6, "local_rope_base": 1e4, "norm_eps": 1e-6, "tie_word_embeddings": True,
           "qk_norm": "head", "norm_offset": 1.0, "norm_scale_fp32": True, "norm_placement": "sandwich",
           "activation": "gelu_tanh", "attention_scale": 256 ** -0.5}
_GEMMA3_LARGE = {**_GEMMA3, "vocab_size": 262208, "block_size": 131072,
                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
_OLMO2 = {"vocab_size": 100352, "block_size": 4096, "rope_base": 5e5, "norm_eps": 1e-6, "norm_placement": "post",
          "qk_norm": "full", "norm_scale_fp32": True}


def _gemma3_windows(n_layer: int, window: int) -> tuple[int, ...]:
    """Gemma 3's layer pattern: every sixth layer global (0), the others windowed."""
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(n_layer))


MODEL_REGISTRY: dict[str, dict[str, Any]] = {
    "Llama-2-7B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, block_size=4096),
    "Llama-2-13B": dict(dim=5120, n_layer=40, n_head=40, intermediate_size=13824, block_size=4096),
    "Llama-2-70B": dict(dim=8192, n_layer=80, n_head=64, n_kv_heads=8, intermediate_size=28672, block_size=4096),
    "CodeLlama-7B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, vocab_size=32016,
                         block_size=16384, rope_base=1e6),
    "CodeLlama-34B": dict(dim=8192, n_layer=48, n_head=64, n_kv_heads=8, intermediate_size=22016,
                          block_size=16384, rope_base=1e6),
    "Mistral-7B": dict(dim=4096, n_layer=32, n_head=32, n_kv_heads=8, intermediate_size=14336, block_size=4096),
    "Llama-3-8B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=14336, block_size=8192, **_LLAMA3_COMMON),
    "Llama-3-70B": dict(dim=8192, n_layer=80, n_head=64, intermediate_size=28672, block_size=8192, **_LLAMA3_COMMON),
    "Llama-3.1-8B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=14336, block_size=131072,
                         rope_scaling=_LLAMA31_SCALING, **_LLAMA3_COMMON),
    "Llama-3.1-70B": dict(dim=8192, n_layer=80, n_head=64, intermediate_size=28672, block_size=131072,
                          rope_scaling=_LLAMA31_SCALING, **_LLAMA3_COMMON),
    "Llama-3.1-405B": dict(dim=16384, n_layer=126, n_head=128, intermediate_size=53248, block_size=131072,
                           rope_scaling=_LLAMA31_SCALING, **_LLAMA3_COMMON),
    "Llama-3.2-1B": dict(dim=2048, n_layer=16, n_head=32, head_dim=64, intermediate_size=8192, block_size=131072,
                         rope_scaling=_LLAMA32_SCALING, tie_word_embeddings=True, **_LLAMA3_COMMON),
    "Llama-3.2-3B": dict(dim=3072, n_layer=28, n_head=24, head_dim=128, intermediate_size=8192, block_size=131072,
                         rope_scaling=_LLAMA32_SCALING, tie_word_embeddings=True, **_LLAMA3_COMMON),
    "TinyLlama-1.1B": dict(dim=2048, n_layer=22, n_head=32, n_kv_heads=4, intermediate_size=5632, block_size=2048),
    # Qwen2.5 (q/k/v biases; the small sizes tie their embeddings).
    "Qwen2.5-0.5B": dict(dim=896, n_layer=24, n_head=14, n_kv_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                         **_QWEN25_SMALL),
    "Qwen2.5-1.5B": dict(dim=1536, n_layer=28, n_head=12, n_kv_heads=2, intermediate_size=8960,
                         tie_word_embeddings=True, **_QWEN25_SMALL),
    "Qwen2.5-7B": dict(dim=3584, n_layer=28, n_head=28, n_kv_heads=4, intermediate_size=18944, **_QWEN25),
    "Qwen2.5-14B": dict(dim=5120, n_layer=48, n_head=40, n_kv_heads=8, intermediate_size=13824, **_QWEN25),
    "Qwen2.5-32B": dict(dim=5120, n_layer=64, n_head=40, n_kv_heads=8, intermediate_size=27648, **_QWEN25),
    "Qwen2.5-72B": dict(dim=8192, n_layer=80, n_head=64, n_kv_heads=8, intermediate_size=29568, **_QWEN25),
    # Qwen3 dense (per-head q/k norms, head_dim 128 whatever the width).
    "Qwen3-0.6B": dict(dim=1024, n_layer=28, n_head=16, intermediate_size=3072, tie_word_embeddings=True, **_QWEN3),
    "Qwen3-1.7B": dict(dim=2048, n_layer=28, n_head=16, intermediate_size=6144, tie_word_embeddings=True, **_QWEN3),
    "Qwen3-4B": dict(dim=2560, n_layer=36, n_head=32, intermediate_size=9728, tie_word_embeddings=True, **_QWEN3),
    "Qwen3-8B": dict(dim=4096, n_layer=36, n_head=32, intermediate_size=12288, **_QWEN3),
    "Qwen3-14B": dict(dim=5120, n_layer=40, n_head=40, intermediate_size=17408, **_QWEN3),
    "Qwen3-32B": dict(dim=5120, n_layer=64, n_head=64, intermediate_size=25600, **_QWEN3),
    # Gemma 3 (five sliding-window layers to one global; the 4B and larger scale the global rope linearly by 8).
    "Gemma-3-1B": dict(dim=1152, n_layer=26, n_head=4, n_kv_heads=1, intermediate_size=6912,
                       embedding_scale=math.sqrt(1152),
                       vocab_size=262144, block_size=32768, layer_windows=_gemma3_windows(26, 512), **_GEMMA3),
    "Gemma-3-4B": dict(dim=2560, n_layer=34, n_head=8, n_kv_heads=4, intermediate_size=10240,
                       embedding_scale=math.sqrt(2560),
                       layer_windows=_gemma3_windows(34, 1024), **_GEMMA3_LARGE),
    "Gemma-3-12B": dict(dim=3840, n_layer=48, n_head=16, n_kv_heads=8, intermediate_size=15360,
                        embedding_scale=math.sqrt(3840),
                        layer_windows=_gemma3_windows(48, 1024), **_GEMMA3_LARGE),
    "Gemma-3-27B": dict(dim=5376, n_layer=62, n_head=32, n_kv_heads=16, intermediate_size=21504,
                        embedding_scale=math.sqrt(5376),
                        layer_windows=_gemma3_windows(62, 1024), **{**_GEMMA3_LARGE, "head_dim": 128,
                                                                     "attention_scale": 168 ** -0.5}),
    # Phi-3-mini-4k: a 2047-token window on every layer, as its config.json sets.
    "Phi-3-mini": dict(dim=3072, n_layer=32, n_head=32, intermediate_size=8192, vocab_size=32064, block_size=4096,
                       layer_windows=(2047,) * 32),
    # Phi-4-mini: partial rotary (96 of 128) and LongRoPE. The shapes are the published ones; the 48 short and long
    # factors are NOT (uncertain: placeholders of 1.0); a converted checkpoint carries the real ones.
    "Phi-4-mini": dict(dim=3072, n_layer=32, n_head=24, n_kv_heads=8, intermediate_size=8192, vocab_size=200064,
                       block_size=131072, rotary_dim=96, tie_word_embeddings=True,
                       rope_scaling=dict(rope_type="longrope", original_max_position_embeddings=4096,
                                         short_factor=(1.0,) * 48, long_factor=(1.0,) * 48,
                                         attention_factor=math.sqrt(1 + math.log(32) / math.log(4096)))),
    # OLMo 2 (November 2024 release): norms on the sub-layers' outputs, q/k norms over the whole width.
    "OLMo-2-7B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, **_OLMO2),
    "OLMo-2-13B": dict(dim=5120, n_layer=40, n_head=40, intermediate_size=13824, **_OLMO2),
    # Granite 3.1 8B: the four multipliers of its config.json.
    "Granite-3.1-8B": dict(dim=4096, n_layer=40, n_head=32, n_kv_heads=8, intermediate_size=12800, vocab_size=49155,
                           block_size=131072, rope_base=1e7, tie_word_embeddings=True, embedding_scale=12.0,
                           attention_scale=0.0078125, residual_scale=0.22, logits_divisor=16.0),
    # Mixture of experts: Mixtral v0.1 (8 experts, 2 per token, renormalized), Qwen3-MoE (128 experts, 8 per token).
    "Mixtral-8x7B": dict(dim=4096, n_layer=32, n_head=32, n_kv_heads=8, intermediate_size=14336, block_size=32768,
                         rope_base=1e6, n_experts=8, n_experts_per_tok=2),
    "Mixtral-8x22B": dict(dim=6144, n_layer=56, n_head=48, n_kv_heads=8, intermediate_size=16384, block_size=65536,
                          rope_base=1e6, n_experts=8, n_experts_per_tok=2),
    "Qwen3-30B-A3B": dict(dim=2048, n_layer=48, n_head=32, intermediate_size=6144, **_QWEN3_MOE,
                          moe_intermediate_size=768),
    "Qwen3-235B-A22B": dict(dim=4096, n_layer=94, n_head=64, intermediate_size=12288, **_QWEN3_MOE,
                            moe_intermediate_size=1536),
    # Tiny configs for tests and CPU smoke runs.
    "debug-tiny": dict(dim=64, n_layer=2, n_head=4, n_kv_heads=2, intermediate_size=160, vocab_size=512, block_size=256),
    "debug-tiny-llama3": dict(dim=64, n_layer=2, n_head=4, n_kv_heads=1, intermediate_size=160, vocab_size=512,
                              block_size=1024, rope_base=500000.0,
                              rope_scaling={**_LLAMA31_SCALING, "original_max_position_embeddings": 64}),
    "debug-tiny-moe": dict(dim=64, n_layer=2, n_head=4, n_kv_heads=2, intermediate_size=128, vocab_size=512,
                           block_size=256, n_experts=4, n_experts_per_tok=2, moe_intermediate_size=64),
}
