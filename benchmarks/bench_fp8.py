#!/usr/bin/env python3
"""The FP8 linear's kernels on one GPU with FP8 (sm89+), on Llama-3-8B's projection shapes: which GEMM to use.

    python benchmarks/bench_fp8.py [--rows 1,16,64,256,1024,4096] [--json FILE]

For each projection and row count: bf16 F.linear (cuBLAS), the int8 op (redline::int8_linear), and the fp8 op's two
GEMMs (kernels.linear.fp8_matmul with backend "scaled_mm": torch._scaled_mm's row-wise FP8 GEMM, and "triton":
triton_fp8.fp8_dot), both including the per-token quantization of x; at one row the fp8 op's GEMV (the int8 GEMV's
kernel on FP8 bytes) against the int8 GEMV, and that GEMV with each of its e4m3 conversions (int32 words through
PTX, int32 words through integer ops, one byte at a time through Triton's cast). Each time is the median of 20
replays of a CUDA graph of 10 calls, with the weights rotated over enough copies to exceed L2 (so the bytes come
from HBM, as in a model). Every fp8 result is first checked against the fp32 reference
(quantize.fp8_linear_reference). The eager columns are each op's wall time per call launched 50 times without a
graph (the host's share included). Prints one table; --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# Llama-3-8B: (name, N, K)
SHAPES = (("wqkv", 6144, 4096), ("wo", 4096, 4096), ("w13", 28672, 4096), ("w2", 4096, 14336))
CALLS = 10  # calls per CUDA graph
L2_BYTES = 64 << 20  # rotate weights over at least 4x this many bytes


def timed(fn, weights: list) -> float:
    """Median seconds per call of fn(weight) over CALLS calls rotating through `weights`, as a CUDA graph."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times)


def eager(fn, arg) -> float:
    """Wall seconds per call of fn(arg) launched eagerly 50 times in a row (host overhead included: what an
    uncompiled prefill of a few tokens pays per linear)."""
    import time

    fn(arg)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        fn(arg)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50


def copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, -(-4 * L2_BYTES // nbytes)))]


def bench_shape(name: str, n: int, k: int, rows: list[int]) -> list[dict]:
    from redline.kernels.linear import fp8_gemm_backend, fp8_matmul
    from redline.quantize import fp8_linear_reference, quantize_fp8, quantize_int8

    w = torch.randn(n, k, device="cuda") / k ** 0.5
    q8, s8 = quantize_int8(w)
    f8, sf = quantize_fp8(w)
    bf = copies(lambda: w.to(torch.bfloat16), n * k * 2)
    int8 = copies(lambda: (q8.clone(), s8.clone()), n * k)
    fp8 = copies(lambda: (f8.clone(), sf.clone()), n * k)
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = fp8_linear_reference(x.float(), f8, sf)
        row = {"shape": name, "n": n, "k": k, "rows": m,
               "bf16_us": 1e6 * timed(lambda b: F.linear(x, b), bf),
               "int8_us": 1e6 * timed(lambda p: torch.ops.redline.int8_linear(x, *p), int8),
               "fp8_op_us": 1e6 * timed(lambda p: torch.ops.redline.fp8_linear(x, *p), fp8),
               "fp8_op_backend": "gemv" if m == 1 else fp8_gemm_backend(x, f8, sf),
               "eager_bf16_us": 1e6 * eager(lambda b: F.linear(x, b), bf[0]),
               "eager_int8_us": 1e6 * eager(lambda p: torch.ops.redline.int8_linear(x, *p), int8[0]),
               "eager_fp8_us": 1e6 * eager(lambda p: torch.ops.redline.fp8_linear(x, *p), fp8[0])}
        if m == 1:  # the FP8 GEMV's weight conversions: words by PTX (the default), words portable, single bytes
            from redline.kernels import triton_linear

            ref = fp8_linear_reference(x.float(), f8, sf)
            for label, kw in (("words_ptx", {"int8_mode": 2}), ("words_int", {"int8_mode": 1}),
                              ("bytes", {"words": False})):
                def gemv(p, kw=kw):
                    return triton_linear.gemv(x, p[0], p[1], pdl=False, **kw)
                err = ((gemv((f8, sf)).float() - ref).abs().max() / ref.abs().max()).item()
                if err > 1e-2:
                    raise RuntimeError(f"{name} GEMV {label}: relative error {err:.2e} against the reference")
                row[f"fp8_gemv_{label}_us"] = 1e6 * timed(gemv, fp8)
        if m > 1:
            for backend in ("scaled_mm", "triton"):
                if backend == "scaled_mm" and fp8_gemm_backend(x, f8, sf) != "scaled_mm":
                    continue
                got = fp8_matmul(x, f8, sf, backend=backend).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                if err > 1e-2:
                    raise RuntimeError(f"{name} rows {m} {backend}: relative error {err:.2e} against the reference")
                row[f"fp8_{backend}_us"] = 1e6 * timed(lambda p: fp8_matmul(x, *p, backend=backend), fp8)
        out.append(row)
        print(format_row(row), flush=True)
    return out


def format_row(r: dict) -> str:
    keys = ("fp8_scaled_mm_us", "fp8_triton_us", "fp8_gemv_words_ptx_us", "fp8_gemv_words_int_us", "fp8_gemv_bytes_us")
    extra = "".join(f"  {key[4:-3]} {r[key]:8.1f}" for key in keys if key in r)
    return (f"{r['shape']:5} rows {r['rows']:5}: bf16 {r['bf16_us']:8.1f} us  int8 {r['int8_us']:8.1f}  fp8 op "
            f"({r['fp8_op_backend']}) {r['fp8_op_us']:8.1f}{extra}  fp8/bf16 {r['bf16_us'] / r['fp8_op_us']:.2f}x  "
            f"eager bf16/int8/fp8 {r['eager_bf16_us']:.1f}/{r['eager_int8_us']:.1f}/{r['eager_fp8_us']:.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64,256,1024,4096", help="comma-separated row counts of x")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)
    from redline.kernels.device import fp8_refusal

    if not torch.cuda.is_available() or (refusal := fp8_refusal("cuda")) is not None:
        print(f"error: {'no CUDA GPU' if not torch.cuda.is_available() else refusal}", file=sys.stderr)
        return 2
    try:
        rows = [int(r) for r in ns.rows.split(",")]
    except ValueError:
        print(f"error: --rows takes comma-separated integers, got {ns.rows!r}", file=sys.stderr)
        return 2
    results = [r for name, n, k in SHAPES for r in bench_shape(name, n, k, rows)]
    if ns.json:
        ns.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
