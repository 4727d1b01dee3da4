"""The report of a benchmark run: markdown tables, the JSON file, a bar chart, and several saved runs merged."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redline.checkpoint import write_atomically
from redline.benchmarks.bench_model import QUANT_CHOICES

# The column label of a dense (unquantized) record: its dtype, short enough for a table cell.
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# Printed under the tables and saved in the JSON, so a saved report says what its numbers mean.
NOTES = [
    "decode tok/s: median over runs of (tokens after the first) / (time after the first), x batch (aggregate); "
    "measured with the shortest prompt and the smallest KV cache, after one discarded warm-up generation",
    "limit tok/s = batch x read bandwidth / bytes per decode step (weights, embedding table excluded); "
    "'limit with KV' also counts reading the whole static KV cache each step",
    "TTFT: start of generate to the first new token on the host (median, after one warm-up generation per prompt "
    "length, two with compiled prefill on a GPU: compile, then CUDA-graph recording); prefill TFLOP/s = FLOPs / "
    "TTFT with FLOPs = B x (2 x block matmul params x T + 2 x head params + 4 x n_layer x T^2/2 x n_head x head_dim)",
    "HF decode tok/s = (N - n_short) / (t(N) - t(n_short)): prefill cancels out; HF static = transformers' own "
    "compiled decode (cache_implementation='static', compile_config mode reduce-overhead)",
    "peak memory: torch.cuda.max_memory_allocated over a timed generation; overhead = peak - weights - KV cache",
]


def merge_reports(paths: Sequence[Path]) -> dict[str, Any]:
    """Several saved reports as one (each record keeps the bandwidth its own run measured)."""
    merged: dict[str, Any] = {"env": {}, "bandwidth_gb_s": None, "bandwidth_runs_gb_s": [], "records": [], "hf": [],
                              "compile_times": [], "errors": [], "notes": NOTES}
    sources = []
    for path in paths:
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path} as JSON ({exc}); pass files written by --json") from None
        if not isinstance(report, dict) or "records" not in report or "env" not in report:
            raise ValueError(f"{path} is not a bench.py report; pass files written by --json")
        for key in ("records", "hf", "compile_times", "errors"):
            merged[key] += report.get(key, [])
        sources.append({"path": str(path), "bandwidth_gb_s": report.get("bandwidth_gb_s"),
                        "command": report["env"].get("command")})
        if not merged["env"]:
            merged["env"] = dict(report["env"])
            merged["bandwidth_gb_s"] = report.get("bandwidth_gb_s")
            merged["bandwidth_runs_gb_s"] = report.get("bandwidth_runs_gb_s", [])
    merged["env"]["merged_from"] = sources
    return merged


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """`value * scale` formatted with `spec`, or a dash where there is no value."""
    return "–" if value is None else format(value * scale, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def format_report(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"# Redline benchmark ({env.get('device')}, torch {env.get('torch_version')})", ""]
    if env.get("command"):
        lines += [f"command: `{env['command']}`", ""]
    if report.get("bandwidth_gb_s"):
        lines.append(f"read bandwidth: {report['bandwidth_gb_s']:.0f} GB/s (bf16 sum, CUDA events, median)")
    for source in env.get("merged_from", []):
        lines.append(f"merged: {source['path']} (bandwidth {fmt(source['bandwidth_gb_s'], '.0f')} GB/s)")
    if report["records"]:
        lines += redline_tables(report["records"])
        lines += all_reduce_table(report["records"])
        lines += tp_speedup_table(report["records"])
    if report["hf"]:
        lines += hf_table(report["hf"], env.get("transformers_version"))
    if report["compile_times"]:
        lines += compile_time_table(report["compile_times"])
    if report.get("errors"):
        lines += ["", "FAILED (see the log for tracebacks):"]
        lines += [f"- {e['what']}: {e['error']}" for e in report["errors"]]
    lines += [""] + [f"- {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def _model_label(record: dict[str, Any]) -> str:
    """The model, and for tensor parallel its ranks and an all-reduce other than NCCL ("Llama-2-70B TP2 oneshot")."""
    tp = record.get("tp", 1)
    if tp == 1:
        return record["model"]
    mode = record.get("all_reduce_mode")
    return f"{record['model']} TP{tp}" + (f" {mode}" if mode not in (None, "nccl") else "")


def tp_speedup_table(records: list[dict[str, Any]]) -> list[str]:
    """Tensor-parallel records against the same model, quantization and batch on one GPU (from --merge of both
    runs): decode tok/s, the ratio, and the share of the N-GPU limit (N x one GPU's bandwidth over the bytes)."""
    single = {(r["model"], r["quant"], r["dtype"], r["batch_size"]): r for r in records if r.get("tp", 1) == 1}
    rows = []
    for r in records:
        one = single.get((r["model"], r["quant"], r["dtype"], r["batch_size"]))
        if r.get("tp", 1) == 1 or one is None:
            continue
        ratio = r["decode_tok_s"] / one["decode_tok_s"] if one["decode_tok_s"] else None
        rows.append([_model_label(r), _quant_label(r), str(r["batch_size"]), fmt(one["decode_tok_s"], ".1f"),
                     fmt(r["decode_tok_s"], ".1f"), fmt(ratio, ".2f"), fmt(r.get("limit_tok_s"), ".0f"),
                     fmt(r.get("pct_of_limit"), ".1f")])
    if not rows:
        return []
    return ["", "Tensor parallel against one GPU (decode tok/s; the limit is N GPUs' bandwidth over the bytes)", ""] + \
        _table(["model", "quant", "batch", "1 GPU tok/s", "TP tok/s", "TP / 1 GPU (x)", "TP limit tok/s",
                "TP % of limit"], rows)


def all_reduce_table(records: list[dict[str, Any]]) -> list[str]:
    """Tensor-parallel records: the all-reduce time of one decode token, NCCL against one-shot."""
    timed = [r for r in records if r.get("all_reduce")]
    if not timed:
        return []
    rows = []
    for r in timed:
        a = r["all_reduce"]
        us = a["us_per_token"]
        step_us = 1e6 / r["decode_tok_s"] if r["decode_tok_s"] else None
        trace = a.get("trace") or {}
        in_trace = "–" if trace.get("us_per_token") is None else \
            f"{trace['us_per_token']:.0f} ({trace['exclusive_us_per_token']:.0f})"
        # The all-reduce's share of a decode step: the time its kernels add to the traced timeline where there is a
        # trace, else the graph of just the all-reduces of the mode the model ran.
        added = trace.get("exclusive_us_per_token")
        added = added if added is not None else us.get(r.get("all_reduce_mode") or "nccl")
        share = 100 * added / step_us if added is not None and step_us else None
        rows.append([_model_label(r), _quant_label(r), str(r["batch_size"]), r.get("all_reduce_mode") or "–",
                     str(a["all_reduces_per_token"]), str(a["bytes_each"]), fmt(us.get("nccl"), ".0f"),
                     fmt(us.get("oneshot"), ".0f"), in_trace, fmt(step_us, ".0f"), fmt(share, ".1f"),
                     "; ".join(f"{k}: {v}" for k, v in a["errors"].items())])
    lines = ["", "Tensor parallel: all-reduce time per decode token (a CUDA graph of just that token's all-reduces, "
             "mean of its replays; with --profile also the all-reduce kernels in rank 0's trace of the model's own "
             "decode, summed duration (time added to the GPU timeline))", ""]
    return lines + _table(["model", "quant", "batch", "model ran", "all-reduces", "bytes each", "NCCL µs/token",
                           "one-shot µs/token", "in the trace µs/token", "decode µs/token",
                           "all-reduce % of a step", "errors"], rows)


def _quant_label(record: dict[str, Any]) -> str:
    return SHORT_DTYPE.get(record["dtype"], record["dtype"]) if record["quant"] == "none" else record["quant"]


def hf_mode_label(hf: dict[str, Any]) -> str:
    if hf["mode"] == "eager":
        return "HF eager"
    return "HF static+compiled" if hf["compiled"] else "HF static (not compiled)"


def redline_tables(records: list[dict[str, Any]]) -> list[str]:
    """One row per model x quant x batch, then one row per prefill measurement."""
    lengths = sorted({p["prompt_tokens"] for r in records for p in r["prefill"]})
    tag = "/".join(str(t) for t in lengths)
    has_compiled = any(p["compiled_prefill"] for r in records for p in r["prefill"])

    def per_length(prefill: list[dict[str, Any]], key: str, spec: str, scale: float = 1.0) -> str:
        by_length = {p["prompt_tokens"]: p[key] for p in prefill}
        return "/".join(fmt(by_length.get(t), spec, scale) for t in lengths)

    header = ["model", "quant", "batch", "decode tok/s", "% of limit", "limit tok/s", "limit w/ KV", "GB/token",
              f"TTFT ms (T={tag})", f"prefill TFLOP/s (T={tag})"]
    header += [f"TTFT ms compiled prefill (T={tag})"] if has_compiled else []
    header += ["peak GB", "weights GB", "KV GB", "overhead GB", "compile s"]
    rows = []
    for r in records:
        eager = [p for p in r["prefill"] if not p["compiled_prefill"]]
        row = [_model_label(r), _quant_label(r), str(r["batch_size"]), f"{r['decode_tok_s']:.1f}",
               fmt(r["pct_of_limit"], ".1f"), fmt(r["limit_tok_s"], ".0f"), fmt(r["limit_with_kv_tok_s"], ".0f"),
               f"{r['bytes_per_token'] / 1e9:.3g}", per_length(eager, "ttft_s", ".1f", 1e3),
               per_length(eager, "tflops", ".3g")]
        if has_compiled:
            row.append(per_length([p for p in r["prefill"] if p["compiled_prefill"]], "ttft_s", ".1f", 1e3))
        row += [fmt(r["peak_memory_bytes"], ".2f", 1e-9), f"{r['weights_bytes'] / 1e9:.2f}",
                f"{r['kv_cache_bytes'] / 1e9:.2f}", fmt(r["overhead_bytes"], ".2f", 1e-9), f"{r['compile_s']:.1f}"]
        rows.append(row)
    detail = [[_model_label(r), _quant_label(r), str(r["batch_size"]), "compiled" if p["compiled_prefill"] else "eager",
               str(p["prompt_tokens"]), str(p["cache_len"]), f"{p['ttft_s'] * 1e3:.1f}", f"{p['flops'] / 1e12:.3g}",
               f"{p['tflops']:.3g}", f"{p['decode_tok_s']:.1f}"] for r in records for p in r["prefill"]]
    lines = [""] + _table(header, rows)
    lines += ["", "Prefill (decode tok/s here runs with the cache sized for the longest prompt)", ""]
    return lines + _table(["model", "quant", "batch", "prefill", "prompt", "cache", "TTFT ms", "TFLOP", "TFLOP/s",
                           "decode tok/s"], detail)


def hf_table(hf_records: list[dict[str, Any]], version: str | None) -> list[str]:
    quants = sorted({q for h in hf_records for q in h["ratio"]}, key=QUANT_CHOICES.index)
    header = ["model", "HF mode", "HF tok/s", "first call s", "t(N) s", "t(short) s"]
    header += [f"Redline {q} / HF" for q in quants]
    rows = [[h["model"], hf_mode_label(h), fmt(h["decode_tok_s"], ".1f"), f"{h['first_call_s']:.1f}",
             f"{h['t_long_s']:.3f}", f"{h['t_short_s']:.3f}"] + [fmt(h["ratio"].get(q), ".2f") for q in quants]
            for h in hf_records]
    first = hf_records[0]
    lines = ["", f"HF transformers {version}: decode tok/s = (N - n_short) / (t(N) - t(n_short)) with "
             f"N={first['new_tokens']}, n_short={first['short_tokens']}, prompt {first['prompt_tokens']} tokens, "
             "batch 1: prefill cancels out", ""]
    lines += _table(header, rows)
    for h in hf_records:
        for q, ratio in h["ratio"].items():
            lines.append(f"ratio {h['model']}: Redline {q} {h['redline_tok_s'][q]:.1f} tok/s / {hf_mode_label(h)} "
                         f"{h['decode_tok_s']:.1f} tok/s = {ratio:.2f}x")
    return lines


def compile_time_table(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for c in records:
        for label in ("cold", "warm"):
            p = c[label]
            rows.append([c["model"], c["quant"], label, fmt(p["first_token_s"], ".1f"), fmt(p["main_s"], ".1f"),
                         fmt(p["built_s"], ".1f"), f"{p['wall_s']:.1f}", p["error"] or ""])
    lines = ["", "Time to first token after process start (a child process per row; random weights are built on "
             "the device instead of loading a checkpoint)", ""]
    return lines + _table(["model", "quant", "inductor cache", "first token s", "imports done s", "model built s",
                           "process wall s", "error"], rows)


def write_json(report: dict[str, Any], path: Path) -> None:
    text = json.dumps(report, indent=2, default=str)
    write_atomically(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))


def plot_series(report: dict[str, Any]) -> tuple[list[str], dict[str, list[float | None]], dict[str, list]]:
    """Per model: decode tok/s of each engine/mode (Redline at its smallest batch), and the bandwidth limits."""
    models = list(dict.fromkeys([r["model"] for r in report["records"]] + [h["model"] for h in report["hf"]]))
    series: dict[str, list[float | None]] = {}
    limits: dict[str, list] = {}
    for i, name in enumerate(models):
        mine = [r for r in report["records"] if r["model"] == name]
        smallest = min((r["batch_size"] for r in mine), default=1)
        for r in mine:
            if r["batch_size"] != smallest:
                continue
            label = f"Redline {_quant_label(r)}"
            series.setdefault(label, [None] * len(models))[i] = r["decode_tok_s"]
            if r["limit_tok_s"]:
                limits.setdefault(label, [None] * len(models))[i] = r["limit_tok_s"]
        for h in report["hf"]:
            if h["model"] == name:
                label = hf_mode_label(h)
                series.setdefault(label, [None] * len(models))[i] = h["decode_tok_s"]
    return models, series, limits


def write_plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display; PNG goes through Agg

    models, series, limits = plot_series(report)
    fig = Figure(figsize=(max(6.0, 3.2 * len(models) + 2), 5.0), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    colors = {}
    for j, (label, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(models))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=label)
        colors[label] = bars.patches[0].get_facecolor() if bars.patches else None
        ax.bar_label(bars, labels=[fmt(v, ".0f") if v is not None else "" for v in values], fontsize=8)
    for label, values in limits.items():
        legend_label: str | None = f"{label} bandwidth limit"  # one legend entry per series
        for i, limit in enumerate(values):
            if limit is None:
                continue
            ax.hlines(limit, i - 0.45, i + 0.45, colors=[colors.get(label)], linestyles="--", linewidth=1.5,
                      label=legend_label)
            legend_label = None
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("decode tok/s")
    batches = sorted({r["batch_size"] for r in report["records"]})
    bw = report.get("bandwidth_gb_s")
    ax.set_title(f"Decode tok/s (Redline batch {batches[0] if batches else 1}; HF batch 1)"
                 + (f"; dashed: limit at {bw:.0f} GB/s" if bw else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a bar or a line
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
