"""The launch configs of every Triton kernel: deterministic tables from the shapes alone, never autotuning.

Nothing compiles or benchmarks inside CUDA-graph capture or torch.compile tracing: the first eager call compiles
the kernel a table picks, and a capture only records launches. The tables were measured on an H200; the
reasoning behind each row is next to it. Plain Python: importing this module needs neither Triton nor a GPU.

    gemv_config(n, k, w_bytes, ...)        one row of x: the matrix-vector kernel (triton_linear.gemv)
    dot_config(n, k, w_bytes, m)           2 or more rows: the tensor-core kernel (triton_linear.small_m_dot)
    int4_dot_config(n, k, group_size, m)   2 or more rows, int4 weights: triton_int4_dot.int4_dot
    attention_config(batch, ..., sms)      one decode token: the split flash-decoding kernel (triton_attention)
    paged_prefill_config(group, ...)       query chunks over a paged cache (triton_paged_attention); paged decode
                                           takes attention_config's splits over the block table's key capacity
    moe_gemv_config(n, k, elt_bytes)       few tokens through their chosen experts (triton_moe's GEMV kernels)
    moe_dot_config(pairs, experts, ...)    more tokens grouped by expert (triton_moe's grouped tensor-core kernels)
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from .device import DeviceCaps

# Rows of x per tile of the tensor-core kernel by default (padded to a power of two >= 16); up to this many rows,
# one tile serves them all, so each weight byte is read once.
DOT_MAX_BLOCK_M = 64
# The most weight groups per K step of the int4 tensor-core kernel: each is a dot of its own in the unrolled loop body
# (on sm90, 8 groups of 32 inputs in a 256-input step spilled registers; 4 did not).
INT4_DOT_GROUPS_PER_STEP = 4

# The attention split count aims for this many programs per SM over the whole grid: on an H200
# (benchmarks/bench_attention.py --sweep, B=1, Llama-2-7B and Llama-3-8B shapes) 1 per SM was 10-35% slower on full
# long caches, 4 per SM within about +-7% of 2, 8 per SM mostly slower.
TARGET_PROGRAMS_PER_SM = 2
# Long caches get more splits, up to MAX_PROGRAMS_PER_SM, so that no split walks more than this many keys: in the
# model on an H200, the 7B shape at a 4096-key cache decoded 249.8 / 363.4 tok/s (bf16 / int8) with 16 splits
# against 244.8 / 355.6 with 9 (455 keys each); the 8B shape at 8192 keys keeps 33 splits of 248 keys.
MAX_SPLIT_KEYS = 256
# The cap on programs per SM when long caches ask for more splits: 8 per SM measured mostly slower than 2-4.
MAX_PROGRAMS_PER_SM = 4
# The most splits per KV group, which bounds the per-split partials the combine kernel loads at once.
MAX_SPLITS = 256
# Keys per block when the cache is too short to give every wanted split a 64-key block.
SHORT_CACHE_BLOCK_S = 32


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the matrix-vector kernel."""

    block_n: int  # rows of w per program
    block_k: int  # K elements per loop step
    num_warps: int
    depth: int = 2  # weight blocks in flight per program (software pipeline depth, 1 or 2)
    red: bool = False  # pre-sum each thread's 8 contiguous products (fewer accumulator registers)


@dataclass(frozen=True)
class DotConfig:
    """Launch parameters of the tensor-core kernel."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_m: int = 0  # rows of x per tile; 0: M rounded up to a power of two in [16, DOT_MAX_BLOCK_M]

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"DotConfig.{name} must be a power of two >= 16 (tl.dot tiles), got {value}")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"DotConfig.block_m must be 0 (from M) or a power of two >= 16, got {self.block_m}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"invalid num_warps {self.num_warps} or num_stages {self.num_stages}")


@dataclass(frozen=True)
class Int4DotConfig(DotConfig):
    """Launch parameters of the int4 tensor-core kernel (triton_int4_dot.int4_dot)."""

    swap: bool = False  # compute (W @ x.T).T: the weight tile is the MMA's left operand (wgmma from registers on Hopper)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the split decode-attention kernel."""

    num_splits: int  # programs per KV group (fixed for a given shape, never from input_pos)
    block_s: int  # keys per loop step
    num_warps: int = 4
    num_stages: int = 2  # K/V tiles in flight; on an H200 3 was within about +-5% of 2, 1 up to 30% slower

    def __post_init__(self) -> None:
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {self.num_splits}")
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s must be a power of two >= 16, got {self.block_s}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"invalid num_warps {self.num_warps} or num_stages {self.num_stages}")


@dataclass(frozen=True)
class PagedPrefillConfig:
    """Launch parameters of the paged prefill kernel: a tile of block_m query rows (tokens x the query heads of one
    KV group, the group padded to a power of two) against block_n keys per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"PagedPrefillConfig.{name} must be a power of two >= 16 (tl.dot tiles), "
                                 f"got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"invalid num_warps {self.num_warps} or num_stages {self.num_stages}")


# --- the matrix-vector kernel ---


def gemv_config(n: int, k: int, w_bytes: int, fused_input: bool = False, swiglu: bool = False,
                residual: bool = False) -> GemvConfig:
    """The GEMV config table: deterministic, from the shape alone (n: rows of w).

    Measured on an H200, most rows alone (CUDA graph of 20 calls, weights rotated past L2; see
    benchmarks/kernel-notes.md): a BLOCK_K that divides K matters for the long-K down projections (a
    partial last block costs a masked pass).
    fused_input (a norm in the prologue) and swiglu need at least 2 rows per program (the second pairs
    a gate row with its up row); the fused int8 rows come from a sweep of the fused kernels
    (BENCHMARKS.md, "Fused decode"), and four int8 rows from sweeps inside the whole model, where they beat
    the winners measured on the kernel alone.
    """
    if w_bytes == 1 and k < 8192 and not swiglu:
        if fused_input and 8192 <= n < 16384:
            # One warp per program measured fastest for the 7B int8 wqkv+norm in the model on an H200 (473.8 /
            # 472.4 / 473.3 / 473.7 / 474.4 tok/s against 456.8-457.4 with (8, 1024, 4, 2)); the 8B wqkv (6144
            # rows) lost 3% that way.
            return GemvConfig(8, 512, 1, 2, True)
        if fused_input and n < 8192:
            # Measured fastest for the 8B int8 wqkv+norm (6144 rows) in the model on an H200: 416.7 / 417.0 tok/s
            # against 415.0 / 414.9 with (8, 1024, 4, 2), alternating in one call.
            return GemvConfig(4, 1024, 4, 2, True)
        if residual:
            return GemvConfig(4, 2048, 4, 1, True)  # 7B wo+residual 6.0 us (table: 6.6)
    if w_bytes == 1 and swiglu and k < 8192 and n < 24576:
        # Measured fastest for the 7B int8 gate/up+norm in the model on an H200 (476.3 / 476.1 tok/s against
        # 473.8 / 472.4 with the table's (4, 512, 2, 2)); the 8B one (28672 rows) measured 385.0 against 386.3,
        # so it keeps the table row.
        return GemvConfig(8, 512, 2, 2, True)
    if w_bytes == 2 and residual and k < 8192:
        # Half the programs, each streaming both rows before its PDL wait, measured fastest for the bf16 wo after
        # attention in the model on an H200 (286.8 / 286.1 tok/s against 285.3 / 285.0 with the one-row row).
        return GemvConfig(2, 2048, 4, 2, True)
    cfg = _gemv_table_config(n, k, w_bytes)
    if (fused_input or swiglu) and cfg.block_n == 1:
        return GemvConfig(2, cfg.block_k, cfg.num_warps, cfg.depth, cfg.red)
    return cfg


def _gemv_table_config(n: int, k: int, w_bytes: int) -> GemvConfig:
    if w_bytes == 1:
        if k >= 8192:
            # Measured fastest for the 8B int8 w2 (K 14336) in the model on an H200: 414.9 tok/s against
            # 402.6 / 402.8 with (2, 2048, 4, 1).
            return GemvConfig(8, 1024, 4, 2, True)
        if n >= 16384:
            return GemvConfig(4, 512, 2, 2, True)
        return GemvConfig(2, 1024, 2, 2, True)
    if k >= 8192:
        return GemvConfig(2, 1024, 4, 2)
    return GemvConfig(1, 2048, 4, 2, True)


def gemv_int4_config(n: int, k: int, group_size: int, fused_input: bool = False, swiglu: bool = False,
                     residual: bool = False) -> GemvConfig:
    """The int4 GEMV's config (triton_int4.gemv_int4; n: rows of the packed weight). Each thread takes one 32-input
    chunk of every row of its program, so BLOCK_K is 1024 inputs per warp (32 chunks); block_n rows share each
    thread's x values (at least 2 for the SwiGLU pairs). The fastest of 12 configs per Llama-2-7B shape in its
    fused decode form on an H200 (fp16x2 products, g128 and g32), checked in the model: 8 rows everywhere; one
    warp for the wide matrices (two blocks in flight spill registers and lost 7% in the model), four warps for the
    4096-row ones (wo, w2), to have programs enough."""
    if n >= 8192:  # wqkv, w13, the output head
        return GemvConfig(8, 1024, 1, 1)
    return GemvConfig(8, 4096, 4, 1)  # wo, w2


# --- the tensor-core kernel ---


def dot_config(n: int, k: int, w_bytes: int, m: int) -> DotConfig:
    """The tensor-core kernel's config table (m: rows of x, 2 or more)."""
    if m > DOT_MAX_BLOCK_M:
        return _row_tiles_config(n, w_bytes, m)
    if m > 16:
        return _medium_m_config(n, k, w_bytes, m)
    if n >= 12288:
        return DotConfig(64, 256, 4, 3) if w_bytes == 1 else DotConfig(64, 128, 4, 4)
    return DotConfig(32, 256, 4, 4)


def _medium_m_config(n: int, k: int, w_bytes: int, m: int) -> DotConfig:
    """17..64 rows of x (x padded to 32 or 64 rows): the best of 8 configs per 7B shape on an H200
    (benchmarks/bench_kernels.py --msweep --dot-sweep --m-rows 32,64; BENCHMARKS.md, "Kernels")."""
    if n < 8192:  # wo, w2: few output tiles, so narrow ones
        if w_bytes == 1:
            if m <= 32:
                return DotConfig(16, 256, 4, 4)
            return DotConfig(32, 256, 4, 3) if k < 8192 else DotConfig(32, 128, 4, 4)
        return DotConfig(32, 256, 4, 3)
    if w_bytes == 1 and m <= 32:
        return DotConfig(64, 128, 4, 4) if n >= 32000 else DotConfig(64, 256, 4, 3)
    if w_bytes == 2 and m <= 32 and n < 16384:
        return DotConfig(32, 128, 4, 4)
    return DotConfig(64, 64, 4, 5) if n < 16384 else DotConfig(128, 64, 4, 4)


def _row_tiles_config(n: int, w_bytes: int, m: int) -> DotConfig:
    """More than 64 rows of x (several tiles of rows): the best of 10 configs per 7B shape at 128 and 256 rows
    on an H200 (benchmarks/bench_kernels.py --msweep --dot-sweep --m-rows 128,256)."""
    if n >= 32000:
        return DotConfig(128, 64, 8, 4, 128)
    if n < 8192 and m <= 128:  # wo, w2
        return DotConfig(64, 128, 4, 3, 64)
    if w_bytes == 1:
        return DotConfig(128, 64, 4, 4, 64)
    if n < 8192:
        return DotConfig(128, 128, 8, 3, 64)
    if m <= 128:
        return DotConfig(64, 64, 4, 4, 64) if n < 16384 else DotConfig(128, 64, 8, 3, 64)
    return DotConfig(128, 64, 8, 3, 64) if n < 16384 else DotConfig(128, 64, 8, 4, 128)


def int4_dot_config(n: int, k: int, group_size: int, m: int) -> Int4DotConfig:
    """The int4 tensor-core kernel's config table (m: rows of x, 2 or more). A first table, from the kernel's
    compiled code (instructions per weight, registers, shared memory on sm90) rather than from GPU measurements;
    benchmarks/bench_int4.py --rows sweeps alternatives.

    The weight tile is wgmma's left operand (swap) in tiles of 64 or 128 rows, except for 32-input groups, whose
    16-byte sub-blocks Triton sends through shared memory that way. The N=4096 projections (wo, w2) take 32-row
    tiles for up to 16 rows of x, so that 128 programs share the GPU. A K step holds at most 4 groups: each group
    is a dot of its own, unrolled in the loop body, and 8 of them spilled registers. The launcher shortens block_k
    to divide K."""
    del k  # the launcher fits block_k to it
    swap = group_size >= 64
    if m > DOT_MAX_BLOCK_M:  # several tiles of rows
        cfg = Int4DotConfig(128, 128, 8, 3, 64, swap) if n >= 8192 else Int4DotConfig(64, 128, 4, 3, 64, swap)
    elif m > 16:
        cfg = Int4DotConfig(128, 128, 8, 4, 0, swap) if n >= 8192 else Int4DotConfig(64, 128, 4, 3, 0, swap)
    elif n < 8192:
        cfg = Int4DotConfig(32, 256, 4, 4)
    else:
        cfg = Int4DotConfig(64, 256, 4, 4, 0, swap)
    return replace(cfg, block_k=min(cfg.block_k, INT4_DOT_GROUPS_PER_STEP * group_size))


# --- the decode-attention kernel ---


def attention_config(batch: int, n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int, sms: int,
                     programs_per_sm: int = TARGET_PROGRAMS_PER_SM) -> AttentionConfig:
    """The split kernel's config for these shapes (sms: the GPU's SM count); depends on the cache length, never
    on input_pos, so one captured graph is correct at every position."""
    block_s = 64 if head_dim <= 128 else 32
    groups = batch * n_kv_heads
    splits = math.ceil(programs_per_sm * sms / groups)
    splits = max(splits, min(math.ceil(seq_len / MAX_SPLIT_KEYS), math.ceil(MAX_PROGRAMS_PER_SM * sms / groups)))
    if math.ceil(seq_len / block_s) < splits:
        # A short cache has fewer blocks than the splits wanted: 32-key blocks let twice the programs share the
        # keys (H200, 256-key cache, batch 1: 294.7 vs 292.0 tok/s for the 7B shape, 266.2 vs 264.0 for the 8B).
        block_s = SHORT_CACHE_BLOCK_S
    splits = max(1, min(splits, MAX_SPLITS, math.ceil(seq_len / block_s)))
    return AttentionConfig(num_splits=splits, block_s=block_s)


# --- fitting the tables to a GPU's shared memory ---

# The attention kernel pipelines at most this much K/V in shared memory, even where a GPU allows more (an H200
# allows 227 KiB a block; the table's two stages take at most 85 KiB).
PIPELINE_SMEM_BYTES = 160 * 1024
# Shared memory the attention kernel takes beyond its K/V stages, per row of its padded query tile and column
# (head_dim + block_s fp32 values: q and p converted for the dots), plus a margin for Triton's small scratch.
ATTENTION_SMEM_MARGIN = 1024
# The smallest tiles the fitting goes down to (tl.dot needs 16; K blocks below 32 cost more than they save).
MIN_DOT_BLOCK_K = 32
MIN_DOT_BLOCK = 16
# Shared memory per row of an int4 tensor-core tile (of x and of the weight) for the kernel's layout conversions of
# its per-row vectors (scales, offsets, sums of x): Triton 3.6 took up to 39 on sm80/sm90.
INT4_DOT_SCRATCH_BYTES = 48


def dot_smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, x_bytes: int, w_bytes: int,
                   caps: DeviceCaps) -> int:
    """Shared memory the tensor-core kernel needs: num_stages - 1 buffered x and w tiles (the pipeliner keeps one
    stage in registers), or one without pipelining; AMD stages the weight tile converted to x's dtype (RDNA does),
    NVIDIA an int8 tile converted for an fp32 dot once more, and the fp32 accumulator may pass through shared
    memory for the store. Measured against Triton 3.6's compiled kernels by scripts/check_targets.py."""
    w_tile_bytes = max(w_bytes, x_bytes) if caps.vendor == "amd" else w_bytes
    buffers = max(num_stages - 1, 1)
    if caps.vendor == "nvidia" and caps.arch >= "sm90" and x_bytes == 2 and block_m >= 64:
        buffers = num_stages  # Hopper's wgmma path keeps every stage in shared memory
    stages = block_k * (block_m * x_bytes + block_n * w_tile_bytes) * buffers
    if buffers == num_stages and w_bytes < x_bytes:  # and the int8 tile once more
        stages += block_n * block_k * w_bytes
    if caps.vendor == "nvidia" and w_bytes < x_bytes == 4:  # int8 w for an fp32 dot: one converted tile as well
        stages += block_n * block_k * x_bytes
    return max(stages, block_m * block_n * 4)


def fitted_dot_config(n: int, k: int, w_bytes: int, x_bytes: int, m: int, caps: DeviceCaps) -> DotConfig | None:
    """dot_config's choice, made smaller until it fits caps' shared memory: fewer stages (not below 2), a shorter
    K block, one stage, fewer columns, fewer rows per tile. None when nothing fits: the caller takes cuBLAS/hipBLAS.
    A config that fits is returned unchanged (every H200 choice fits its 227 KiB)."""
    cfg = dot_config(n, k, w_bytes, m)
    block_m = dot_block_m(cfg, m)
    for c in _smaller_dot_configs(cfg, block_m):
        if dot_smem_bytes(c.block_m or block_m, c.block_n, c.block_k, c.num_stages, x_bytes, w_bytes,
                          caps) <= caps.shared_memory_per_block:
            return c
    return None


def dot_block_m(cfg: DotConfig, m: int) -> int:
    """Rows of x per tile: cfg.block_m, or m rounded up to a power of two in [16, DOT_MAX_BLOCK_M]."""
    return cfg.block_m or min(DOT_MAX_BLOCK_M, max(16, 1 << (max(m, 2) - 1).bit_length()))


def _smaller_dot_configs(cfg: DotConfig, block_m: int) -> Iterator[DotConfig]:
    """cfg, then ever smaller variants of it (block_m: the rows per tile cfg takes)."""
    yield cfg
    for stages in range(cfg.num_stages - 1, 1, -1):
        yield replace(cfg, num_stages=stages)
    block_k = cfg.block_k
    while block_k > MIN_DOT_BLOCK_K:
        block_k //= 2
        yield replace(cfg, block_k=block_k, num_stages=min(cfg.num_stages, 2))
    block_n, rows = cfg.block_n, block_m
    while True:
        yield replace(cfg, block_n=block_n, block_k=block_k, num_stages=1,
                      block_m=cfg.block_m if rows == block_m else rows)
        if block_n > MIN_DOT_BLOCK:
            block_n //= 2
        elif rows > MIN_DOT_BLOCK:
            rows //= 2
        else:
            return


def int4_dot_smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, x_bytes: int, group_size: int,
                        swap: bool, caps: DeviceCaps) -> int:
    """Shared memory the int4 tensor-core kernel needs: num_stages - 1 buffered x and packed weight tiles (x as it
    is stored, the weights at half a byte each); for fp32 x, whose full-precision dot runs on FMAs, both operands
    staged once more in fp32; on Hopper, wgmma's shared-memory operand of one sub-block of min(block_k, group_size)
    inputs in 16 bits (x's halves with swap and a weight tile of at least 64 rows, the dequantized weights for
    64-row x tiles without swap); the scratch of the small layout conversions; and the fp32 accumulator, which may
    pass through shared memory for the store. Checked against Triton 3.6's compiled kernels (sm80, sm90) by
    tests/test_kernels_int4_dot.py."""
    sub = min(block_k, group_size)
    total = block_k * (block_m * x_bytes + block_n // 2) * max(num_stages - 1, 1)
    if x_bytes == 4:
        total += (block_m + block_n) * block_k * 4
    elif caps.vendor == "nvidia" and caps.arch >= "sm90":
        if swap and block_n >= 64:
            total += block_m * sub * 2
        elif not swap and block_m >= 64:
            total += block_n * sub * 2
    total += (block_m + block_n) * INT4_DOT_SCRATCH_BYTES
    return max(total, block_m * block_n * 4)


def fitted_int4_dot_config(n: int, k: int, group_size: int, x_bytes: int, m: int,
                           caps: DeviceCaps) -> Int4DotConfig | None:
    """int4_dot_config's choice made smaller until it fits caps' shared memory (as fitted_dot_config does), or None:
    the caller dequantizes for cuBLAS/hipBLAS."""
    cfg = int4_dot_config(n, k, group_size, m)
    if caps.vendor == "amd":
        cfg = _amd_int4_dot_config(cfg, group_size)
    block_m = dot_block_m(cfg, m)
    for c in _smaller_dot_configs(cfg, block_m):
        if int4_dot_smem_bytes(c.block_m or block_m, c.block_n, c.block_k, c.num_stages, x_bytes, group_size, c.swap,
                               caps) <= caps.shared_memory_per_block:
            return c
    return None


def _amd_int4_dot_config(cfg: Int4DotConfig, group_size: int) -> Int4DotConfig:
    """The table's choice cut for AMD GPUs, where Triton 3.6 compiled it worse (scripts/check_targets.py on gfx90a,
    gfx942, gfx1100): 4 pipeline stages of a one-group K step failed to compile (3 and 5 compiled); 4 groups per step
    or 128-row weight tiles spilled registers (up to 2500 VGPRs on gfx90a), 2 groups and 64 rows did not on gfx90a
    and gfx942 (gfx1100, with 256 VGPRs a lane, still spills in some)."""
    return replace(cfg, num_stages=min(cfg.num_stages, 3), block_k=min(cfg.block_k, 2 * group_size),
                   block_n=min(cfg.block_n, 64), num_warps=4 if cfg.block_n > 64 else cfg.num_warps)


def attention_smem_bytes(block_g: int, block_s: int, head_dim: int, elt_bytes: int, num_stages: int,
                         caps: DeviceCaps, kv_bytes: int = 0) -> int:
    """Shared memory the split attention kernel needs: num_stages - 1 buffered K and V tiles (one without
    pipelining) and the fp32 query and probability tiles of the dots. kv_bytes: the cache's element size where it
    differs from the queries' elt_bytes (an e4m3 cache, 1): its tiles are buffered as codes, and one K and one V tile
    converted to the queries' dtype are staged for the dots (sm89, fp32 queries: 90,112 B where the codes alone
    would count 78,848)."""
    del caps  # NVIDIA and AMD measured alike (scripts/check_targets.py checks this estimate on every target)
    kv_bytes = kv_bytes or elt_bytes
    kv = 2 * block_s * head_dim * kv_bytes * max(num_stages - 1, 1)
    if kv_bytes != elt_bytes:
        kv += 2 * block_s * head_dim * elt_bytes
    return kv + block_g * (head_dim + block_s) * 4 + ATTENTION_SMEM_MARGIN


def fitted_attention_config(batch: int, n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int,
                            elt_bytes: int, caps: DeviceCaps, num_stages: int = 0,
                            kv_bytes: int = 0) -> AttentionConfig | None:
    """attention_config's choice for caps' SM count (with num_stages pipeline stages where given), with its stages
    and then its key blocks cut until it fits the shared memory (and PIPELINE_SMEM_BYTES); None when nothing fits:
    the caller takes the reference."""
    cfg = attention_config(batch, n_heads, n_kv_heads, seq_len, head_dim, max(caps.sm_count, 1))
    if num_stages:
        cfg = replace(cfg, num_stages=num_stages)
    block_g = max(16, 1 << max(n_heads // n_kv_heads - 1, 0).bit_length())
    limit = min(PIPELINE_SMEM_BYTES, caps.shared_memory_per_block)
    block_s = cfg.block_s
    while block_s >= 16:
        for stages in range(cfg.num_stages, 0, -1):
            if attention_smem_bytes(block_g, block_s, head_dim, elt_bytes, stages, caps, kv_bytes) <= limit:
                splits = max(1, min(cfg.num_splits, math.ceil(seq_len / block_s)))
                return AttentionConfig(splits, block_s, cfg.num_warps, stages)
        block_s //= 2
    return None


# --- the paged attention kernels ---

# Pipeline stages of the paged decode kernel (attention_config's splits and key blocks over the block table's key
# capacity): its page addresses are loaded one block ahead, and 3 stages then measured faster than 2 on an H200
# (benchmarks/bench_paged_attention.py, Llama-3-8B heads, bf16: 141.6 against 164.6 us at B=16 over 8192 keys,
# 17.7 against 19.7 us at B=1).
PAGED_DECODE_STAGES = 3


def paged_prefill_config(group: int, head_dim: int, elt_bytes: int) -> PagedPrefillConfig:
    """The paged prefill kernel's config (group: query heads per KV head). 16-bit, 128-wide heads: 128 query rows
    against 128 keys a step, 8 warps, 3 stages, the fastest of 8 configs on an H200 (benchmarks/
    bench_paged_attention.py --sweep, Llama-3-8B heads, bf16, 512-token chunks over 2048-8192 keys: 2983 against
    3520 us for 64-key steps at B=16 over 8192 keys). Otherwise (not measured): 64 keys a step, and 64 query rows in
    fp32, whose operands take twice the registers."""
    if elt_bytes == 4:
        cfg = PagedPrefillConfig(64, 64, 4, 3)
    elif head_dim >= 128:
        cfg = PagedPrefillConfig(128, 128, 8, 3)
    else:
        cfg = PagedPrefillConfig(128, 64, 4, 3)
    return replace(cfg, block_m=max(cfg.block_m, 1 << max(group - 1, 0).bit_length()))  # one token's heads at least


def paged_prefill_smem_bytes(block_m: int, block_n: int, head_dim: int, elt_bytes: int, num_stages: int,
                             caps: DeviceCaps) -> int:
    """Shared memory the paged prefill kernel needs: the query tile, num_stages - 1 buffered K and V tiles (one
    without pipelining; on Hopper's wgmma path at least two: Triton 3.6 took 160 KiB for 128 x 128 bf16 tiles at 2
    and 3 stages on sm90), the probability tile of the second dot, and fp32 scratch for layout conversions of
    per-row values and the key tile's page numbers. scripts/check_targets.py checks it on every target."""
    buffers = max(num_stages - 1, 1)
    if caps.vendor == "nvidia" and caps.arch >= "sm90" and elt_bytes == 2:
        buffers = max(num_stages - 1, 2)
    kv = 2 * block_n * head_dim * elt_bytes * buffers
    return block_m * head_dim * elt_bytes + kv + block_m * block_n * elt_bytes + 8 * (block_m + block_n) + \
        ATTENTION_SMEM_MARGIN


def fitted_paged_prefill_config(group: int, head_dim: int, elt_bytes: int,
                                caps: DeviceCaps) -> PagedPrefillConfig | None:
    """paged_prefill_config's choice with its stages, then its key block, then its query rows cut until it fits
    caps' shared memory; None when nothing fits (or a KV group does not fit a tile): the caller takes the reference."""
    cfg = paged_prefill_config(group, head_dim, elt_bytes)
    group_rows = 1 << max(group - 1, 0).bit_length()
    block_m = cfg.block_m
    while block_m >= max(MIN_DOT_BLOCK, group_rows):
        block_n = cfg.block_n
        while block_n >= MIN_DOT_BLOCK:
            for stages in range(cfg.num_stages, 0, -1):
                if paged_prefill_smem_bytes(block_m, block_n, head_dim, elt_bytes, stages,
                                            caps) <= caps.shared_memory_per_block:
                    warps = cfg.num_warps if block_m >= 128 else min(cfg.num_warps, 4)
                    return PagedPrefillConfig(block_m, block_n, warps, stages)
            block_n //= 2
        block_m //= 2
    return None


# --- the mixture-of-experts kernels ---

# Tokens up to which redline::moe_experts runs the GEMV kernels (each (token, expert) pair reads its expert's rows);
# more take the grouped tensor-core kernels (each chosen expert's weights read once per tile of its rows). Not yet
# measured on a GPU: a decode step of a few sequences is GEMV-bound either way.
MOE_GEMV_MAX_TOKENS = 4
MOE_MAX_BLOCK_M = 64  # the most (token, expert) rows per grouped tile


@dataclass(frozen=True)
class MoeGemvConfig:
    """Launch parameters of the MoE GEMV kernels: block_n weight rows per program (block_n gate rows and their up
    rows in the first kernel), block_k inputs per step, an fp32 accumulator tile of (block_n, block_k)."""

    block_n: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoeGemvConfig.{name} must be a power of two, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"invalid num_warps {self.num_warps}")


@dataclass(frozen=True)
class MoeDotConfig:
    """Launch parameters of the grouped MoE kernels: block_m (token, expert) rows of one expert per tile against
    block_n weight rows, block_k inputs per step (the first kernel holds a gate and an up weight tile)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoeDotConfig.{name} must be a power of two >= 16 (tl.dot tiles), got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"invalid num_warps {self.num_warps} or num_stages {self.num_stages}")


def moe_gemv_config(n: int, k: int, elt_bytes: int) -> MoeGemvConfig:
    """The GEMV kernels' config for n weight rows of k inputs (first kernel: n = I, k = dim; second: n = dim, k = I).
    Not measured yet: 4 rows a program (a few hundred to a few thousand programs on the Qwen3-MoE and Mixtral
    shapes) and 16 bytes per thread per row and step at 4 warps (8 fp32 accumulators a row); clamped to small
    shapes so a program's tile is not mostly masked."""
    block_k = 2048 // elt_bytes if elt_bytes < 4 else 256
    block_k = min(block_k, max(16, 1 << max(k - 1, 0).bit_length()))
    block_n = min(4, max(1, 1 << max(n - 1, 0).bit_length()))
    return MoeGemvConfig(block_n, block_k, 4 if block_k >= 512 else 2)


def moe_block_m(n_pairs: int, n_experts: int) -> int:
    """Rows per grouped tile: the mean rows per expert rounded up to a power of two in [16, MOE_MAX_BLOCK_M], so few
    tokens pad each expert's rows little and many fill whole tiles."""
    rows = -(-n_pairs // max(n_experts, 1))
    return min(MOE_MAX_BLOCK_M, max(16, 1 << max(rows - 1, 0).bit_length()))


def moe_dot_config(n_pairs: int, n_experts: int, elt_bytes: int) -> MoeDotConfig:
    """The grouped kernels' config (both kernels take it) for n_pairs = tokens x top-k rows over n_experts. Not
    measured yet: 64-wide weight tiles and 64-input steps in 3 stages for 16-bit (two 64 x 64 fp32 accumulators
    in the first kernel at block_m 64); fp32 (full-precision dots on FMAs) half the tile in 2 stages."""
    block_m = moe_block_m(n_pairs, n_experts)
    if elt_bytes == 4:
        return MoeDotConfig(block_m, 32, 32, 4, 2)
    return MoeDotConfig(block_m, 64, 64, 4, 3)


def moe_dot_smem_bytes(cfg: MoeDotConfig, elt_bytes: int, weight_tiles: int, caps: DeviceCaps) -> int:
    """Shared memory of one grouped kernel: the tensor-core kernel's estimate (dot_smem_bytes) with weight_tiles
    weight tiles a step (2: the gate and up tiles of the first kernel), plus the gathered rows' indices. Checked
    against the compiled kernels by scripts/check_targets.py."""
    tiles = dot_smem_bytes(cfg.block_m, weight_tiles * cfg.block_n, cfg.block_k, cfg.num_stages, elt_bytes,
                           elt_bytes, caps)
    return tiles + 8 * cfg.block_m


def fitted_moe_dot_config(n_pairs: int, n_experts: int, elt_bytes: int, caps: DeviceCaps) -> MoeDotConfig | None:
    """moe_dot_config's choice (8 warps for 64-row tiles on RDNA) made smaller until both grouped kernels fit caps'
    shared memory (fewer stages, a shorter K block, fewer columns, fewer rows, as fitted_dot_config does), or None:
    the op takes the reference."""
    cfg = moe_dot_config(n_pairs, n_experts, elt_bytes)
    if caps.vendor == "amd" and caps.warp_size == 32 and cfg.block_m >= 64:
        # RDNA (wave32, 256 VGPRs a lane): 64-row tiles at 4 warps spilled registers in Triton 3.6 (gfx1100, the
        # first kernel's two accumulators); 8 warps share them
        cfg = replace(cfg, num_warps=8)
    for c in _smaller_dot_configs(cfg, cfg.block_m):
        if moe_dot_smem_bytes(c, elt_bytes, 2, caps) <= caps.shared_memory_per_block:
            return c
    return None


@dataclass(frozen=True)
class Fp8DotConfig:
    """Launch parameters of the FP8 W8A8 tensor-core kernel (triton_fp8.fp8_dot)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Fp8DotConfig.{name} must be a power of two >= 16 (tl.dot tiles), got {value}")
        if self.block_k > 128:
            raise ValueError(f"Fp8DotConfig.block_k must divide the 128-input weight blocks, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"invalid num_warps {self.num_warps} or num_stages {self.num_stages}")


def fp8_dot_smem(cfg: Fp8DotConfig) -> int:
    """Shared memory of the FP8 kernel's pipeline: num_stages tiles of x and of w, one byte an element (the fp32
    output tile is converted in registers)."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k


def fp8_dot_config(m: int, n: int, k: int, caps: DeviceCaps) -> Fp8DotConfig:
    """The FP8 kernel's config, from the shape alone: rows in tiles of 16-128 (a decode batch in one tile, so each
    weight byte is read once; a prefill in 128-row tiles), 128 outputs and 128 inputs a step (the weight blocks'
    size), as many pipeline stages as fit the GPU's shared memory (up to 4). Not yet tuned on a GPU."""
    block_m = min(128, max(16, 1 << max(m - 1, 1).bit_length()))
    cfg = Fp8DotConfig(block_m, 128, 128, 8 if block_m >= 64 else 4, 4)
    while cfg.num_stages > 1 and caps.shared_memory_per_block and fp8_dot_smem(cfg) > caps.shared_memory_per_block:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg
