"""Benchmark decode attention: redline.decode_attention (Triton flash-decoding) against
F.scaled_dot_product_attention with the boolean mask and enable_gqa, as model.py calls it.

For each model shape and cache length S, LAYERS layers' caches (B=1, bf16, random) are allocated and
each implementation is timed as one CUDA graph of LAYERS calls, one per layer's cache (about one
token's attention), replayed REPS times; the median per call is reported, with CUDA events. Two
positions per S: input_pos = S - 1 (full cache) and S / 8 (a short prefix in a long cache).
"valid KV" is the bytes of K and V at positions 0..input_pos; GB/s is valid KV / time, for both
implementations (SDPA reads the whole cache, so its GB/s is the useful rate, not what it moves).
The read bandwidth of a large .sum() is measured in the same process as the ceiling.

    python benchmarks/bench_attention.py --json out/bench_attention.json
    python benchmarks/bench_attention.py --sweep --json out/sweep_attention.json   # also try kernel configs
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from redline.kernels import attention as da  # registers torch.ops.redline.decode_attention
from redline.kernels.configs import attention_config
from redline.checkpoint import write_atomically
from redline.profiling import cuda_graph_us_per_call, read_bandwidth_gb_s

# name: (n_head, n_kv_heads, head_dim)
SHAPES = {"Llama-2-7B": (32, 32, 128), "Llama-3-8B": (32, 8, 128)}
SEQ_LENS = (256, 2304, 8192, 32768)
LAYERS = 32


@dataclass(frozen=True)
class BenchRow:
    shape: str
    seq_len: int
    input_pos: int
    impl: str
    us_per_call: float
    valid_kv_bytes: int
    gbs: float
    rel_err: float

    def __post_init__(self) -> None:
        if self.us_per_call <= 0 or self.valid_kv_bytes <= 0:
            raise ValueError(f"invalid benchmark row {self}")








class Caches:
    """LAYERS random bf16 caches (1, Hkv, S, D) and one query (1, H, 1, D)."""

    def __init__(self, n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int):
        self.n_heads, self.n_kv_heads, self.seq_len, self.head_dim = n_heads, n_kv_heads, seq_len, head_dim
        shape = (1, n_kv_heads, seq_len, head_dim)
        self.k = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.v = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.q = torch.randn(1, n_heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)

    def valid_bytes(self, pos: int) -> int:
        return 2 * self.n_kv_heads * (pos + 1) * self.head_dim * 2  # K and V, bf16


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def triton_calls(c: Caches, pos_t: torch.Tensor, config=None) -> list:
    if config is None:
        return [lambda i=i: torch.ops.redline.decode_attention(c.q, c.k[i], c.v[i], pos_t) for i in range(LAYERS)]
    from redline.kernels import triton_attention as ta

    return [lambda i=i: ta.decode_attention(c.q, c.k[i], c.v[i], pos_t, config) for i in range(LAYERS)]


def sdpa_calls(c: Caches, pos_t: torch.Tensor) -> list:
    mask = (torch.arange(c.seq_len, device="cuda") <= pos_t).view(1, 1, 1, c.seq_len)  # (1, 1, 1, S)
    gqa = c.n_heads != c.n_kv_heads
    return [lambda i=i: F.scaled_dot_product_attention(c.q, c.k[i], c.v[i], attn_mask=mask, enable_gqa=gqa)
            for i in range(LAYERS)]


def bench_shape(name: str, c: Caches, pos: int, reps: int) -> list[BenchRow]:
    pos_t = torch.tensor([pos], device="cuda")
    ref = da.decode_attention_reference(c.q.float(), c.k[0].float(), c.v[0].float(), pos_t)
    rows = []
    for impl, calls in (("triton", triton_calls(c, pos_t)), ("sdpa", sdpa_calls(c, pos_t))):
        err = rel_err(calls[0](), ref)
        us = cuda_graph_us_per_call(calls, reps)
        nbytes = c.valid_bytes(pos)
        rows.append(BenchRow(name, c.seq_len, pos, impl, us, nbytes, nbytes / us / 1e3, err))
    return rows


def sweep_shape(name: str, c: Caches, pos: int, reps: int, sms: int) -> list[dict]:
    """Time the Triton kernel under several configs around attention_config's choice."""
    pos_t = torch.tensor([pos], device="cuda")
    base = attention_config(1, c.n_heads, c.n_kv_heads, c.seq_len, c.head_dim, sms)
    configs = {"default": base}
    for pps in (1, 4, 8):
        configs[f"programs_per_sm={pps}"] = attention_config(1, c.n_heads, c.n_kv_heads, c.seq_len, c.head_dim, sms,
                                                     programs_per_sm=pps)
    for block_s, warps in ((32, 4), (128, 4), (128, 8), (64, 8), (64, 2)):
        configs[f"block_s={block_s},warps={warps}"] = dataclasses.replace(base, block_s=block_s, num_warps=warps)
    for stages in (1, 3):
        configs[f"stages={stages}"] = dataclasses.replace(base, num_stages=stages)
    out = []
    for label, cfg in configs.items():
        try:
            us = cuda_graph_us_per_call(triton_calls(c, pos_t, cfg), reps)
        except Exception as e:  # a config past the chip's limits (shared memory, registers): note it, go on
            out.append(dict(shape=name, seq_len=c.seq_len, input_pos=pos, config=label, error=repr(e)[:300]))
            print(f"  sweep {name} S={c.seq_len} pos={pos} {label}: failed: {repr(e)[:200]}", flush=True)
            continue
        nbytes = c.valid_bytes(pos)
        out.append(dict(shape=name, seq_len=c.seq_len, input_pos=pos, config=label, **dataclasses.asdict(cfg),
                        us_per_call=us, gbs=nbytes / us / 1e3))
        print(f"  sweep {name} S={c.seq_len} pos={pos} {label}: {us:.2f} us, {nbytes / us / 1e3:.0f} GB/s",
              flush=True)
    return out


def markdown_table(rows: list[BenchRow], read_gbs: float) -> str:
    lines = [f"read bandwidth (bf16 .sum()): {read_gbs:.0f} GB/s; B=1, bf16, median µs per call of a "
             f"{LAYERS}-call CUDA graph", "",
             "| shape | S | input_pos | valid KV (MB) | triton µs | triton GB/s | sdpa µs | sdpa GB/s | speedup |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_key: dict[tuple, dict[str, BenchRow]] = {}
    for r in rows:
        by_key.setdefault((r.shape, r.seq_len, r.input_pos), {})[r.impl] = r
    for (shape, seq_len, pos), impls in by_key.items():
        t, s = impls["triton"], impls["sdpa"]
        lines.append(f"| {shape} | {seq_len} | {pos} | {t.valid_kv_bytes / 1e6:.2f} | {t.us_per_call:.2f} | "
                     f"{t.gbs:.0f} | {s.us_per_call:.2f} | {s.gbs:.0f} | {s.us_per_call / t.us_per_call:.2f}x |")
    return "\n".join(lines)


def write_json(path: str | None, report: dict) -> None:
    if path:
        write_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(report, indent=1)))


def parse_seq_lens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--seq-lens must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 8:
        raise ValueError(f"--seq-lens needs cache lengths of at least 8, got {text!r}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write all numbers to this JSON file")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed per measurement (median)")
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)), help="cache lengths S, comma-separated")
    p.add_argument("--sweep", action="store_true", help="also time kernel configs around the default")
    p.add_argument("--sweep-seq-lens", default="8192,32768", help="cache lengths the sweep covers")
    args = p.parse_args(argv)
    try:
        seq_lens = parse_seq_lens(args.seq_lens)
        sweep_lens = parse_seq_lens(args.sweep_seq_lens)
        if args.reps < 1:
            raise ValueError(f"--reps must be at least 1, got {args.reps}")
        if not torch.cuda.is_available():
            raise ValueError("no CUDA/ROCm GPU found; run this benchmark on a GPU machine")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    read_gbs = statistics.median(read_bandwidth_gb_s())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"device": torch.cuda.get_device_name(0), "sms": sms, "read_gbs": read_gbs, "layers": LAYERS,
              "rows": [], "sweep": []}
    rows: list[BenchRow] = []
    for name, (n_heads, n_kv_heads, head_dim) in SHAPES.items():
        for seq_len in seq_lens:
            caches = Caches(n_heads, n_kv_heads, seq_len, head_dim)
            for pos in (seq_len - 1, seq_len // 8):
                new = bench_shape(name, caches, pos, args.reps)
                rows += new
                report["rows"] += [dataclasses.asdict(r) for r in new]
                for r in new:
                    print(f"{name} S={seq_len} pos={pos} {r.impl}: {r.us_per_call:.2f} us, {r.gbs:.0f} GB/s, "
                          f"rel err {r.rel_err:.1e}", flush=True)
                write_json(args.json, report)  # after each step, so a cut-off run keeps what it measured
            del caches
            torch.cuda.empty_cache()
    table = markdown_table(rows, read_gbs)
    report["table"] = table
    write_json(args.json, report)
    print(table, flush=True)
    if args.sweep:
        for name, (n_heads, n_kv_heads, head_dim) in SHAPES.items():
            for seq_len in sweep_lens:
                caches = Caches(n_heads, n_kv_heads, seq_len, head_dim)
                for pos in (seq_len - 1, seq_len // 8):
                    report["sweep"] += sweep_shape(name, caches, pos, args.reps, sms)
                    write_json(args.json, report)
                del caches
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.bench_attention import main as package_main

    sys.exit(package_main())
