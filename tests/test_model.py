"""model.py against HF transformers: logits, KV-cache decoding, rope, ModelArgs."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from redline.checkpoint import read_checkpoint_info
from redline.model import MODEL_REGISTRY, ModelArgs, Transformer, rope_frequencies
from redline.quantize import load_model

from conftest import save_tiny_hf_checkpoint


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
