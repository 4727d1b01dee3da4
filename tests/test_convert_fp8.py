"""scripts/convert_hf_checkpoint.py on FP8 checkpoints: compressed-tensors' float-quantized files (written with the
compressed-tensors library) and transformers' block-wise fp8 (Qwen3-FP8 style) convert without dequantizing, and
their weights match the files' own dequantized weights exactly."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_hf_config
from redline.checkpoint import load_tensors, read_checkpoint_info
from redline.quantize import FP8_DTYPE, Fp8Linear, dequantize_fp8, load_model, quantize_fp8
from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

# Shapes whose q, k, v and gate, up row counts are whole 128-row blocks (the block scales fuse with them).
SHAPES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256)
# HF name -> (Redline fused tensor, rows before it in the fused tensor), for layer 0.
PARTS = {"self_attn.q_proj": ("attention.wqkv", 0), "self_attn.k_proj": ("attention.wqkv", 128),
         "self_attn.v_proj": ("attention.wqkv", 256), "self_attn.o_proj": ("attention.wo", 0),
         "mlp.gate_proj": ("feed_forward.w13", 0), "mlp.up_proj": ("feed_forward.w13", 256),
         "mlp.down_proj": ("feed_forward.w2", 0)}


def hf_model(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_hf_config(**SHAPES)).eval()


def dequantized_hf(tensors: dict[str, torch.Tensor], scale_suffix: str) -> dict[str, torch.Tensor]:
    """Each FP8 weight of an HF state dict times its scale, fp32 (compressed-tensors: per channel (N, 1); block-wise
    fp8: 128 x 128 blocks)."""
    out = {}
    for name, t in tensors.items():
        if t.dtype != FP8_DTYPE:
            continue
        scale = tensors[name.removesuffix(".weight") + scale_suffix].float()
        if scale_suffix == ".weight_scale_inv":  # 128 x 128 blocks
            scale = scale.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
        out[name] = t.float() * scale
    return out


@pytest.fixture(scope="module")
def compressed_tensors_dir(tmp_path_factory, sp_tokenizer_dir):
    """A float-quantized (FP8, per-channel weight scales, dynamic per-token activations) checkpoint written by
    compressed-tensors' own compressor, lm_head left float as llm-compressor's FP8_DYNAMIC recipe does."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    out = tmp_path_factory.mktemp("ct-fp8")
    model = hf_model()
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                                ignore=["lm_head"], format="float-quantized")
    apply_quantization_config(model, config)
    for module in model.modules():  # the weight observer's job: max |w| / 448 per output row
        if hasattr(module, "weight_scale"):
            module.weight_scale.data = module.weight.detach().abs().amax(dim=1, keepdim=True) / 448
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    assert ct.__version__ and json.loads((out / "config.json").read_text())["quantization_config"]["format"] == \
        "float-quantized"
    return out


@pytest.fixture(scope="module")
def block_fp8_dir(tmp_path_factory):
    """transformers' block-wise fp8 layout (as Qwen3-8B-FP8): e4m3 weights, fp32 weight_scale_inv per 128 x 128
    block, quant_method "fp8" with weight_block_size [128, 128]; lm_head float."""
    out = tmp_path_factory.mktemp("block-fp8")
    model = hf_model(seed=1)
    model.config.save_pretrained(out)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t, block_scales=True)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def stored(folder) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("layout", ["compressed-tensors", "block-fp8"])
def test_fp8_checkpoints_convert_as_stored_and_match_their_dequantized_weights(layout, compressed_tensors_dir,
                                                                              block_fp8_dir, tmp_path):
    folder, suffix = (compressed_tensors_dir, ".weight_scale") if layout == "compressed-tensors" else (
        block_fp8_dir, ".weight_scale_inv")
    path = convert_hf_checkpoint(folder, tmp_path / "model.safetensors", dtype="bfloat16")
    info = read_checkpoint_info(path)
    assert info.scheme == "fp8"
    assert info.quantization["granularity"] == ("block" if layout == "block-fp8" else "per-output-channel")
    assert "output" in info.quantization["not_quantized"]
    ours = load_tensors(info)
    hf = stored(folder)
    want = dequantized_hf(hf, suffix)
    assert want, "the source holds FP8 weights"
    for hf_part, (target, row0) in PARTS.items():
        name = f"model.layers.1.{hf_part}.weight"
        weight, scales = ours[f"layers.1.{target}.weight"], ours[f"layers.1.{target}.scales"]
        assert weight.dtype == FP8_DTYPE
        rows = hf[name].shape[0]
        assert torch.equal(weight[row0:row0 + rows].view(torch.uint8), hf[name].view(torch.uint8))  # the same codes
        assert torch.equal(dequantize_fp8(weight, scales)[row0:row0 + rows], want[name])
    model = load_model(info, "cpu")
    assert isinstance(model.layers[0].attention.wqkv, Fp8Linear)
    assert type(model.output) is torch.nn.Linear and model.output.weight.dtype == torch.bfloat16


def test_converted_fp8_model_decodes_like_its_dequantized_hf_model(compressed_tensors_dir, tmp_path):
    """One row at a time (weight-only: the GEMV path) the converted model's logits equal those of the HF model with
    the dequantized weights, in fp32."""
    path = convert_hf_checkpoint(compressed_tensors_dir, tmp_path / "model.safetensors", dtype="float32")
    reference = hf_model()
    state = {k: v for k, v in stored(compressed_tensors_dir).items() if not k.endswith("_scale")}
    state.update(dequantized_hf(stored(compressed_tensors_dir), ".weight_scale"))
    reference.load_state_dict(state)
    ids = torch.tensor([[3, 17, 41, 5, 99]])
    with torch.no_grad():
        want = reference(ids).logits[0, -1]
    model = load_model(read_checkpoint_info(path), "cpu")
    model.setup_caches(1, 16)
    with torch.no_grad():
        for pos in range(ids.shape[1]):
            got = model(ids[:, pos:pos + 1], torch.tensor([pos]))[0, -1]  # (vocab,)
    assert torch.allclose(got.float(), want, atol=2e-4, rtol=1e-4), (got - want).abs().max()


def test_fp8_checkpoints_that_cannot_be_held_are_one_line_errors(block_fp8_dir, tmp_path):
    config = json.loads((block_fp8_dir / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(block_fp8_dir / "model.safetensors", bad / "model.safetensors")
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\]; Redline converts block-wise fp8 with"):
        convert_hf_checkpoint(bad, tmp_path / "out.safetensors")
    tensors = stored(block_fp8_dir)
    del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").unlink()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj.weight has no weight_scale beside it"):
        convert_hf_checkpoint(bad, tmp_path / "out.safetensors")
