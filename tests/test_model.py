"""model.py against HF transformers: logits, KV-cache decoding, rope, configs."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given, settings
from hypothesis import strategies as st

from redline.checkpoint import read_checkpoint_info
from redline.model import MODEL_REGISTRY, ModelArgs, Transformer, rope_frequencies
from redline.quantize import load_model
from redline.scripts.hf_config import args_from_hf_config

from conftest import prefill_then_decode_logits, save_tiny_hf_checkpoint, tiny_hf_config


def load_fp32(path):
    return load_model(read_checkpoint_info(path), "cpu", torch.float32)


def full_forward(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    model.setup_caches(ids.shape[0], ids.shape[1])
    return model(ids, torch.arange(ids.shape[1]))


def test_converted_logits_match_hf(hf_variant_checkpoint):
    variant, _, hf_model, path = hf_variant_checkpoint
    model = load_fp32(path)
    torch.manual_seed(1)
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 40))
    with torch.no_grad():
        ours = full_forward(model, ids)
        ref = hf_model(ids).logits.float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4, variant


def test_llama3_rope_beyond_original_length_matches_hf(tmp_path):
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir, hf_model = save_tiny_hf_checkpoint(tmp_path, "llama3_rope")
    model = load_fp32(convert_hf_checkpoint(hf_dir, dtype="float32"))
    ids = torch.randint(0, 512, (1, 300))  # far past original_max_position_embeddings=32
    with torch.no_grad():
        diff = (full_forward(model, ids) - hf_model(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4


def test_incremental_decoding_matches_full_forward(tiny_checkpoint):
    path, _ = tiny_checkpoint
    model = load_fp32(path)
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        full = full_forward(model, ids)
        model.setup_caches(2, 64)  # a cache longer than the sequence: unused slots must be masked
        prefix = 8
        steps = [model(ids[:, :prefix], torch.arange(prefix))]
        for pos in range(prefix, ids.shape[1]):
            steps.append(model(ids[:, pos:pos + 1], torch.tensor([pos])))
    incremental = torch.cat(steps, dim=1)
    assert (incremental - full).abs().max().item() <= 1e-4


def test_from_start_prefill_matches_the_masked_path(tiny_checkpoint):
    model = load_fp32(tiny_checkpoint[0])
    ids = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        model.setup_caches(2, 100)  # the cache is longer than the prompt
        masked = model(ids, torch.arange(30))
        model.setup_caches(2, 100)
        causal = model(ids, torch.arange(30), from_start=True)
        after = model(ids[:, :1], torch.tensor([30]))  # the cache written by the fast path serves decoding
        model.setup_caches(2, 100)
        model(ids, torch.arange(30))
        reference_after = model(ids[:, :1], torch.tensor([30]))
    torch.testing.assert_close(causal, masked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, reference_after, atol=1e-5, rtol=1e-5)


def test_logits_at_selects_positions(tiny_checkpoint):
    model = load_fp32(tiny_checkpoint[0])
    ids = torch.randint(0, 512, (1, 10))
    with torch.no_grad():
        full = full_forward(model, ids)
        model.setup_caches(1, 10)
        picked = model(ids, torch.arange(10), logits_at=torch.tensor([9, 4]))
    assert picked.shape == (1, 2, 512)
    torch.testing.assert_close(picked[:, 0], full[:, 9])
    torch.testing.assert_close(picked[:, 1], full[:, 4])


def test_forward_without_cache_is_a_clear_error():
    model = Transformer(ModelArgs.from_name("debug-tiny"))
    with pytest.raises(RuntimeError, match="setup_caches"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3))


def test_cache_longer_than_context_is_refused():
    model = Transformer(ModelArgs.from_name("debug-tiny"))
    with pytest.raises(ValueError, match="context"):
        model.setup_caches(1, 10_000)


def test_from_name_unknown_lists_known_names():
    with pytest.raises(ValueError, match="Llama-2-7B") as info:
        ModelArgs.from_name("Llama-9-1T")
    assert "Llama-9-1T" in str(info.value)


@pytest.mark.parametrize("name", sorted(MODEL_REGISTRY))
def test_registry_entries_are_valid(name):
    args = ModelArgs.from_name(name)
    assert args.n_head % args.n_kv_heads == 0 and args.head_dim % 2 == 0


def test_registry_7b_parameter_count():
    args = ModelArgs.from_name("Llama-2-7B")
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616


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


def test_model_args_validation():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelArgs(dim=64, n_head=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="positive integer"):
        ModelArgs(dim=0)


def test_rope_llama3_scaling_keeps_high_frequencies_and_slows_low_ones():
    plain = rope_frequencies(ModelArgs.from_name("Llama-3-8B"))
    scaled = rope_frequencies(ModelArgs.from_name("Llama-3.1-8B"))
    assert plain.dtype == torch.float32 and plain.shape == (64,)
    torch.testing.assert_close(scaled[:10], plain[:10])  # short wavelengths untouched
    torch.testing.assert_close(scaled[-5:], plain[-5:] / 8.0)  # long wavelengths divided by the factor
    assert torch.all(scaled <= plain + 1e-12)


def test_rope_table_is_fp32_and_matches_cos_sin():
    from redline.model import rope_table

    args = ModelArgs.from_name("debug-tiny")
    table = rope_table(args, 50)
    assert table.shape == (50, 2, args.head_dim // 2) and table.dtype == torch.float32
    pos, i = 37, 3
    angle = 37 * (1.0 / (args.rope_base ** (2 * i / args.head_dim)))
    assert math.isclose(table[pos, 0, i].item(), math.cos(angle), abs_tol=1e-5)
    assert math.isclose(table[pos, 1, i].item(), math.sin(angle), abs_tol=1e-5)


def test_model_source_has_no_custom_ops():
    """model.py is the plain model: the GPU fast paths are applied from outside (kernels.use_kernels)."""
    source = (Path(__file__).resolve().parents[1] / "model.py").read_text()
    assert "torch.ops" not in source


class RedlineOpRecorder(TorchDispatchMode):
    """Records every redline:: custom op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "redline":
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("quantized", [False, True])
def test_a_model_without_use_kernels_runs_no_redline_op(quantized):
    from redline import kernels
    from redline.quantize import quantize_

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("debug-tiny")).eval()
    if quantized:
        quantize_(model, "int8")
    ids = torch.randint(0, 512, (1, 10))
    with torch.no_grad():
        with RedlineOpRecorder() as plain:
            model.setup_caches(1, 16)
            model(ids[:, :8], torch.arange(8), from_start=True)
            model(ids[:, 8:9], torch.tensor([8]))
        assert plain.seen == []
        kernels.use_kernels(model)  # the same steps through the kernel modules do reach the ops
        with RedlineOpRecorder() as routed:
            model.setup_caches(1, 16)
            model(ids[:, :8], torch.arange(8), from_start=True)
            model(ids[:, 8:9], torch.tensor([8]))
    linear_op = "redline.int8_linear.default" if quantized else "redline.linear.default"
    assert {"redline.prefill_rope_cache.default", "redline.decode_attention.default", linear_op} <= set(routed.seen)


# Rope keys as config.json files carry them (transformers 4.x `rope_scaling`, 5.x `rope_parameters`, or both);
# each must resolve to what transformers itself uses.
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
