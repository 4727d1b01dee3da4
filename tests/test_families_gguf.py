"""Each family through GGUF: the tiny HF model written as llama.cpp's converter lays it out (names, rope row order,
Gemma's stored 1 + w norms, no output when tied, the metadata keys), converted, against transformers' logits."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from redline.checkpoint import read_checkpoint_info
from redline.quantize import load_model
from redline.scripts.convert_gguf import convert_gguf

from conftest import save_family_checkpoint

GGUF_ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
             "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
             "GraniteForCausalLM": "granite"}
# GGUF has no query_pre_attn_scalar: llama.cpp scales Gemma's attention by head_dim ** -0.5 (27B aside), so these
# variants use that scalar.
GGUF_OVERRIDES = {"gemma3": dict(query_pre_attn_scalar=32), "gemma3_untied_softcap": dict(query_pre_attn_scalar=16),
                  "gemma2": dict(query_pre_attn_scalar=24)}
# qwen2_window is left out: llama.cpp's qwen2 has no sliding window (released Qwen2.5 checkpoints have it off).
VARIANTS = ["qwen2_tied", "qwen3", "qwen3_tied_bias", "gemma3", "gemma3_untied_softcap", "gemma2",
            "phi3_longrope", "phi3_window", "olmo2", "olmo2_bias", "granite"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama and granite: each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_metadata(writer, c, arch: str) -> None:
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if "head_dim" in c.to_dict() and arch != "phi3":
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        if c.final_logit_softcapping:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(float(c.rope_parameters["sliding_attention"]["rope_theta"]))
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        head_dim = c.hidden_size // c.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if c.sliding_window:
            writer.add_sliding_window(c.sliding_window)
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            scale = c.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "granite":
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)


def write_family_gguf(path, hf_model):
    """hf_model as an F32 GGUF, as llama.cpp's convert_hf_to_gguf.py writes it."""
    c = hf_model.config
    arch = GGUF_ARCH[type(hf_model).__name__]
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, c, arch)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     c.num_hidden_layers)
    for name, p in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied head is stored once, as the embedding
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w = p.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if arch == "granite" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if gguf_name.endswith("attn_q.weight") else c.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        writer.add_tensor(gguf_name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_logits_match_transformers(tmp_path, variant):
    hf_dir, hf_model = save_family_checkpoint(tmp_path / "hf", variant, **GGUF_OVERRIDES.get(variant, {}))
    path = convert_gguf(write_family_gguf(tmp_path / "m.gguf", hf_model), tmp_path / "out" / "model.safetensors",
                        dtype="float32")
    model = load_model(read_checkpoint_info(path), "cpu", torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (2, 40))  # past every sliding window
    model.setup_caches(2, 40)
    with torch.no_grad():
        diff = (model(ids, torch.arange(40)) - hf_model(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4, (variant, diff)
    assert ("output.weight" in dict(model.named_parameters())) != hf_model.config.tie_word_embeddings
