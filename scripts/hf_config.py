"""Hugging Face `config.json` -> ModelArgs: each supported architecture's fields read and checked, every option
Redline does not implement refused in one line."""
from __future__ import annotations

import math
from typing import Any

from redline.model import ModelArgs, RopeScaling

# Each supported architecture class and its config's model_type -> the family reader below.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
# The multimodal families: their language model's family, read from the nested (or, Qwen2.5-VL in transformers 4,
# top-level) text config.
MULTIMODAL_TEXT_FAMILIES = {"gemma3": "gemma3_text", "qwen2_5_vl": "qwen2_5_vl_text"}
# transformers' Gemma3TextConfig defaults: the multimodal checkpoints' text_config lists only the fields that differ
# (Gemma 3 4B-27B on the Hub), and transformers fills the rest from these.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                            rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096)
HF_MODEL_TYPES = tuple(dict.fromkeys(HF_ARCHITECTURES.values()))
LAYER_TYPES = ("full_attention", "sliding_attention")


def hf_family(config: Any) -> str:
    """The family (a model_type of HF_MODEL_TYPES) of a config.json, from its architectures or its model_type."""
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, got a {type(config).__name__}; re-download it")
    archs = _hf_field(config, "architectures", list, [])
    model_type = _hf_field(config, "model_type", str, None)
    for arch in map(str, archs):
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    if model_type in HF_MODEL_TYPES:
        return model_type
    found = archs[0] if archs else model_type
    raise ValueError(f"unsupported architecture {found!r}; Redline converts {', '.join(HF_ARCHITECTURES)} checkpoints")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: the multimodal families nest it under text_config (Qwen2.5-VL's
    transformers 4 configs keep it at the top level, beside vision_config)."""
    family = hf_family(config)
    if family not in MULTIMODAL_TEXT_FAMILIES:
        return config
    inner = _hf_field(config, "text_config", dict, {})
    if family == "qwen2_5_vl":
        outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config", "architectures")}
        return {**outer, **inner, "model_type": "qwen2_5_vl_text"}
    # transformers' Gemma3Config gives its text model the tie flag of the outer config.
    return {**GEMMA3_TEXT_DEFAULTS, "tie_word_embeddings": config.get("tie_word_embeddings", True),
            **{k: v for k, v in inner.items() if v is not None}, "model_type": "gemma3_text"}


def args_from_hf_config(config: Any) -> ModelArgs:
    """Read a Hugging Face `config.json` of a supported family; every field read is checked, and an option Redline
    does not implement is refused in one line."""
    family = hf_family(config)
    config = text_config(config)
    family = MULTIMODAL_TEXT_FAMILIES.get(family, family)
    args = _llama_fields(config, family)
    deltas = _FAMILY_DELTAS[family](config, args)
    return ModelArgs(**{**args, **deltas})


def _refuse(config: dict[str, Any], key: str, allowed: Any, default: Any, kind: type = bool) -> None:
    value = _hf_field(config, key, kind, default)
    if value != allowed:
        raise ValueError(f"config.json sets {key}={value!r}, which Redline does not implement for "
                         f"{config.get('model_type')!r} models (only {allowed!r}); it cannot be converted")


def _llama_fields(config: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields every family shares with Llama."""
    gemma = family.startswith("gemma")
    act = _hf_field(config, "hidden_activation" if gemma else "hidden_act", str,
                    "gelu_pytorch_tanh" if gemma else "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"config.json hidden activation {act!r} is not implemented for {family!r} models (Redline: "
                         f"{'gelu_pytorch_tanh' if gemma else 'silu'})")
    _refuse(config, "mlp_bias", False, False)
    n_head = _hf_field(config, "num_attention_heads", int)
    dim = _hf_field(config, "hidden_size", int)
    block_size = _hf_field(config, "max_position_embeddings", int, 2048)
    bias = _hf_field(config, "attention_bias", bool, False)
    if bias and family in ("qwen2", "phi3"):
        raise ValueError(f"config.json sets attention_bias=true, which {family!r} models do not have; fix the config")
    return dict(
        dim=dim,
        n_layer=_hf_field(config, "num_hidden_layers", int),
        n_head=n_head,
        n_kv_heads=_hf_field(config, "num_key_value_heads", int, None) or n_head,
        head_dim=_hf_field(config, "head_dim", int, None) or dim // n_head,
        intermediate_size=_hf_field(config, "intermediate_size", int),
        vocab_size=_hf_field(config, "vocab_size", int),
        block_size=block_size,
        norm_eps=_hf_field(config, "rms_norm_eps", float, 1e-6),
        tie_word_embeddings=_hf_field(config, "tie_word_embeddings", bool, gemma),
        qkv_bias=bias, o_bias=bias,
    )


def _llama_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    # Sliding-window attention (Mistral v0.1) equals full attention up to the window, so cap the context there
    # rather than give silently different outputs beyond it.
    window = _hf_field(config, "sliding_window", int, None)
    block_size = min(window, args["block_size"]) if window else args["block_size"]
    return dict(rope_base=rope_base, rope_scaling=rope_scaling, block_size=block_size)


def _layer_windows(config: dict[str, Any], n_layer: int, default_sliding: list[bool]) -> tuple[int, ...]:
    """Per-layer windows from `layer_types` (or the family's default pattern when absent); () when none slides."""
    types = _hf_field(config, "layer_types", list, None)
    if types is None:
        sliding = default_sliding
    else:
        if len(types) != n_layer or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"config.json layer_types must list one of {', '.join(LAYER_TYPES)} per layer "
                             f"({n_layer}); got {types!r}")
        sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return ()
    window = _hf_field(config, "sliding_window", int)
    return tuple(window if s else 0 for s in sliding)


def _qwen_deltas(config: dict[str, Any], args: dict[str, Any], qk_norm: str) -> dict[str, Any]:
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    n_layer = args["n_layer"]
    slides = _hf_field(config, "use_sliding_window", bool, False)
    first = _hf_field(config, "max_window_layers", int, n_layer) if slides else n_layer
    if not slides and config.get("layer_types") is not None:
        config = {**config, "layer_types": None}  # without use_sliding_window, transformers ignores the window
    windows = _layer_windows(config, n_layer, [i >= first for i in range(n_layer)])
    return dict(rope_base=rope_base, rope_scaling=rope_scaling, layer_windows=windows, qk_norm=qk_norm)


def _qwen2_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    return {**_qwen_deltas(config, args, "none"), "qkv_bias": True, "o_bias": False}


def _qwen2_5_vl_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's language model with multimodal rope: the rope's frequencies split into t, h and w sections."""
    params = _hf_rope_parameters(config)
    sections = params.get("mrope_section")
    if not (isinstance(sections, list) and len(sections) == 3 and all(type(n) is int and n >= 0 for n in sections)):
        raise ValueError(f"config.json rope parameters must give mrope_section as three counts, got {sections!r}; "
                         f"fix the config")
    plain = {k: v for k, v in params.items() if k != "mrope_section"}
    if plain.get("rope_type", plain.get("type")) in ("mrope", "default"):  # transformers 4 named it "mrope"
        plain = {k: v for k, v in plain.items() if k not in ("rope_type", "type")}
    config = {**config, "rope_scaling": None, "rope_parameters": plain or None}
    return {**_qwen2_deltas(config, args), "mrope_sections": tuple(sections)}


def _qwen3_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    return _qwen_deltas(config, args, "head")


def _gemma_common(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    _refuse(config, "use_bidirectional_attention", False, False)
    return dict(norm_offset=1.0, norm_scale_fp32=True, norm_placement="sandwich", activation="gelu_tanh",
                embedding_scale=math.sqrt(args["dim"]),
                attention_scale=_hf_field(config, "query_pre_attn_scalar", float, 256.0) ** -0.5)


def _gemma2_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    n = args["n_layer"]
    return dict(**_gemma_common(config, args), rope_base=rope_base, rope_scaling=rope_scaling,
                layer_windows=_layer_windows(config, n, [i % 2 == 0 for i in range(n)]),
                attn_softcap=_hf_field(config, "attn_logit_softcapping", float, 0.0),
                final_softcap=_hf_field(config, "final_logit_softcapping", float, 0.0))


def _gemma3_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    params = _hf_rope_parameters(config)
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one rope per layer type
        full = {**config, "rope_scaling": None, "rope_parameters": params.get("full_attention") or {},
                "rope_theta": config.get("rope_theta", 1e6)}
        local = {"rope_parameters": params.get("sliding_attention") or {},
                 "rope_theta": config.get("rope_local_base_freq", 1e4)}
    else:  # transformers 4: rope_theta and rope_scaling for the global layers, rope_local_base_freq for the local
        full = {**config, "rope_theta": config.get("rope_theta", 1e6)}
        local = {"rope_theta": config.get("rope_local_base_freq", 1e4)}
    rope_base, rope_scaling = _hf_rope(full, args["block_size"])
    local_base, local_scaling = _hf_rope(local, args["block_size"])
    if local_scaling is not None:
        raise ValueError("config.json scales the sliding layers' rope, which Redline does not implement for Gemma 3")
    n = args["n_layer"]
    pattern = _hf_field(config, "sliding_window_pattern", int, 6)  # without layer_types: every n-th layer global
    return dict(**_gemma_common(config, args), rope_base=rope_base, rope_scaling=rope_scaling, qk_norm="head",
                layer_windows=_layer_windows(config, n, [(i + 1) % pattern != 0 for i in range(n)]),
                local_rope_base=local_base,
                # transformers' Gemma 3 attention reads attn_logit_softcapping but never applies it; neither does this.
                final_softcap=_hf_field(config, "final_logit_softcapping", float, 0.0))


def _phi3_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    params = _hf_rope_parameters(config)
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    factor = _hf_field({"partial_rotary_factor": factor}, "partial_rotary_factor", float, 1.0)
    if factor > 1.0:
        raise ValueError(f"config.json partial_rotary_factor {factor} exceeds 1; fix the config")
    rotary_dim = int(args["head_dim"] * factor)
    rope_base, rope_scaling = _hf_rope(config, args["block_size"], rotary_dim)
    window = _hf_field(config, "sliding_window", int, None)
    # transformers applies Phi-3's window to every layer; one as long as the context never binds.
    windows = (window,) * args["n_layer"] if window and window < args["block_size"] else ()
    return dict(rope_base=rope_base, rope_scaling=rope_scaling, rotary_dim=rotary_dim, layer_windows=windows)


def _olmo2_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    return dict(rope_base=rope_base, rope_scaling=rope_scaling, norm_placement="post", qk_norm="full",
                norm_scale_fp32=True)


def _granite_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    return dict(rope_base=rope_base, rope_scaling=rope_scaling,
                embedding_scale=_hf_field(config, "embedding_multiplier", float, 1.0),
                attention_scale=_hf_field(config, "attention_multiplier", float, 1.0),
                residual_scale=_hf_field(config, "residual_multiplier", float, 1.0),
                logits_divisor=_hf_field(config, "logits_scaling", float, 1.0))


def _mixtral_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    window = _hf_field(config, "sliding_window", int, None)
    # transformers windows every layer; a window as long as the context never binds.
    windows = (window,) * args["n_layer"] if window and window < args["block_size"] else ()
    return dict(rope_base=rope_base, rope_scaling=rope_scaling, layer_windows=windows,
                **_experts(config, "num_local_experts", args["intermediate_size"]), norm_topk_prob=True)


def _qwen3_moe_deltas(config: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    _refuse(config, "use_sliding_window", False, False)
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):  # other MoE families' shared experts
        if config.get(key):
            raise ValueError(f"config.json sets {key}={config[key]!r}: shared experts are not part of Qwen3-MoE and "
                             f"Redline does not implement them; it cannot be converted")
    rope_base, rope_scaling = _hf_rope(config, args["block_size"])
    n = args["n_layer"]
    dense = {"rope_base": rope_base, "rope_scaling": rope_scaling, "qk_norm": "head"}
    if config.get("num_experts", config.get("num_local_experts")) == 0:
        return dense  # transformers builds no sparse layer without experts
    step = _hf_field(config, "decoder_sparse_step", int, 1)
    only = _hf_field(config, "mlp_only_layers", list, [])
    if not all(type(i) is int and 0 <= i < n for i in only):
        raise ValueError(f"config.json mlp_only_layers must list layer indices 0..{n - 1}, got {only!r}; fix the "
                         f"config")
    moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
    key = "num_experts" if "num_experts" in config else "num_local_experts"  # transformers 5 saves the latter
    return dict(dense, **_experts(config, key, _hf_field(config, "moe_intermediate_size", int)),
                norm_topk_prob=_hf_field(config, "norm_topk_prob", bool, False), router_weights_rounded=True,
                moe_layers=moe_layers if not all(moe_layers) else ())


def _experts(config: dict[str, Any], count_key: str, hidden: int) -> dict[str, Any]:
    """The expert count, the experts chosen per token and their intermediate size."""
    n = _hf_field(config, count_key, int)
    k = _hf_field(config, "num_experts_per_tok", int)
    if k > n:
        raise ValueError(f"config.json num_experts_per_tok ({k}) exceeds the {n} experts; fix the config")
    return dict(n_experts=n, n_experts_per_tok=k, moe_intermediate_size=hidden)


_FAMILY_DELTAS = {
    "llama": _llama_deltas, "mistral": _llama_deltas, "qwen2": _qwen2_deltas, "qwen3": _qwen3_deltas,
    "gemma2": _gemma2_deltas, "gemma3_text": _gemma3_deltas, "phi3": _phi3_deltas, "olmo2": _olmo2_deltas,
    "granite": _granite_deltas, "mixtral": _mixtral_deltas, "qwen3_moe": _qwen3_moe_deltas,
    "qwen2_5_vl_text": _qwen2_5_vl_deltas,
}


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


def _hf_rope(config: dict[str, Any], max_positions: int,
             rotary_dim: int = 0) -> tuple[float, RopeScaling | None]:
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
    if rope_type == "linear":
        return base, RopeScaling(rope_type="linear", factor=_hf_field(params, "factor", float, where=where))
    if rope_type in ("longrope", "su") and rotary_dim:  # Phi-3 (which also calls it "su")
        return base, _longrope(config, params, max_positions, rotary_dim)
    raise ValueError(f"config.json uses rope type {rope_type!r}, which Redline does not implement for "
                     f"{config.get('model_type', 'this')!r} models; converting it would give wrong logits")


def _longrope(config: dict[str, Any], params: dict[str, Any], max_positions: int, rotary_dim: int) -> RopeScaling:
    """LongRoPE as transformers computes it: the attention factor, unless given, from max / original positions."""
    where = "config.json rope parameters"
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    original = _hf_field({"original_max_position_embeddings": original}, "original_max_position_embeddings", int,
                         where=where)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = _hf_field(params, key, list, where=where)
        if len(values) != rotary_dim // 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and
                                                     math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"{where} {key} must list {rotary_dim // 2} positive numbers; fix the config")
        factors[key] = tuple(float(v) for v in values)
    factor = _hf_field(params, "factor", float, max_positions / original, where)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = _hf_field({"attention_factor": attention}, "attention_factor", float, where=where)
    return RopeScaling(rope_type="longrope", original_max_position_embeddings=original, attention_factor=attention,
                       **factors)


# ---------------------------------------------------------------------------------------------------------------------
# Vision towers of the multimodal families (vision.py).

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def vision_args_from_hf_config(config: Any, processor: dict[str, Any] | None = None,
                               newline_id: int | None = None) -> Any:
    """The VisionArgs of a multimodal config.json (None for a text-only family), with the preprocessing of its
    preprocessor_config.json (the family's defaults without one). newline_id: the tokenizer's "\\n\\n" token, which
    Gemma 3's processor puts around each image."""
    from redline.vision import ImageProcessing, VisionArgs

    family = hf_family(config)
    if family not in MULTIMODAL_TEXT_FAMILIES:
        return None
    vision = _hf_field(config, "vision_config", dict, {})
    processor = processor or {}
    if not isinstance(processor, dict):
        raise ValueError("preprocessor_config.json must hold a JSON object; re-download it")
    out_dim = args_from_hf_config(config).dim
    where = "config.json vision_config"
    if family == "gemma3":
        act = _hf_field(vision, "hidden_act", str, "gelu_pytorch_tanh", where)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{where} hidden_act {act!r} is not implemented for Gemma 3's tower (gelu_pytorch_tanh)")
        size = processor.get("size") or {}
        image_size = _hf_field(vision, "image_size", int, 896, where)
        if size and (size.get("height") != image_size or size.get("width") != image_size):
            raise ValueError(f"preprocessor_config.json size {size} differs from the tower's {image_size}-pixel tiles; "
                             f"fix the config")
        nl = () if newline_id is None else (newline_id,)
        boi = _hf_field(config, "boi_token_index", int, 255999)
        return VisionArgs(
            family="gemma3", dim=_hf_field(vision, "hidden_size", int, where=where),
            n_layer=_hf_field(vision, "num_hidden_layers", int, where=where),
            n_head=_hf_field(vision, "num_attention_heads", int, where=where),
            intermediate_size=_hf_field(vision, "intermediate_size", int, where=where), out_dim=out_dim,
            patch_size=_hf_field(vision, "patch_size", int, 14, where),
            norm_eps=_hf_field(vision, "layer_norm_eps", float, 1e-6, where), image_size=image_size,
            tokens_per_image=_hf_field(config, "mm_tokens_per_image", int, 256),
            placeholder_id=boi, image_token_id=_hf_field(config, "image_token_index", int, 262144),
            image_prefix=nl + (boi,), image_suffix=(_hf_field(config, "eoi_token_index", int, 256000),) + nl,
            processing=_image_processing(processor, ImageProcessing, (0.5,) * 3, (0.5,) * 3, 2, tile_size=image_size))
    act = _hf_field(vision, "hidden_act", str, "silu", where)
    if act != "silu":
        raise ValueError(f"{where} hidden_act {act!r} is not implemented for Qwen2.5-VL's tower (silu)")
    patch = _hf_field(vision, "patch_size", int, 14, where)
    merge = _hf_field(vision, "spatial_merge_size", int, 2, where)
    frames = _hf_field(vision, "temporal_patch_size", int, 2, where)
    for key, own in (("patch_size", patch), ("merge_size", merge), ("temporal_patch_size", frames)):
        if processor.get(key, own) != own:
            raise ValueError(f"preprocessor_config.json {key} {processor[key]} differs from the tower's {own}; fix it")
    size = processor.get("size") or {}
    pixels = dict(min_pixels=processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
                  max_pixels=processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    image_token = _hf_field(config, "image_token_id", int, 151655)
    full = _hf_field(vision, "fullatt_block_indexes", list, [], where)
    depth = _hf_field(vision, "depth", int, where=where)
    if not all(type(i) is int and 0 <= i < depth for i in full):
        raise ValueError(f"{where} fullatt_block_indexes must list layers 0..{depth - 1}, got {full!r}; fix it")
    return VisionArgs(
        family="qwen2_5_vl", dim=_hf_field(vision, "hidden_size", int, where=where), n_layer=depth,
        n_head=_hf_field(vision, "num_heads", int, where=where),
        intermediate_size=_hf_field(vision, "intermediate_size", int, where=where),
        out_dim=_hf_field(vision, "out_hidden_size", int, out_dim, where), patch_size=patch,
        temporal_patch_size=frames, merge_size=merge, window_size=_hf_field(vision, "window_size", int, 112, where),
        full_attention_layers=tuple(full), rope_base=_hf_field({"rope_theta": theta}, "rope_theta", float, where=where),
        placeholder_id=image_token, image_token_id=image_token,
        processing=_image_processing(processor, ImageProcessing, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, 3,
                                     patch_size=patch, merge_size=merge, temporal_patch_size=frames, **pixels))


def _image_processing(processor: dict[str, Any], kind: type, mean: tuple, std: tuple, resample: int,
                      **sizes: int) -> Any:
    """An ImageProcessing from preprocessor_config.json's fields, the family's defaults where absent."""
    for key in ("do_resize", "do_rescale", "do_normalize"):
        if processor.get(key, True) is not True:
            raise ValueError(f"preprocessor_config.json sets {key}={processor[key]!r}; Redline always does that step")
    if processor.get("do_pan_and_scan"):
        raise ValueError("preprocessor_config.json turns on pan and scan, which Redline does not implement; turn it "
                         "off")
    return kind(image_mean=tuple(processor.get("image_mean") or mean),
                image_std=tuple(processor.get("image_std") or std),
                rescale_factor=_hf_field(processor, "rescale_factor", float, 1 / 255, "preprocessor_config.json"),
                resample=processor.get("resample", resample), **sizes)
