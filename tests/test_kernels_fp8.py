"""redline::fp8_linear (kernels/linear.py, triton_fp8.py, the FP8 GEMV in triton_linear.py): validation, the CPU
reference, the refusal of GPUs without FP8, and on a GPU with FP8 every path against the fp32 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import redline.kernels  # noqa: F401  (registers torch.ops.redline.*)
from redline.kernels.device import fp8_refusal, simulated, target_caps
from redline.kernels.linear import KernelFp8Linear, fp8_gemm_backend, swap_linears
from redline.quantize import Fp8Linear, dequantize_fp8, fp8_linear_reference, quantize_fp8
from conftest import GPU_TEST_KV_TOKENS

# GPU kernels against the fp32 reference: the same e4m3 codes and scales, fp32 accumulation; what differs is the
# summation order and the output rounding (bf16: 2**-8 relative).
GPU_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# Two or more rows multiply on the FP8 tensor cores, whose dot products keep fewer bits than fp32 inside each K step
# (Hopper: the kernels add each step's partial sums in fp32): measured 1.4e-4 to 2.3e-4 of the largest output on an
# H200 for K of 1,040 and 14,336 in fp32, against 1.5e-3 to 8.7e-3 when the tensor cores summed every step.
FP8_DOT_TOLERANCE = {**GPU_TOLERANCE, torch.float32: 5e-4}


def fp8_weight(n: int, k: int, block: bool, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(n + k)
    q, scales = quantize_fp8(torch.randn(n, k) / k ** 0.5, block_scales=block)
    return q.to(device), scales.to(device)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("block", [False, True])
def test_cpu_op_is_the_reference(block):
    q, scales = fp8_weight(200, 300, block)
    for shape in ((300,), (1, 300), (5, 300), (2, 3, 300)):
        x = torch.randn(shape, dtype=torch.bfloat16)
        got = torch.ops.redline.fp8_linear(x, q, scales)
        assert got.shape == (*shape[:-1], 200) and got.dtype == torch.bfloat16
        assert torch.equal(got, fp8_linear_reference(x, q, scales))


def test_validation_is_one_line():
    q, scales = fp8_weight(64, 128, False)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        torch.ops.redline.fp8_linear(x, q.float(), scales)
    with pytest.raises(ValueError, match=r"scales must be fp32 \(64,\) .* or \(1, 1\)"):
        torch.ops.redline.fp8_linear(x, q, scales[:10])
    with pytest.raises(ValueError, match="x has K=127"):
        torch.ops.redline.fp8_linear(torch.randn(2, 127), q, scales)


def test_gpus_without_fp8_are_refused_by_name():
    for target in ("sm80", "sm86", "gfx90a", "gfx942"):
        with simulated(target_caps(target)):
            assert "compute capability 8.9" in fp8_refusal("cuda")
    for target in ("sm89", "sm90"):
        with simulated(target_caps(target)):
            assert fp8_refusal("cuda") is None
    assert fp8_refusal("cpu") is None


def test_cublas_takes_per_channel_bf16_on_hopper_only():
    q, scales = fp8_weight(64, 128, False)
    _, blocks = fp8_weight(64, 128, True)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with simulated(target_caps("sm90")):
        assert fp8_gemm_backend(x, q, scales) == "scaled_mm"
        assert fp8_gemm_backend(x, q, blocks) == "triton"
        assert fp8_gemm_backend(x.half(), q, scales) == "triton"
    with simulated(target_caps("sm89")):
        assert fp8_gemm_backend(x, q, scales) == "triton"


def test_swap_and_compile_on_the_cpu():
    layer = Fp8Linear(128, 64)
    layer.weight, layer.scales = fp8_weight(64, 128, True)
    model = torch.nn.Sequential(layer)
    swap_linears(model)
    assert type(model[0]) is KernelFp8Linear
    x = torch.randn(3, 128)
    compiled = torch.compile(model, fullgraph=True)
    assert torch.equal(compiled(x), fp8_linear_reference(x, layer.weight, layer.scales))


def test_fused_linear_takes_fp8_weights_on_the_cpu():
    q, scales = fp8_weight(256, 128, True)
    x = torch.randn(1, 128)
    norm = torch.rand(128) + 0.5
    got = torch.ops.redline.fused_linear(x, q, scales, norm, 1e-5, None, True, None, -1, -1)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    gate, up = F.linear(normed, dequantize_fp8(q, scales)).chunk(2, dim=-1)
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def _gpu_with_fp8() -> bool:
    return torch.cuda.is_available() and fp8_refusal("cuda") is None


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300, 2048])
def test_gpu_paths_match_the_reference(block, dtype, rows):
    if not _gpu_with_fp8():
        pytest.skip("needs an NVIDIA GPU with FP8 (sm89+)")
    q, scales = fp8_weight(4096 + 32, 1024 + 16, block, "cuda")  # N, K past whole tiles and blocks
    x = torch.randn(rows, 1024 + 16, device="cuda", dtype=dtype)
    got = torch.ops.redline.fp8_linear(x, q, scales)
    want = fp8_linear_reference(x.cpu(), q.cpu(), scales.cpu())
    assert rel_err(got.cpu(), want) <= (GPU_TOLERANCE if rows == 1 else FP8_DOT_TOLERANCE)[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("conversion", [{"int8_mode": 2}, {"int8_mode": 1}, {"words": False}],
                         ids=["words-ptx", "words-int", "bytes"])
@pytest.mark.parametrize("block", [False, True], ids=["per-channel", "block"])
def test_gpu_gemv_conversions_match_the_reference(conversion, block):
    """The FP8 GEMV's three e4m3 conversions, on every byte value a quantized weight can hold (subnormals included)."""
    if not _gpu_with_fp8():
        pytest.skip("needs an NVIDIA GPU with FP8 (sm89+)")
    from redline.kernels import triton_linear

    q, scales = fp8_weight(4096 + 32, 1024 + 16, block, "cuda")
    every_code = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q[:, :256] = every_code[every_code.float().isfinite()].repeat(2)[:256].to("cuda")
    x = torch.randn(1, 1024 + 16, device="cuda", dtype=torch.float32)
    got = triton_linear.gemv(x, q, scales, pdl=False, **conversion)
    assert rel_err(got.cpu(), fp8_linear_reference(x.cpu(), q.cpu(), scales.cpu())) <= GPU_TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_quantized_rows_are_the_references_codes_and_scales(dtype):
    """The per-token quantizer gives torch's codes (as values: a tiny negative input may round to +0 where torch
    gives -0) and its scales bit for bit (a scale one ulp off flips codes at the e4m3 rounding ties, which bf16
    rows meet often: torch's own GPU ops, dividing by 448 as a product, differ from its CPU in 114 of 312,000)."""
    if not _gpu_with_fp8():
        pytest.skip("needs an NVIDIA GPU with FP8 (sm89+)")
    from redline.kernels import triton_fp8
    from redline.quantize import quantize_activations_fp8

    torch.manual_seed(0)
    x = torch.randn(300, 1040, device="cuda", dtype=dtype)
    codes, scales = triton_fp8.quantize_rows(x)
    want_codes, want_scales = quantize_activations_fp8(x.cpu())
    assert torch.equal(codes.cpu().float(), want_codes.float())
    assert torch.equal(scales.cpu(), want_scales.squeeze(1))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["scaled_mm", "triton"])
def test_gpu_backends_agree_on_llama_shapes(backend):
    if not _gpu_with_fp8():
        pytest.skip("needs an NVIDIA GPU with FP8 (sm89+)")
    from redline.kernels.linear import fp8_matmul

    q, scales = fp8_weight(14336, 4096, False, "cuda")
    x = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)
    if backend == "scaled_mm" and fp8_gemm_backend(x, q, scales) != "scaled_mm":
        pytest.skip("torch._scaled_mm's row-wise FP8 GEMM runs on Hopper here")
    got = fp8_matmul(x, q, scales, backend=backend)
    assert rel_err(got.cpu(), fp8_linear_reference(x.cpu(), q.cpu(), scales.cpu())) <= 1e-2


@pytest.mark.gpu
def test_gpu_fused_decode_runs_an_fp8_model(tiny_llm_checkpoint):
    if not _gpu_with_fp8():
        pytest.skip("needs an NVIDIA GPU with FP8 (sm89+)")
    from redline.generate import LLM

    path = tiny_llm_checkpoint[0]
    reference = LLM.load(path, device="cpu", quantize="fp8")
    fused = LLM.load(path, device="cuda", dtype=torch.float32, quantize="fp8", compile=False,
                     max_kv_tokens=GPU_TEST_KV_TOKENS)
    ids = [5, 9, 13, 17, 21, 25]
    assert fused.generate(ids, max_new_tokens=8, temperature=0).token_ids == \
        reference.generate(ids, max_new_tokens=8, temperature=0).token_ids
