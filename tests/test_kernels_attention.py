"""kernels/attention.py and kernels/triton_attention.py: the references against SDPA, the ops on the CPU, the Triton
kernels on a GPU, and KernelAttention in a model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from redline.kernels import attention as da
from redline.kernels.configs import AttentionConfig
from conftest import prefill_then_decode_logits

HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # (H, Hkv); gqa is 4:1


def make_inputs(batch, n_heads, n_kv_heads, seq_len, head_dim, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, n_heads, 1, head_dim, generator=gen, device=device).to(dtype)  # (B, H, 1, D)
    k = torch.randn(batch, n_kv_heads, seq_len, head_dim, generator=gen, device=device).to(dtype)  # (B, Hkv, S, D)
    v = torch.randn(batch, n_kv_heads, seq_len, head_dim, generator=gen, device=device).to(dtype)
    return q, k, v


def sdpa_as_model_calls_it(q, k, v, pos: int):
    seq_len = k.shape[2]
    mask = (torch.arange(seq_len, device=q.device) <= pos).view(1, 1, 1, seq_len)  # (1, 1, 1, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned(cache, pos: int):
    """A copy of cache (B, Hkv, S, D) with NaN at every position after pos."""
    bad = cache.clone()
    bad[:, :, pos + 1:] = float("nan")
    return bad


# --- CPU ---


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_reference_matches_sdpa(layout, head_dim):
    n_heads, n_kv_heads = HEAD_LAYOUTS[layout]
    seq_len = 40
    q, k, v = make_inputs(2, n_heads, n_kv_heads, seq_len, head_dim)
    for pos in (0, 1, 17, seq_len - 1):
        out = da.decode_attention_reference(q, k, v, torch.tensor([pos]))
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, sdpa_as_model_calls_it(q, k, v, pos), atol=1e-5, rtol=1e-5)


def test_reference_at_pos_zero_returns_first_value():
    q, k, v = make_inputs(1, 4, 2, 16, 32)
    out = da.decode_attention_reference(q, k, v, torch.tensor([0]))
    torch.testing.assert_close(out, v[:, :, :1].repeat_interleave(2, dim=1))  # softmax over one key is 1


def test_reference_ignores_garbage_past_input_pos():
    q, k, v = make_inputs(2, 8, 2, 32, 64)
    pos = 9
    out = da.decode_attention_reference(q, poisoned(k, pos), poisoned(v, pos), torch.tensor([pos]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, da.decode_attention_reference(q, k, v, torch.tensor([pos])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_accumulates_in_fp32(dtype):
    q, k, v = make_inputs(1, 4, 1, 64, 64, dtype=dtype)
    out = da.decode_attention_reference(q, k, v, torch.tensor([50]))
    assert out.dtype == dtype
    ref = sdpa_as_model_calls_it(q.float(), k.float(), v.float(), 50)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_op_dispatches_to_reference_on_cpu(layout):
    n_heads, n_kv_heads = HEAD_LAYOUTS[layout]
    q, k, v = make_inputs(2, n_heads, n_kv_heads, 24, 32)
    pos = torch.tensor([11])
    assert not da.decode_attention_supported(q, k)
    out = torch.ops.redline.decode_attention(q, k, v, pos)
    assert out.is_contiguous()
    torch.testing.assert_close(out, da.decode_attention_reference(q, k, v, pos), atol=0, rtol=0)


def test_op_accepts_non_contiguous_q_and_int32_pos():
    q_wide, k, v = make_inputs(1, 4, 2, 16, 64)
    q = q_wide[..., :32]  # (B, H, 1, D) with a head stride of 64
    k, v = k[..., :32].contiguous(), v[..., :32].contiguous()
    assert not q.is_contiguous()
    out = torch.ops.redline.decode_attention(q, k, v, torch.tensor([5], dtype=torch.int32))
    torch.testing.assert_close(out, da.decode_attention_reference(q, k, v, torch.tensor([5])))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q_shape=(1, 4, 2, 32)), "one token"),
        (dict(q_shape=(1, 4, 32)), r"\(B, H, 1, D\)"),
        (dict(q_shape=(1, 3, 1, 32)), "multiple"),
        (dict(q_shape=(2, 4, 1, 32)), "batch and head_dim"),
        (dict(q_shape=(1, 4, 1, 16)), "batch and head_dim"),
        (dict(v_shape=(1, 2, 8, 32)), "v_cache"),
        (dict(k_dtype=torch.float16), "one dtype"),
        (dict(pos=torch.tensor([1, 2])), "input_pos"),
        (dict(pos=torch.tensor(3)), "input_pos"),
        (dict(pos=torch.tensor([1.0])), "input_pos"),
        (dict(window=-1), "window must be"),
    ],
)
def test_validation_errors(change, match):
    q = torch.randn(change.get("q_shape", (1, 4, 1, 32)))
    k = torch.randn(1, 2, 16, 32, dtype=change.get("k_dtype", torch.float32))
    v = torch.randn(change.get("v_shape", (1, 2, 16, 32)), dtype=k.dtype)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.decode_attention(q, k, v, change.get("pos", torch.tensor([3])), change.get("window", 0))


def test_a_window_sees_only_the_last_keys():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 32)  # (B, H, 1, D)
    k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)  # (B, Hkv, S, D)
    pos = torch.tensor([9])
    windowed = torch.ops.redline.decode_attention(q, k, v, pos, 4)  # keys 6..9
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :6], v2[:, :, :6] = 100.0, -100.0  # keys before the window change nothing...
    torch.testing.assert_close(torch.ops.redline.decode_attention(q, k2, v2, pos, 4), windowed)
    assert not torch.allclose(torch.ops.redline.decode_attention(q, k2, v2, pos), windowed)  # ...without it, all
    torch.testing.assert_close(torch.ops.redline.decode_attention(q, k, v, pos, 10),
                               torch.ops.redline.decode_attention(q, k, v, pos))  # a window past the start: no window


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 1, 64, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 128, 64, dtype=torch.bfloat16)
        out = torch.ops.redline.decode_attention(q, k, torch.empty_like(k), torch.zeros(1, dtype=torch.long))
        assert out.shape == (2, 8, 1, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()
        with pytest.raises(ValueError, match="multiple"):
            torch.ops.redline.decode_attention(torch.empty(2, 3, 1, 64, dtype=torch.bfloat16), k, k,
                                               torch.zeros(1, dtype=torch.long))


def test_opcheck_cpu():
    q, k, v = make_inputs(2, 8, 2, 24, 32)
    torch.library.opcheck(torch.ops.redline.decode_attention.default, (q, k, v, torch.tensor([7])))


def test_torch_compile_fullgraph_cpu():
    q, k, v = make_inputs(1, 4, 2, 32, 32)

    def step(q, k, v, pos):
        out = torch.ops.redline.decode_attention(q * 0.5, k, v, pos)  # (B, H, 1, D)
        return out.transpose(1, 2).reshape(q.shape[0], 1, -1) + 1.0

    compiled = torch.compile(step, fullgraph=True)
    for pos in (0, 13, 31):
        p = torch.tensor([pos])
        torch.testing.assert_close(compiled(q, k, v, p), step(q, k, v, p))


# --- GPU ---

GPU_LAYOUTS = {"mha": (32, 32), "gqa": (32, 8), "mqa": (32, 1)}
BF16_TOL = 1e-2


def gpu_check(q, k, v, pos: int, tol: float, **op_kwargs):
    """Run the op on caches poisoned past pos and compare with the fp32 reference on the clean caches."""
    ref = da.decode_attention_reference(q.float(), k.float(), v.float(), torch.tensor([pos], device=q.device))
    out = torch.ops.redline.decode_attention(q, poisoned(k, pos), poisoned(v, pos),
                                             torch.tensor([pos], device=q.device))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), f"NaN past input_pos={pos} leaked into the output"
    err = rel_err(out, ref)
    assert err <= tol, f"pos={pos}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("seq_len", [256, 2304, 8192])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", sorted(GPU_LAYOUTS))
def test_gpu_kernel_matches_reference(layout, head_dim, seq_len, batch):
    n_heads, n_kv_heads = GPU_LAYOUTS[layout]
    q, k, v = make_inputs(batch, n_heads, n_kv_heads, seq_len, head_dim, torch.bfloat16, "cuda")
    assert da.decode_attention_supported(q, k)
    for pos in (0, 1, 100, seq_len - 1):
        gpu_check(q, k, v, pos, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("head_dim", [16, 32, 256])
def test_gpu_other_dtypes_and_head_dims(dtype, tol, head_dim):
    q, k, v = make_inputs(2, 8, 2, 1000, head_dim, dtype, "cuda")
    for pos in (0, 63, 64, 999):
        gpu_check(q, k, v, pos, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("block_s", [16, 64, 128])
@pytest.mark.parametrize("layout", ["mha", "gqa"])
def test_gpu_explicit_configs(layout, block_s, num_splits):
    from redline.kernels import triton_attention as ta

    n_heads, n_kv_heads = GPU_LAYOUTS[layout]
    q, k, v = make_inputs(1, n_heads, n_kv_heads, 3000, 128, torch.bfloat16, "cuda")
    for stages in (1, 3):
        cfg = AttentionConfig(num_splits=num_splits, block_s=block_s, num_stages=stages)
        for pos in (0, 200, 2999):
            p = torch.tensor([pos], device="cuda")
            ref = da.decode_attention_reference(q.float(), k.float(), v.float(), p)
            out = ta.decode_attention(q, poisoned(k, pos), poisoned(v, pos), p, cfg)
            assert rel_err(out, ref) <= BF16_TOL, (stages, pos)


@pytest.mark.gpu
def test_gpu_non_contiguous_q_and_batch_slice_of_cache():
    q_wide, k, v = make_inputs(4, 32, 8, 512, 256, torch.bfloat16, "cuda")
    q = q_wide[..., :128]  # (B, H, 1, D) with a head stride of 256
    k, v = k[..., :128].contiguous(), v[..., :128].contiguous()
    k2, v2, q2 = k[:2], v[:2], q[:2]  # KVCache.update returns self.k[:batch]
    p = torch.tensor([300], device="cuda")
    out = torch.ops.redline.decode_attention(q2, k2, v2, p)
    ref = da.decode_attention_reference(q2.float(), k2.float(), v2.float(), p)
    assert rel_err(out, ref) <= BF16_TOL


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_at_changing_positions():
    q, k, v = make_inputs(1, 32, 8, 2304, 128, torch.bfloat16, "cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.redline.decode_attention(q, k, v, pos)  # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.redline.decode_attention(q, k, v, pos)
    for p in (0, 1, 100, 2303, 5, 1500):
        pos.fill_(p)
        graph.replay()
        ref = da.decode_attention_reference(q.float(), k.float(), v.float(), pos)
        assert rel_err(out, ref) <= BF16_TOL, p


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead():
    q, k, v = make_inputs(1, 32, 8, 2304, 128, torch.bfloat16, "cuda")

    def step(q, k, v, pos):
        return torch.ops.redline.decode_attention(q, k, v, pos) * 2.0

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for p in (0, 1, 100, 2303, 7, 1024, 2000):
        pos = torch.tensor([p], device="cuda")
        out = compiled(q, k, v, pos).clone()
        ref = 2.0 * da.decode_attention_reference(q.float(), k.float(), v.float(), pos)
        assert rel_err(out, ref) <= BF16_TOL, p


def test_routed_model_decodes_like_sdpa():
    """The model's one-token steps through the op give the logits of the masked-SDPA path."""
    from redline.kernels import KernelAttention, use_kernels
    from redline.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("debug-tiny")).eval()
    ids = torch.randint(0, 512, (2, 20))
    with torch.no_grad():
        reference = prefill_then_decode_logits(model, ids, 5)
        use_kernels(model)
        assert sum(type(m) is KernelAttention for m in model.modules()) == 2
        routed = prefill_then_decode_logits(model, ids, 5)
    torch.testing.assert_close(routed, reference, atol=1e-5, rtol=1e-5)


# --- the fused op: rope + cache write + attention from the raw qkv projection ---


def qkv_inputs(batch, n_heads, n_kv_heads, seq_len, head_dim, pos, dtype=torch.float32, device="cpu", seed=0):
    """Raw qkv (B, 1, (H + 2 Hkv) D), caches with random history, and the rope table (the op reads row pos)."""
    from redline.model import ModelArgs, rope_table

    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(batch, 1, (n_heads + 2 * n_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, n_kv_heads, seq_len, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, n_kv_heads, seq_len, head_dim, generator=gen, device=device).to(dtype)
    args = ModelArgs(dim=n_heads * head_dim, n_layer=1, n_head=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     intermediate_size=8, vocab_size=8, block_size=seq_len)
    rope = rope_table(args, seq_len, torch.device(device))  # (S, 2, D/2): the op reads row pos
    return qkv, k, v, rope, torch.tensor([pos], device=device)


def unfused_steps(qkv, k, v, rope, pos):
    """What the model's Attention does for one token, on copies of the caches (rope: the whole table)."""
    from redline.model import apply_rope

    rope = rope[pos:pos + 1]  # (1, 2, D/2)
    batch, n_kv_heads, _, head_dim = k.shape
    n_heads = qkv.shape[-1] // head_dim - 2 * n_kv_heads
    q_, k_, v_ = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q_ = apply_rope(q_.view(batch, 1, n_heads, head_dim), rope).transpose(1, 2)
    k_ = apply_rope(k_.view(batch, 1, n_kv_heads, head_dim), rope).transpose(1, 2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, pos] = k_[:, :, 0]
    v2[:, :, pos] = v_.view(batch, n_kv_heads, head_dim)
    out = sdpa_as_model_calls_it(q_.float(), k2.float(), v2.float(), pos)  # (B, H, 1, D)
    return out.transpose(1, 2).reshape(batch, 1, -1), k2, v2


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("pos", [0, 17, 39])
def test_qkv_op_on_cpu_is_rope_cache_write_and_attention(layout, pos):
    n_heads, n_kv_heads = HEAD_LAYOUTS[layout]
    qkv, k, v, rope, ip = qkv_inputs(2, n_heads, n_kv_heads, 40, 32, pos)
    ref, k_ref, v_ref = unfused_steps(qkv, k, v, rope, pos)
    out = torch.ops.redline.decode_attention_qkv(qkv, k, v, rope, ip)  # writes k, v in place
    assert out.shape == (2, 1, n_heads * 32)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(qkv=torch.zeros(1, 1, 100)), "qkv must be"),
    (dict(rope=torch.zeros(40, 2, 17)), "rope must be"),  # more rotated features (34) than a head has (32)
    (dict(rope=torch.zeros(40, 2, 16, dtype=torch.float64)), "rope must be"),
    (dict(rope=torch.zeros(39, 2, 16)), "S >= the cache length 40"),  # row input_pos could fall outside it
    (dict(rope=torch.zeros(1, 2, 16)), "rope must be"),  # the old single-row form
    (dict(pos=torch.tensor([1.0])), "input_pos must be"),
    (dict(qkv=torch.zeros(1, 1, 8 * 32, dtype=torch.float16)), "dtype"),
])
def test_qkv_op_validation(change, match):
    qkv, k, v, rope, ip = qkv_inputs(1, 4, 2, 40, 32, 3)
    args = dict(qkv=qkv, rope=rope, pos=ip)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.decode_attention_qkv(args["qkv"], k, v, args["rope"], args["pos"])


def test_qkv_op_opcheck_cpu():
    qkv, k, v, rope, ip = qkv_inputs(1, 8, 2, 40, 32, 5)
    torch.library.opcheck(torch.ops.redline.decode_attention_qkv.default, (qkv, k, v, rope, ip))
    q_norm, k_norm = torch.rand(32) + 0.5, torch.rand(32) + 0.5
    torch.library.opcheck(torch.ops.redline.decode_attention_qkv.default, (qkv, k, v, rope, ip, q_norm, k_norm, 1e-6))


def head_normed_steps(qkv, k, v, rope, pos, q_norm, k_norm, eps):
    """unfused_steps after Qwen3's per-head q/k norms (model.rms_norm over each head of q and of k)."""
    from redline.model import rms_norm

    head_dim = k.shape[-1]
    n_q = qkv.shape[-1] - 2 * k.shape[1] * head_dim
    q_, k_, v_ = qkv.split([n_q, k.shape[1] * head_dim, k.shape[1] * head_dim], dim=-1)
    q_ = rms_norm(q_.unflatten(-1, (-1, head_dim)), q_norm, eps).flatten(-2)
    k_ = rms_norm(k_.unflatten(-1, (-1, head_dim)), k_norm, eps).flatten(-2)
    return unfused_steps(torch.cat([q_, k_, v_], dim=-1), k, v, rope, pos)


@pytest.mark.parametrize("pos", [0, 17])
def test_qkv_op_with_head_norms_on_cpu(pos):
    """q_norm / k_norm: each head of q and of k RMS-normalized (Qwen3) before rope, the cache write and attention;
    weights and inputs far from unit scale, so the test fails without the norms."""
    qkv, k, v, rope, ip = qkv_inputs(2, 8, 2, 40, 32, pos)
    qkv = qkv * 4
    q_norm, k_norm = torch.rand(32) * 2 + 0.2, torch.rand(32) * 2 + 0.2
    ref, k_ref, v_ref = head_normed_steps(qkv, k, v, rope, pos, q_norm, k_norm, 1e-6)
    out = torch.ops.redline.decode_attention_qkv(qkv, k, v, rope, ip, q_norm, k_norm, 1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(k[:, :, pos], unfused_steps(qkv, k, v, rope, pos)[1][:, :, pos], atol=1e-2)
    if pos:  # (at position 0 the output is the one value, whatever q and k)
        assert not torch.allclose(out, unfused_steps(qkv, k, v, rope, pos)[0], atol=1e-2)


@pytest.mark.parametrize("change,match", [
    (dict(k_norm=None), "need both q_norm and k_norm"),
    (dict(q_norm=torch.ones(16)), "q_norm must be \\(32,\\)"),
    (dict(k_norm=torch.ones(32, dtype=torch.float16)), "k_norm must be"),
    (dict(eps=0.0), "norm_eps must be positive"),
])
def test_qkv_op_head_norm_validation(change, match):
    qkv, k, v, rope, ip = qkv_inputs(1, 4, 2, 40, 32, 3)
    args = dict(q_norm=torch.ones(32), k_norm=torch.ones(32), eps=1e-6)
    args.update(change)
    with pytest.raises(ValueError, match=match) as info:
        torch.ops.redline.decode_attention_qkv(qkv, k, v, rope, ip, args["q_norm"], args["k_norm"], args["eps"])
    assert "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [256, 2304])
def test_gpu_qkv_kernel_with_head_norms_matches_unfused_steps(seq_len):
    """Qwen3-8B's heads (32 q, 8 kv, 128 wide) with per-head q/k norms in the kernel, against the model's steps."""
    for pos in (0, 63, seq_len - 1):
        qkv, k, v, rope, ip = qkv_inputs(1, 32, 8, seq_len, 128, pos, torch.bfloat16, "cuda")
        qkv = qkv * 4
        q_norm = (torch.rand(128, device="cuda") * 2 + 0.2).bfloat16()
        k_norm = (torch.rand(128, device="cuda") * 2 + 0.2).bfloat16()
        ref, _, _ = head_normed_steps(qkv.float(), k.float(), v.float(), rope, pos, q_norm.float(), k_norm.float(),
                                      1e-6)
        out = torch.ops.redline.decode_attention_qkv(qkv, k.clone(), v.clone(), rope, ip, q_norm, k_norm, 1e-6)
        assert rel_err(out, ref) <= BF16_TOL, pos


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [256, 2304])
@pytest.mark.parametrize("layout", sorted(GPU_LAYOUTS))
def test_gpu_qkv_kernel_matches_unfused_steps(layout, seq_len):
    """Rope, the cache write at input_pos and the attention in one kernel, against the model's steps in fp32,
    at positions that fall in the first, a middle and the last split (the owning split writes before reading)."""
    n_heads, n_kv_heads = GPU_LAYOUTS[layout]
    for pos in (0, 1, 63, 64, 200, seq_len - 1):
        qkv, k, v, rope, ip = qkv_inputs(1, n_heads, n_kv_heads, seq_len, 128, pos, torch.bfloat16, "cuda")
        ref, k_ref, v_ref = unfused_steps(qkv.float(), k.float(), v.float(), rope, pos)
        k_run, v_run = poisoned(k, pos), poisoned(v, pos)
        out = torch.ops.redline.decode_attention_qkv(qkv, k_run, v_run, rope, ip)
        assert torch.isfinite(out).all(), f"pos={pos}: NaN past input_pos leaked"
        assert rel_err(out, ref) <= BF16_TOL, pos
        torch.testing.assert_close(k_run[:, :, :pos + 1].float(), k_ref[:, :, :pos + 1], rtol=1e-2, atol=1e-2)
        assert torch.equal(v_run[0, :, pos], qkv[0, 0, (n_heads + n_kv_heads) * 128:].view(n_kv_heads, 128))


@pytest.mark.gpu
def test_gpu_qkv_kernel_in_a_cuda_graph():
    from redline.kernels import triton_attention as ta

    qkv, k, v, rope, ip = qkv_inputs(1, 32, 8, 2304, 128, 0, torch.bfloat16, "cuda")
    for splits in (1, 8):
        cfg = AttentionConfig(num_splits=splits, block_s=64)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ta.decode_attention_qkv(qkv, k.clone(), v.clone(), rope, ip, config=cfg)  # compile outside capture
        torch.cuda.current_stream().wait_stream(s)
        k_run, v_run = k.clone(), v.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ta.decode_attention_qkv(qkv, k_run, v_run, rope, ip, config=cfg)
        for p in (5, 100, 2303, 64):
            ip.fill_(p)  # the replay reads the new position's rope row from the table
            ref, _, _ = unfused_steps(qkv.float(), k_run.float(), v_run.float(), rope, p)
            graph.replay()
            assert rel_err(out, ref) <= BF16_TOL, (splits, p)


# --- prefill from position 0: rope + cache write in one op ---


def prefill_inputs(batch, n_heads, n_kv_heads, length, seq_len, head_dim, dtype=torch.float32, device="cpu", seed=0):
    """Raw qkv (B, T, (H + 2 Hkv) D), caches filled with NaN (so untouched rows stay visible), rope rows 0..T-1."""
    from redline.model import ModelArgs, rope_table

    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(batch, length, (n_heads + 2 * n_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
    k = torch.full((batch + 1, n_kv_heads, seq_len, head_dim), float("nan"), device=device, dtype=dtype)
    args = ModelArgs(dim=n_heads * head_dim, n_layer=1, n_head=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     intermediate_size=8, vocab_size=8, block_size=seq_len)
    return qkv, k, k.clone(), rope_table(args, seq_len, torch.device(device))[:length]  # rope (T, 2, D/2)


def model_prefill_steps(qkv, k, v, rope):
    """What the model does without the op: split, apply_rope, write_prefix."""
    from redline.model import apply_rope

    batch, length, _ = qkv.shape
    n_kv_heads, head_dim = k.shape[1], k.shape[3]
    n_heads = qkv.shape[-1] // head_dim - 2 * n_kv_heads
    q, kn, vn = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(batch, length, n_heads, head_dim), rope)  # (B, T, H, D)
    k[:batch, :, :length] = apply_rope(kn.view(batch, length, n_kv_heads, head_dim), rope).transpose(1, 2)
    v[:batch, :, :length] = vn.view(batch, length, n_kv_heads, head_dim).transpose(1, 2)
    return q


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_prefill_op_on_cpu_is_the_model_steps(layout):
    n_heads, n_kv_heads = HEAD_LAYOUTS[layout]
    qkv, k, v, rope = prefill_inputs(2, n_heads, n_kv_heads, 11, 40, 32)
    k_ref, v_ref = k.clone(), v.clone()
    q = torch.ops.redline.prefill_rope_cache(qkv, k, v, rope)
    q_ref = model_prefill_steps(qkv, k_ref, v_ref, rope)
    assert q.shape == (2, 11, n_heads, 32) and q.is_contiguous()
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=0, equal_nan=True)  # also: rows past T and batch row 2 untouched
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0, equal_nan=True)
    assert k[:2, :, 11:].isnan().all() and k[2].isnan().all() and not k[:2, :, :11].isnan().any()


@pytest.mark.parametrize("change,match", [
    (dict(qkv=torch.zeros(1, 5, 100)), "qkv must be"),
    (dict(qkv=torch.zeros(1, 41, 8 * 32)), "do not fit the cache"),
    (dict(qkv=torch.zeros(3, 5, 8 * 32)), "do not fit the cache"),
    (dict(rope=torch.zeros(4, 2, 16)), "rope must be"),
    (dict(rope=torch.zeros(5, 2, 17)), "rope must be"),
    (dict(rope=torch.zeros(5, 2, 16, dtype=torch.float64)), "rope must be"),
    (dict(qkv=torch.zeros(1, 5, 8 * 32, dtype=torch.float16)), "dtype"),
    (dict(qkv=torch.zeros(1, 5, 16 * 32)[..., ::2]), "unit stride"),
])
def test_prefill_op_validation(change, match):
    qkv, k, v, rope = prefill_inputs(1, 4, 2, 5, 40, 32)
    args = dict(qkv=qkv, rope=rope)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.prefill_rope_cache(args["qkv"], k, v, args["rope"])


def test_prefill_op_opcheck_cpu():
    qkv, k, v, rope = prefill_inputs(1, 8, 2, 7, 40, 32)
    torch.library.opcheck(torch.ops.redline.prefill_rope_cache.default, (qkv, k.nan_to_num(), v.nan_to_num(), rope))


def test_routed_model_prefills_from_start_like_the_unrouted_one():
    """A from_start prefill through the op (then decode steps reading the cache it wrote) gives the same logits."""
    from redline.kernels import use_kernels
    from redline.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("debug-tiny-llama3")).eval()  # GQA
    ids = torch.randint(0, 512, (2, 16))

    def run():
        model.setup_caches(2, 32)
        logits = [model(ids[:, :12], torch.arange(12), from_start=True)]
        logits += [model(ids[:, p:p + 1], torch.tensor([p])) for p in range(12, 16)]
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        reference = run()
        use_kernels(model)
        routed = run()
    torch.testing.assert_close(routed, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32, 32, 2048, 128), (1, 32, 8, 2047, 128), (2, 8, 2, 37, 64), (1, 4, 4, 1, 128)],
                         ids=["7b-2048", "8b-2047", "odd-b2", "one-token"])
def test_gpu_prefill_kernel_matches_the_model_steps(shape, dtype):
    batch, n_heads, n_kv_heads, length, head_dim = shape
    qkv, k, v, rope = prefill_inputs(batch, n_heads, n_kv_heads, length, length + 5, head_dim, dtype, "cuda")
    k_ref, v_ref = k.clone(), v.clone()
    q = torch.ops.redline.prefill_rope_cache(qkv, k, v, rope)
    q_ref = model_prefill_steps(qkv, k_ref, v_ref, rope)
    # The kernel's fp32 rope may fuse a multiply-add: at most one step of the output dtype apart.
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, equal_nan=True, **tol)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0, equal_nan=True)
    assert k[:batch, :, length:].isnan().all() and k[batch].isnan().all()


@pytest.mark.gpu
def test_no_fitting_attention_config_takes_the_reference(monkeypatch):
    from dataclasses import replace

    from redline.kernels import triton_attention
    from redline.kernels.device import device_caps, simulated

    def refuse(*args, **kwargs):
        raise AssertionError("the split kernel ran on a GPU where no config fits")

    monkeypatch.setattr(triton_attention, "decode_attention", refuse)
    monkeypatch.setattr(triton_attention, "decode_attention_qkv", refuse)
    torch.manual_seed(0)
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)  # (B, H, 1, D)
    k = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)  # (B, Hkv, S, D)
    v = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([200], device="cuda")
    rope = torch.randn(256, 2, 64, device="cuda")
    qkv = torch.randn(1, 1, 12 * 128, device="cuda", dtype=torch.bfloat16)
    with simulated(replace(device_caps(), shared_memory_per_block=1024)):
        assert da.attention_kernel_config(1, 8, k) is None
        out = torch.ops.redline.decode_attention(q, k, v, pos)
        k2, v2 = k.clone(), v.clone()
        fused = torch.ops.redline.decode_attention_qkv(qkv, k2, v2, rope, pos)
        k3, v3 = k.clone(), v.clone()
        want = da.decode_attention_qkv_reference(qkv, k3, v3, rope, pos)  # its attention runs the reference here
    torch.testing.assert_close(out, da.decode_attention_reference(q, k, v, pos))
    torch.testing.assert_close(fused, want)
    torch.testing.assert_close(k2, k3)
