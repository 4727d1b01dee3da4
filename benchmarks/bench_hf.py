"""Hugging Face transformers' LlamaForCausalLM with the same config and random weights, in the same process: eager
(dynamic cache) and static cache + compiled decode, its decode rate taken from two generation lengths."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from redline import generate, runner
from redline.model import ModelArgs
from redline.benchmarks.bench_config import HF_SHORT_TOKENS
from redline.benchmarks.bench_model import param_counts, random_prompts
from redline.benchmarks.bench_redline import RedlineRecord, median
from redline.benchmarks.bench_report import fmt

if TYPE_CHECKING:
    from redline.benchmarks.bench_config import BenchConfig

# Compiled HF generate keeps getting faster for a few calls (compile, then CUDA graph recording): warm it up until
# two calls in a row agree within this fraction, or this many calls.
HF_STEADY_TOLERANCE = 0.05
HF_MAX_WARMUP_CALLS = 6


@dataclass(frozen=True)
class HFRecord:
    model: str
    mode: str  # "eager" (dynamic cache) | "static+compiled"
    dtype: str
    cache_implementation: str
    compiled: bool
    fullgraph: bool | None
    prompt_tokens: int
    new_tokens: int
    short_tokens: int
    runs: int
    t_long_s: float  # median wall time of generate(new_tokens)
    t_short_s: float  # median wall time of generate(short_tokens)
    t_long_runs_s: list[float]
    t_short_runs_s: list[float]
    decode_tok_s: float | None  # (new - short) / (t_long - t_short); None if the difference is not positive
    first_call_s: float
    warmup_calls_s: list[float]
    redline_tok_s: dict[str, float] = field(default_factory=dict)  # quant -> Redline batch-1 decode tok/s
    ratio: dict[str, float] = field(default_factory=dict)  # quant -> Redline / HF


def hf_llama_config(args: ModelArgs) -> Any:
    """A transformers LlamaConfig with Redline's architecture (rope in transformers 5's `rope_parameters`)."""
    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_base)}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": float(args.rope_base), "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    return LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.intermediate_size, num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        vocab_size=args.vocab_size, max_position_embeddings=args.block_size, rope_parameters=rope,
        rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_word_embeddings,
        # No EOS: every generation runs to max_new_tokens.
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )


def build_hf_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Any:
    """Random-weight LlamaForCausalLM built directly on the device in `dtype` (no fp32 host copy)."""
    from transformers import AutoModelForCausalLM

    config = hf_llama_config(args)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    n_hf = sum(p.numel() for p in model.parameters())
    if n_hf != param_counts(args)["total"]:
        raise RuntimeError(f"HF model has {n_hf} parameters, Redline's config {param_counts(args)['total']}: "
                           "the config mapping is wrong")
    return model


def time_hf_generate(model: Any, ids: Tensor, new_tokens: int, **kwargs: Any) -> float:
    device = ids.device
    runner.sync(device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    runner.sync(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens instead of {new_tokens}")
    return elapsed


def hf_decode_record(cfg: BenchConfig, name: str, model: Any, ids: Tensor, mode: str, compiled: bool,
                     fullgraph: bool | None, warmup_calls: list[float], **kwargs: Any) -> HFRecord:
    """Times generate(N) and generate(n_short) alternately; their difference is decode alone."""
    n, short = cfg.new_tokens, cfg.hf_short_tokens
    time_hf_generate(model, ids, short, **kwargs)  # warm the short path too (same cache size: long ran first)
    longs, shorts = [], []
    for _ in range(cfg.runs):
        longs.append(time_hf_generate(model, ids, n, **kwargs))
        shorts.append(time_hf_generate(model, ids, short, **kwargs))
    t_long, t_short = median(longs), median(shorts)
    rate = (n - short) / (t_long - t_short) if t_long > t_short else None
    return HFRecord(
        model=name, mode=mode, dtype=cfg.dtype, cache_implementation=kwargs.get("cache_implementation", "dynamic"),
        compiled=compiled, fullgraph=fullgraph, prompt_tokens=ids.shape[1], new_tokens=n, short_tokens=short,
        runs=cfg.runs, t_long_s=t_long, t_short_s=t_short, t_long_runs_s=longs, t_short_runs_s=shorts,
        decode_tok_s=rate, first_call_s=warmup_calls[0], warmup_calls_s=warmup_calls,
    )


def warm_until_steady(model: Any, ids: Tensor, new_tokens: int, **kwargs: Any) -> list[float]:
    """The first compiled call compiles, the next ones record CUDA graphs: call until two calls agree."""
    calls = [time_hf_generate(model, ids, new_tokens, **kwargs)]
    while len(calls) < HF_MAX_WARMUP_CALLS:
        calls.append(time_hf_generate(model, ids, new_tokens, **kwargs))
        if len(calls) >= 3 and abs(calls[-1] - calls[-2]) <= HF_STEADY_TOLERANCE * calls[-2]:
            break
    return calls


def bench_hf(cfg: BenchConfig, name: str, log: Any) -> list[HFRecord]:
    """Batch-1 decode of transformers' LlamaForCausalLM: eager, then static cache + compiled decode."""
    from transformers import CompileConfig

    device = torch.device(cfg.device)
    args = ModelArgs.from_name(name)
    log(f"{name} HF: building random weights")
    model = build_hf_model(args, device, cfg.torch_dtype)
    ids = random_prompts(args.vocab_size, 1, cfg.decode_prompt_length, cfg.seed).to(device)  # (1, T)
    records = []

    log(f"{name} HF eager (dynamic cache)")
    warm = [time_hf_generate(model, ids, cfg.new_tokens)]
    records.append(hf_decode_record(cfg, name, model, ids, "eager", False, None, warm))
    log(f"{name} HF eager: {fmt(records[-1].decode_tok_s, '.1f')} tok/s")

    # transformers 5 compiles the decode step itself when generate gets a static cache on a GPU
    # (`compile_config`, default mode "reduce-overhead"); compiling model.forward by hand would also
    # compile prefill per prompt length. The long generation runs first so the short one reuses its cache.
    gpu = device.type == "cuda"
    kwargs: dict[str, Any] = {"cache_implementation": "static"}
    fullgraph: bool | None = None
    if gpu:
        fullgraph = True
        kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    log(f"{name} HF static cache{' + compiled' if gpu else ' (not compiled on the CPU)'}: warm-up")
    try:
        warm = warm_until_steady(model, ids, cfg.new_tokens, **kwargs)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # a graph break under fullgraph=True: fall back to HF's default compile config
        if not gpu:
            raise
        log(f"{name} HF fullgraph=True failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "retrying with fullgraph=False")
        fullgraph = False
        kwargs["compile_config"] = CompileConfig(fullgraph=False, mode="reduce-overhead")
        warm = warm_until_steady(model, ids, cfg.new_tokens, **kwargs)
    records.append(hf_decode_record(cfg, name, model, ids, "static+compiled", gpu, fullgraph, warm, **kwargs))
    log(f"{name} HF static: {fmt(records[-1].decode_tok_s, '.1f')} tok/s (first call {warm[0]:.1f} s)")
    return records


def attach_ratios(hf_records: list[HFRecord], records: list[RedlineRecord]) -> list[HFRecord]:
    """Each HF record with Redline's batch-1 decode rate per quant mode (same model and dtype) and the ratio."""
    out = []
    for hf in hf_records:
        redline = {r.quant: r.decode_tok_s for r in records
                   if r.model == hf.model and r.batch_size == 1 and r.dtype == hf.dtype}
        ratio = {q: v / hf.decode_tok_s for q, v in redline.items() if hf.decode_tok_s}
        out.append(HFRecord(**{**asdict(hf), "redline_tok_s": redline, "ratio": ratio}))
    return out

