"""quantize.py's fp8 scheme (W8A8 e4m3): rounding bounds, the linear against fp32, checkpoints, quantize on load, the
demo model's perplexity against its float weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from redline.checkpoint import read_checkpoint_info
from redline.generate import LLM
from redline.quantize import (FP8_DTYPE, FP8_MAX, Fp8Linear, dequantize_fp8, fp8_linear_reference, load_model, main,
                              quantize_, quantize_activations_fp8, quantize_checkpoint, quantize_fp8)

# e4m3 keeps 3 mantissa bits: rounding to the nearest value errs by at most half a spacing, 2**-4 of the value
# (normal range); below the smallest normal (2**-6) the spacing is 2**-9, so at most 2**-10 in units of the scale.
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL_ABS = 2.0 ** -10
# The W8A8 product against the fp32 one, relative Frobenius error, for random weights and activations: two e4m3
# roundings of about 2**-4 / sqrt(3) RMS each (measured 0.030-0.035 here; the bound leaves room).
MAX_W8A8_REL_ERROR = 0.05
# Weight-only (one row): one rounding (measured about 0.022).
MAX_WEIGHT_ONLY_REL_ERROR = 0.035
# The demo model (SmolLM2-135M) in FP8 against its float32 weights on the CPU: the perplexity of a README excerpt
# (windows of 512, stride 256). Measured: 34.90 against 33.58 (+3.9%; bf16 33.61, FP8 with bf16 activations 34.84,
# +3.7% of bf16). The 1% target is NOT met on this 135M model: on one window, FP8 weights alone cost +2.0%, per-token
# activations +3.8% in all, activations per 64-input group +2.6%. Greedy continuations (8 chat prompts, 24 tokens,
# EOS ignored) all diverge from float32's somewhere (0 of 8 identical). The bound is the measurement with a margin, so
# that a regression fails.
MAX_PERPLEXITY_RATIO = 1.05


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def within_e4m3_rounding(w: torch.Tensor, dequantized: torch.Tensor, scale: torch.Tensor) -> bool:
    bound = torch.maximum(w.abs() * E4M3_REL, scale * E4M3_SUBNORMAL_ABS) * (1 + 1e-6)
    return bool(((dequantized - w).abs() <= bound).all())


@pytest.mark.parametrize("block", [False, True], ids=["per-channel", "block"])
def test_quantize_fp8_rounds_each_weight_to_its_nearest_e4m3_value(block):
    w = torch.randn(300, 260) * torch.linspace(0.01, 5, 300).unsqueeze(1)
    q, scales = quantize_fp8(w, block_scales=block)
    assert q.dtype == FP8_DTYPE and scales.dtype == torch.float32
    assert scales.shape == ((3, 3) if block else (300,))
    full = scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260] if block else scales[:, None]
    assert within_e4m3_rounding(w, dequantize_fp8(q, scales), full.expand_as(w))
    assert q.float().abs().max() == FP8_MAX  # each scale maps its largest |w| to 448
    assert torch.isfinite(q.float()).all()


def test_zero_rows_and_blocks_stay_zero():
    w = torch.zeros(256, 256)
    w[200:, 130:] = 1.5
    for block in (False, True):
        q, scales = quantize_fp8(w, block_scales=block)
        assert torch.equal(dequantize_fp8(q, scales), w)


def test_activations_are_quantized_per_token():
    x = torch.randn(3, 5, 64) * torch.tensor([1e-3, 1.0, 300.0]).view(3, 1, 1)
    x[1, 2] = 0
    codes, scales = quantize_activations_fp8(x)
    assert codes.shape == x.shape and scales.shape == (3, 5, 1)
    assert (codes.float().abs().amax(-1)[scales.squeeze(-1) > 1e-30] == FP8_MAX).all()
    assert torch.equal(codes[1, 2].float(), torch.zeros(64))
    assert within_e4m3_rounding(x, codes.float() * scales, scales.expand_as(x))


@pytest.mark.parametrize("block", [False, True], ids=["per-channel", "block"])
def test_fp8_linear_against_fp32_within_stated_bounds(block):
    torch.manual_seed(0)
    w = torch.randn(384, 512) / 512 ** 0.5
    q, scales = quantize_fp8(w, block_scales=block)
    x = torch.randn(4, 7, 512)
    assert rel_error(fp8_linear_reference(x, q, scales), F.linear(x, w)) <= MAX_W8A8_REL_ERROR
    one = x[:1, :1]
    got = fp8_linear_reference(one, q, scales)
    assert rel_error(got, F.linear(one, w)) <= MAX_WEIGHT_ONLY_REL_ERROR
    # one row is weight-only: exactly x times the dequantized weight
    assert torch.equal(got, F.linear(one, dequantize_fp8(q, scales)))
    # two or more rows: the row quantized per token, whatever the rows beside it
    assert torch.allclose(fp8_linear_reference(x, q, scales)[0, 0], fp8_linear_reference(x[0, :2], q, scales)[0],
                          rtol=1e-6, atol=1e-6)


def test_fp8_linear_keeps_the_activation_dtype():
    q, scales = quantize_fp8(torch.randn(64, 32))
    layer = Fp8Linear(32, 64)
    layer.weight, layer.scales = q, scales
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert layer(torch.randn(3, 32, dtype=dtype)).dtype == dtype


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_llm_checkpoint, tmp_path_factory):
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    src = tiny_llm_checkpoint[0].parent
    return convert_hf_checkpoint(src, tmp_path_factory.mktemp("bf16") / "model.safetensors", dtype="bfloat16")


@pytest.fixture(scope="module")
def fp8_checkpoint(bf16_checkpoint, tmp_path_factory):
    return quantize_checkpoint(bf16_checkpoint, "fp8", tmp_path_factory.mktemp("fp8") / "model.fp8.safetensors")


def test_checkpoint_holds_e4m3_weights_and_says_so(bf16_checkpoint, fp8_checkpoint):
    info = read_checkpoint_info(fp8_checkpoint)
    assert info.scheme == "fp8" and info.quantization["granularity"] == "per-output-channel"
    assert info.quantization["format"] == "float8_e4m3fn"
    with safe_open(str(fp8_checkpoint), "pt") as f:
        assert f.get_slice("layers.0.attention.wqkv.weight").get_dtype() == "F8_E4M3"
        assert f.get_tensor("layers.0.attention.wqkv.scales").dtype == torch.float32
    model = load_model(info, "cpu")
    assert isinstance(model.layers[0].feed_forward.w13, Fp8Linear)
    assert model.layers[0].feed_forward.w13.weight.dtype == FP8_DTYPE
    # the linears halve; this tiny model's bf16 embedding (kept) is a third of its bytes, so the file is 64% of bf16's
    assert fp8_checkpoint.stat().st_size < 0.7 * bf16_checkpoint.stat().st_size


def test_quantize_on_load_equals_the_quantized_file(bf16_checkpoint, fp8_checkpoint, tiny_llm_checkpoint):
    import shutil

    for path in (bf16_checkpoint, fp8_checkpoint):  # the tokenizer sits beside the checkpoint
        shutil.copy(tiny_llm_checkpoint[0].parent / "tokenizer.model", path.parent / "tokenizer.model")
    from_file = LLM.load(fp8_checkpoint, device="cpu")
    on_load = LLM.load(bf16_checkpoint, device="cpu", quantize="fp8")
    plain = LLM.load(bf16_checkpoint, device="cpu")
    ids = [5, 9, 13, 17, 21, 25]
    a = from_file.generate(ids, max_new_tokens=8, temperature=0)
    b = on_load.generate(ids, max_new_tokens=8, temperature=0)
    assert a.token_ids == b.token_ids
    assert a.stats.model_bytes_per_token < 0.6 * plain.bytes_per_token
    with pytest.raises(ValueError, match="already quantized"):
        LLM.load(fp8_checkpoint, device="cpu", quantize="fp8")


def test_bad_requests_are_one_line_errors(bf16_checkpoint, capsys, tmp_path):
    from redline.model import ModelArgs, Transformer

    with pytest.raises(ValueError, match="per output channel; --groupsize applies to int4 only"):
        quantize_checkpoint(bf16_checkpoint, "fp8", tmp_path / "x.safetensors", group_size=64)
    with pytest.raises(ValueError, match="choose int8, int4, fp8"):
        LLM.load(bf16_checkpoint, device="cpu", quantize="fp16")
    model = Transformer(ModelArgs(dim=32, n_layer=1, n_head=2, intermediate_size=64, vocab_size=64,
                                  n_experts=4, n_experts_per_tok=2))
    with pytest.raises(ValueError, match="fp8 does not quantize mixture-of-experts"):
        quantize_(model, "fp8")
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "fp8", "--groupsize", "32"]) != 0
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_cli_writes_the_fp8_file(bf16_checkpoint, tmp_path, capsys):
    out = tmp_path / "m.fp8.safetensors"
    assert main(["--checkpoint_path", str(bf16_checkpoint), "--mode", "fp8", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert read_checkpoint_info(out).scheme == "fp8"


@pytest.mark.slow
def test_demo_model_perplexity_stays_near_the_float_model(smollm2_checkpoint):
    """The demo model quantized to FP8 on load against the float32 model it came from (fp32 activations on the CPU:
    bf16 matmuls run about 10x slower on an AVX2 CPU); the scored windows are W8A8 products of many rows."""
    from pathlib import Path

    from redline.scripts.perplexity import evaluate

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")[:3000]
    perplexity = {}
    for quantize in (None, "fp8"):
        llm = LLM.load(smollm2_checkpoint, device="cpu", quantize=quantize, compile=False)
        perplexity[quantize] = evaluate(llm, [text], 512, 256)[0].value
    assert perplexity["fp8"] <= perplexity[None] * MAX_PERPLEXITY_RATIO, perplexity
