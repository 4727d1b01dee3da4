"""The int4 GEMV on one GPU, in one process: correctness against the reference, per-shape speed next to torch's
int4 kernel (tinygemm, `aten._weight_int4pack_mm`), a config sweep, then the decode benchmark of benchmarks/bench.py.

    python benchmarks/bench_int4.py [--skip-decode] [--json FILE]
    python benchmarks/bench_int4.py --rows 4,16,64 [--groupsize 128,32] [--no-sweep] [--json FILE]

--rows times the int4 tensor-core kernel (2-256 rows of x) on the 7B shapes instead, with its table's config and a
sweep of alternatives, against dequantizing for cuBLAS (the int4 op's path for long prompts) and against bf16's
tensor-core kernel on bf16 weights of the same shapes; GB/s counts the weight bytes each one reads.

Every GEMV time is a CUDA graph of back-to-back calls whose weights rotate over enough copies that the bytes read
between two uses of one copy exceed the L2 cache. The "tinygemm ceiling" is 1 / (the sum of tinygemm's GEMV times
for one token of the model): the tok/s its GEMVs alone allow. bench.py's `--quant int4` reports it too.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from typing import Any

import torch

from redline.model import ModelArgs
from redline.profiling import cuda_graph_us_per_call

# Bytes of weights read between two uses of one copy: five times an H200's 60 MB L2.
ROTATE_BYTES = 5 * 60 * 2**20
# Back-to-back calls per captured graph and graph replays per measurement.
CALLS, REPEATS = 20, 10
# tinygemm's K tiling (what torchao and gpt-fast pass).
INNER_K_TILES = 8
# (block_n, block_k, num_warps, num_stages, block_m, swap) of the int4 tensor-core kernel tried on each 7B shape.
INT4_DOT_SWEEP = [(64, 256, 4, 4, 0, True), (64, 128, 4, 4, 0, True), (128, 256, 4, 3, 0, True),
                  (128, 128, 4, 4, 0, True), (128, 128, 8, 4, 0, True), (64, 512, 4, 3, 0, True),
                  (32, 256, 4, 4, 0, False), (64, 256, 4, 4, 0, False), (32, 512, 4, 4, 0, False),
                  (64, 128, 4, 3, 64, True)]
# (block_n, block_k, num_warps, depth) of the int4 GEMV: the kernel wants block_k >= 1024 inputs per warp (one
# 32-input chunk per thread); rows per program and warps trade x reuse against programs in flight.
INT4_SWEEP = [(4, 1024, 1, 1), (8, 1024, 1, 1), (16, 1024, 1, 1), (8, 1024, 1, 2), (16, 1024, 1, 2),
              (4, 2048, 2, 2), (8, 2048, 2, 2), (8, 2048, 2, 1), (16, 2048, 2, 1), (8, 4096, 4, 1),
              (16, 4096, 4, 1), (8, 2048, 1, 1)]


def fastest(candidates: list[tuple], us_of: Any) -> tuple[tuple | None, float | None]:
    """(config, µs) of the fastest of `candidates` by us_of(config); a config that does not compile or fit is
    skipped with a line, not fatal; (None, None) when none runs."""
    best = (None, None)
    for c in candidates:
        try:
            t = us_of(c)
        except Exception as exc:
            print(f"  config {c} failed: {type(exc).__name__}", flush=True)
            continue
        if best[1] is None or t < best[1]:
            best = (c, t)
    return best


def model_gemv_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(N, K) of one token's projections: per block wqkv, wo, w13, w2, and the output head."""
    return {"wqkv": (args.q_size + 2 * args.kv_size, args.dim), "wo": (args.dim, args.q_size),
            "w13": (2 * args.intermediate_size, args.dim), "w2": (args.dim, args.intermediate_size),
            "lm_head": (args.vocab_size, args.dim)}


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1)))


def random_int4(n: int, k: int, group_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed weights (uint8 (N, K/2)) and [scale, offset] (fp16 (N, K/G, 2)) in quantize.py's layout."""
    w = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.int32).to(torch.uint8)
    sz = torch.empty(n, k // group_size, 2, device=device, dtype=torch.float16)
    sz[..., 0].uniform_(0.002, 0.01)
    sz[..., 1].uniform_(-0.05, 0.0)
    return w, sz


def tinygemm_us(n: int, k: int, group_size: int, device: torch.device) -> float:
    """µs per call of aten._weight_int4pack_mm for one bf16 row (its own packing of random codes)."""
    copies = copies_for(n * k // 2)
    mats = []
    for _ in range(copies):
        codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.int32).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(codes, INNER_K_TILES)
        sz = torch.rand(k // group_size, n, 2, device=device, dtype=torch.bfloat16) * 0.01
        mats.append((packed, sz))
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    calls = [lambda p=p, s=s: torch._weight_int4pack_mm(x, p, group_size, s) for p, s in mats]
    return cuda_graph_us_per_call([calls[i % copies] for i in range(CALLS)], REPEATS)


def redline_us(n: int, k: int, group_size: int, device: torch.device, config: Any = None,
               half2: bool | None = None) -> float:
    from redline.kernels.triton_int4 import gemv_int4

    copies = copies_for(n * k // 2)
    mats = [random_int4(n, k, group_size, device) for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
    calls = [lambda w=w, s=s: gemv_int4(x, w, s, out, config=config, half2=half2) for w, s in mats]
    return cuda_graph_us_per_call([calls[i % copies] for i in range(CALLS)], REPEATS)


def int4_bytes(n: int, k: int, group_size: int) -> int:
    return n * k // 2 + n * (k // group_size) * 4


def tinygemm_anchor(name: str, group_size: int, device: torch.device, log: Any) -> dict[str, Any]:
    """tinygemm's GEMV time on each of the model's shapes and the tok/s its GEMVs alone allow."""
    args = ModelArgs.from_name(name)
    shapes = model_gemv_shapes(args)
    us = {part: tinygemm_us(n, k, group_size, device) for part, (n, k) in shapes.items()}
    token_us = args.n_layer * sum(us[p] for p in ("wqkv", "wo", "w13", "w2")) + us["lm_head"]
    ceiling = 1e6 / token_us
    log(f"{name} tinygemm int4 g{group_size}: " + ", ".join(f"{p} {t:.1f} us" for p, t in us.items())
        + f"; GEMV ceiling {ceiling:.0f} tok/s")
    return {"model": name, "group_size": group_size, "us": us, "ceiling_tok_s": ceiling}


def check_correctness(device: torch.device) -> float:
    """Max relative error of the int4 GEMV (plain and fused) against the fp32 reference on real and odd shapes."""
    from redline.kernels.linear import fused_linear_reference, int4_linear_reference
    from redline.kernels.triton_int4 import gemv_int4

    worst = 0.0
    shapes = [(12288, 4096), (4096, 11008), (22016, 4096), (6144, 4096), (4096, 14336), (10240, 8192),
              (8192, 28672), (57344, 8192), (32000, 4096), (1000, 96), (7, 32), (333, 4160), (64, 1056)]
    for n, k in shapes:
        for g in (32, 64, 128, 256):
            if k % g:
                continue
            w, sz = random_int4(n, k, g, device)
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            ref = int4_linear_reference(x, w, sz).float()
            err = ((gemv_int4(x, w, sz).float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
            worst = max(worst, err)
            print(f"check int4 GEMV N={n} K={k} g{g}: max error / max |y| = {err:.2e}", flush=True)
    for n, k, g in ((22016, 4096, 128), (1002, 288, 32)):  # fused: norm + SwiGLU, and norm + residual
        w, sz = random_int4(n, k, g, device)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        nw = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
        for swiglu in (True, False):
            res = None if swiglu else torch.randn(1, n, device=device, dtype=torch.bfloat16)
            ref = fused_linear_reference(x, w, sz, nw, 1e-5, res, swiglu).float()
            got = gemv_int4(x, w, sz, norm_weight=nw, eps=1e-5, residual=None if res is None else res.view(-1),
                            swiglu=swiglu).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            print(f"check fused int4 GEMV N={n} K={k} g{g} swiglu={swiglu}: {err:.2e}", flush=True)
    return worst


def time_shapes(device: torch.device, sweep: bool) -> list[dict[str, Any]]:
    from redline.kernels.configs import GemvConfig

    rows = []
    shapes = model_gemv_shapes(ModelArgs.from_name("Llama-2-7B"))
    for g in (128, 32):
        for part, (n, k) in shapes.items():
            nbytes = int4_bytes(n, k, g)
            ours, tiny = redline_us(n, k, g, device), tinygemm_us(n, k, g, device)
            fp32 = redline_us(n, k, g, device, half2=False)  # the same table, fp32 products
            row = {"group_size": g, "part": part, "n": n, "k": k, "redline_us": ours, "tinygemm_us": tiny,
                   "redline_fp32_products_us": fp32, "redline_gb_s": nbytes / ours / 1e3,
                   "tinygemm_gb_s": nbytes / tiny / 1e3}
            if sweep:
                row["best_config"], row["best_us"] = fastest(
                    INT4_SWEEP, lambda c: redline_us(n, k, g, device, GemvConfig(*c)))
            rows.append(row)
            print(f"7B {part} g{g}: redline {ours:.1f} us ({row['redline_gb_s']:.0f} GB/s; fp32 products {fp32:.1f} "
                  f"us), tinygemm {tiny:.1f} us "
                  f"({row['tinygemm_gb_s']:.0f} GB/s)" + (f", best {row['best_config']} {row['best_us']:.1f} us"
                                                          if sweep and row.get('best_us') else ""), flush=True)
    return rows


def rotated_us(make, nbytes: int) -> float:
    """µs per call of make(i) (a call on weight copy i) in a CUDA graph over enough copies to rotate past L2."""
    copies = copies_for(nbytes)
    calls = [make(i) for i in range(copies)]
    return cuda_graph_us_per_call([calls[i % copies] for i in range(CALLS)], REPEATS)


def time_rows_shape(n: int, k: int, g: int, m: int, device: torch.device, sweep: bool) -> dict[str, Any]:
    """One 7B shape at m rows: the int4 tensor-core kernel (table config, and the sweep), dequantize + cuBLAS, and
    bf16's tensor-core kernel, in µs and GB/s of weights read."""
    from redline.kernels.configs import Int4DotConfig, fitted_int4_dot_config
    from redline.kernels.device import device_caps
    from redline.kernels.linear import _int4_matmul, int4_linear_reference
    from redline.kernels.triton_int4_dot import int4_dot
    from redline.kernels.triton_linear import small_m_dot

    nbytes = int4_bytes(n, k, g)
    mats = [random_int4(n, k, g, device) for _ in range(copies_for(nbytes))]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    ref = int4_linear_reference(x, *mats[0]).float()
    err = ((int4_dot(x, *mats[0]).float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()

    def int4_us(config: Any) -> float:
        return rotated_us(lambda i: lambda: int4_dot(x, *mats[i % len(mats)], out, config=config), nbytes)

    table = fitted_int4_dot_config(n, k, g, 2, m, device_caps(device))
    row = {"group_size": g, "n": n, "k": k, "rows": m, "config": table, "max_rel_error": err,
           "int4_dot_us": int4_us(table),
           "dequant_cublas_us": rotated_us(lambda i: lambda: _int4_matmul(x, *mats[i % len(mats)]), nbytes)}
    bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
    row["bf16_dot_us"] = rotated_us(lambda i: lambda: small_m_dot(x, bf16[i % len(bf16)], None, out), n * k * 2)
    del bf16
    if sweep:
        row["best_config"], row["best_us"] = fastest(INT4_DOT_SWEEP, lambda c: int4_us(Int4DotConfig(*c)))
    for key in ("int4_dot", "dequant_cublas"):
        row[f"{key}_gb_s"] = nbytes / row[f"{key}_us"] / 1e3
    row["bf16_dot_gb_s"] = n * k * 2 / row["bf16_dot_us"] / 1e3
    return row


def time_rows(device: torch.device, rows: list[int], group_sizes: list[int], sweep: bool) -> list[dict[str, Any]]:
    """time_rows_shape on the 7B shapes (one token's projections and the head) for every group size and row count."""
    out = []
    for g in group_sizes:
        for part, (n, k) in model_gemv_shapes(ModelArgs.from_name("Llama-2-7B")).items():
            for m in rows:
                r = time_rows_shape(n, k, g, m, device, sweep)
                out.append({"part": part, **r})
                best = f", best {r['best_config']} {r['best_us']:.1f} us" if r.get("best_us") else ""
                print(f"7B {part} g{g} rows={m}: int4 dot {r['int4_dot_us']:.1f} us ({r['int4_dot_gb_s']:.0f} GB/s; "
                      f"{r['config']}){best}; dequantize + cuBLAS {r['dequant_cublas_us']:.1f} us "
                      f"({r['dequant_cublas_gb_s']:.0f} GB/s); bf16 dot {r['bf16_dot_us']:.1f} us "
                      f"({r['bf16_dot_gb_s']:.0f} GB/s); int4 / bf16 time {r['int4_dot_us'] / r['bf16_dot_us']:.2f}; "
                      f"max error / max |y| {r['max_rel_error']:.1e}", flush=True)
    return out


def parse_ints(text: str) -> list[int]:
    """Comma-separated integers ("4,16,64"), or [] when the text is not that."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-decode", action="store_true", help="only the kernel checks and timings")
    p.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    p.add_argument("--json", default=None, help="write the kernel numbers here")
    p.add_argument("--rows", default=None,
                   help="comma-separated rows of x (2-256, e.g. 4,16,64): time the int4 tensor-core kernel instead")
    p.add_argument("--groupsize", default="128,32", help="with --rows: comma-separated group sizes (default 128,32)")
    ns = p.parse_args(argv)
    rows = parse_ints(ns.rows) if ns.rows is not None else None
    group_sizes = parse_ints(ns.groupsize)
    if rows is not None and (not rows or not all(2 <= m <= 256 for m in rows)):
        print(f"error: --rows takes the int4 tensor-core kernel's rows, 2-256, comma-separated (e.g. 4,16,64); "
              f"got {ns.rows!r}", file=sys.stderr)
        return 2
    if not group_sizes or any(g < 32 or g & (g - 1) for g in group_sizes):
        print(f"error: --groupsize takes powers of two >= 32 (32, 64, 128, 256), got {ns.groupsize}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench_int4 needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if rows is not None:
        results = time_rows(device, rows, group_sizes, not ns.no_sweep)
        worst = max(r["max_rel_error"] for r in results)
        print(f"int4 tensor-core kernel worst relative error: {worst:.2e} ({'OK' if worst < 4e-3 else 'FAIL'})")
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"rows": [{**r, "config": str(r["config"])} for r in results]}, f, indent=1)
        return 0 if worst < 4e-3 else 1
    worst = check_correctness(device)
    print(f"int4 GEMV worst relative error: {worst:.2e} ({'OK' if worst < 2e-2 else 'FAIL'})", flush=True)
    rows = time_shapes(device, not ns.no_sweep)
    for g in (128, 32):
        us = {r["part"]: r for r in rows if r["group_size"] == g}
        for who in ("redline", "redline_fp32_products", "tinygemm"):
            token = 32 * sum(us[p][f"{who}_us"] for p in ("wqkv", "wo", "w13", "w2")) + us["lm_head"][f"{who}_us"]
            print(f"7B g{g} {who} GEMVs alone: {1e6 / token:.0f} tok/s", flush=True)
        if all(us[p].get("best_us") for p in us):
            token = 32 * sum(us[p]["best_us"] for p in ("wqkv", "wo", "w13", "w2")) + us["lm_head"]["best_us"]
            print(f"7B g{g} redline GEMVs alone, best swept configs: {1e6 / token:.0f} tok/s", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"worst_error": worst, "shapes": rows}, f, indent=1)
    if ns.skip_decode:
        return 0 if worst < 2e-2 else 1
    status = 0
    for g in ("128", "32"):  # the decode benchmark in its own process: bench.py imports this module's anchor
        status |= subprocess.call([sys.executable, "-m", "redline.benchmarks.bench", "--model", "Llama-2-7B", "--quant",
                                   "int4", "--groupsize", g, "--new-tokens", "200", "--runs", "5", "--bandwidth-gib", "2"])
    return status or (0 if worst < 2e-2 else 1)


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.bench_int4 import main as package_main

    sys.exit(package_main())
