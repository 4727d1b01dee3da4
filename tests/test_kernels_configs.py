"""kernels/configs.py: the launch config tables (plain Python, so they are checked on the CPU)."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from redline.kernels import configs
from redline.kernels.configs import AttentionConfig, DotConfig, GemvConfig, attention_config, dot_config, gemv_config
from redline.kernels.device import DEFAULT_TARGETS, target_caps

# (N, K) of Llama-2-7B's and Llama-3-8B's decode projections.
LLAMA2_7B = {"wqkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008),
             "lm_head": (32000, 4096)}
LLAMA3_8B = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336),
             "lm_head": (128256, 4096)}


def test_split_count_depends_on_shape_only():
    a = attention_config(1, 32, 8, 8192, 128, sms=132)
    assert a == attention_config(1, 32, 8, 8192, 128, sms=132)
    assert 1 < a.num_splits <= 8192 // a.block_s
    short = attention_config(1, 32, 8, 128, 128, sms=132)
    assert (short.block_s, short.num_splits) == (configs.SHORT_CACHE_BLOCK_S, 4)  # never more splits than key blocks
    assert attention_config(1, 32, 32, 256, 128, sms=132).block_s == configs.SHORT_CACHE_BLOCK_S  # 4 blocks of 64 < 9
    assert attention_config(1, 32, 32, 2304, 128, sms=132).block_s == 64  # 36 blocks of 64: enough for 9 splits
    assert attention_config(64, 32, 32, 256, 128, sms=132).num_splits == 1  # enough groups to fill the GPU
    # Long caches: splits of at most MAX_SPLIT_KEYS keys, up to MAX_PROGRAMS_PER_SM programs per SM.
    assert attention_config(1, 32, 32, 4096, 128, sms=132).num_splits == 4096 // configs.MAX_SPLIT_KEYS  # 16, not 9
    assert attention_config(1, 32, 8, 8192, 128, sms=132).num_splits == 33  # 2 per SM already gives 248 keys each
    assert attention_config(16, 32, 32, 4096, 128, sms=132).num_splits == 2  # capped at 4 programs per SM
    with pytest.raises(ValueError, match="block_s"):
        AttentionConfig(num_splits=4, block_s=48)


def test_config_validation():
    with pytest.raises(ValueError, match="block_m"):
        DotConfig(32, 64, 4, 3, 24)
    with pytest.raises(ValueError, match="block_k"):
        DotConfig(32, 8, 4, 3)
    with pytest.raises(ValueError, match="num_splits"):
        AttentionConfig(num_splits=configs.MAX_SPLITS + 1, block_s=64)
    with pytest.raises(ValueError, match="num_warps"):
        AttentionConfig(num_splits=4, block_s=64, num_warps=3)


@pytest.mark.parametrize("w_bytes", [1, 2])
@pytest.mark.parametrize("name,nk", sorted({**{f"7b-{k}": v for k, v in LLAMA2_7B.items()},
                                             **{f"8b-{k}": v for k, v in LLAMA3_8B.items()}}.items()))
def test_gemv_table_gives_fused_calls_paired_rows(name, nk, w_bytes):
    """A norm in the prologue or a SwiGLU epilogue needs at least 2 (an even number of) rows per program."""
    n, k = nk
    for fused in (dict(fused_input=True), dict(fused_input=True, swiglu=True), dict(residual=True), {}):
        cfg = gemv_config(n, k, w_bytes, **fused)
        assert isinstance(cfg, GemvConfig) and cfg.depth in (1, 2) and cfg.block_k % 8 == 0
        if fused.get("swiglu"):
            assert cfg.block_n % 2 == 0
        if fused.get("fused_input"):
            assert cfg.block_n >= 2


def test_gemv_table_keeps_the_rows_measured_in_the_model():
    """The rows chosen by in-model measurements (the comments beside them) are what the 7B and 8B calls get."""
    assert gemv_config(12288, 4096, 1, fused_input=True) == GemvConfig(8, 512, 1, 2, True)  # 7B int8 wqkv+norm
    assert gemv_config(6144, 4096, 1, fused_input=True) == GemvConfig(4, 1024, 4, 2, True)  # 8B int8 wqkv+norm
    assert gemv_config(22016, 4096, 1, fused_input=True, swiglu=True) == GemvConfig(8, 512, 2, 2, True)
    assert gemv_config(28672, 4096, 1, fused_input=True, swiglu=True) == GemvConfig(4, 512, 2, 2, True)
    assert gemv_config(4096, 4096, 2, residual=True) == GemvConfig(2, 2048, 4, 2, True)  # bf16 wo+residual
    assert gemv_config(4096, 14336, 1, residual=True) == GemvConfig(8, 1024, 4, 2, True)  # 8B int8 w2


@pytest.mark.parametrize("m", [2, 16, 17, 33, 64, 65, 128, 200, 256])
@pytest.mark.parametrize("w_bytes", [1, 2])
def test_dot_table_tiles_rows_within_the_kernel_limits(m, w_bytes):
    for n, k in list(LLAMA2_7B.values()) + list(LLAMA3_8B.values()):
        cfg = dot_config(n, k, w_bytes, m)
        assert isinstance(cfg, DotConfig)
        # Up to DOT_MAX_BLOCK_M rows, one tile of rows (block_m from M); more rows take explicit tiles.
        assert (cfg.block_m == 0) == (m <= configs.DOT_MAX_BLOCK_M)


# --- the tables fitted to each target's shared memory ---

# (N, K) of every projection of the demo model, Llama-2-7B, Llama-3-8B and Llama-3-70B: qkv, wo, gate/up, w2, output.
MODEL_PROJECTIONS = sorted({
    shape for dim, heads, kv_heads, inter, vocab in ((576, 9, 3, 1536, 49152), (4096, 32, 32, 11008, 32000),
                                                     (4096, 32, 8, 14336, 128256), (8192, 64, 8, 28672, 128256))
    for shape in (((heads + 2 * kv_heads) * (dim // heads), dim), (dim, dim), (2 * inter, dim), (dim, inter),
                  (vocab, dim))})
DTYPE_BYTES = [(2, 2), (4, 4), (1, 2), (1, 4)]  # (weight, x): bf16/fp16, fp32, int8 weights


@pytest.mark.parametrize("target", DEFAULT_TARGETS)
def test_dot_configs_never_exceed_the_targets_shared_memory(target):
    caps = target_caps(target)
    fallbacks = 0
    for (n, k), (w_bytes, x_bytes), m in itertools.product(MODEL_PROJECTIONS, DTYPE_BYTES, range(2, 257)):
        cfg = configs.fitted_dot_config(n, k, w_bytes, x_bytes, m, caps)
        if cfg is None:
            fallbacks += 1
            continue
        need = configs.dot_smem_bytes(configs.dot_block_m(cfg, m), cfg.block_n, cfg.block_k, cfg.num_stages,
                                      x_bytes, w_bytes, caps)
        assert need <= caps.shared_memory_per_block, (target, n, k, w_bytes, x_bytes, m, cfg)
    assert fallbacks == 0  # every shape keeps a tensor-core config on every default target


@pytest.mark.parametrize("target", DEFAULT_TARGETS)
def test_attention_configs_never_exceed_the_targets_shared_memory(target):
    caps = target_caps(target)
    for batch, (heads, kv_heads), seq_len, head_dim, elt in itertools.product(
            (1, 2, 8, 64, 256), ((9, 3), (32, 32), (32, 8), (64, 8)), (64, 256, 2048, 8192), (64, 128, 256),
            (2, 4)):
        cfg = configs.fitted_attention_config(batch, heads, kv_heads, seq_len, head_dim, elt, caps)
        block_g = max(16, 1 << (heads // kv_heads - 1).bit_length())
        need = configs.attention_smem_bytes(block_g, cfg.block_s, head_dim, elt, cfg.num_stages, caps)
        assert need <= min(caps.shared_memory_per_block, configs.PIPELINE_SMEM_BYTES), (target, cfg)
        assert cfg.num_splits <= -(-seq_len // cfg.block_s)


def test_h200_keeps_every_measured_config():
    caps = target_caps("sm90")
    for (n, k), (w_bytes, x_bytes), m in itertools.product(MODEL_PROJECTIONS, DTYPE_BYTES, range(2, 257)):
        assert configs.fitted_dot_config(n, k, w_bytes, x_bytes, m, caps) == configs.dot_config(n, k, w_bytes, m)
    for batch, seq_len, head_dim, elt in itertools.product((1, 4, 64), (256, 4096, 8192), (64, 128, 256), (2, 4)):
        table = configs.attention_config(batch, 32, 8, seq_len, head_dim, caps.sm_count)
        assert configs.fitted_attention_config(batch, 32, 8, seq_len, head_dim, elt, caps) == table


def test_configs_shrink_where_the_h200_tables_do_not_fit():
    # 7B bf16 wo at 8 rows: (32, 256) tiles in 4 stages need 72 KiB, over AMD's 64 KiB of LDS
    amd = target_caps("gfx90a")
    table = configs.dot_config(4096, 4096, 2, 8)
    assert configs.dot_smem_bytes(16, table.block_n, table.block_k, table.num_stages, 2, 2, amd) > 64 * 1024
    fitted = configs.fitted_dot_config(4096, 4096, 2, 2, 8, amd)
    assert fitted.num_stages < table.num_stages and (fitted.block_n, fitted.block_k) == (table.block_n, table.block_k)
    # fp32 on an RTX 4090 (99 KiB): smaller tiles at any row count
    assert configs.fitted_dot_config(4096, 4096, 4, 4, 8, target_caps("sm89")) != configs.dot_config(4096, 4096, 4, 8)
    # fp32 attention with 128-wide heads on AMD: 64-key blocks in 2 stages do not fit, 32-key blocks do
    assert configs.fitted_attention_config(1, 32, 32, 4096, 128, 4, amd).block_s == 32


def test_no_config_when_nothing_fits():
    tiny = replace(target_caps("sm80"), shared_memory_per_block=1024)
    assert configs.fitted_dot_config(4096, 4096, 2, 2, 8, tiny) is None
    assert configs.fitted_attention_config(1, 32, 8, 4096, 128, 2, tiny) is None
