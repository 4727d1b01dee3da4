"""scripts/hf_config.py: config.json fields read and checked as transformers resolves them, refusals in one line."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redline.model import rope_frequencies
from redline.scripts.hf_config import args_from_hf_config

from conftest import tiny_hf_config


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(num_key_value_heads=1), dict(n_kv_heads=1)),
        (dict(head_dim=24), dict(head_dim=24)),
        (dict(rope_theta=123.0), dict(rope_base=123.0)),
        (dict(rms_norm_eps=1e-6), dict(norm_eps=1e-6)),
        (dict(tie_word_embeddings=True), dict(tie_word_embeddings=True)),
        (dict(max_position_embeddings=777), dict(block_size=777)),
    ],
)
def test_from_hf_config_fields(overrides, expected):
    args = args_from_hf_config(tiny_hf_config(num_attention_heads=4, **overrides).to_dict())
    for key, value in expected.items():
        assert getattr(args, key) == value


def test_from_hf_config_reads_transformers4_style_rope_scaling():
    config = tiny_hf_config(num_attention_heads=4).to_dict()
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    args = args_from_hf_config(config)
    assert args.rope_base == 500000.0 and args.rope_scaling.factor == 8.0


def test_from_hf_config_rejects_other_architectures():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        args_from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_from_hf_config_rejects_unsupported_rope():
    config = tiny_hf_config(num_attention_heads=4).to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="yarn"):
        args_from_hf_config(config)


def test_mistral_sliding_window_caps_context():
    config = tiny_hf_config(num_attention_heads=4, max_position_embeddings=32768).to_dict()
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
    assert args_from_hf_config(config).block_size == 4096


_ROPE_KEY_CASES = [
    dict(rope_scaling={"type": "default"}, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    dict(rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 77.0}),
    dict(rope_scaling={}, rope_parameters={"rope_type": "default", "rope_theta": 77.0}, rope_theta=5.0),
    dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_theta=1234.0),
    dict(rope_scaling={"type": "llama3", "rope_type": "default", "factor": 2.0}),
    dict(rope_theta=321.0),
    dict(),
]


@pytest.mark.parametrize("keys", _ROPE_KEY_CASES)
def test_rope_keys_resolve_as_transformers_resolves_them(keys):
    import copy

    from transformers import LlamaConfig

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 160, "vocab_size": 512, "max_position_embeddings": 256,
              **keys}
    hf = LlamaConfig.from_dict(copy.deepcopy(config)).rope_parameters
    args = args_from_hf_config(copy.deepcopy(config))
    assert args.rope_base == float(hf["rope_theta"])
    if hf["rope_type"] == "default":
        assert args.rope_scaling is None
    else:
        assert hf["rope_type"] == "llama3"
        assert (args.rope_scaling.factor, args.rope_scaling.original_max_position_embeddings) == (
            hf["factor"], hf["original_max_position_embeddings"])


def test_legacy_linear_rope_beside_default_rope_parameters_wins():
    """transformers lets the legacy key win, so this model uses linear scaling, and so must the conversion."""
    config = tiny_hf_config(num_attention_heads=4).to_dict()
    config.update(rope_scaling={"type": "linear", "factor": 4.0}, rope_parameters={"rope_type": "default"})
    scaling = args_from_hf_config(config).rope_scaling
    assert (scaling.rope_type, scaling.factor) == ("linear", 4.0)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope", "proportional"])
def test_unimplemented_rope_types_are_refused_in_one_line(rope_type):
    config = tiny_hf_config(num_attention_heads=4).to_dict()
    config["rope_parameters"] = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=f"rope type '{rope_type}', which Redline does not implement") as info:
        args_from_hf_config(config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("num_attention_heads"), "no 'num_attention_heads'"),
    (lambda c: c.pop("vocab_size"), "no 'vocab_size'"),
    (lambda c: c.update(num_hidden_layers=True), "num_hidden_layers must be a positive integer"),
    (lambda c: c.update(intermediate_size=-1), "intermediate_size must be a positive integer"),
    (lambda c: c.update(rope_parameters=None, rope_theta="1e4"), "rope_theta must be a positive number"),
    (lambda c: c.update(sliding_window="4096"), "sliding_window must be a positive integer"),
    (lambda c: c.update(architectures="LlamaForCausalLM"), "architectures must be a list"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     "no 'high_freq_factor'"),
])
def test_from_hf_config_checks_every_field_it_reads(change, message):
    config = tiny_hf_config(num_attention_heads=4).to_dict()
    change(config)
    with pytest.raises(ValueError, match=message):
        args_from_hf_config(config)


def test_from_hf_config_refuses_a_config_that_is_not_an_object():
    with pytest.raises(ValueError, match="got a list"):
        args_from_hf_config([{"model_type": "llama"}])

# Values for the property test: the right kinds, the wrong kinds and edge numbers.
_CONFIG_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 300), st.floats(allow_nan=True, width=32),
                           st.text(max_size=6), st.lists(st.integers(0, 3), max_size=2),
                           st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "low_freq_factor",
                                                            "high_freq_factor", "rope_theta"]),
                                           st.one_of(st.sampled_from(["default", "llama3", "linear"]),
                                                     st.floats(0.5, 10), st.integers(-1, 64)), max_size=5))
_HF_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters", "tie_word_embeddings", "sliding_window", "hidden_act", "attention_bias", "architectures",
            "model_type"]


@settings(max_examples=100, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(_HF_KEYS), _CONFIG_VALUES, max_size=4),
       dropped=st.lists(st.sampled_from(_HF_KEYS), max_size=2))
def test_random_hf_configs_give_valid_args_or_one_clear_error(changes, dropped):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 512,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, **changes}
    for key in dropped:
        config.pop(key, None)
    try:
        args = args_from_hf_config(config)
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert args.n_head % args.n_kv_heads == 0 and args.head_dim % 2 == 0 and args.block_size > 0
    assert math.isfinite(args.rope_base) and args.rope_base > 0 and args.norm_eps > 0
    assert isinstance(args.tie_word_embeddings, bool)
    assert rope_frequencies(args).isfinite().all()
