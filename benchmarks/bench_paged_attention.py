"""Benchmark the paged attention ops against F.scaled_dot_product_attention on contiguous K/V of the same lengths.

Llama-3-8B attention heads (H=32, Hkv=8, D=128), bf16, 16-token pages placed at random in the pool. For each
batch B and context length L:

- decode: redline.paged_decode_attention, one query per row over L keys, against SDPA with q (B, H, 1, D) and
  contiguous K/V (B, Hkv, L, D) (enable_gqa);
- prefill: redline.paged_prefill_attention, a chunk of the last min(L, CHUNK) tokens of each sequence (the keys
  before it cached), against SDPA on the same chunk with an explicit causal mask; skipped past MAX_PREFILL_TOKENS
  query tokens in all.

Each implementation runs as one CUDA graph of calls over enough separate pools (one per layer, as a model would
read them) that K/V never sits in L2, replayed REPS times; the median µs per call is reported, with the GB/s of K/V
read (every valid key and value once) and its % of the read bandwidth of a large .sum() measured in the same run;
prefill also reports TFLOP/s of the causal attention. The relative error against SDPA checks each result.

    python benchmarks/bench_paged_attention.py --json out/bench_paged_attention.json
    python benchmarks/bench_paged_attention.py --batches 1,16 --contexts 512,8192
    python benchmarks/bench_paged_attention.py --sweep --batches 1,16,64 --contexts 2048,8192  # also try configs
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from redline.checkpoint import write_atomically
from redline.kernels import paged_attention  # noqa: F401  (registers torch.ops.redline.paged_*)
from redline.profiling import cuda_graph_us_per_call, read_bandwidth_gb_s

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
PAGE_SIZE = 16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
CHUNK = 512  # prefill query tokens per sequence
MAX_PREFILL_TOKENS = 32768
MIN_BYTES_PER_GRAPH = 512 * 2**20  # enough pools that a graph's K/V reads do not fit in L2
MAX_LAYERS = 64
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class BenchRow:
    op: str  # "decode" or "prefill"
    impl: str  # "paged" or "sdpa"
    batch: int
    context: int
    q_tokens: int  # query tokens per sequence
    us_per_call: float
    kv_bytes: int  # K and V bytes of the valid keys
    gbs: float
    pct_read_bw: float
    tflops: float
    rel_err: float  # against SDPA

    def __post_init__(self) -> None:
        if self.us_per_call <= 0 or self.kv_bytes <= 0:
            raise ValueError(f"invalid benchmark row {self}")


class Layers:
    """`n` layers' paged pools, block tables and the same keys and values as contiguous (B, Hkv, L, D) tensors."""

    def __init__(self, batch: int, context: int, n: int):
        pages = batch * math.ceil(context / PAGE_SIZE)
        self.k_dense, self.v_dense, self.k_pool, self.v_pool = [], [], [], []
        for _ in range(n):
            k = torch.randn(batch, N_KV_HEADS, context, HEAD_DIM, device="cuda", dtype=DTYPE)  # (B, Hkv, L, D)
            v = torch.randn_like(k)
            self.k_dense.append(k)
            self.v_dense.append(v)
        perm = torch.randperm(pages, device="cuda")
        self.tables = perm.view(batch, -1).to(torch.int32)  # (B, pages per sequence): pages shuffled in the pool
        for k, v in zip(self.k_dense, self.v_dense):
            self.k_pool.append(self._paged(k, pages))
            self.v_pool.append(self._paged(v, pages))
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

    def _paged(self, dense: torch.Tensor, pages: int) -> torch.Tensor:
        batch, _, context, _ = dense.shape
        per_seq = math.ceil(context / PAGE_SIZE)
        padded = F.pad(dense, (0, 0, 0, per_seq * PAGE_SIZE - context))  # (B, Hkv, pages * P, D)
        blocks = padded.view(batch, N_KV_HEADS, per_seq, PAGE_SIZE, HEAD_DIM).permute(0, 2, 3, 1, 4)
        pool = torch.empty(pages, PAGE_SIZE, N_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        pool[self.tables.flatten().long()] = blocks.reshape(-1, PAGE_SIZE, N_KV_HEADS, HEAD_DIM)
        return pool

    def __len__(self) -> int:
        return len(self.k_pool)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def decode_rows(layers: Layers, batch: int, context: int, reps: int, read_gbs: float) -> list[BenchRow]:
    scale = HEAD_DIM ** -0.5
    q = torch.randn(batch, N_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)  # (B, H, D)
    paged = [lambda i=i: torch.ops.redline.paged_decode_attention(q, layers.k_pool[i], layers.v_pool[i],
                                                                  layers.tables, layers.lens, scale)
             for i in range(len(layers))]
    sdpa = [lambda i=i: F.scaled_dot_product_attention(q[:, :, None], layers.k_dense[i], layers.v_dense[i],
                                                       scale=scale, enable_gqa=True)[:, :, 0]
            for i in range(len(layers))]
    ref = sdpa[0]().float()
    kv_bytes = 2 * batch * context * N_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    return [_row("decode", impl, calls, batch, context, 1, kv_bytes, 0.0, ref, reps, read_gbs)
            for impl, calls in (("paged", paged), ("sdpa", sdpa))]


def prefill_rows(layers: Layers, batch: int, context: int, reps: int, read_gbs: float) -> list[BenchRow]:
    scale = HEAD_DIM ** -0.5
    chunk = min(context, CHUNK)
    q = torch.randn(batch * chunk, N_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)  # (T, H, D)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * chunk  # (B + 1,)
    positions = torch.arange(context - chunk, context, device="cuda")  # (chunk,) the queries' positions
    mask = torch.arange(context, device="cuda")[None, :] <= positions[:, None]  # (chunk, L)
    q4 = q.view(batch, chunk, N_HEADS, HEAD_DIM).transpose(1, 2)  # (B, H, chunk, D)
    paged = [lambda i=i: torch.ops.redline.paged_prefill_attention(q, layers.k_pool[i], layers.v_pool[i],
                                                                   layers.tables, cu, layers.lens, scale)
             for i in range(len(layers))]
    sdpa = [lambda i=i: F.scaled_dot_product_attention(q4, layers.k_dense[i], layers.v_dense[i], attn_mask=mask,
                                                       scale=scale, enable_gqa=True).transpose(1, 2).flatten(0, 1)
            for i in range(len(layers))]
    ref = sdpa[0]().float()
    kv_bytes = 2 * batch * context * N_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    # q k^T and p v over the causal keys of each query: 4 D FLOPs per (head, query, key)
    keys = sum(context - chunk + j + 1 for j in range(chunk))
    flops = 4 * HEAD_DIM * N_HEADS * batch * keys
    return [_row("prefill", impl, calls, batch, context, chunk, kv_bytes, flops, ref, reps, read_gbs)
            for impl, calls in (("paged", paged), ("sdpa", sdpa))]


def _row(op: str, impl: str, calls: list, batch: int, context: int, q_tokens: int, kv_bytes: int, flops: float,
         ref: torch.Tensor, reps: int, read_gbs: float) -> BenchRow:
    err = rel_err(calls[0](), ref)
    us = cuda_graph_us_per_call(calls, reps)
    gbs = kv_bytes / us / 1e3
    return BenchRow(op, impl, batch, context, q_tokens, us, kv_bytes, gbs, 100 * gbs / read_gbs, flops / us / 1e6,
                    err)


def sweep_rows(layers: Layers, batch: int, context: int, reps: int, decode_only: bool) -> list[dict]:
    """Time both kernels under configs around the dispatcher's choice (the launchers take a config)."""
    from redline.kernels import paged_attention as pa
    from redline.kernels import triton_paged_attention as tpa

    scale = HEAD_DIM ** -0.5
    q = torch.randn(batch, N_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    base = pa.paged_decode_config(q, layers.k_pool[0], layers.v_pool[0], layers.tables)
    decode = {"default": base, **{f"stages={n}": dataclasses.replace(base, num_stages=n) for n in (1, 3, 4)},
              **{f"block_s={b},warps={w}": dataclasses.replace(base, block_s=b, num_warps=w)
                 for b, w in ((32, 4), (128, 4), (128, 8), (64, 8), (64, 2))},
              **{f"splits={s}": dataclasses.replace(base, num_splits=s)
                 for s in sorted({1, max(1, base.num_splits // 2), base.num_splits * 2} - {base.num_splits})}}
    chunk = min(context, CHUNK)
    qp = torch.randn(batch * chunk, N_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * chunk
    pbase = pa.paged_prefill_config(qp, layers.k_pool[0], layers.v_pool[0])
    prefill = {"default": pbase, **{f"stages={n}": dataclasses.replace(pbase, num_stages=n) for n in (2, 4)},
               **{f"block_m={m},block_n={n},warps={w}": dataclasses.replace(pbase, block_m=m, block_n=n, num_warps=w)
                  for m, n, w in ((128, 32, 8), (128, 128, 8), (64, 64, 4), (128, 64, 4), (64, 128, 4))}}
    out = []
    for op, table in (("decode", decode), ("prefill", prefill)):
        if op == "prefill" and (decode_only or batch * chunk > MAX_PREFILL_TOKENS):
            continue
        for label, cfg in table.items():
            if op == "decode":
                calls = [lambda i=i, c=cfg: tpa.paged_decode_attention(q, layers.k_pool[i], layers.v_pool[i],
                                                                       layers.tables, layers.lens, scale, c)
                         for i in range(len(layers))]
            else:
                calls = [lambda i=i, c=cfg: tpa.paged_prefill_attention(qp, layers.k_pool[i], layers.v_pool[i],
                                                                        layers.tables, cu, layers.lens, scale, c)
                         for i in range(len(layers))]
            try:
                us = cuda_graph_us_per_call(calls, reps)
            except Exception as e:  # a config past the chip's limits (shared memory, registers): note it, go on
                out.append(dict(op=op, batch=batch, context=context, config=label, error=repr(e)[:300]))
                print(f"  sweep {op} B={batch} L={context} {label}: failed: {repr(e)[:200]}", flush=True)
                continue
            out.append(dict(op=op, batch=batch, context=context, config=label, **dataclasses.asdict(cfg),
                            us_per_call=us))
            print(f"  sweep {op} B={batch} L={context} {label}: {us:.1f} us", flush=True)
    return out


def markdown_table(rows: list[BenchRow], read_gbs: float) -> str:
    lines = [f"read bandwidth (bf16 .sum()): {read_gbs:.0f} GB/s; H=32, Hkv=8, D=128, bf16, {PAGE_SIZE}-token "
             "pages; median µs per call of a CUDA graph", "",
             "| op | B | context | q tokens | paged µs | paged GB/s | % read BW | paged TFLOP/s | sdpa µs "
             "| sdpa GB/s | speedup |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_key: dict[tuple, dict[str, BenchRow]] = {}
    for r in rows:
        by_key.setdefault((r.op, r.batch, r.context), {})[r.impl] = r
    for (op, batch, context), impls in by_key.items():
        p, s = impls["paged"], impls["sdpa"]
        lines.append(f"| {op} | {batch} | {context} | {p.q_tokens} | {p.us_per_call:.1f} | {p.gbs:.0f} | "
                     f"{p.pct_read_bw:.0f}% | {p.tflops:.0f} | {s.us_per_call:.1f} | {s.gbs:.0f} | "
                     f"{s.us_per_call / p.us_per_call:.2f}x |")
    return "\n".join(lines)


def write_json(path: str | None, report: dict) -> None:
    if path:
        write_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(report, indent=1)))


def parse_ints(flag: str, text: str, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{flag} needs values of at least {minimum}, got {text!r}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write all numbers to this JSON file")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed per measurement (median)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes B, comma-separated")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="context lengths, comma-separated")
    p.add_argument("--decode-only", action="store_true", help="skip the prefill op")
    p.add_argument("--sweep", action="store_true", help="also time kernel configs around the dispatcher's choice")
    args = p.parse_args(argv)
    try:
        batches = parse_ints("--batches", args.batches, 1)
        contexts = parse_ints("--contexts", args.contexts, 1)
        if args.reps < 1:
            raise ValueError(f"--reps must be at least 1, got {args.reps}")
        if not torch.cuda.is_available():
            raise ValueError("no CUDA/ROCm GPU found; run this benchmark on a GPU machine")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    read_gbs = statistics.median(read_bandwidth_gb_s())
    report = {"device": torch.cuda.get_device_name(0), "read_gbs": read_gbs, "torch": torch.__version__, "rows": [],
              "sweep": []}
    rows: list[BenchRow] = []
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * N_KV_HEADS * HEAD_DIM * DTYPE.itemsize
            layers = Layers(batch, context, max(1, min(MAX_LAYERS, MIN_BYTES_PER_GRAPH // kv_bytes)))
            new = decode_rows(layers, batch, context, args.reps, read_gbs)
            if not args.decode_only and batch * min(context, CHUNK) <= MAX_PREFILL_TOKENS:
                new += prefill_rows(layers, batch, context, args.reps, read_gbs)
            for r in new:
                print(f"{r.op} {r.impl} B={batch} L={context}: {r.us_per_call:.1f} us, {r.gbs:.0f} GB/s "
                      f"({r.pct_read_bw:.0f}% of read), {r.tflops:.0f} TFLOP/s, rel err {r.rel_err:.1e}", flush=True)
            rows += new
            report["rows"] += [dataclasses.asdict(r) for r in new]
            if args.sweep:
                report["sweep"] += sweep_rows(layers, batch, context, args.reps, args.decode_only)
            write_json(args.json, report)  # after each step, so a cut-off run keeps what it measured
            del layers
            torch.cuda.empty_cache()
    print()
    print(markdown_table(rows, read_gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
