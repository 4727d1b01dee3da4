"""kernels/configs.py: the launch config tables (plain Python, so they are checked on the CPU)."""
from __future__ import annotations

import pytest

from kernels import configs
from kernels.configs import AttentionConfig, DotConfig, GemvConfig, attention_config, dot_config, gemv_config

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
