"""Hugging Face `config.json` -> ModelArgs: each supported architecture's fields read and checked, every option
Redline does not implement refused in one line."""
from __future__ import annotations

import math
from typing import Any

from redline.model import ModelArgs, RopeScaling

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
HF_MODEL_TYPES = ("llama", "mistral")


def args_from_hf_config(config: Any) -> ModelArgs:
    """Read a Hugging Face `config.json` (Llama or Mistral architecture); every field read is checked."""
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, got a {type(config).__name__}; re-download it")
    archs = _hf_field(config, "architectures", list, [])
    model_type = _hf_field(config, "model_type", str, None)
    if not (set(map(str, archs)) & set(HF_ARCHITECTURES) or model_type in HF_MODEL_TYPES):
        found = archs[0] if archs else model_type
        raise ValueError(
            f"unsupported architecture {found!r}; Redline converts LlamaForCausalLM and MistralForCausalLM checkpoints"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if _hf_field(config, flag, bool, False):
            raise ValueError(f"config.json sets {flag}=true; Redline's Llama has no biases in these layers")
    act = _hf_field(config, "hidden_act", str, "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}; Redline's feed-forward is SwiGLU (silu)")
    n_head = _hf_field(config, "num_attention_heads", int)
    dim = _hf_field(config, "hidden_size", int)
    block_size = _hf_field(config, "max_position_embeddings", int, 2048)
    rope_base, rope_scaling = _hf_rope(config, block_size)
    # Sliding-window attention (Mistral v0.1) equals full attention up to the window, so cap the context there
    # rather than give silently different outputs beyond it.
    window = _hf_field(config, "sliding_window", int, None)
    if window and window < block_size:
        block_size = window
    return ModelArgs(
        dim=dim,
        n_layer=_hf_field(config, "num_hidden_layers", int),
        n_head=n_head,
        n_kv_heads=_hf_field(config, "num_key_value_heads", int, None) or n_head,
        head_dim=_hf_field(config, "head_dim", int, None) or dim // n_head,
        intermediate_size=_hf_field(config, "intermediate_size", int),
        vocab_size=_hf_field(config, "vocab_size", int),
        block_size=block_size,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        norm_eps=_hf_field(config, "rms_norm_eps", float, 1e-6),
        tie_word_embeddings=_hf_field(config, "tie_word_embeddings", bool, False),
    )


_REQUIRED = object()  # marks a config.json field that has no default


def _hf_field(config: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED, where: str = "config.json") -> Any:
    """config[key] checked against its kind: int and float must be positive numbers (bool is neither), and a JSON
    null or an absent key gives the default; a field without a default must be present."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{where} has no {key!r}; it is required for a Llama model, re-download the config")
        return default
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        expected = "a positive integer"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        expected = "a positive number"
    else:
        ok = isinstance(value, kind)
        expected = {bool: "true or false", str: "a string", list: "a list", dict: "an object"}[kind]
    if not ok:
        raise ValueError(f"{where} {key} must be {expected}, got {value!r}; fix or re-download the config")
    return float(value) if kind is float else value


def _hf_rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rope dict that transformers 5.x uses: a non-empty legacy `rope_scaling` replaces `rope_parameters`
    entirely; inside it, `rope_type` wins over the legacy `type`."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json {key} must be an object or null, got {value!r}; fix the config")
    return dict(config.get("rope_scaling") or config.get("rope_parameters") or {})


def _hf_rope(config: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """Rope base and scaling, resolved from the transformers 4.x keys and 5.x `rope_parameters` as 5.x does."""
    params = _hf_rope_parameters(config)
    where = "config.json rope parameters"
    theta = params.get("rope_theta", config.get("rope_theta"))
    base = _hf_field({"rope_theta": theta}, "rope_theta", float, 10000.0, where)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return base, None
    if rope_type == "llama3":
        return base, RopeScaling(
            factor=_hf_field(params, "factor", float, where=where),
            low_freq_factor=_hf_field(params, "low_freq_factor", float, where=where),
            high_freq_factor=_hf_field(params, "high_freq_factor", float, where=where),
            original_max_position_embeddings=_hf_field(params, "original_max_position_embeddings", int, max_positions,
                                                       where),
        )
    raise ValueError(f"config.json uses rope type {rope_type!r}, which Redline does not implement (only 'default' and "
                     "'llama3'); converting it would give wrong logits")
