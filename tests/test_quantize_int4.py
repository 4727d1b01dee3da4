"""quantize.py's int4 scheme: packing round trip, per-layer error bounds, group-size errors, checkpoints, loading."""
from __future__ import annotations

import pytest
import torch

from redline.checkpoint import read_checkpoint_info
from redline.quantize import (Int4Linear, dequantize_int4, load_model, main, pack_int4, quantize_, quantize_checkpoint,
                      quantize_int4, unpack_int4)


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_llm_checkpoint, tmp_path_factory):
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    src = tiny_llm_checkpoint[0].parent
    return convert_hf_checkpoint(src, tmp_path_factory.mktemp("bf16") / "model.safetensors", dtype="bfloat16")


def test_pack_unpack_round_trip_and_layout():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # input 2i in the low nibble, 2i + 1 in the high one; a 32-bit word holds inputs 8j..8j+7 in bits 4i..4i+3
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 1].item() << 4)
    word = int.from_bytes(bytes(packed[0, :4].tolist()), "little")
    assert [(word >> (4 * i)) & 15 for i in range(8)] == q[0, :8].tolist()


def test_scales_and_offsets_round_trip_exactly():
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # every group spans the whole code range
    sz = torch.stack((torch.rand(8, 4) * 0.01 + 1e-3, torch.randn(8, 4) * 0.05), dim=-1).half()  # (N, K/G, 2)
    w = dequantize_int4(pack_int4(codes), sz)
    packed, scales = quantize_int4(w, 32)
    # min/max quantization of values that are exactly scale * q + offset finds them again (up to fp16 rounding)
    assert torch.allclose(dequantize_int4(packed, scales), w, atol=1e-4, rtol=1e-3)
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("group_size,bound", [(32, 0.085), (64, 0.095), (128, 0.105), (256, 0.115)])
def test_per_layer_relative_error_bounds(group_size, bound):
    # A Gaussian weight quantized to 16 levels per group: the relative error grows with the group's range.
    torch.manual_seed(0)
    w = torch.randn(256, 1024) * 0.02
    packed, scales = quantize_int4(w, group_size)
    assert scales.dtype == torch.float16 and scales.shape == (256, 1024 // group_size, 2)
    err = ((dequantize_int4(packed, scales) - w).norm() / w.norm()).item()
    assert err < bound
    assert err > bound - 0.03  # four bits are four bits: a much smaller error would mean nothing was quantized


def test_every_value_within_half_a_step():
    w = torch.randn(16, 256)
    packed, scales = quantize_int4(w, 64)
    step = scales[..., 0].float().repeat_interleave(64, dim=1)  # (N, K)
    assert ((dequantize_int4(packed, scales) - w).abs() <= step * 0.5 + 1e-3).all()


def test_constant_group_is_exact():
    w = torch.full((2, 64), 0.25)
    assert torch.equal(dequantize_int4(*quantize_int4(w, 32)), w)


@pytest.mark.parametrize("group_size,match", [(48, "power of two"), (16, "at least 32"), (0, "power of two"),
                                              (512, "does not divide")])
def test_bad_group_sizes_are_clean_errors(group_size, match):
    with pytest.raises(ValueError, match=match):
        quantize_int4(torch.randn(4, 256), group_size)


def test_int4_linear_forward_is_dequantize_then_linear():
    lin = Int4Linear(128, 8, 32)
    lin.weight, lin.scales = quantize_int4(torch.randn(8, 128), 32)
    x = torch.randn(3, 128)
    assert torch.allclose(lin(x), x @ dequantize_int4(lin.weight, lin.scales).T, atol=1e-5)


def test_quantize_checkpoint_int4_metadata_and_load(bf16_checkpoint, tmp_path):
    out = quantize_checkpoint(bf16_checkpoint, "int4", tmp_path / "m.int4.safetensors", group_size=32)
    info = read_checkpoint_info(out)
    q = info.quantization
    assert q["scheme"] == "int4" and q["group_size"] == 32 and q["scale_dtype"] == "float16"
    assert q["layout"].endswith("/v1") and q["not_quantized"][0] == "tok_embeddings"
    model = load_model(info, "cpu")
    layer = model.layers[0].attention.wqkv
    assert isinstance(layer, Int4Linear) and layer.group_size == 32 and layer.scales.dtype == torch.float16
    ref = load_model(read_checkpoint_info(bf16_checkpoint), "cpu", torch.float32)
    quantize_(ref, "int4", 32)
    assert torch.equal(ref.layers[0].attention.wqkv.weight, layer.weight)


def test_llm_load_quantizes_int4_in_memory(bf16_checkpoint, tiny_llm_checkpoint):
    import shutil

    from redline.generate import LLM

    shutil.copy(tiny_llm_checkpoint[0].parent / "tokenizer.model", bf16_checkpoint.parent / "tokenizer.model")
    # plain "int4" takes the largest group size up to 128 that divides every layer (the tiny model: 64 and 160 inputs)
    llm = LLM.load(bf16_checkpoint, device="cpu", quantize="int4", compile=False)
    assert {m.group_size for m in llm.model.modules() if isinstance(m, Int4Linear)} == {32}
    llm = LLM.load(bf16_checkpoint, device="cpu", quantize="int4-g32", compile=False)
    assert llm.generate("abc", max_new_tokens=3, temperature=0).token_ids
    # an explicit group size that does not divide: a clean error naming the fix
    with pytest.raises(ValueError, match="does not divide a layer's 64 inputs; choose a smaller group size"):
        LLM.load(bf16_checkpoint, device="cpu", quantize="int4-g128", compile=False)
    with pytest.raises(ValueError, match="unknown quantization 'int4-g'"):
        LLM.load(bf16_checkpoint, device="cpu", quantize="int4-g", compile=False)


def test_auto_group_size_is_the_largest_that_divides_every_layer():
    from redline.model import ModelArgs
    from redline.quantize import auto_group_size, model_input_features

    assert auto_group_size(model_input_features(ModelArgs.from_name("Llama-2-7B"))) == 128
    assert auto_group_size([576, 1536]) == 64  # SmolLM2-135M: dim 576, intermediate 1536
    assert auto_group_size([64, 160]) == 32
    with pytest.raises(ValueError, match="no int4 group size of at least 32 divides"):
        auto_group_size([576, 100])


@pytest.mark.parametrize("spec, parsed", [("int8", ("int8", None)), ("int4", ("int4", None)),
                                          ("int4-g64", ("int4", 64)), ("int4-g256", ("int4", 256))])
def test_quant_spec_parses(spec, parsed):
    from redline.quantize import parse_quant_spec

    assert parse_quant_spec(spec) == parsed


@pytest.mark.parametrize("spec, message", [("int3", "unknown quantization"), ("int8-g32", "unknown quantization"),
                                           ("int4-gx", "unknown quantization"), ("int4-g48", "power of two"),
                                           ("int4-g16", "at least 32"), ("int4-g", "unknown quantization")])
def test_bad_quant_specs_are_one_line_errors(spec, message):
    from redline.quantize import parse_quant_spec

    with pytest.raises(ValueError, match=message) as info:
        parse_quant_spec(spec)
    assert "\n" not in str(info.value)


def test_quantize_in_memory_checks_every_layer_first(bf16_checkpoint):
    model = load_model(read_checkpoint_info(bf16_checkpoint), "cpu")
    k = model.layers[0].feed_forward.w2.in_features
    with pytest.raises(ValueError, match="does not divide"):
        quantize_(model, "int4", 2 * (1 << (k.bit_length())))
    assert not any(isinstance(m, Int4Linear) for m in model.modules())


def test_cli_int4_and_bad_groupsize(bf16_checkpoint, tmp_path, capsys):
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int4", "--groupsize", "48",
                 "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "power of two" in capsys.readouterr().err
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int8", "--groupsize", "32",
                 "--out", str(tmp_path / "y.safetensors")]) == 2
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int4", "--groupsize", "32",
                 "--out", str(tmp_path / "z.safetensors")]) == 0
    # without --groupsize: the largest that divides every layer (32 for the tiny model)
    out = tmp_path / "a.safetensors"
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "int4", "--out", str(out)]) == 0
    assert read_checkpoint_info(out).quantization["group_size"] == 32
