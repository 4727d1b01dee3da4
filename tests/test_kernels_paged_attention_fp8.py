"""kernels/paged_attention.py over an e4m3 (fp8) KV cache: the references against attention over the dequantized
pages and within e4m3's bound of the true keys, validation and compile, the Triton kernels' KV_FP8 variants in
Triton's interpreter (a child process, as tests/test_kernels_paged_attention.py runs its own), and on a GPU."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from redline import model as model_py
from redline.kernels import configs
from redline.kernels import paged_attention as pa
from redline.model import FP8_KV_DTYPE, quantized_kv

from conftest import interpreted_errors_of
from test_kernels_paged_attention import (GPU_TOLERANCE, LAYOUTS, PagedBatch, dense_decode, dense_prefill, paged_batch,
                                          prefill_inputs, qkv_batch, rel_err, unfused_decode_qkv)

ROOT = Path(__file__).resolve().parents[1]

# --- the references, the bound against the unquantized keys ---

E4M3_HALF_STEP = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: a normal value is rounded by at most 2^-4 of itself
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # below 2^-6 (subnormal) the step is 2^-9 of the scale


def fp8_pools(k_cache, v_cache, margin=2.0):
    """The pools as e4m3 codes with one scale per KV head, the largest |value| (NaN garbage aside) times margin
    mapped to 448, as the engine calibrates them: (k codes, v codes, k_scale (Hkv,), v_scale (Hkv,))."""
    ks, vs = (pool.float().nan_to_num().abs().amax(dim=(0, 1, 3)) * margin / 448 for pool in (k_cache, v_cache))
    return quantized_kv(k_cache, ks), quantized_kv(v_cache, vs), ks, vs


def dequantized(codes, scale):
    return codes.float() * scale[:, None]


def fp8_output_bound(q, k, v, k_deq, v_deq, scale):
    """A bound (H,) on |attention over the e4m3 keys - over the true ones| of each query head q (H, D) over keys and
    values k, v (Hkv, L, D) stored as k_deq, v_deq. A key's error moves the head's scores by at most
    m = scale max_j |q . dk_j|, so each probability by a factor within e^(+-2m) and the weights by at most e^(2m) - 1
    in all; the values' own error adds max |dv|: |d out| <= (e^(2m) - 1) max |v'| + max |dv|. Every stored element is
    checked to be within its e4m3 half step first (2^-4 of itself, or 2^-10 of the scale below 2^-6)."""
    group = q.shape[0] // k.shape[0]
    dk, dv = (k_deq - k).repeat_interleave(group, 0), (v_deq - v).repeat_interleave(group, 0)  # (H, L, D)
    m = scale * torch.einsum("hd,hld->hl", q.float(), dk).abs().amax(dim=1)  # (H,)
    v_max = v_deq.repeat_interleave(group, 0).abs().flatten(1).amax(dim=1)
    return torch.expm1(2 * m) * v_max + dv.abs().flatten(1).amax(dim=1)


def assert_within_half_steps(true, deq, scale):
    """Every dequantized element (..., Hkv, D) of true is within e4m3's rounding of it."""
    step = torch.maximum(E4M3_HALF_STEP * true.abs(), E4M3_SUBNORMAL_HALF_STEP * scale[:, None])
    assert ((deq - true).abs() <= step * (1 + 1e-6)).all()


def fp8_decode_case(lengths=(0, 1, 37, 150, 8), n_heads=4, n_kv_heads=2, head_dim=64, page_size=8, seed=0):
    """(q fp32, the fp32 batch, its e4m3 pools and scales) for the decode comparisons."""
    batch = paged_batch(list(lengths), n_kv_heads, head_dim, page_size, seed=seed)
    q = torch.randn(len(lengths), n_heads, head_dim, generator=torch.Generator().manual_seed(seed + 7))
    return q, batch, fp8_pools(batch.k_cache, batch.v_cache)


def fp8_decode_bound_ratio(got, q, batch, ks, vs, scale):
    """The largest |got - dense fp32 attention over the true keys| over fp8_output_bound, per head of every row."""
    want = dense_decode(q, batch, scale)  # (B, H, D)
    worst = 0.0
    for b, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        if k.shape[1] == 0:
            continue
        k_deq, v_deq = dequantized(quantized_kv(k.transpose(0, 1), ks), ks), dequantized(quantized_kv(
            v.transpose(0, 1), vs), vs)  # (L, Hkv, D) each
        assert_within_half_steps(k.transpose(0, 1), k_deq, ks)
        assert_within_half_steps(v.transpose(0, 1), v_deq, vs)
        bound = fp8_output_bound(q[b], k, v, k_deq.transpose(0, 1), v_deq.transpose(0, 1), scale)  # (H,)
        err = (got[b].float() - want[b]).abs().amax(dim=1)  # (H,)
        worst = max(worst, (err / bound).max().item())
    return worst


def test_fp8_cache_references_are_attention_over_the_dequantized_cache():
    q, batch, (k8, v8, ks, vs) = fp8_decode_case()
    tables, lens = batch.block_tables, batch.seq_lens
    k_deq, v_deq = dequantized(k8, ks), dequantized(v8, vs)
    want = pa.paged_decode_attention_reference(q, k_deq, v_deq, tables, lens, 0.125)
    for got in (pa.paged_decode_attention_reference(q, k8, v8, tables, lens, 0.125, 0, ks, vs),
                torch.ops.redline.paged_decode_attention(q, k8, v8, tables, lens, 0.125, 0, ks, vs)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # model.py's references (the engine's on the CPU) read zeroed pools and rows with keys, as the engine gives them.
    k8, v8, ks, vs = fp8_pools(batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num())
    rows, tables = slice(1, None), tables.clamp(min=0)
    want = pa.paged_decode_attention_reference(q[rows], dequantized(k8, ks), dequantized(v8, vs), tables[rows],
                                               lens[rows], 0.125)
    got = model_py.paged_decode_attention(q[rows], k8, v8, tables[rows], lens[rows], 0.125, 0, 0.0, ks, vs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    lengths, q_lens = [40, 9, 70], [40, 3, 21]
    batch = paged_batch(lengths, 2, 64, 8)
    k8, v8, ks, vs = fp8_pools(batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num())
    qp, cu = prefill_inputs(lengths, q_lens, 8, batch)
    tables = batch.block_tables.clamp(min=0)  # model.py's reference gathers whole table rows
    want = pa.paged_prefill_attention_reference(qp, dequantized(k8, ks), dequantized(v8, vs), tables, cu,
                                                batch.seq_lens, 0.125)
    for got in (pa.paged_prefill_attention_reference(qp, k8, v8, tables, cu, batch.seq_lens, 0.125, 0, ks, vs),
                torch.ops.redline.paged_prefill_attention(qp, k8, v8, tables, cu, batch.seq_lens, 0.125, 0, ks, vs),
                model_py.paged_prefill_attention(qp, k8, v8, tables, cu, batch.seq_lens, 0.125, k_scale=ks,
                                                 v_scale=vs)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_fp8_cache_reference_is_within_the_e4m3_bound_of_the_true_keys():
    """Against fp32 attention over the unquantized keys and values: within fp8_output_bound, which follows from
    e4m3's half step of 2^-4 (each stored element is checked against it), and in practice well inside it."""
    q, batch, (k8, v8, ks, vs) = fp8_decode_case()
    got = pa.paged_decode_attention_reference(q, k8, v8, batch.block_tables, batch.seq_lens, 0.125, 0, ks, vs)
    ratio = fp8_decode_bound_ratio(got, q, batch, ks, vs, 0.125)
    assert 0 < ratio <= 1
    assert rel_err(got, dense_decode(q, batch, 0.125)) < 2 * E4M3_HALF_STEP  # 3.4% of the largest output here


def test_quantized_kv_clamps_to_the_finite_range():
    x = torch.tensor([[[1e9, -1e9, 447.0, 0.3, 0.0]]])  # (1, Hkv=1, 5)
    codes = quantized_kv(x, torch.ones(1))
    assert codes.dtype == FP8_KV_DTYPE
    assert codes.float().tolist() == [[[448.0, -448.0, 448.0, 0.3125, 0.0]]]


def test_fp8_cache_validation_errors():
    q, batch, (k8, v8, ks, vs) = fp8_decode_case(lengths=(10, 20), head_dim=16)
    args = (q, k8, v8, batch.block_tables, batch.seq_lens, 0.25, 0)
    with pytest.raises(ValueError, match="pass k_scale and v_scale with float8_e4m3fn caches") as info:
        torch.ops.redline.paged_decode_attention(*args)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="k_scale and v_scale must be fp32 \\(2,\\)"):
        torch.ops.redline.paged_decode_attention(*args, ks[:1], vs[:1])
    with pytest.raises(ValueError, match="only with them"):
        torch.ops.redline.paged_decode_attention(q, batch.k_cache, batch.v_cache, *args[3:], ks, vs)


def test_fp8_cache_ops_under_torch_compile_fullgraph_cpu():
    q, batch, (k8, v8, ks, vs) = fp8_decode_case(lengths=(10, 33), head_dim=16)
    qkv_b, qkv, rope, _ = qkv_batch([10, 33], 4, 2, 16, 8)
    k8q, v8q, _, _ = fp8_pools(qkv_b.k_cache, qkv_b.v_cache)

    @torch.compile(fullgraph=True, backend="eager")
    def step(q, k, v, tables, lens, ks, vs, qkv, kq, vq, rope, qtables):
        out = torch.ops.redline.paged_decode_attention(q * 2, k, v, tables, lens, 0.25, 0, ks, vs) + 1
        return out, torch.ops.redline.paged_decode_attention_qkv(qkv, kq, vq, rope, qtables, lens, 0.25, 0, None,
                                                                 None, 0.0, ks, vs)

    pools = (k8q.clone(), v8q.clone())
    got, got_qkv = step(q, k8, v8, batch.block_tables, batch.seq_lens, ks, vs, qkv, *pools, rope,
                        qkv_b.block_tables)
    want = pa.paged_decode_attention_reference(q * 2, k8, v8, batch.block_tables, batch.seq_lens, 0.25, 0, ks,
                                               vs) + 1
    want_pools = (k8q.clone(), v8q.clone())
    want_qkv = pa.paged_decode_attention_qkv_reference(qkv, *want_pools, rope, qkv_b.block_tables, batch.seq_lens,
                                                       0.25, 0, None, None, 0.0, ks, vs)
    assert torch.equal(got, want) and torch.equal(got_qkv, want_qkv)
    assert all(torch.equal(p.view(torch.uint8), w.view(torch.uint8)) for p, w in zip(pools, want_pools))


def fp8_qkv_case(n_heads=4, n_kv_heads=2, head_dim=64, page_size=8, dtype=torch.float32, device="cpu"):
    """A qkv_batch over e4m3 pages whose new keys and values reach 20 x 448 times their power-of-two scales (the
    larger ones clamped), and whose rope turns nothing: the pages written by the kernel and by the reference must be
    equal byte for byte, which a rope rounded differently (Triton's and torch's arithmetic) could otherwise break
    in a rare last bit. Returns (batch, qkv, rope, k codes, v codes, k_scale, v_scale)."""
    lengths = [0, 1, 37, 150, 8, 9]
    batch, qkv, rope, _ = qkv_batch(lengths, n_heads, n_kv_heads, head_dim, page_size, None, dtype, device)
    ks = torch.full((n_kv_heads,), 2.0 ** -4, device=device)
    vs = torch.full((n_kv_heads,), 2.0 ** -3, device=device)
    new = torch.randn(len(lengths), 2 * n_kv_heads * head_dim, generator=torch.Generator().manual_seed(3)) * 60
    new[:, ::17] *= 20  # past 448: clamped
    scales = torch.cat([ks.cpu().repeat_interleave(head_dim), vs.cpu().repeat_interleave(head_dim)])
    qkv = qkv.clone()
    qkv[:, n_heads * head_dim:] = (new * scales).to(dtype).to(device)
    rope = torch.stack([torch.ones_like(rope[:, 0]), torch.zeros_like(rope[:, 1])], dim=1)  # cos 1, sin 0
    k8 = quantized_kv(batch.k_cache.nan_to_num(), ks)
    v8 = quantized_kv(batch.v_cache.nan_to_num(), vs)
    return batch, qkv, rope, k8, v8, ks, vs


def test_fp8_qkv_reference_writes_the_codes_and_attends_like_the_unfused_steps():
    batch, qkv, rope, k8, v8, ks, vs = fp8_qkv_case()
    pools = (k8.clone(), v8.clone())
    got = torch.ops.redline.paged_decode_attention_qkv(qkv, *pools, rope, batch.block_tables, batch.seq_lens, 0.125,
                                                       0, None, None, 0.0, ks, vs)
    # The unfused steps over the dequantized pools, with the new keys and values as their e4m3 codes would give them
    # back (the rope turns nothing): the same pages and the same attention.
    rounded = qkv.clone()
    keys, values = rounded[:, 4 * 64:6 * 64], rounded[:, 6 * 64:]  # (B, Hkv D) each
    keys.copy_(dequantized(quantized_kv(keys.view(-1, 2, 64), ks), ks).flatten(1))
    values.copy_(dequantized(quantized_kv(values.view(-1, 2, 64), vs), vs).flatten(1))
    deq = PagedBatch(dequantized(k8, ks), dequantized(v8, vs), batch.block_tables, batch.seq_lens, batch.dense_k,
                     batch.dense_v)
    want, want_k, want_v = unfused_decode_qkv(rounded, rope, deq, 4, 0.125)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dequantized(pools[0], ks), want_k, atol=0, rtol=0)
    torch.testing.assert_close(dequantized(pools[1], vs), want_v, atol=0, rtol=0)


# --- the Triton kernels in the interpreter ---

# (op, bound, dtype): each kernel against its reference over the same codes (fp32 and fp16 queries), and (bound)
# against fp32 attention over the true keys in units of fp8_output_bound (fp32 queries): at most 1. The
# interpreter's tl.dot is wrong for bf16.
INTERPRETER_CASES = [(op, False, d) for op in ("decode", "prefill", "qkv") for d in ("float32", "float16")]
INTERPRETER_CASES += [(op, True, "float32") for op in ("decode", "prefill")]
INTERPRETER_TOLERANCE = {"float32": 1e-4, "float16": 2e-3}


def case_name(op: str, bound: bool, dtype: str) -> str:
    return f"{op}_{'fp8bound' if bound else 'fp8'}/{dtype}"


def run_interpreted_case(op: str, bound: bool, dtype_name: str) -> float:
    """One case's error (run under TRITON_INTERPRET=1), from the same seed as every case."""
    torch.manual_seed(0)
    return run_interpreted_fp8_case(op, bound, getattr(torch, dtype_name))


def run_interpreted_fp8_case(op: str, bound: bool, dtype: torch.dtype) -> float:
    """An e4m3-cache kernel case: its relative error against the reference over the same codes, or (bound) its
    error against fp32 attention over the true keys over fp8_output_bound."""
    from redline.kernels import triton_paged_attention as tpa

    if op == "qkv":  # its output and both pools after its writes, byte for byte (fp8_qkv_case)
        batch, qkv, rope, k8, v8, ks, vs = fp8_qkv_case(dtype=dtype)
        pools, want_pools = [k8.clone(), v8.clone()], [k8.clone(), v8.clone()]
        cfg = configs.AttentionConfig(num_splits=5, block_s=16, num_warps=4, num_stages=1)
        extra = (None, None, 0.0, ks, vs)
        got = tpa.paged_decode_attention_qkv(qkv, *pools, rope, batch.block_tables, batch.seq_lens, 0.125, cfg, 0,
                                             *extra)
        want = pa.paged_decode_attention_qkv_reference(qkv, *want_pools, rope, batch.block_tables, batch.seq_lens,
                                                       0.125, 0, *extra)
        same = all(torch.equal(p.view(torch.uint8), w.view(torch.uint8)) for p, w in zip(pools, want_pools))
        return rel_err(got, want) if same else float("inf")
    if op == "decode":
        q, batch, (k8, v8, ks, vs) = fp8_decode_case()
        cfg = configs.AttentionConfig(num_splits=5, block_s=16, num_warps=4, num_stages=1)
        args = (q.to(dtype), k8, v8, batch.block_tables, batch.seq_lens, 0.125)
        got = tpa.paged_decode_attention(*args, config=cfg, window=0, k_scale=ks, v_scale=vs)
        if bound:
            return fp8_decode_bound_ratio(got, q, batch, ks, vs, 0.125)
        return rel_err(got, pa.paged_decode_attention_reference(*args, 0, ks, vs))
    lengths, q_lens = [40, 9, 70], [40, 3, 21]
    batch = paged_batch(lengths, 2, 64, 8)
    k8, v8, ks, vs = fp8_pools(batch.k_cache, batch.v_cache)
    q, cu = prefill_inputs(lengths, q_lens, 8, batch, dtype=dtype)
    args = (q, k8, v8, batch.block_tables, cu, batch.seq_lens, 0.125)
    got = tpa.paged_prefill_attention(*args, config=configs.PagedPrefillConfig(16, 16, 4, 1), k_scale=ks,
                                      v_scale=vs)
    if not bound:
        return rel_err(got, pa.paged_prefill_attention_reference(*args, 0, ks, vs))
    return fp8_prefill_bound_ratio(got, q, cu, batch, ks, vs, 0.125)


def fp8_prefill_bound_ratio(got, q, cu, batch, ks, vs, scale):
    """fp8_decode_bound_ratio for prefill chunks: each query row against its dense causal attention (the bound over
    all of its sequence's keys, which holds for any subset of them)."""
    want = dense_prefill(q, cu, batch, scale)  # (T, H, D)
    worst = 0.0
    for s, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        k_deq = dequantized(quantized_kv(k.transpose(0, 1), ks), ks).transpose(0, 1)  # (Hkv, L, D)
        v_deq = dequantized(quantized_kv(v.transpose(0, 1), vs), vs).transpose(0, 1)
        for row in range(int(cu[s]), int(cu[s + 1])):
            bound = fp8_output_bound(q[row], k, v, k_deq, v_deq, scale)
            worst = max(worst, ((got[row].float() - want[row]).abs().amax(dim=1) / bound).max().item())
    return worst


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return interpreted_errors_of(__file__, timeout=900)


@pytest.mark.parametrize("op,bound,dtype", INTERPRETER_CASES, ids=[case_name(*c) for c in INTERPRETER_CASES])
def test_kernel_matches_reference_in_interpreter(interpreted_errors, op, bound, dtype):
    err = interpreted_errors[case_name(op, bound, dtype)]
    limit = 1.0 if bound else INTERPRETER_TOLERANCE[dtype]  # bound cases: in units of fp8_output_bound
    assert err <= limit, f"{case_name(op, bound, dtype)}: relative error {err:.2e}"


# --- on a GPU ---

def skip_without_fp8():
    from redline.kernels.device import kv_fp8_refusal

    if (refusal := kv_fp8_refusal("cuda")) is not None:
        pytest.skip(refusal)


def assert_codes_within_one_step(got, want, scale):
    """Two e4m3 pools (..., Hkv, D): equal codes, except at most 1% that differ by one step (a rope or division
    rounded the other way on the GPU)."""
    a, b = dequantized(got, scale), dequantized(want, scale)
    same = (got.view(torch.uint8) == want.view(torch.uint8))
    step = 2.0 ** -3 * torch.maximum(a.abs(), b.abs()) + 2.0 ** -9 * scale[:, None]
    assert (same | ((a - b).abs() <= step * (1 + 1e-6))).all()
    assert same.float().mean() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", pa.PAGED_HEAD_DIMS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpu_fp8_cache_kernels_match_reference(layout, head_dim, dtype):
    """The e4m3-cache kernels (decode, fused qkv decode, prefill) against the references over the same codes."""
    skip_without_fp8()
    n_heads, n_kv_heads = LAYOUTS[layout]
    lengths = [0, 1, 17, 255, 1000, 4097, 16, 33]
    batch = paged_batch(lengths, n_kv_heads, head_dim, 16, device="cuda")
    k8, v8, ks, vs = fp8_pools(batch.k_cache, batch.v_cache)
    q = torch.randn(len(lengths), n_heads, head_dim, device="cuda").to(dtype)
    args = (q, k8, v8, batch.block_tables, batch.seq_lens, head_dim ** -0.5, 0, ks, vs)
    assert pa.paged_decode_config(q, k8, v8, batch.block_tables) is not None
    got = torch.ops.redline.paged_decode_attention(*args)
    assert rel_err(got, pa.paged_decode_attention_reference(*args)) <= GPU_TOLERANCE[dtype]
    window = torch.ops.redline.paged_decode_attention(*args[:6], 100, ks, vs)
    assert rel_err(window, pa.paged_decode_attention_reference(*args[:6], 100, ks, vs)) <= GPU_TOLERANCE[dtype]

    lengths, q_lens = [600, 45, 1, 2000, 130], [600, 13, 1, 300, 0]
    batch = paged_batch(lengths, n_kv_heads, head_dim, 64, device="cuda")
    k8, v8, ks, vs = fp8_pools(batch.k_cache, batch.v_cache)
    qp, cu = prefill_inputs(lengths, q_lens, n_heads, batch, dtype=dtype, extra_rows=5)
    args = (qp, k8, v8, batch.block_tables, cu, batch.seq_lens, head_dim ** -0.5, 0, ks, vs)
    assert pa.paged_prefill_config(qp, k8, v8) is not None
    got = torch.ops.redline.paged_prefill_attention(*args)
    assert rel_err(got, pa.paged_prefill_attention_reference(*args)) <= GPU_TOLERANCE[dtype]
    assert (got[-5:] == 0).all()

    batch, qkv, rope, norms = qkv_batch([0, 1, 17, 255, 1000, 4097, 16, 33], n_heads, n_kv_heads, head_dim, 16,
                                        None, dtype, "cuda")
    k8, v8, ks, vs = fp8_pools(batch.k_cache, batch.v_cache)
    pools, want_pools = (k8.clone(), v8.clone()), (k8.clone(), v8.clone())
    extra = (rope, batch.block_tables, batch.seq_lens, head_dim ** -0.5, 0, norms[0], norms[1], 1e-6, ks, vs)
    got = torch.ops.redline.paged_decode_attention_qkv(qkv, *pools, *extra)
    want = pa.paged_decode_attention_qkv_reference(qkv, *want_pools, *extra)
    assert torch.isfinite(got).all() and rel_err(got, want) <= GPU_TOLERANCE[dtype]
    for pool, want_pool, scale in zip(pools, want_pools, (ks, vs)):
        assert_codes_within_one_step(pool, want_pool, scale)


@pytest.mark.gpu
def test_gpu_fp8_cache_decode_is_within_the_e4m3_bound_of_the_true_keys():
    skip_without_fp8()
    q, batch, (k8, v8, ks, vs) = fp8_decode_case(lengths=(1, 37, 150, 1000), head_dim=128, page_size=16)
    on_gpu = [t.cuda() for t in (q, k8, v8, batch.block_tables, batch.seq_lens, ks, vs)]
    got = torch.ops.redline.paged_decode_attention(*on_gpu[:5], 0.125, 0, *on_gpu[5:]).cpu()
    assert fp8_decode_bound_ratio(got, q, batch, ks, vs, 0.125) <= 1


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_interpreter import _allow_one_element_loop_bounds

    _allow_one_element_loop_bounds()
    print(json.dumps({case_name(*case): run_interpreted_case(*case) for case in INTERPRETER_CASES}))
