"""Benchmark the decode GEMVs: cuBLAS (F.linear) vs redline bf16 vs redline int8, at M=1.

Each measurement replays a CUDA graph of CALLS back-to-back calls whose weights rotate over enough
copies that the weights read between two uses of one copy exceed the L2 cache (60 MB on an H200)
several times, and takes the median over REPS replays timed with CUDA events. The read bandwidth is
measured in the same process (a large bf16 .sum(), CUDA events, median of 20), and each row shows
the share of it that the kernel reaches.

    python benchmarks/bench_kernels.py --json out/bench_kernels.json
    python benchmarks/bench_kernels.py --sweep --msweep --json out/sweep.json   # also try configs
    python benchmarks/bench_kernels.py --msweep --dot-sweep --m-rows 32,64,256 --no-table   # batches

--sweep times several (BLOCK_N, BLOCK_K, num_warps, depth, red) configs of the GEMV kernel per shape
(and the best one without PDL); --msweep compares the ops with cuBLAS at M = 2, 4, 8, 16 on the 7B
wo, w13 and w2 shapes, or at the rows given by --m-rows (with --sweep or --dot-sweep also tensor-core kernel
configs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import astuple

import torch
import torch.nn.functional as F

from redline.kernels.configs import DotConfig, GemvConfig
from redline.kernels import linear as kernels  # registers torch.ops.redline
from redline.profiling import cuda_graph_us_per_call, read_bandwidth_gb_s

LLAMA2_7B = {"wqkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008),
             "lm_head": (32000, 4096)}
LLAMA3_8B = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336),
             "lm_head": (128256, 4096)}
N_LAYERS_7B = 32
L2_BYTES = 60 * 2**20
ROTATE_BYTES = 5 * L2_BYTES  # bytes of weights between two uses of one copy

# (BLOCK_N, BLOCK_K, num_warps, depth, red) of the GEMV kernel, M=1
BF16_SWEEP = [(2, 1024, 4, 2, False), (2, 2048, 4, 2, False), (1, 1024, 2, 2, False), (4, 512, 4, 2, False),
              (2, 1024, 4, 2, True), (2, 2048, 4, 2, True), (1, 1024, 2, 2, True), (1, 2048, 4, 2, True),
              (4, 512, 2, 2, True), (2, 512, 2, 2, True), (4, 1024, 4, 2, True), (2, 2048, 8, 2, True)]
INT8_SWEEP = [(4, 512, 2, 2, False), (2, 1024, 2, 2, False), (2, 2048, 4, 1, False), (4, 512, 2, 2, True),
              (2, 1024, 2, 2, True), (4, 1024, 4, 2, True), (8, 512, 4, 2, True), (2, 2048, 4, 2, True),
              (4, 1024, 2, 2, True), (8, 1024, 4, 2, True)]
INT8_MODES = (2,)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core kernel for 2 <= M <= 16
DOT_SWEEP = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (16, 512, 4, 3),
             (32, 512, 4, 3), (64, 256, 4, 3)]
# the same for 17..64 rows (x padded to 32 or 64 rows)
MEDIUM_DOT_SWEEP = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5), (64, 128, 4, 4),
                    (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3),
                    (32, 256, 4, 3, 32), (64, 128, 4, 4, 32), (128, 64, 4, 4, 32), (64, 64, 4, 5, 32)]
# more than 64 rows: several row tiles (the 5th field is the rows per tile)
LARGE_DOT_SWEEP = [(64, 64, 4, 4, 64), (128, 64, 4, 4, 64), (128, 64, 8, 3, 64), (64, 128, 4, 3, 64),
                   (128, 128, 8, 3, 64), (256, 64, 8, 3, 64), (128, 128, 8, 3, 128), (128, 64, 8, 4, 128),
                   (256, 64, 8, 3, 128), (64, 128, 4, 3, 32)]








class Weights:
    """`copies` random copies of one (N, K) weight, in bf16 and int8 (+ fp32 scales)."""

    def __init__(self, n: int, k: int, dtype=torch.bfloat16):
        self.n, self.k = n, k
        bf16_bytes = n * k * 2
        self.copies = max(2, math.ceil(ROTATE_BYTES / (n * k)))  # sized for int8, the smaller
        self.w, self.q, self.s = [], [], []
        for i in range(self.copies):
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
            if i < max(2, math.ceil(ROTATE_BYTES / bf16_bytes)):
                self.w.append(w)
            s = w.float().abs().amax(dim=1) / 127.0
            self.q.append(torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8))
            self.s.append(s)
            del w

    def bytes(self, kind: str) -> int:
        return self.n * self.k * (2 if kind == "bf16" else 1) + (self.n * 4 if kind == "int8" else 0)


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_impls(W: Weights, x: torch.Tensor, calls: int, reps: int, extra: bool) -> dict:
    tk = kernels.triton_linear()
    res = {}
    nw, nq = len(W.w), len(W.q)
    res["cublas"] = cuda_graph_us_per_call([lambda i=i: F.linear(x, W.w[i % nw]) for i in range(calls)], reps)
    res["redline_bf16"] = cuda_graph_us_per_call(
        [lambda i=i: torch.ops.redline.linear(x, W.w[i % nw]) for i in range(calls)], reps)
    res["redline_int8"] = cuda_graph_us_per_call(
        [lambda i=i: torch.ops.redline.int8_linear(x, W.q[i % nq], W.s[i % nq]) for i in range(calls)], reps)
    if extra:  # the same kernels without programmatic dependent launch
        res["bf16_nopdl"] = cuda_graph_us_per_call(
            [lambda i=i: tk.gemv(x.view(-1, W.k), W.w[i % nw], pdl=False) for i in range(calls)], reps)
        res["int8_nopdl"] = cuda_graph_us_per_call(
            [lambda i=i: tk.gemv(x.view(-1, W.k), W.q[i % nq], W.s[i % nq], pdl=False) for i in range(calls)], reps)
    # correctness of what was timed
    ref = kernels.linear_reference(x, W.w[0])
    res["err_bf16"] = rel_err(torch.ops.redline.linear(x, W.w[0]), ref)
    res["err_int8"] = rel_err(torch.ops.redline.int8_linear(x, W.q[0], W.s[0]),
                              kernels.int8_linear_reference(x, W.q[0], W.s[0]))
    return res


def sweep_shape(W: Weights, m: int, calls: int, reps: int, cfgs_bf16, cfgs_int8, modes=True) -> list:
    tk = kernels.triton_linear()
    x = torch.randn(m, W.k, device="cuda", dtype=torch.bfloat16)
    rows = []
    nw, nq = len(W.w), len(W.q)
    variants = [("bf16", c, True, 2) for c in cfgs_bf16]
    variants += [("int8", c, True, mode) for c in cfgs_int8 for mode in INT8_MODES]
    for kind, cfg_t, pdl, mode in variants:
        cfg = GemvConfig(*cfg_t)
        bn, bk, warps, depth = cfg_t[:4]
        if kind == "bf16":
            mk = lambda i, cfg=cfg, pdl=pdl: tk.gemv(x, W.w[i % nw], config=cfg, pdl=pdl)
            ref = kernels.linear_reference(x, W.w[0])
        else:
            mk = lambda i, cfg=cfg, pdl=pdl, mode=mode: tk.gemv(x, W.q[i % nq], W.s[i % nq], config=cfg, pdl=pdl,
                                                                 int8_mode=mode)
            ref = kernels.int8_linear_reference(x, W.q[0], W.s[0])
        try:
            err = rel_err(mk(0), ref)
            us = cuda_graph_us_per_call([lambda i=i: mk(i) for i in range(calls)], reps)
        except Exception as e:  # a config that fails to compile or run is reported, not fatal
            rows.append(dict(kind=kind, cfg=list(cfg_t), pdl=pdl, mode=mode, error=repr(e)[:300]))
            print("  FAIL", kind, cfg_t, repr(e)[:200], flush=True)
            continue
        gbs = W.bytes(kind) / us / 1e3
        rows.append(dict(kind=kind, cfg=list(cfg_t), pdl=pdl, mode=mode, us=us, gbs=gbs, err=err))
        print(f"  {kind} m={m} cfg={cfg_t} pdl={int(pdl)} mode={mode}: {us:8.2f} us "
              f"{gbs:7.0f} GB/s err {err:.1e}", flush=True)
    if modes:  # best configs again without PDL, and int8 with the other conversions
        for kind in ("bf16", "int8"):
            ok = [r for r in rows if r["kind"] == kind and "us" in r and r["err"] < 1e-2]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["us"])
            extra = [(best["cfg"], False, best["mode"])]
            for cfg, pdl, mode in extra:
                rows += sweep_shape_one(W, x, kind, GemvConfig(*cfg), pdl, mode, calls, reps)
    return rows


def sweep_shape_one(W, x, kind, cfg, pdl, mode, calls, reps):
    tk = kernels.triton_linear()
    nw, nq = len(W.w), len(W.q)
    if kind == "bf16":
        mk = lambda i: tk.gemv(x, W.w[i % nw], config=cfg, pdl=pdl)
        ref = kernels.linear_reference(x, W.w[0])
    else:
        mk = lambda i: tk.gemv(x, W.q[i % nq], W.s[i % nq], config=cfg, pdl=pdl, int8_mode=mode)
        ref = kernels.int8_linear_reference(x, W.q[0], W.s[0])
    try:
        err = rel_err(mk(0), ref)
        us = cuda_graph_us_per_call([lambda i=i: mk(i) for i in range(calls)], reps)
    except Exception as e:
        print("  FAIL", kind, cfg, pdl, mode, repr(e)[:200], flush=True)
        return [dict(kind=kind, cfg=list(astuple(cfg)), pdl=pdl, mode=mode, error=repr(e)[:300])]
    gbs = W.bytes(kind) / us / 1e3
    print(f"  {kind} m={x.shape[0]} cfg={astuple(cfg)} pdl={int(pdl)} mode={mode}: "
          f"{us:8.2f} us {gbs:7.0f} GB/s err {err:.1e}", flush=True)
    return [dict(kind=kind, cfg=list(astuple(cfg)), pdl=pdl, mode=mode, us=us, gbs=gbs, err=err)]


def msweep_shape(W: Weights, m: int, calls: int, reps: int, dot_configs=()) -> list:
    """At M rows: cuBLAS (bf16; dequantize + cuBLAS for int8) vs the redline ops (their default
    dispatch) and, optionally, tensor-core kernel configs."""
    tk = kernels.triton_linear()
    x = torch.randn(m, W.k, device="cuda", dtype=torch.bfloat16)
    nw, nq = len(W.w), len(W.q)
    out = []

    def run(label, kind, mk, ref):
        try:
            err = rel_err(mk(0), ref)
            us = cuda_graph_us_per_call([lambda i=i: mk(i) for i in range(calls)], reps)
        except Exception as e:
            print(f"  FAIL m={m} {label} {kind} {repr(e)[:200]}", flush=True)
            return
        print(f"  m={m} {label} {kind}: {us:8.2f} us ({W.bytes(kind) / us / 1e3:5.0f} GB/s) err {err:.1e}", flush=True)
        out.append(dict(shape=[W.n, W.k], m=m, impl=label, kind=kind, us=us, err=err))

    ref16 = kernels.linear_reference(x, W.w[0])
    ref8 = kernels.int8_linear_reference(x, W.q[0], W.s[0])
    run("cublas", "bf16", lambda i: F.linear(x, W.w[i % nw]), ref16)
    run("cublas_dequant", "int8", lambda i: kernels._int8_matmul(x, W.q[i % nq], W.s[i % nq]), ref8)
    run("redline", "bf16", lambda i: torch.ops.redline.linear(x, W.w[i % nw]), ref16)
    run("redline", "int8", lambda i: torch.ops.redline.int8_linear(x, W.q[i % nq], W.s[i % nq]), ref8)
    for c in dot_configs:
        cfg = DotConfig(*c)
        run(f"dot{c}", "bf16", lambda i, cfg=cfg: tk.small_m_dot(x, W.w[i % nw], config=cfg), ref16)
        run(f"dot{c}", "int8", lambda i, cfg=cfg: tk.small_m_dot(x, W.q[i % nq], W.s[i % nq], config=cfg), ref8)
    return out


def ncu_run() -> None:
    """Two launches to profile with Nsight Compute (-k regex:_gemv_kernel): 7B w13 at M=1."""
    tk = kernels.triton_linear()
    n, k = LLAMA2_7B["w13"]
    W = Weights(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    tk.gemv(x, W.w[0])  # bf16, table config
    tk.gemv(x, W.q[0], W.s[0])  # int8, table config
    torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write all numbers to this JSON file")
    p.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    p.add_argument("--reps", type=int, default=15, help="timed graph replays (median)")
    p.add_argument("--sweep", action="store_true", help="also sweep Triton configs per shape at M=1")
    p.add_argument("--msweep", action="store_true", help="also compare kernels and cuBLAS at several M (--m-rows)")
    p.add_argument("--m-rows", default="2,4,8,16",
                   help="rows of x for --msweep (default 2,4,8,16: the wo, w13 and w2 shapes; any M above 16 "
                        "also takes the 7B wqkv and lm_head shapes)")
    p.add_argument("--dot-sweep", action="store_true", help="with --msweep: time tensor-core kernel configs too")
    p.add_argument("--no-table", action="store_true", help="skip the main table (sweeps only)")
    p.add_argument("--ncu-run", action="store_true", help="only launch a few kernels (to run under ncu)")
    args = p.parse_args(argv)
    if args.ncu_run:
        ncu_run()
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_properties(0)
    bw = statistics.median(read_bandwidth_gb_s())
    print(f"# {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}; "
          f"measured read bandwidth {bw:.0f} GB/s", flush=True)
    report = {"device": dev.name, "torch": torch.__version__, "read_bw_gbs": bw, "calls": args.calls,
              "reps": args.reps, "rows": [], "sweep": [], "msweep": []}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass

    shapes = [("7b", name, nk) for name, nk in LLAMA2_7B.items()] + [("8b", name, nk) for name, nk in LLAMA3_8B.items()]
    cache: dict = {}
    for model, name, (n, k) in shapes:
        W = None
        if args.sweep and (n, k) not in {tuple(r["shape"]) for r in report["sweep"]}:
            W = Weights(n, k)
            print(f"## sweep {model} {name} ({n}, {k}), {W.copies} copies", flush=True)
            for r in sweep_shape(W, 1, args.calls, args.reps, BF16_SWEEP, INT8_SWEEP):
                report["sweep"].append(dict(shape=[n, k], m=1, **r))
        if args.msweep and model == "7b":
            for m in (int(v) for v in args.m_rows.split(",")):
                if m <= 16 and name not in ("wo", "w13", "w2"):
                    continue
                W = W or Weights(n, k)
                configs = ((LARGE_DOT_SWEEP if m > 64 else MEDIUM_DOT_SWEEP if m > 16 else DOT_SWEEP)
                           if args.sweep or args.dot_sweep else ())
                report["msweep"] += msweep_shape(W, m, args.calls, args.reps, configs)
        if not args.no_table:
            if (n, k) not in cache:
                W = W or Weights(n, k)
                x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
                cache[(n, k)] = bench_impls(W, x, args.calls, args.reps, extra=True)
                cache[(n, k)]["bytes_bf16"] = W.bytes("bf16")
                cache[(n, k)]["bytes_int8"] = W.bytes("int8")
            r = cache[(n, k)]
            report["rows"].append(dict(model=model, name=name, shape=[n, k], **r))
        del W
        torch.cuda.empty_cache()
        write_json(args.json, report)

    if report["sweep"]:
        print("\n## sweep: best config per shape (M=1)")
        for kind in ("bf16", "int8"):
            for shape in sorted({tuple(r["shape"]) for r in report["sweep"]}):
                ok = [r for r in report["sweep"] if tuple(r["shape"]) == shape and r["kind"] == kind and "us" in r
                      and r["err"] < 1e-2]
                if ok:
                    b = min(ok, key=lambda r: r["us"])
                    print(f"{kind} {shape}: cfg {b['cfg']} pdl {b['pdl']} mode {b['mode']} {b['us']:.2f} us "
                          f"{b['gbs']:.0f} GB/s ({100 * b['gbs'] / bw:.1f}%)")
    if report["msweep"]:
        print_msweep(report["msweep"])
    if report["rows"]:
        print_table(report, bw)
    write_json(args.json, report)
    return 0


def print_msweep(rows: list) -> None:
    print("\n## several rows of x (7B shapes): µs per call, CUDA graph, weights rotated past L2\n")
    print("| shape (N, K) | M | cuBLAS bf16 | redline bf16 | dequant + cuBLAS int8 | redline int8 |")
    print("|---|---|---|---|---|---|")
    for shape in sorted({tuple(r["shape"]) for r in rows}):
        for m in sorted({r["m"] for r in rows if tuple(r["shape"]) == shape}):
            t = {(r["impl"], r["kind"]): r["us"] for r in rows if tuple(r["shape"]) == shape and r["m"] == m}
            cells = [t.get(key) for key in (("cublas", "bf16"), ("redline", "bf16"), ("cublas_dequant", "int8"),
                                            ("redline", "int8"))]
            print(f"| {shape} | {m} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")


def write_json(path: str | None, report: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def print_table(report: dict, bw: float) -> None:
    print(f"\n## M=1 GEMVs, CUDA graph of {report['calls']} calls, weights rotated past L2, "
          f"median of {report['reps']} replays; read bandwidth {bw:.0f} GB/s\n")
    print("| model | shape (N, K) | MB bf16 | cuBLAS µs | GB/s | % | redline bf16 µs | GB/s | % | "
          "bf16 no-PDL µs | % | MB int8 | redline int8 µs | GB/s | % | int8 no-PDL µs | % | int8 speed-up vs bf16 |")
    print("|" + "---|" * 19)
    for r in report["rows"]:
        b2, b1 = r["bytes_bf16"], r["bytes_int8"]

        def pct(nbytes, us):
            return f"{100 * nbytes / us / 1e3 / bw:.1f}"

        print(f"| {r['model']} | {r['name']} ({r['shape'][0]}, {r['shape'][1]}) | {b2 / 1e6:.1f} | "
              f"{r['cublas']:.2f} | {b2 / r['cublas'] / 1e3:.0f} | {pct(b2, r['cublas'])} | "
              f"{r['redline_bf16']:.2f} | {b2 / r['redline_bf16'] / 1e3:.0f} | {pct(b2, r['redline_bf16'])} | "
              f"{r['bf16_nopdl']:.2f} | {pct(b2, r['bf16_nopdl'])} | {b1 / 1e6:.1f} | "
              f"{r['redline_int8']:.2f} | {b1 / r['redline_int8'] / 1e3:.0f} | {pct(b1, r['redline_int8'])} | "
              f"{r['int8_nopdl']:.2f} | {pct(b1, r['int8_nopdl'])} | {r['redline_bf16'] / r['redline_int8']:.2f}x |")
    rows7 = {r["name"]: r for r in report["rows"] if r["model"] == "7b"}
    if set(rows7) >= {"wqkv", "wo", "w13", "w2", "lm_head"}:
        print("\n## one Llama-2-7B token's GEMVs: 32 x (wqkv + wo + w13 + w2) + lm_head")
        token = {}
        for impl in ("cublas", "redline_bf16", "bf16_nopdl", "redline_int8", "int8_nopdl"):
            us = N_LAYERS_7B * sum(rows7[n][impl] for n in ("wqkv", "wo", "w13", "w2")) + rows7["lm_head"][impl]
            token[impl] = us
            print(f"- {impl}: {us / 1000:.3f} ms -> {1e6 / us:.0f} tok/s (GEMVs only)")
        report["token_7b_us"] = token


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.bench_kernels import main as package_main

    sys.exit(package_main())
