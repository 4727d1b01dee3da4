"""Tests for kernels/cpu_linear.py and cpu_gemv.cpp: redline::int8_linear / int4_linear on the CPU and the C++ ops
(redline_cpu::*) against their references on every instruction-set path this CPU has (forced one at a time), one
row (decode) and many (prefill, the blocked product), odd sizes, on one thread and on the kernels' pool; within
test_quantize*.py's accuracy bounds; use_cpu_kernels; the demo model's native Q4_1 import against its float32
dequantization."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn.functional as F

from redline.kernels import cpu_linear, use_cpu_kernels
from redline.kernels.cpu_linear import CpuHalfLinear, CpuLinear, HalfHead
from redline.kernels.linear import CpuInt4Linear, CpuInt8Linear, int4_linear_reference, int8_linear_reference
from redline.model import ModelArgs, Transformer
from redline.quantize import Int4Linear, Int8Linear, dequantize_int4, quantize_, quantize_int4, quantize_int8

# Rows of x: one (decode), a partial and a full block of 4, and blocks plus a remainder (prefill).
ROWS = [1, 3, 4, 9, 37]
# The accuracy bounds of test_quantize.py (int8 per layer) and test_quantize_int4.py (int4 per group size).
MAX_LAYER_REL_ERROR = 0.01
INT4_BOUNDS = {32: 0.085, 64: 0.095, 128: 0.105, 256: 0.115}
# Relative error of the op against its reference: fp32 sums in another order, then one rounding to x's dtype.
OP_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# The int8 and int4 kernels' products on x's int16 codes per block of 32 inputs (half a step, 1/65534 of the block's
# largest |x|, per input): 2-6e-5 relative on random x and quantize.py's weights, within this bound. An int8 weight
# whose K is not a multiple of 32 keeps x in fp32 (OP_TOLERANCE).
X_CODES_TOLERANCE = 1e-4


def codes_tolerance(dtype: torch.dtype) -> float:
    return max(OP_TOLERANCE[dtype], X_CODES_TOLERANCE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nk", [(48, 64), (50, 72), (7, 13), (960, 576), (33, 4100)])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_cpu_matches_reference(rows, nk, dtype):
    n, k = nk
    torch.manual_seed(0)
    q, s = quantize_int8(torch.randn(n, k) * 0.02)
    x = torch.randn(rows, k).to(dtype)
    out = torch.ops.redline.int8_linear(x, q, s)
    assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
    bound = codes_tolerance(dtype) if k % 32 == 0 else OP_TOLERANCE[dtype]
    assert rel_err(out, int8_linear_reference(x, q, s).float()) <= bound
    exact = (x.double() @ q.double().T) * s.double()  # the formula in fp64
    assert rel_err(out, exact) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(48, 512, 32), (50, 576, 64), (7, 1024, 128), (960, 512, 256), (3, 32, 32),
                                         (5, 96, 32)])  # an odd count of groups
@pytest.mark.parametrize("rows", ROWS)
def test_int4_linear_cpu_matches_reference(rows, n, k, group, dtype):
    torch.manual_seed(1)
    w, sz = quantize_int4(torch.randn(n, k) * 0.02, group)
    x = torch.randn(2, rows, k).to(dtype)
    out = torch.ops.redline.int4_linear(x, w, sz)
    assert out.shape == (2, rows, n) and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, int4_linear_reference(x, w, sz).float()) <= codes_tolerance(dtype)
    exact = x.double() @ dequantize_int4(w, sz).double().T
    assert rel_err(out, exact) <= codes_tolerance(dtype)


def test_gemv_reads_the_layout_of_quantize_py():
    """One weight code at a time: each nibble, scale and offset lands on its own input and output."""
    n, k, group = 3, 64, 32
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[1, 5], codes[2, 40] = 15, 7  # an odd input (high nibble) and an even one (low nibble), two groups
    w = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sz = torch.zeros(n, k // group, 2, dtype=torch.float16)
    sz[..., 0] = torch.tensor([[1.0, 2.0], [0.5, 0.25], [4.0, 0.125]])
    sz[0, 1, 1] = 3.0  # an offset: every input of row 0's second group adds 3 * x
    x = torch.arange(1, k + 1, dtype=torch.float32)[None]  # x[i] = i + 1
    out = torch.ops.redline.int4_linear(x, w, sz)[0]
    # x's int16 codes per block of 32 inputs round each input by up to half a step (1/65534 of the block's largest
    # |x|), and the kernel multiplies them by the centred codes (q - 8): per output at most
    # sum over inputs of 8 |scale| max|x of the block| / 65534.
    scale = sz[..., 0].float().repeat_interleave(group, dim=1)  # (n, k)
    block_max = x.view(-1, 32).abs().amax(dim=1).repeat_interleave(32)  # (k,)
    bound = (8 * scale.abs() * block_max / 65534).sum(dim=1)
    want = torch.tensor([3.0 * sum(range(33, 65)), 0.5 * 15 * 6, 0.125 * 7 * 41])
    assert ((out - want).abs() <= bound).all(), (out, want, bound)


def test_cpu_paths_within_the_quantization_bounds():
    """The bounds test_quantize*.py sets for the quantized formats hold on the CPU kernels: int8 per layer within
    1% of the float product, int4 within each group size's bound."""
    torch.manual_seed(0)
    w = torch.randn(256, 1024) * 0.02
    x = torch.randn(16, 1024)
    ref = F.linear(x, w)
    for rows in (1, 16):
        q, s = quantize_int8(w)
        assert rel_err(torch.ops.redline.int8_linear(x[:rows], q, s), ref[:rows]) <= MAX_LAYER_REL_ERROR
        for group, bound in INT4_BOUNDS.items():
            packed, sz = quantize_int4(w, group)
            assert rel_err(torch.ops.redline.int4_linear(x[:rows], packed, sz), ref[:rows]) < bound


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_use_cpu_kernels_swaps_quantized_linears_and_keeps_the_model(mode):
    torch.manual_seed(0)
    reference = quantize_(Transformer(ModelArgs.from_name("debug-tiny")).eval(), mode, 32 if mode == "int4" else None)
    kind, plain = (CpuInt8Linear, Int8Linear) if mode == "int8" else (CpuInt4Linear, Int4Linear)
    model = copy.deepcopy(reference)
    weights = [m.weight for m in model.modules() if isinstance(m, plain)]
    use_cpu_kernels(use_cpu_kernels(model))  # twice: the second call changes nothing
    quantized = [m for m in model.modules() if isinstance(m, plain)]
    assert not model.args.tie_word_embeddings  # debug-tiny: an untied head, quantized with the blocks
    assert len(quantized) == 2 * 4 + 1 and all(type(m) is kind for m in quantized)
    assert all(m.weight is w for m, w in zip(quantized, weights))  # only the classes changed
    ids = torch.randint(0, model.args.vocab_size, (2, 24))
    with torch.no_grad():
        for m in (reference, model):
            m.setup_caches(2, 64)
        want = reference(ids, torch.arange(24))
        got = model(ids, torch.arange(24))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        step_want = reference(ids[:, :1], torch.tensor([24]))  # a decode step: the GEMV
        step_got = model(ids[:, :1], torch.tensor([24]))
        torch.testing.assert_close(step_got, step_want, rtol=1e-4, atol=1e-4)


def test_llm_on_the_cpu_runs_the_kernels_with_the_references_tokens(tiny_llm_checkpoint):
    from redline.generate import LLM

    path = tiny_llm_checkpoint[0]
    llm = LLM.load(path, device="cpu", quantize="int4-g32", compile=False)
    assert all(type(m) is CpuInt4Linear for m in llm.model.modules() if isinstance(m, Int4Linear))
    got = llm.generate("def f(x):", max_new_tokens=12, temperature=0, ignore_eos=True).token_ids
    reference = LLM.load(path, device="cpu", quantize="int4-g32", compile=False)
    for m in reference.model.modules():  # back to the plain PyTorch modules: the references
        if type(m) is CpuInt4Linear:
            m.__class__ = Int4Linear
    want = reference.generate("def f(x):", max_new_tokens=12, temperature=0, ignore_eos=True).token_ids
    assert got == want


def test_a_failed_build_is_a_one_line_error(tmp_path):
    """In a child process: a failed build leaves a process whose loaded ops the parent's tests still call."""
    import subprocess
    import sys

    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    script = (f"from pathlib import Path\nfrom redline.kernels import cpu_linear\n"
              f"cpu_linear.SOURCE = Path({str(broken)!r})\ncpu_linear.EXTENSION_NAME = 'redline_cpu_gemv_broken_test'\n"
              f"try:\n    cpu_linear.cpu_ops()\nexcept RuntimeError as exc:\n    print(repr(str(exc)))\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    message = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"could not build Redline's CPU int8/int4 kernel .*install a C\+\+ compiler", message), message
    assert "\\n" not in message


@pytest.mark.real_model
@pytest.mark.slow
def test_q4_1_import_greedy_text_equals_its_float32_dequantization(smollm2_checkpoint):
    """The demo model's native Q4_1 import (int4 g32 on the CPU GEMV) writes the float32 dequantization's text."""
    from redline.generate import LLM
    from redline.scripts.demo_model import demo_checkpoint

    native = LLM.load(demo_checkpoint(smollm2_checkpoint.parents[1], int4=True), device="cpu")
    float32 = LLM.load(smollm2_checkpoint, device="cpu")
    assert all(type(m) is CpuInt4Linear for m in native.model.modules() if isinstance(m, Int4Linear))
    for prompt in ("The capital of France is", "def fibonacci(n):", "Explain gravity to a child."):
        want = float32.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True)
        got = native.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.text == want.text, prompt


def test_exact_int8_head_form_and_op():
    torch.manual_seed(2)
    codes = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    codes[:, 0] = 127  # every group's largest code is 127, as GGUF's Q8_0 writes them
    codes[:, 32] = -127
    scales = (torch.rand(40, 2) * 0.01 + 1e-3).to(torch.float16)
    table = (codes.float().view(40, 2, 32) * scales.float().unsqueeze(-1)).view(40, 64)
    form = cpu_linear.exact_int8_groups(table)
    assert form is not None and torch.equal(form[0], codes) and torch.equal(form[1], scales)
    assert cpu_linear.exact_int8_groups(torch.randn(40, 64)) is None  # a trained float table has no exact form
    for rows in ROWS:
        x = torch.randn(rows, 64)
        out = torch.ops.redline.exact_head_linear(x, table, *form)
        assert rel_err(out, F.linear(x.double(), table.double())) <= X_CODES_TOLERANCE
    torch.library.opcheck(torch.ops.redline.exact_head_linear.default, (torch.randn(2, 64), table, *form))


def q6_k_table(n: int, k: int, seed: int) -> torch.Tensor:
    """An (n, k) fp32 table as GGUF's Q6_K dequantizes: d (fp16, per 256 inputs) * scale (int8, per 16) * (q - 32),
    q a 6-bit code."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 64, (n, k // 16, 16), generator=g).float() - 32
    sc = torch.randint(-128, 128, (n, k // 256, 16), generator=g).float().view(n, k // 16)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-5).half().float().repeat_interleave(16, dim=1)
    return (c * (d * sc).unsqueeze(-1)).view(n, k)


def test_exact_int8_form_of_a_q6_k_table():
    table = q6_k_table(300, 512, seed=5)
    table[7, :16] = 0  # an all-zero group: scale 0
    table[9, 16:32] = table[9, 16:32].sign() * table[9, 16:32].abs().amax()  # one code's magnitude throughout
    codes, scales = cpu_linear.exact_int8_groups16(table)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (300, 32)
    assert torch.equal((codes.float().view(300, 32, 16) * scales.unsqueeze(-1)).view(300, 512), table)
    assert codes.abs().max() <= cpu_linear.GROUP16_MAX_CODE and scales[7, 0] == 0
    x = torch.randn(3, 512)
    assert rel_err(torch.ops.redline.exact_head_linear(x, table, codes, scales), x.double() @ table.double().T) < 5e-6
    assert cpu_linear.exact_int8_groups16(torch.randn(300, 512)) is None  # a trained float table has no such form
    late = table.clone()
    late[250, 3] = torch.nextafter(late[250, 3], torch.tensor(1.0))  # one value off the form, past the probed rows
    assert cpu_linear.exact_int8_groups16(late) is None
    assert cpu_linear.exact_int8_groups16(table[:, :200]) is None  # K not a multiple of 16
    with pytest.raises(RuntimeError, match="a power of two, at least 16"):
        torch.ops.redline_cpu.int8_group_linear(x[:, :480], codes[:, :480].contiguous(), scales[:, :10].contiguous())


def test_a_quantized_models_q6_k_head_reads_its_int8_form():
    from redline.kernels.linear import ExactInt8Head

    args = ModelArgs.from_name("debug-tiny")
    args = type(args)(**{**args.__dict__, "tie_word_embeddings": True, "dim": 256})
    torch.manual_seed(0)
    model = Transformer(args).eval()
    model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        model.tok_embeddings.weight.copy_(q6_k_table(*model.tok_embeddings.weight.shape, seed=6) / 16)  # still exact
    reference = quantize_(model, "int4", 32)
    fast = use_cpu_kernels(copy.deepcopy(reference))
    assert type(fast.output) is ExactInt8Head and fast.output.group_scales.dtype == torch.float32
    assert fast.output.read_bytes() == args.vocab_size * args.dim * (1 + 4 / 16)
    ids = torch.randint(0, args.vocab_size, (1, 12))
    with torch.no_grad():
        for m in (reference, fast):
            m.setup_caches(1, 32)
        torch.testing.assert_close(fast(ids, torch.arange(12)), reference(ids, torch.arange(12)), rtol=1e-3, atol=1e-3)


def test_a_quantized_models_q8_0_head_reads_its_int8_form():
    from redline.runner import model_bytes_per_token
    from redline.kernels.linear import ExactInt8Head

    torch.manual_seed(0)
    args = ModelArgs.from_name("debug-tiny")
    args = type(args)(**{**args.__dict__, "tie_word_embeddings": True})
    model = Transformer(args).eval()
    model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():  # make the table a Q8_0 table, as in a GGUF import
        q = torch.randint(-127, 128, model.tok_embeddings.weight.shape)
        q[:, 0::32] = 127
        s = (torch.rand(q.shape[0], q.shape[1] // 32) * 0.01 + 1e-3).half().float()
        model.tok_embeddings.weight.copy_((q.float().view(q.shape[0], -1, 32) * s.unsqueeze(-1)).view(q.shape))
    reference = quantize_(model, "int4", 32)
    fast = use_cpu_kernels(copy.deepcopy(reference))
    assert type(fast.output) is ExactInt8Head and fast.output.weight is fast.tok_embeddings.weight
    assert set(fast.state_dict()) == set(reference.state_dict())  # the checkpoint's tensors are unchanged
    table_bytes = fast.tok_embeddings.weight.numel() * 4
    assert model_bytes_per_token(fast) == model_bytes_per_token(reference) - table_bytes + fast.output.read_bytes()
    ids = torch.randint(0, args.vocab_size, (1, 12))
    with torch.no_grad():
        for m in (reference, fast):
            m.setup_caches(1, 32)
        # The int4 layers read x as int16 codes (X_CODES_TOLERANCE): the logits agree to 1e-3.
        torch.testing.assert_close(fast(ids, torch.arange(12)), reference(ids, torch.arange(12)), rtol=1e-3, atol=1e-3)
        want = reference(ids[:, :1], torch.tensor([12]))
        torch.testing.assert_close(fast(ids[:, :1], torch.tensor([12])), want, rtol=1e-3, atol=1e-3)


# -- every instruction-set path, forced one at a time --------------------------------------------------------------


def simd_paths() -> list:
    """Every path of cpu_gemv.cpp as a parameter; those this CPU lacks are skipped (the AVX-512 one on an AVX2 CPU,
    NEON on x86: tests/test_kernels_cpu_neon.py runs it under emulation)."""
    have = cpu_linear.available_simd()
    return [pytest.param(name, marks=pytest.mark.skipif(name not in have, reason=f"this CPU lacks {name}"))
            for name in cpu_linear.SIMD_LEVELS]


@pytest.fixture(params=simd_paths())
def simd(request):
    with cpu_linear.forced_simd(request.param):
        assert cpu_linear.simd() == request.param
        yield request.param
    assert cpu_linear.simd() == cpu_linear.detected_simd()  # forcing is undone


@pytest.fixture(params=[1, 3])
def kernel_threads(request):
    """The kernels on one thread, then on their pool (the caller and 2 helpers), whatever the suite set before."""
    previous = torch.ops.redline_cpu.set_threads(request.param)
    try:
        yield request.param
    finally:
        torch.ops.redline_cpu.set_threads(previous)


def random_shapes(seed: int, count: int, multiple: int = 1) -> list[tuple[int, int, int]]:
    """(rows of x, N, K) triples of odd sizes; K a multiple of `multiple`."""
    g = torch.Generator().manual_seed(seed)
    return [(int(torch.randint(1, 41, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g)),
             multiple * int(torch.randint(1, 2048 // multiple, (1,), generator=g))) for _ in range(count)]


def test_every_simd_path_matches_the_references(simd, kernel_threads):
    """int8 (any K), grouped int8 (Q8_0) and int4 (groups of 32..256) and fp32 weights, random odd shapes and row
    counts, against the fp64 formulas; on one thread and on the pool (blocks claimed by several threads)."""
    torch.manual_seed(3)
    for m, n, k in random_shapes(0, 6):
        x = torch.randn(2, m, k)
        q, s = quantize_int8(torch.randn(n, k))
        bound = X_CODES_TOLERANCE if k % 32 == 0 else 5e-6
        assert rel_err(torch.ops.redline_cpu.int8_linear(x, q, s), (x.double() @ q.double().T) * s.double()) < bound
        w = torch.randn(n, k)
        assert rel_err(torch.ops.redline_cpu.float_linear(x, w), x.double() @ w.double().T) < 5e-6
    for group in (32, 64, 128, 256):
        for m, n, k in random_shapes(group, 2, multiple=group):
            x = torch.randn(m, k)
            packed, sz = quantize_int4(torch.randn(n, k), group)
            want = x.double() @ dequantize_int4(packed, sz).double().T
            assert rel_err(torch.ops.redline_cpu.int4_linear(x, packed, sz), want) < X_CODES_TOLERANCE, \
                (m, n, k, group)
    for m, n, k in random_shapes(7, 4, multiple=32):
        x = torch.randn(m, k)
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales = (torch.rand(n, k // 32) * 0.01).half()
        table = (codes.double().view(n, -1, 32) * scales.double().unsqueeze(-1)).view(n, k)
        assert rel_err(torch.ops.redline_cpu.int8_group_linear(x, codes, scales), x.double() @ table.T) < \
            X_CODES_TOLERANCE
    for group, dtype in ((16, torch.float32), (16, torch.float16), (64, torch.float32)):  # x in fp32 (Q6_K: 16, fp32)
        for m, n, k in random_shapes(group + 1, 3, multiple=group):
            x = torch.randn(m, k)
            codes = torch.randint(-32, 32, (n, k), dtype=torch.int8)
            scales = (torch.rand(n, k // group) * 0.01).to(dtype)
            table = (codes.double().view(n, -1, group) * scales.double().unsqueeze(-1)).view(n, k)
            assert rel_err(torch.ops.redline_cpu.int8_group_linear(x, codes, scales), x.double() @ table.T) < 5e-6, \
                (m, n, k, group, dtype)


def test_simd_paths_agree_with_each_other():
    """The same product on every path this CPU has: the same values to fp32 rounding (the sums' order per lane
    differs with the register width)."""
    torch.manual_seed(4)
    x = torch.randn(5, 1024)
    packed, sz = quantize_int4(torch.randn(300, 1024), 64)
    q, s = quantize_int8(torch.randn(300, 1024))
    codes = torch.randint(-127, 128, (300, 1024), dtype=torch.int8)
    group_scales = (torch.rand(300, 32) * 0.01).half()
    scales16 = torch.rand(300, 64) * 0.01  # fp32 scales of groups of 16 (a Q6_K table's form)
    have = cpu_linear.available_simd()
    outs = []
    for name in have:
        with cpu_linear.forced_simd(name):
            outs.append([torch.ops.redline_cpu.int4_linear(x, packed, sz), torch.ops.redline_cpu.int8_linear(x, q, s),
                         torch.ops.redline_cpu.int8_group_linear(x, codes, group_scales),
                         torch.ops.redline_cpu.int8_group_linear(x, codes, scales16)])
    for out in outs[1:]:
        for got, want in zip(out, outs[0]):
            assert rel_err(got, want) < 5e-6


def test_forcing_a_missing_or_unknown_simd_path_is_refused():
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        with cpu_linear.forced_simd("sse9"):
            pass
    missing = [name for name in cpu_linear.SIMD_LEVELS if name not in cpu_linear.available_simd()]
    assert missing  # no CPU is both x86 and ARM
    for name in missing:
        with pytest.raises(ValueError, match=f"this CPU lacks {name}"):
            with cpu_linear.forced_simd(name):
                pass
    assert "portable" in cpu_linear.available_simd() and cpu_linear.detected_simd() in cpu_linear.available_simd()
    assert cpu_linear.simd() == cpu_linear.detected_simd()


def test_the_ops_keep_x_dtype_and_leading_shape_and_trace_under_compile():
    torch.manual_seed(5)
    packed, sz = quantize_int4(torch.randn(24, 64), 32)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = torch.ops.redline_cpu.int4_linear(x, packed, sz)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    compiled = torch.compile(lambda t: torch.ops.redline_cpu.int4_linear(t, packed, sz) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x.float()), 2 * torch.ops.redline_cpu.int4_linear(x.float(), packed, sz))


def test_use_threads_sets_the_kernels_pool_and_one_torch_thread():
    before = (torch.get_num_threads(), torch.ops.redline_cpu.threads(), torch.ops.redline_cpu.set_threads(0))
    try:
        cpu_linear.use_threads(3)
        assert cpu_linear.kernel_threads() == 3 and torch.get_num_threads() == 1
    finally:
        torch.ops.redline_cpu.set_threads(before[2])
        torch.set_num_threads(before[0])


def test_a_float_models_linears_run_the_cpu_kernel():
    torch.manual_seed(6)
    model = Transformer(ModelArgs.from_name("debug-tiny")).eval()
    reference = copy.deepcopy(model)
    use_cpu_kernels(model)
    assert any(type(m) is CpuLinear for m in model.modules())
    ids = torch.randint(0, model.args.vocab_size, (1, 10))
    with torch.no_grad():
        for m in (reference, model):
            m.setup_caches(1, 32)
        torch.testing.assert_close(model(ids, torch.arange(10)), reference(ids, torch.arange(10)), rtol=1e-4,
                                   atol=1e-4)


# --- fp16 weights that hold a float model's values exactly ---


def test_fp16_weights_give_their_fp32_copys_bits(simd, kernel_threads):
    """float_linear on an fp16 weight: the same products and sums as on its fp32 copy, bit for bit, on every path,
    odd shapes (scalar tails included) and row counts; and the fp64 formula within fp32 rounding."""
    torch.manual_seed(8)
    for m, n, k in random_shapes(11, 8) + [(1, 7, 13), (2, 9, 7), (4, 3, 1)]:
        x = torch.randn(m, k)
        w16 = torch.randn(n, k).half()
        out = torch.ops.redline_cpu.float_linear(x, w16)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        assert torch.equal(out, torch.ops.redline_cpu.float_linear(x, w16.float())), (m, n, k)
        assert rel_err(out, x.double() @ w16.double().T) < 5e-6


def test_exact_half_takes_only_weights_fp16_holds():
    torch.manual_seed(9)
    w = torch.randn(300, 40).half().float()
    half = cpu_linear.exact_half(w)
    assert half is not None and half.dtype == torch.float16 and torch.equal(half.float(), w)
    for bad in (1.0001, 70000.0, float("nan")):  # off fp16's grid, beyond its largest value, not a number
        other = w.clone()
        other[123, 7] = bad
        assert cpu_linear.exact_half(other) is None
    assert cpu_linear.exact_half(w.to(torch.bfloat16)) is None  # only fp32 weights are candidates


def fp16_valued(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_a_float_model_with_fp16_values_reads_fp16_weights_and_gives_the_same_logits(tied, monkeypatch):
    """An fp32 model whose weights fp16 holds exactly (an F16 GGUF file's conversion): its linears keep the fp16 form
    only (CpuHalfLinear), a tied head reads an fp16 copy beside the embedding's fp32 table (HalfHead), a weight off
    fp16's grid stays fp32 (CpuLinear); the logits equal, bit for bit, those of the same model on fp32 weights."""
    import dataclasses

    from redline.kernels import linear as linear_module
    from redline.runner.runner import model_bytes_per_token

    torch.manual_seed(10)
    args = dataclasses.replace(ModelArgs.from_name("debug-tiny"), tie_word_embeddings=tied)
    model = fp16_valued(Transformer(args).eval())
    if tied:
        model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        model.layers[1].attention.wo.weight[0, 0] += 1e-6  # off fp16's grid: this one stays fp32
    reference = copy.deepcopy(model)
    fp32_bytes = model_bytes_per_token(model)
    use_cpu_kernels(model)
    monkeypatch.setattr(linear_module, "exact_half", lambda weight: None)
    use_cpu_kernels(reference)
    assert type(model.layers[1].attention.wo) is CpuLinear
    assert model.layers[1].attention.wo.weight.dtype == torch.float32
    halves = [m for m in model.modules() if type(m) is CpuHalfLinear]
    assert halves and all(m.weight.dtype == torch.float16 for m in halves)
    assert not any(type(m) is CpuHalfLinear for m in reference.modules())
    if tied:
        assert type(model.output) is HalfHead and model.output.weight is model.tok_embeddings.weight
        assert model.output.weight.dtype == torch.float32 and model.output.half_weight.dtype == torch.float16
    else:
        assert type(model.output) is CpuHalfLinear
    saved = sum(m.weight.numel() * 2 for m in halves) + (model.output.half_weight.numel() * 2 if tied else 0)
    assert model_bytes_per_token(model) == fp32_bytes - saved
    ids = torch.randint(0, args.vocab_size, (1, 10))
    with torch.no_grad():
        for m in (reference, model):
            m.setup_caches(1, 32)
        assert torch.equal(model(ids, torch.arange(10)), reference(ids, torch.arange(10)))


def test_a_mixtures_router_stays_fp32():
    torch.manual_seed(12)
    model = fp16_valued(Transformer(ModelArgs.from_name("debug-tiny-moe")).eval())
    use_cpu_kernels(model)
    routers = [m.gate for m in model.modules() if hasattr(m, "n_experts") and hasattr(m, "gate")]
    assert routers and all(r.weight.dtype == torch.float32 and type(r) is not CpuHalfLinear for r in routers)
    assert any(type(m) is CpuHalfLinear for m in model.modules())


# --- redline_cpu::decode_attention ---

# (B, H, Hkv, S, D, position, window): GQA, MHA, multi-query; odd head dims (scalar tails), a window, position 0,
# and a long cache (work spread over the kernels' threads).
ATTENTION_SHAPES = [(1, 9, 3, 256, 64, 70, 0), (2, 8, 2, 100, 36, 99, 0), (1, 4, 4, 50, 13, 40, 7),
                    (1, 4, 1, 20, 64, 0, 0), (3, 6, 3, 3000, 128, 2999, 0), (2, 4, 2, 64, 8, 30, 1)]


def test_decode_attention_reads_only_the_valid_keys_on_every_path(simd, kernel_threads):
    """Against attention.decode_attention_reference (the masked softmax over the whole cache, fp32): keys past the
    position and before a window hold NaN, which a read would carry into the output."""
    from redline.kernels.attention import decode_attention_reference

    torch.manual_seed(8)
    for b, h, hkv, s, d, pos, window in ATTENTION_SHAPES:
        q, k, v = torch.randn(b, h, 1, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
        lo = max(0, pos - window + 1) if window else 0
        for cache in (k, v):
            cache[:, :, pos + 1:] = float("nan")
            cache[:, :, :lo] = float("nan")
        position = torch.tensor([pos])
        got = torch.ops.redline_cpu.decode_attention(q, k, v, position, window)
        torch.testing.assert_close(got, decode_attention_reference(q, k, v, position, window), rtol=1e-5, atol=1e-6)


def test_decode_attention_refuses_bad_input_in_one_line():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 16, 8)
    for args, match in [((q, k, k, torch.tensor([16]), 0), "outside the cache's 16 positions"),
                        ((q.double(), k, k, torch.tensor([3]), 0), "fp32"),
                        ((torch.randn(1, 3, 1, 8), k, k, torch.tensor([3]), 0), "multiple of Hkv"),
                        ((q, k, k, torch.tensor([3]), -1), "window")]:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.redline_cpu.decode_attention(*args)


@pytest.mark.parametrize("name", ["debug-tiny", "debug-tiny-llama3"])
def test_a_cpu_models_decode_steps_attend_over_the_valid_keys_only(name):
    """use_cpu_kernels swaps attention.CpuAttention in: a prefill then one-token steps (redline_cpu::decode_attention
    over keys 0..position) give model.Attention's logits (SDPA over the masked whole cache)."""
    from redline.kernels.attention import CpuAttention

    torch.manual_seed(9)
    model = Transformer(ModelArgs.from_name(name)).eval()
    reference = copy.deepcopy(model)
    use_cpu_kernels(model)
    assert any(type(m) is CpuAttention for m in model.modules())
    ids = torch.randint(0, model.args.vocab_size, (1, 12))
    with torch.no_grad():
        for m in (reference, model):
            m.setup_caches(1, 64)
        for m in (reference, model):
            m(ids[:, :8], torch.arange(8), from_start=True)
        for t in range(8, 12):
            position = torch.tensor([t])
            torch.testing.assert_close(model(ids[:, t:t + 1], position), reference(ids[:, t:t + 1], position),
                                       rtol=1e-4, atol=1e-5)


def test_paged_decode_attention_reads_only_each_rows_pages_on_every_path(simd, kernel_threads):
    """Against model.paged_decode_attention (every row's pages gathered and masked, fp32): rows of different lengths
    over shuffled pages, a window, odd head dims; the pages no row names, and the slots past each row's length,
    hold NaN."""
    from redline.model import paged_decode_attention

    torch.manual_seed(10)
    for b, h, hkv, d, page, lengths, window in [(3, 8, 2, 64, 16, (1, 17, 40), 0), (2, 6, 3, 13, 4, (9, 30), 5),
                                                (1, 4, 4, 128, 16, (300,), 0)]:
        width = max(-(-n // page) for n in lengths)
        order = torch.randperm(b * width + 3)  # three pages nobody uses
        tables = order[:b * width].view(b, width).to(torch.int32)
        k = torch.full((b * width + 3, page, hkv, d), float("nan"))
        v = torch.full_like(k, float("nan"))
        for row, n in enumerate(lengths):
            for t in range(n):
                slot = (tables[row, t // page], t % page)
                k[slot], v[slot] = torch.randn(hkv, d), torch.randn(hkv, d)
        q, seq_lens = torch.randn(b, h, d), torch.tensor(lengths, dtype=torch.int32)
        got = torch.ops.redline_cpu.paged_decode_attention(q, k, v, tables, seq_lens, d ** -0.5, window)
        want = paged_decode_attention(q, k.nan_to_num(), v.nan_to_num(), tables, seq_lens, d ** -0.5, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_paged_decode_attention_refuses_tables_past_the_pool():
    q, k = torch.randn(1, 4, 8), torch.randn(4, 16, 2, 8)
    with pytest.raises(RuntimeError, match="names page 9 of 4"):
        torch.ops.redline_cpu.paged_decode_attention(q, k, k, torch.tensor([[9]], dtype=torch.int32),
                                                     torch.tensor([3], dtype=torch.int32), 0.35, 0)
    with pytest.raises(RuntimeError, match="has 17 keys; its table holds 16"):
        torch.ops.redline_cpu.paged_decode_attention(q, k, k, torch.tensor([[0]], dtype=torch.int32),
                                                     torch.tensor([17], dtype=torch.int32), 0.35, 0)
