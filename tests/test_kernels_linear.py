"""Tests for kernels/linear.py (custom ops, references, dispatch, the kernel modules) and kernels/triton_linear.py.

CPU tests check the ops' contract with plain PyTorch. GPU tests (marker `gpu`) check the Triton
GEMV against an fp32 reference by relative Frobenius error, on random data, for the Llama-2-7B and
Llama-3-8B shapes and odd ones, and inside CUDA graphs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from redline.kernels import linear as kl
from redline.kernels.configs import DotConfig, GemvConfig
from redline.kernels.cpu_linear import x_codes_error_bound
from redline.kernels.linear import PROMPT_SMALL_M, SMALL_M, int8_linear_reference, linear_reference

# (N, K) of the decode GEMVs that matter.
LLAMA2_7B = {"wqkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008),
             "lm_head": (32000, 4096)}
LLAMA3_8B = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336),
             "lm_head": (128256, 4096)}
ODD_SHAPES = [(50, 72), (7, 13), (1000, 1000), (33, 4100), (4097, 2056)]


def assert_within_codes_bound(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out within the int16 codes' bound of ref (x_codes_error_bound), plus the bound of K-term fp32 sums
    (K * eps * sum |x_i w_i|) and one rounding to out's dtype (two of its ulps of |ref|)."""
    sums = x.shape[-1] * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    slack = x_codes_error_bound(x, weight) + sums + 2 * torch.finfo(out.dtype).eps * ref.double().abs()
    assert ((out.double() - ref.double()).abs() <= slack).all(), ((out.double() - ref.double()).abs() / slack).max()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~= q * s."""
    s = w.float().abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


# ---------------------------------------------------------------- CPU


def test_ops_are_registered():
    assert hasattr(torch.ops.redline, "linear")
    assert hasattr(torch.ops.redline, "int8_linear")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead", [(), (1, 1), (2, 3), (5,)])
@pytest.mark.parametrize("nk", [(64, 128), (50, 72), (7, 13)])
def test_linear_cpu_matches_f_linear(dtype, lead, nk):
    n, k = nk
    x = torch.randn(*lead, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    out = torch.ops.redline.linear(x, w)
    assert out.shape == (*lead, n) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, linear_reference(x, w)) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(), (1, 1), (2, 3)])
@pytest.mark.parametrize("nk", [(64, 128), (50, 72)])
def test_int8_linear_cpu_matches_dequant_formula(dtype, scale_dtype, lead, nk):
    n, k = nk
    x = torch.randn(*lead, k, dtype=dtype)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = (torch.rand(n) * 0.02 + 0.001).to(scale_dtype)
    out = torch.ops.redline.int8_linear(x, q, s)
    assert out.shape == (*lead, n) and out.dtype == dtype and out.is_contiguous()
    # The CPU GEMV (cpu_gemv.cpp) works on x's int16 codes (K a multiple of 32) and sums in another order: within
    # the codes' stated bound and fp32 rounding of the formula in fp64 and of the reference, then rounded to x's dtype.
    dequantized = q.double() * s.double().unsqueeze(-1)
    assert_within_codes_bound(out, ((x.double() @ q.double().T) * s.double()).to(dtype), x, dequantized)
    assert_within_codes_bound(out, int8_linear_reference(x, q, s), x, dequantized)


def test_non_contiguous_x_cpu():
    x = torch.randn(8, 3, 64).transpose(0, 1)  # (3, 8, 64), not contiguous
    w = torch.randn(32, 64)
    assert not x.is_contiguous()
    torch.testing.assert_close(torch.ops.redline.linear(x, w), F.linear(x.contiguous(), w))
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    s = torch.rand(32)
    # The CPU kernel rounds x to int16 codes (at most x_codes_error_bound) and sums in its own order (blocks of
    # inputs across SIMD lanes, whose width depends on the CPU): apart by at most that plus the bound of K-term
    # float32 sums, K * eps * sum |x_i q_i| * s.
    out = torch.ops.redline.int8_linear(x, q, s)
    ref = int8_linear_reference(x.contiguous(), q, s)
    bound = 64 * torch.finfo(torch.float32).eps * (x.abs() @ q.float().abs().T) * s + \
        x_codes_error_bound(x, q.float() * s.unsqueeze(-1)).float()
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() / bound).max()
    assert ((out - ref).abs() <= bound / 4).float().mean() > 0.9  # most far within it


def test_gemv_supported_is_false_on_cpu():
    assert not kl.gemv_supported(torch.randn(1, 64))


def test_triton_row_limit_sends_float_prompts_to_cublas_sooner():
    assert PROMPT_SMALL_M < SMALL_M
    assert kl.triton_row_limit((64, 1, 4096), quantized=False) == SMALL_M  # a decode batch: 1 token each
    assert kl.triton_row_limit((200, 4096), quantized=False) == SMALL_M  # 2-D x: rows, no token axis
    assert kl.triton_row_limit((1, 128, 4096), quantized=False) == PROMPT_SMALL_M  # a prompt
    assert kl.triton_row_limit((2, 3, 4096), quantized=False) == PROMPT_SMALL_M
    assert kl.triton_row_limit((1, 128, 4096), quantized=True) == SMALL_M  # int8 keeps the kernel


def test_validation_errors():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="K=64"):
        torch.ops.redline.linear(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.redline.linear(x, torch.randn(64))
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.redline.linear(x, torch.randn(32, 64, dtype=torch.bfloat16))
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        torch.ops.redline.int8_linear(x, q.float(), torch.rand(32))
    with pytest.raises(ValueError, match=r"scales must have shape \(32,\)"):
        torch.ops.redline.int8_linear(x, q, torch.rand(31))
    with pytest.raises(ValueError, match=r"scales must have shape"):
        torch.ops.redline.int8_linear(x, q, torch.rand(32, 1))
    with pytest.raises(ValueError, match="K=64"):
        torch.ops.redline.int8_linear(x, q[:, :48], torch.rand(32))
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.redline.int8_linear(x, q[0], torch.rand(32))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        w = torch.empty(48, 64, dtype=torch.bfloat16)
        q = torch.empty(48, 64, dtype=torch.int8)
        s = torch.empty(48, dtype=torch.float32)
        y = torch.ops.redline.linear(x, w)
        z = torch.ops.redline.int8_linear(x, q, s)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert z.shape == (2, 3, 48) and z.dtype == torch.bfloat16


def test_opcheck_cpu():
    x = torch.randn(3, 64)
    w = torch.randn(48, 64)
    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    s = torch.rand(48)
    torch.library.opcheck(torch.ops.redline.linear.default, (x, w))
    torch.library.opcheck(torch.ops.redline.int8_linear.default, (x, q, s))


def test_torch_compile_fullgraph_cpu():
    w = torch.randn(48, 64)
    q = torch.randint(-127, 128, (32, 48), dtype=torch.int8)
    s = torch.rand(32)

    def f(x):
        return torch.ops.redline.int8_linear(torch.relu(torch.ops.redline.linear(x, w)), q, s)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 64)
    torch.testing.assert_close(compiled(x), f(x))


# ---------------------------------------------------------------- GPU


def _gpu_shapes():
    named = [(f"7b-{k}", v) for k, v in LLAMA2_7B.items()] + [(f"8b-{k}", v) for k, v in LLAMA3_8B.items()]
    named += [(f"odd-{n}x{k}", (n, k)) for n, k in ODD_SHAPES]
    seen, out = set(), []
    for name, shape in named:
        if shape not in seen:
            seen.add(shape)
            out.append(pytest.param(shape, id=name))
    return out


GPU_M = sorted({1, 2, 4, 8, 16, 17, 33, 64, 65, 200, SMALL_M, SMALL_M + 1})
_WEIGHTS: dict = {}


def _weights(n: int, k: int, dtype: torch.dtype):
    """Random (not zero) weights, cached per shape so big ones are made once."""
    key = (n, k, dtype)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 6:
            _WEIGHTS.clear()
        g = torch.Generator(device="cuda").manual_seed(n * 7919 + k)
        w = torch.randn(n, k, device="cuda", dtype=torch.float32, generator=g) / k**0.5
        q, s = quantize_rows(w)
        _WEIGHTS[key] = (w.to(dtype), q, s)
    return _WEIGHTS[key]


@pytest.fixture(autouse=False)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", GPU_M)
@pytest.mark.parametrize("shape", _gpu_shapes())
def test_gpu_gemv_matches_reference(shape, m, dtype, no_tf32):
    n, k = shape
    w, q, s = _weights(n, k, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert kl.gemv_supported(x) == (m <= SMALL_M)
    out = torch.ops.redline.linear(x, w)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    err = rel_err(out, linear_reference(x, w))
    assert err <= 1e-2, f"linear rel err {err:.2e}"
    out8 = torch.ops.redline.int8_linear(x, q, s)
    assert out8.shape == (m, n) and out8.dtype == dtype
    err8 = rel_err(out8, int8_linear_reference(x, q, s))
    assert err8 <= 1e-2, f"int8_linear rel err {err8:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [PROMPT_SMALL_M, PROMPT_SMALL_M + 1, SMALL_M])
def test_gpu_prompt_rows_route_by_weight_dtype(tokens, no_tf32):
    """A float prompt of more than PROMPT_SMALL_M tokens runs cuBLAS, an int8 one the Triton kernel: both correct."""
    n, k = 1000, 1000
    w, q, s = _weights(n, k, torch.bfloat16)
    x = torch.randn(1, tokens, k, device="cuda", dtype=torch.bfloat16)
    assert kl.gemv_supported(x) == (tokens <= PROMPT_SMALL_M)
    assert kl.gemv_supported(x, quantized=True)
    assert rel_err(torch.ops.redline.linear(x, w), linear_reference(x, w)) <= 1e-2
    assert rel_err(torch.ops.redline.int8_linear(x, q, s), int8_linear_reference(x, q, s)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (3,)])
def test_gpu_batch_shapes_and_non_contiguous(lead, no_tf32):
    n, k = 1000, 1000
    w, q, s = _weights(n, k, torch.bfloat16)
    x = torch.randn(*lead, 2 * k, device="cuda", dtype=torch.bfloat16)[..., ::2]  # stride 2 along K
    assert not x.is_contiguous()
    out = torch.ops.redline.linear(x, w)
    assert out.shape == (*lead, n) and out.is_contiguous()
    assert rel_err(out, linear_reference(x, w)) <= 1e-2
    out8 = torch.ops.redline.int8_linear(x, q, s.to(torch.bfloat16))
    assert rel_err(out8, int8_linear_reference(x, q, s.to(torch.bfloat16))) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_int8_fp32_x_and_prefill(x_dtype, m, no_tf32):
    n, k = 4096, 4096
    _, q, s = _weights(n, k, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=x_dtype)
    out = torch.ops.redline.int8_linear(x, q, s)
    assert out.dtype == x_dtype
    tol = 1e-5 if x_dtype == torch.float32 and m == 1 else 1e-2
    assert rel_err(out, int8_linear_reference(x, q, s)) <= tol


@pytest.mark.gpu
def test_gpu_int8_prefill_chunked(monkeypatch, no_tf32):
    monkeypatch.setattr(kl, "_DEQUANT_CHUNK_ELEMENTS", 1000 * 64)  # forces 16 row blocks
    _, q, s = _weights(1000, 1000, torch.bfloat16)
    x = torch.randn(2, 17, 1000, device="cuda", dtype=torch.bfloat16)
    assert rel_err(torch.ops.redline.int8_linear(x, q, s), int8_linear_reference(x, q, s)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("int8_mode", [1, 2])
@pytest.mark.parametrize("shape", [(4096, 11008), (50, 72), (7, 13)])
def test_gpu_gemv_variants_overwrite_poisoned_output(shape, int8_mode, pdl, no_tf32):
    from redline.kernels import triton_linear as tk

    from redline.kernels.device import device_caps

    if pdl and not device_caps().supports_pdl:
        pytest.skip("PDL needs NVIDIA sm_90+")
    n, k = shape
    w, q, s = _weights(n, k, torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tk.gemv(x, w, None, out, pdl=pdl)
    assert torch.isfinite(out).all()
    assert rel_err(out, linear_reference(x, w)) <= 1e-2
    out.fill_(float("nan"))
    tk.gemv(x, q, s, out, pdl=pdl, int8_mode=int8_mode)
    assert torch.isfinite(out).all()
    assert rel_err(out, int8_linear_reference(x, q, s)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(1, 2048, 4, 2, True), (2, 1024, 4, 2), (2, 1024, 2, 2, True), (4, 512, 2, 2, True),
                                 (8, 1024, 4, 2, True), (8, 512, 1, 2, True), (8, 512, 2, 2, True),
                                 (4, 1024, 4, 2, True), (2, 2048, 4, 1), (1, 4096, 8, 2), (2, 128, 4, 2)])
@pytest.mark.parametrize("shape", [(4096, 11008), (4096, 14336), (33, 4100), (50, 72)])
def test_gpu_gemv_configs(shape, cfg, no_tf32):
    """Every config the table may pick is correct, also when BLOCK_K does not divide K."""
    from redline.kernels import triton_linear as tk

    n, k = shape
    w, q, s = _weights(n, k, torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tk.gemv(x, w, None, out, config=GemvConfig(*cfg))
    assert rel_err(out, linear_reference(x, w)) <= 1e-2
    out.fill_(float("nan"))
    tk.gemv(x, q, s, out, config=GemvConfig(*cfg))
    assert rel_err(out, int8_linear_reference(x, q, s)) <= 1e-2


@pytest.mark.gpu
def test_gpu_kernel_bounds():
    from redline.kernels import triton_linear as tk

    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        tk.gemv(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 11008), (12288, 4096), (50, 72), (4097, 2056)])
def test_gpu_small_m_dot(shape, x_dtype, no_tf32):
    from redline.kernels import triton_linear as tk

    n, k = shape
    w32, q, s = _weights(n, k, torch.float32)
    w = w32.to(x_dtype)
    for m in (2, 5, 16, 17, 40, 64, 65, 200):  # x padded to 16, 32 and 64 rows; then several tiles of rows
        x = torch.randn(m, k, device="cuda", dtype=x_dtype)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=x_dtype)
        tk.small_m_dot(x, w, None, out)
        assert rel_err(out, linear_reference(x, w)) <= 1e-2
        out.fill_(float("nan"))
        tk.small_m_dot(x, q, s, out)
        assert rel_err(out, int8_linear_reference(x, q, s)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(32, 64, 4, 3, 16), (64, 128, 4, 4, 32), (128, 64, 4, 4, 64), (128, 64, 8, 4, 128)])
def test_gpu_small_m_dot_row_tiles(config, no_tf32):
    """Explicit rows per tile: every tile of rows, the partial last one included, is computed and stored."""
    from redline.kernels import triton_linear as tk

    n, k = 4097, 2056
    w32, q, s = _weights(n, k, torch.float32)
    w = w32.to(torch.bfloat16)
    for m in (1, 37, 129, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        tk.small_m_dot(x, w, None, out, config=DotConfig(*config))
        assert rel_err(out, linear_reference(x, w)) <= 1e-2, m
        out.fill_(float("nan"))
        tk.small_m_dot(x, q, s, out, config=DotConfig(*config))
        assert rel_err(out, int8_linear_reference(x, q, s)) <= 1e-2, m


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["linear", "int8_linear"])
def test_gpu_cuda_graph_replay(op, no_tf32):
    n, k = 4096, 4096
    w, q, s = _weights(n, k, torch.bfloat16)
    args = (w,) if op == "linear" else (q, s)
    fn = getattr(torch.ops.redline, op)
    ref = linear_reference if op == "linear" else int8_linear_reference
    static_x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(static_x, *args)  # compile + warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn(static_x, *args)
    for _ in range(3):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        static_x.copy_(x)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(static_y, ref(x, *args)) <= 1e-2


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead(no_tf32):
    n, k = 4096, 4096
    w, q, s = _weights(n, k, torch.bfloat16)
    w2 = _weights(1000, 4096, torch.bfloat16)[0]

    def f(x):
        h = torch.ops.redline.linear(x, w)  # (1, 1, 4096)
        y = torch.ops.redline.int8_linear(torch.nn.functional.silu(h), q, s)
        return torch.ops.redline.linear(y, w2)

    def ref(x):
        h = linear_reference(x, w)
        y = int8_linear_reference(torch.nn.functional.silu(h), q, s)
        return linear_reference(y, w2)

    torch._dynamo.reset()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    static_x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm-up and recording
        compiled(static_x)
    results = []
    for _ in range(3):
        x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
        static_x.copy_(x)
        out = compiled(static_x).clone()
        torch.cuda.synchronize()
        results.append(out)
        assert rel_err(out, ref(x)) <= 2e-2
    assert not torch.equal(results[0], results[1])


def test_use_kernels_swaps_linears_keeping_weights_shared_and_outputs_equal():
    from redline.kernels import KernelLinear, use_kernels
    from redline.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("debug-tiny")).eval()
    model.output.weight = model.tok_embeddings.weight  # a tied head must stay tied
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        model.setup_caches(1, 12)
        before = model(ids, torch.arange(12))
        assert use_kernels(model) is model
        assert sum(type(m) is KernelLinear for m in model.modules()) == 2 * 4 + 1
        model.setup_caches(1, 12)
        after = model(ids, torch.arange(12))
    assert isinstance(model.layers[1].feed_forward.w2, KernelLinear)
    assert model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(after, before)


def test_use_kernels_swaps_int8_linears_for_the_kernel_op():
    from redline.kernels import KernelInt8Linear, use_kernels
    from redline.model import ModelArgs, Transformer
    from redline.quantize import Int8Linear, quantize_

    torch.manual_seed(0)
    model = quantize_(Transformer(ModelArgs.from_name("debug-tiny")).eval(), "int8")
    use_kernels(use_kernels(model))  # twice: the second call changes nothing
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 2 * 4 + 1 and all(type(m) is KernelInt8Linear for m in int8)
    layer = int8[0]
    x = torch.randn(2, 3, layer.in_features)
    assert_within_codes_bound(layer(x), int8_linear_reference(x, layer.weight, layer.scales), x,
                              layer.weight.double() * layer.scales.double().unsqueeze(-1))


# ---------------------------------------------------------------- fused decode projections (redline.fused_linear)


def fused_inputs(n: int, k: int, dtype=torch.bfloat16, device="cpu", int8=False, norm=True, residual=False,
                 swiglu=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 1, k, generator=g) * 3).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    scales = None
    if int8:
        w, scales = quantize_rows(w)
        scales = scales.to(device)
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype).to(device) if norm else None
    out_n = n // 2 if swiglu else n
    r = torch.randn(1, 1, out_n, generator=g).to(dtype).to(device) if residual else None
    return x, w.to(device), scales, nw, r


def fused_fp32(x, w, scales, nw, eps, r, swiglu):
    """The fused product in fp32 with no intermediate rounding (what the GPU kernel approximates)."""
    xf = x.double()
    if nw is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * nw.double()
    y = xf @ w.double().T
    if scales is not None:
        y = y * scales.double()
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if r is None else y + r.double()


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("norm,residual,swiglu", [(True, False, False), (False, True, False), (True, False, True),
                                                  (False, False, False)])
def test_fused_linear_cpu_is_the_unfused_ops(int8, norm, residual, swiglu):
    """On the CPU the op runs the model's own ops in the model's order: bit-identical to composing them."""
    from redline.model import rms_norm

    x, w, s, nw, r = fused_inputs(24, 40, int8=int8, norm=norm, residual=residual, swiglu=swiglu)
    out = torch.ops.redline.fused_linear(x, w, s, nw, 1e-5, r, swiglu, None, -1, -1)
    h = rms_norm(x, nw, 1e-5) if norm else x
    y = torch.ops.redline.int8_linear(h, w, s) if int8 else F.linear(h, w)
    if swiglu:
        y = F.silu(y[..., :12]) * y[..., 12:]
    if residual:
        y = r + y
    assert out.shape == y.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, y, rtol=0, atol=0)
    assert rel_err(out, fused_fp32(x, w, s, nw, 1e-5, r, swiglu)) < 1e-2


@pytest.mark.parametrize("change,match", [
    (dict(nw=torch.ones(39, dtype=torch.bfloat16)), "norm_weight must be"),
    (dict(nw=torch.ones(40, dtype=torch.float64)), "norm_weight must be"),
    (dict(gelu=True), "needs swiglu=True"),
    (dict(r=torch.zeros(1, 1, 23, dtype=torch.bfloat16)), "residual must have shape"),
    (dict(swiglu=True, w=torch.zeros(23, 40, dtype=torch.bfloat16)), "even N"),
    (dict(w=torch.zeros(24, 41, dtype=torch.bfloat16)), "expects K=41"),
    (dict(sum_out=0), "pass sums"),
    (dict(sums=torch.zeros(4, 2), sum_out=4), "outside sums"),
    (dict(sums=torch.zeros(4, 2, dtype=torch.float64), sum_out=1), "lanes"),
    (dict(sums=torch.zeros(4, 3), sum_out=1), "power-of-two"),
    (dict(sums=torch.zeros(4), sum_out=1), "lanes"),
    (dict(sums=torch.zeros(4, 2), sum_in=1, nw=None), "needs norm_weight"),
])
def test_fused_linear_validation(change, match):
    x, w, s, nw, r = fused_inputs(24, 40, norm=True, residual=True)
    args = dict(x=x, w=w, s=s, nw=nw, eps=1e-5, r=r, swiglu=False)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.fused_linear(args["x"], args["w"], args["s"], args["nw"], args["eps"], args["r"],
                                       args["swiglu"], args.get("sums"), args.get("sum_in", -1), args.get("sum_out", -1),
                                       args.get("gelu", False))


@pytest.mark.parametrize("int8", [False, True])
def test_fused_linear_cpu_gemma_norm_and_geglu_are_the_unfused_ops(int8):
    """A float32 norm weight (Gemma's 1 + w) scales in fp32 and rounds once, as model.rms_norm(scale_fp32=True)
    does; gelu=True is GeGLU (gelu with the tanh approximation) on the gated pair."""
    from redline.model import rms_norm

    x, w, s, _, _ = fused_inputs(24, 40, int8=int8, swiglu=True)
    offset_w = (torch.rand(40) * 0.5 - 0.25).to(x.dtype)  # Gemma's stored weight; the norm scales by 1 + w
    out = torch.ops.redline.fused_linear(x, w, s, offset_w.float() + 1, 1e-6, None, True, None, -1, -1, True)
    h = rms_norm(x, offset_w, 1e-6, offset=1.0, scale_fp32=True)
    y = torch.ops.redline.int8_linear(h, w, s) if int8 else F.linear(h, w)
    y = F.gelu(y[..., :12], approximate="tanh") * y[..., 12:]
    torch.testing.assert_close(out, y, rtol=0, atol=0)
    silu = torch.ops.redline.fused_linear(x, w, s, offset_w.float() + 1, 1e-6, None, True, None, -1, -1)
    assert not torch.allclose(out, silu)


def test_fused_linear_opcheck_and_fake_shapes_cpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for int8, swiglu, residual in [(False, False, True), (True, True, False)]:
        x, w, s, nw, r = fused_inputs(24, 40, int8=int8, residual=residual, swiglu=swiglu)
        sums = torch.zeros(3, 4)
        torch.library.opcheck(torch.ops.redline.fused_linear.default, (x, w, s, nw, 1e-5, r, swiglu, sums, 0, 2))
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = torch.ops.redline.fused_linear(x, w, s, nw, 1e-5, r, swiglu, None, -1, -1)
        assert out.shape == (1, 1, 12 if swiglu else 24)


GPU_FUSED_SHAPES = {  # (N of w, K): the fused decode calls of Llama-2-7B and Llama-3-8B, and odd ones
    "7b wqkv+norm": (12288, 4096, "norm"), "7b wo+res": (4096, 4096, "res"), "7b w13+norm+swiglu": (22016, 4096, "swiglu"),
    "7b w2+res": (4096, 11008, "res"), "7b head+norm": (32000, 4096, "norm"), "8b wqkv+norm": (6144, 4096, "norm"),
    "8b w13+norm+swiglu": (28672, 4096, "swiglu"), "8b w2+res": (4096, 14336, "res"),
    "odd swiglu": (50, 72, "swiglu"), "odd norm": (33, 4100, "norm"), "odd res": (1000, 1000, "res"),
    "odd swiglu 2": (2, 13, "swiglu"),  # one output: compared with the fp32 product only
}


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("name", sorted(GPU_FUSED_SHAPES))
def test_gpu_fused_linear_matches_reference(name, int8, no_tf32):
    """The one-kernel fused GEMV against the fp32 product (bf16 output rounding) and against the unfused ops."""
    n, k, kind = GPU_FUSED_SHAPES[name]
    norm, residual, swiglu = kind in ("norm", "swiglu"), kind == "res", kind == "swiglu"
    x, w, s, nw, r = fused_inputs(n, k, device="cuda", int8=int8, norm=norm, residual=residual, swiglu=swiglu)
    sums = torch.zeros(3, 32, device="cuda")
    if norm:  # the sum of x**2 handed in by "the kernel before" gives the same norm as summing in the kernel
        sums[0] = x.float().pow(2).sum() / 32
    out = torch.ops.redline.fused_linear(x, w, s, nw, 1e-5, r, swiglu, sums, 0 if norm else -1, 2)
    assert out.shape == (1, 1, n // 2 if swiglu else n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(sums[2].sum(), out.float().pow(2).sum(), rtol=1e-4, atol=0)
    same = torch.ops.redline.fused_linear(x, w, s, nw, 1e-5, r, swiglu, None, -1, -1)
    assert rel_err(same, out) < 4e-3
    assert torch.isfinite(out).all()
    assert rel_err(out, fused_fp32(x, w, s, nw, 1e-5, r, swiglu)) < 8e-3
    if out.numel() >= 64:  # a few outputs may sit one bf16 step apart (the normalized input is not rounded)
        unfused = kl.fused_linear_reference(x, w, s, nw, 1e-5, r, swiglu)
        assert rel_err(out, unfused) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_gpu_fused_linear_gemma_norm_and_geglu(int8, no_tf32):
    """Gemma-3-12B's gate/up GEMV: its fp32 1 + w norm weight and GeGLU in the kernel, against the unfused ops."""
    x, w, s, _, _ = fused_inputs(2 * 15360, 3840, device="cuda", int8=int8, swiglu=True)
    nw = (torch.rand(3840, device="cuda") * 0.5 - 0.25).bfloat16().float() + 1
    out = torch.ops.redline.fused_linear(x, w, s, nw, 1e-6, None, True, None, -1, -1, True)
    assert rel_err(out, kl.fused_linear_reference(x, w, s, nw, 1e-6, None, True, gelu=True)) < 8e-3
    assert rel_err(out, kl.fused_linear_reference(x, w, s, nw, 1e-6, None, True)) > 5e-2  # not SwiGLU


@pytest.mark.gpu
def test_gpu_fused_linear_configs_and_no_pdl(no_tf32):
    from redline.kernels import triton_linear as tk

    x, w, s, nw, r = fused_inputs(4098, 4096, device="cuda", swiglu=True)
    ref = fused_fp32(x, w, s, nw, 1e-6, None, True)
    for cfg in (GemvConfig(2, 256, 2, 1), GemvConfig(4, 1024, 4, 2, True), GemvConfig(8, 512, 4, 2)):
        for pdl in (False, True):
            out = tk.gemv(x.view(1, -1), w, norm_weight=nw, eps=1e-6, swiglu=True, config=cfg, pdl=pdl)
            assert rel_err(out, ref.view(1, -1)) < 8e-3, (cfg, pdl)
    with pytest.raises(ValueError, match="even block_n"):
        tk.gemv(x.view(1, -1), w, norm_weight=nw, eps=1e-6, swiglu=True, config=GemvConfig(1, 256, 2, 1))


def test_fused_linear_cpu_accumulates_the_sum_of_squares():
    x, w, s, nw, r = fused_inputs(24, 40, norm=True, residual=True)
    sums = torch.tensor([[0.0, 0.0], [5.0, 1.0]])
    out = torch.ops.redline.fused_linear(x, w, s, nw, 1e-5, r, False, sums, -1, 1)
    assert sums[0].tolist() == [0.0, 0.0]
    torch.testing.assert_close(sums[1].sum(), torch.tensor(6.0 + out.float().pow(2).sum().item()))


@pytest.mark.gpu
def test_no_fitting_tensor_core_config_takes_blas_and_matches_the_reference(monkeypatch):
    from dataclasses import replace

    from redline.kernels import triton_linear
    from redline.kernels.device import device_caps, simulated

    launched = []
    real = triton_linear.small_m_dot
    monkeypatch.setattr(triton_linear, "small_m_dot", lambda *a, **k: launched.append(1) or real(*a, **k))
    torch.manual_seed(0)
    x = torch.randn(8, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.float16) / 512 ** 0.5
    wq = torch.randint(-127, 128, (1024, 512), device="cuda", dtype=torch.int8)
    scales = torch.rand(1024, device="cuda", dtype=torch.float16) / 100
    # a GPU whose shared memory holds no tensor-core config: the ops must not launch the kernel
    with simulated(replace(device_caps(), shared_memory_per_block=1024)):
        y = torch.ops.redline.linear(x, w)
        yq = torch.ops.redline.int8_linear(x, wq, scales)
    assert not launched
    torch.testing.assert_close(y, linear_reference(x, w), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(yq, int8_linear_reference(x, wq, scales), rtol=1e-2, atol=1e-2)
    torch.ops.redline.linear(x, w)  # the real limit: the kernel runs
    assert launched
