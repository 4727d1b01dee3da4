"""Each supported family against transformers' own class: fp32 logits, cached decoding and greedy tokens."""
from __future__ import annotations

import pytest
import torch

from redline.checkpoint import read_checkpoint_info
from redline.generate import LLM
from redline.quantize import load_model

from conftest import prefill_then_decode_logits, save_family_checkpoint


def load_fp32(path):
    return load_model(read_checkpoint_info(path), "cpu", torch.float32)


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.setup_caches(ids.shape[0], ids.shape[1])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]))


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits.float()


def test_logits_match_transformers(family_checkpoint):
    variant, _, hf_model, path = family_checkpoint
    model = load_fp32(path)
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (2, 40))  # longer than every variant's sliding window
    diff = (full_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff <= 1e-4, (variant, diff)


def test_cached_decoding_matches_transformers(family_checkpoint):
    """Prefill then one token at a time through the static cache (a cache longer than the sequence), across the
    window."""
    variant, _, hf_model, path = family_checkpoint
    model = load_fp32(path)
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (1, 30))
    with torch.no_grad():
        ours = prefill_then_decode_logits(model, ids, prompt_len=12, cache_len=48 if "longrope" not in variant else 64)
    diff = (ours - hf_logits(hf_model, ids)).abs().max().item()
    assert diff <= 1e-4, (variant, diff)


def check_greedy_tokens(checkpoint, device: str = "cpu") -> None:
    """16 greedy tokens of a converted (variant, HF dir, HF model, path) checkpoint equal transformers' generate; on
    a GPU through the kernels, compiled, with the fused decode where the family takes it (float32 throughout)."""
    variant, _, hf_model, path = checkpoint
    model = load_model(read_checkpoint_info(path), device, torch.float32)
    llm = LLM(model, None, torch.device(device), compile=device != "cpu")
    prompt = [5, 17, 99, 230, 7, 64, 300, 12]
    ours = llm.generate(prompt, max_new_tokens=16, ignore_eos=True, temperature=0).token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours == ref[0, len(prompt):].tolist(), variant


def test_greedy_tokens_match_transformers(family_checkpoint):
    check_greedy_tokens(family_checkpoint)


@pytest.mark.gpu
def test_gpu_kernels_and_compile_give_transformers_greedy_tokens(family_checkpoint):
    check_greedy_tokens(family_checkpoint, "cuda")


@pytest.mark.parametrize("length", [200, 300])
def test_phi3_longrope_below_and_above_the_original_length(tmp_path, length):
    """transformers picks the long factors when the sequence passes original_max_position_embeddings (256); Redline
    picks them when the cache does, so a cache of the sequence's length gives the same logits on both sides."""
    hf_dir, hf_model = save_family_checkpoint(tmp_path, "phi3_longrope")
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    model = load_fp32(convert_hf_checkpoint(hf_dir, dtype="float32"))
    ids = torch.randint(0, 512, (1, length))
    diff = (full_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff <= 1e-4, diff
    scaling, rot = model.args.rope_scaling, model.args.rotary_dim
    factors = torch.tensor(scaling.long_factor if length > 256 else scaling.short_factor, dtype=torch.float64)
    inv_freq = 1.0 / (factors * 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    torch.testing.assert_close(model.rope[1, 1].double() / scaling.attention_factor, inv_freq.sin(), rtol=1e-5,
                               atol=1e-6)


def test_int8_stays_within_the_int8_bounds(family_checkpoint, tmp_path):
    """The converted file quantized to int8 (quantize.py's checkpoint path), loaded, against the fp32 model: every
    quantized layer within test_quantize's relative error, and its teacher-forced top-1 agreement."""
    import torch.nn.functional as F

    from redline.quantize import Int8Linear, quantize_checkpoint
    from test_quantize import MAX_LAYER_REL_ERROR, MIN_TOP1_AGREEMENT, rel_error

    variant, _, _, path = family_checkpoint
    ref = load_fp32(path)
    q_model = load_fp32(quantize_checkpoint(path, "int8", tmp_path / "model.int8.safetensors"))
    torch.manual_seed(0)
    quantized = dict(q_model.named_modules())
    for name, module in ref.named_modules():
        if isinstance(quantized.get(name), Int8Linear):
            x = torch.randn(16, module.in_features)
            assert rel_error(quantized[name](x), F.linear(x, module.weight)) <= MAX_LAYER_REL_ERROR, (variant, name)
    ids = torch.randint(3, 512, (2, 96))
    agreement = (full_logits(ref, ids).argmax(-1) == full_logits(q_model, ids).argmax(-1)).float().mean().item()
    assert agreement >= MIN_TOP1_AGREEMENT, (variant, agreement)


def test_kernel_modules_and_the_fused_decode_keep_every_family_exact(family_checkpoint):
    """kernels.use_kernels on each family (the ops run their references on the CPU): the same logits through prefill
    and one-token steps; attention layers whose ops the kernels lack keep model.Attention; FusedDecode runs every
    family exactly but those with soft-caps (Gemma 2), residual or logit scales (Granite) or an output bias, and
    refuses those in one line naming what it lacks."""
    from redline.kernels import FusedDecode, KernelAttention, fused_decode_refusal, use_kernels
    from redline.model import Attention

    variant, _, _, path = family_checkpoint
    ref, model = load_fp32(path), use_kernels(load_fp32(path))
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        want = prefill_then_decode_logits(ref, ids, prompt_len=8, cache_len=32)
        got = prefill_then_decode_logits(model, ids, prompt_len=8, cache_len=32)
    assert (got - want).abs().max().item() <= 1e-5, variant
    kinds = {type(layer.attention) for layer in model.layers}
    a = model.args
    plain = not a.attn_softcap and a.attention_scale in (0.0, a.head_dim ** -0.5)  # partial rotary, windows too
    assert kinds == ({KernelAttention} if plain else {Attention}), variant
    lacks = a.o_bias or a.attn_softcap or a.final_softcap or (a.residual_scale, a.logits_divisor) != (1.0, 1.0)
    assert (fused_decode_refusal(a) is None) != lacks, variant
    if not lacks:
        fused = FusedDecode(model)
        with torch.no_grad():
            model.setup_caches(1, 32)
            steps = [model(ids[:, :8], torch.arange(8))]  # the prompt runs the unfused blocks, each token the fused
            steps += [fused(ids[:, p:p + 1], torch.tensor([p])) for p in range(8, 20)]
        assert (torch.cat(steps, dim=1) - want).abs().max().item() <= 1e-5, variant
        return
    with pytest.raises(ValueError, match="fused batch-1 decode does not implement") as info:
        FusedDecode(model)
    assert "\n" not in str(info.value)


def test_gemma3_multimodal_checkpoint_converts_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (how the 4B-27B ship): the text model's tensors under their multimodal names
    convert, the vision tower and projector are left out, and text-only logits match transformers'."""
    import transformers

    from conftest import _FAMILY_BASE, FAMILY_VARIANTS, randomize_parameters
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    text = {k: v for k, v in {**_FAMILY_BASE, **FAMILY_VARIANTS["gemma3"][1]}.items()
            if k not in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       initializer_range=0.1, attn_implementation="eager")
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_parameters(hf_model.model.language_model, gemma=True)
    hf_model.save_pretrained(tmp_path)
    model = load_fp32(convert_hf_checkpoint(tmp_path, dtype="float32"))
    assert model.args.layer_windows == (8, 0, 8, 0) and model.args.tie_word_embeddings
    ids = torch.randint(0, 512, (1, 30))
    diff = (full_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff <= 1e-4, diff


# Published config.json values (the fields these readers use) of a few registry models.
_PUBLISHED = {
    "Qwen2.5-7B": dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       use_sliding_window=False, sliding_window=131072, max_window_layers=28, hidden_act="silu"),
    "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36, head_dim=128,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     attention_bias=False, use_sliding_window=False, hidden_act="silu"),
    "Gemma-3-1B": dict(architectures=["Gemma3ForCausalLM"], hidden_size=1152, num_hidden_layers=26, head_dim=256,
                       num_attention_heads=4, num_key_value_heads=1, intermediate_size=6912, vocab_size=262144,
                       max_position_embeddings=32768, rope_theta=1e6, rope_local_base_freq=1e4, rms_norm_eps=1e-6,
                       query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                       hidden_activation="gelu_pytorch_tanh", rope_scaling=None),
    "OLMo-2-7B": dict(architectures=["Olmo2ForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=100352,
                      max_position_embeddings=4096, rope_theta=5e5, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Granite-3.1-8B": dict(architectures=["GraniteForCausalLM"], hidden_size=4096, num_hidden_layers=40,
                           num_attention_heads=32, num_key_value_heads=8, intermediate_size=12800, vocab_size=49155,
                           max_position_embeddings=131072, rope_theta=1e7, rms_norm_eps=1e-5,
                           tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.0078125,
                           residual_multiplier=0.22, logits_scaling=16.0),
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_registry_entries_equal_the_converted_published_configs(name):
    from redline.model import ModelArgs
    from redline.scripts.hf_config import args_from_hf_config

    assert args_from_hf_config(_PUBLISHED[name]) == ModelArgs.from_name(name)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "unsupported architecture"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden activation 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types must list"),
])
def test_unsupported_options_are_refused_in_one_line(change, message):
    from redline.scripts.hf_config import args_from_hf_config

    with pytest.raises(ValueError, match=message) as info:
        args_from_hf_config({**_PUBLISHED["Qwen3-8B"], **change, "use_sliding_window": True})
    assert "\n" not in str(info.value)


def test_gemma_bidirectional_attention_is_refused():
    from redline.scripts.hf_config import args_from_hf_config

    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        args_from_hf_config({**_PUBLISHED["Gemma-3-1B"], "use_bidirectional_attention": True})


def test_int4_model_is_the_model_of_its_dequantized_weights(family_checkpoint, tmp_path):
    """The int4 checkpoint of each family loads with every family tensor (biases, q/k norms, post-norms) in place:
    its logits equal those of the fp32 model whose linears hold the dequantized int4 weights."""
    from redline.quantize import Int4Linear, dequantize_int4, quantize_checkpoint

    variant, _, _, path = family_checkpoint
    q_model = load_fp32(quantize_checkpoint(path, "int4", tmp_path / "model.int4.safetensors", group_size=32))
    ref = load_fp32(path)
    with torch.no_grad():
        for name, module in q_model.named_modules():
            if isinstance(module, Int4Linear):
                ref.get_submodule(name).weight.copy_(dequantize_int4(module.weight, module.scales))
    ids = torch.randint(0, 512, (1, 30))
    diff = (full_logits(q_model, ids) - full_logits(ref, ids)).abs().max().item()
    assert diff <= 1e-4, (variant, diff)


@pytest.mark.parametrize("variant", ["qwen2_window", "gemma3", "phi3_longrope"])
def test_speculative_decoding_keeps_the_greedy_tokens(tmp_path, variant):
    """A draft of the same family (itself: every draft accepted) and prompt lookup verify several tokens per step
    through the windowed, soft-capped or partial-rotary attention; the tokens stay transformers' greedy ones."""
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir, hf_model = save_family_checkpoint(tmp_path, variant)
    path = convert_hf_checkpoint(hf_dir, dtype="float32")
    llm = LLM(load_fp32(path), None, torch.device("cpu"), compile=False)
    draft = LLM(load_fp32(path), None, torch.device("cpu"), compile=False)
    prompt = [5, 17, 99, 230, 7, 64, 5, 17, 99, 230, 7, 64]  # repeats, so prompt lookup finds matches
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    for spec in (draft, "prompt_lookup"):
        ours = llm.generate(prompt, max_new_tokens=20, ignore_eos=True, temperature=0, draft=spec, speculate_k=4)
        assert ours.token_ids == ref[0, len(prompt):].tolist(), (variant, spec)


def test_generate_batch_gives_each_prompt_its_tokens_alone(family_checkpoint):
    """The batching engine (paged cache, prefill chunks mixed with decode rows) against LLM.generate on the static
    cache, per family: prompts of different lengths, some longer than the sliding windows, greedy; LongRoPE models
    are refused by the paged cache in one line."""
    variant, _, _, path = family_checkpoint
    llm = LLM(load_fp32(path), None, torch.device("cpu"), compile=False)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 23, 41)]
    if "longrope" in variant:
        with pytest.raises(ValueError, match="LongRoPE"):
            llm.generate_batch(prompts, max_new_tokens=4, ignore_eos=True)
        return
    alone = [llm.generate(p, max_new_tokens=12, ignore_eos=True).token_ids for p in prompts]
    batched = [r.token_ids for r in llm.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)]
    assert batched == alone, variant
