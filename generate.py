"""Redline's engine, CLI and Python API, on one code path.

    from generate import LLM
    llm = LLM.load("checkpoints/redline/tiny-python")
    print(llm.generate("def fibonacci(n):", max_new_tokens=64).text)

    python generate.py --checkpoint_path PATH --prompt TEXT [--max_new_tokens N] ...
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from checkpoint import CheckpointInfo, dtype_from_name, dtype_name, read_checkpoint_info
from kernels import FusedDecode, use_kernels
from kernels import available as kernels_available
from model import Transformer
from quantize import load_model, model_quantization
from tokenizer import Tokenizer, load_tokenizer

DEFAULT_MAX_NEW_TOKENS = 200
SMALLEST_PREFILL_BUCKET = 16
# A top_p above 1 disables the nucleus filter without a branch in the compiled graph.
TOP_P_DISABLED = 2.0


# ---------------------------------------------------------------------------------------------------------------------
# Sampling: pure tensor functions, no host synchronisation.


def nucleus_keep_mask(sorted_probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Which of the descending-sorted probabilities (B, V) survive top-k and top-p.

    A token is kept when its rank is below top_k and the mass of the tokens before it is below top_p,
    i.e. the smallest prefix whose mass reaches top_p. The most likely token is always kept.
    """
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)  # (V,)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
    keep = (ranks < top_k) & (mass_before < top_p)
    keep[..., 0] = True
    return keep


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """One token per row from logits (B, V); temperature/top_k/top_p are 0-d tensors, so new values never recompile."""
    scaled = logits.float() / temperature.clamp_min(1e-5)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    probs = probs * nucleus_keep_mask(probs, top_k, top_p)
    # argmax(p / E) with E ~ Exp(1) draws from p (normalisation does not matter) without a device sync.
    noise = torch.empty_like(probs).exponential_(1)
    choice = torch.argmax(probs / noise, dim=-1, keepdim=True)  # (B, 1)
    return order.gather(-1, choice)


def greedy(logits: Tensor) -> Tensor:
    return torch.argmax(logits, dim=-1, keepdim=True)  # (B, 1)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def tensors(self, vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        top_k = self.top_k if self.top_k is not None else vocab_size
        top_p = self.top_p if self.top_p is not None else TOP_P_DISABLED
        return (torch.tensor(float(self.temperature), device=device), torch.tensor(top_k, device=device),
                torch.tensor(float(top_p), device=device))


# ---------------------------------------------------------------------------------------------------------------------
# The two model calls of a generation.


def prefill(model: Transformer, ids: Tensor, input_pos: Tensor, last_index: Tensor, *sampling: Tensor) -> Tensor:
    """ids (B, T) -> first new token (B, 1). `last_index` (1,) is the last real prompt token (prompts may be padded)."""
    logits = model(ids, input_pos, logits_at=last_index, from_start=True)[:, -1]  # (B, V)
    return sample(logits, *sampling) if sampling else greedy(logits)


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, *sampling: Tensor) -> Tensor:
    """token (B, 1) at position input_pos (1,) -> next token (B, 1)."""
    logits = model(token, input_pos)[:, -1]  # (B, V)
    return sample(logits, *sampling) if sampling else greedy(logits)


def prefill_bucket(length: int, limit: int) -> int:
    """Prompt lengths are padded to a power of two, so each bucket compiles once."""
    bucket = SMALLEST_PREFILL_BUCKET
    while bucket < length:
        bucket *= 2
    return min(bucket, limit)


# ---------------------------------------------------------------------------------------------------------------------
# Results.


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # start of prefill to the first new token on the host
    prefill_tok_s: float
    decode_tok_s: float  # tokens after the first, over the time after the first
    model_bytes_per_token: int  # weights each decode step reads (the embedding table excluded: one row is read)
    bandwidth_gb_s: float
    peak_memory_gb: float | None  # None on the CPU
    compile_s: float = 0.0  # compile/warm-up time spent before this generation, kept out of the rates above
    batch_size: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        mem = f", peak memory {self.peak_memory_gb:.2f} GB" if self.peak_memory_gb is not None else ""
        compiled = f", compile {self.compile_s:.1f} s" if self.compile_s else ""
        return (f"prompt {self.prompt_tokens} tok, generated {self.new_tokens} tok | TTFT {self.ttft_s * 1e3:.1f} ms, "
                f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.2f} tok/s, "
                f"{self.bandwidth_gb_s:.1f} GB/s of {self.model_bytes_per_token / 1e9:.2f} GB/token{mem}{compiled}")


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only
    stats: GenerationStats
    finish_reason: str  # "eos" | "stop" | "length"


# ---------------------------------------------------------------------------------------------------------------------
# Incremental detokenisation for streaming.


class TextStream:
    """Turns token ids into text pieces, holding back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_start = 0  # ids before this are final
        self.read_start = 0  # ids before this have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.read_start])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        if text.endswith("\ufffd") or len(text) <= len(prefix):
            return ""  # an incomplete multi-byte character, or nothing new yet
        self.prefix_start, self.read_start = self.read_start, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.read_start])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        self.prefix_start = self.read_start = len(self.ids)
        return text[len(prefix):]


# ---------------------------------------------------------------------------------------------------------------------
# The engine.


def model_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter and weight buffer, but only one embedding row."""
    total = 0
    seen: set[int] = set()
    embedding = model.tok_embeddings.weight
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or "kv_cache" in name or name == "rope":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    if not model.args.tie_word_embeddings:  # a tied table is read whole by the output head
        total -= embedding.numel() * embedding.element_size()
    return total


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LLM:
    """A loaded model with its tokenizer and compiled step functions."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, device: torch.device, compile: bool,
                 compile_prefill: bool = False, info: CheckpointInfo | None = None,
                 kernels: bool | None = None, name: str | None = None, fuse: bool | None = None) -> None:
        self.model = model.requires_grad_(False)  # inference only: graphs are traced without autograd
        # Redline's Triton GEMVs beat cuBLAS at decode shapes (BENCHMARKS.md); default on where they run.
        self.kernels = device.type == "cuda" and kernels_available() if kernels is None else kernels
        # Batch-1 decode steps fuse norm, rope, cache write, SwiGLU and residuals into the kernels (on by default).
        self.fuse = self.kernels if fuse is None else fuse
        if self.kernels:
            if device.type != "cuda" or not kernels_available():
                raise ValueError("kernels=True needs a CUDA/ROCm GPU with Triton installed")
            use_kernels(model)
        if self.fuse and not self.kernels:
            raise ValueError("fuse=True needs the GPU kernels (kernels=True)")
        # What the decode step runs: the fused batch-1 path wraps the model (any other call goes to the model).
        self._step_model = FusedDecode(model) if self.fuse else model
        self.tokenizer = tokenizer
        self.device = device
        self.compile = compile
        self.compile_prefill = compile_prefill
        self.info = info
        self.name = name  # for stats and traces; by default the checkpoint's folder name
        self.bytes_per_token = model_bytes_per_token(model)
        self._prefill_fn: Callable[..., Tensor] = prefill
        self._decode_fn: Callable[..., Tensor] = decode_one_token
        self._warm: set[tuple] = set()  # decode graphs already compiled and captured
        self._pending_compile_s = 0.0
        if compile:
            self._compile()

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, compile: bool | None = None, quantize: str | None = None,
             compile_prefill: bool = False) -> LLM:
        """Load a Redline checkpoint (file or folder); its tokenizer is found beside it."""
        device = torch.device(device) if device is not None else default_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but no CUDA/ROCm GPU is visible; use --device cpu")
        info = read_checkpoint_info(path)
        tokenizer = load_tokenizer(info.path)
        model = load_model(info, device, dtype_from_name(dtype) if dtype is not None else None)
        if quantize is not None:
            from quantize import quantize_

            if info.scheme != "none":
                raise ValueError(f"{info.path} is already quantized ({info.scheme}); drop quantize=")
            quantize_(model, quantize)
        if compile is None:
            compile = device.type == "cuda"
        return cls(model, tokenizer, device, compile, compile_prefill, info)

    # -- compilation -------------------------------------------------------------------------------------------------

    def _compile(self) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.triton.unique_kernel_names = True
        inductor_config.fx_graph_cache = True
        # Each prefill bucket, batch size and sampling mode is its own graph; never fall back to eager silently.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # Inductor otherwise skips intermediate roundings to bf16 that eager performs, and greedy tokens can drift.
        inductor_config.emulate_precision_casts = True
        gpu = self.device.type == "cuda"
        self._decode_fn = torch.compile(decode_one_token, mode="reduce-overhead" if gpu else None,
                                        fullgraph=True, dynamic=False)
        if self.compile_prefill:
            # One CUDA graph per prompt bucket too: short prompts are otherwise bound by kernel launches.
            self._prefill_fn = torch.compile(prefill, mode="reduce-overhead" if gpu else None, fullgraph=True,
                                             dynamic=False)

    def _ensure_cache(self, batch_size: int, seq_len: int) -> None:
        """Keep the current cache when it is large enough (a new cache shape means a new graph)."""
        m = self.model
        if m.max_batch_size >= batch_size and m.max_seq_length >= seq_len:
            return
        length = min(max(seq_len, m.max_seq_length, 256), m.args.block_size)
        length = min(-(-length // 256) * 256, m.args.block_size)  # round up: fewer cache shapes, fewer compiles
        m.setup_caches(max(batch_size, m.max_batch_size), length)

    def _warm_up(self, batch_size: int, sampling: tuple[Tensor, ...]) -> float:
        """Compile and capture the decode graph for this cache and sampling mode before timing anything."""
        cache = self.model.layers[0].attention.kv_cache
        # A re-allocated cache (the caller may call setup_caches) needs a new capture even at the same shapes.
        key = (batch_size, self.model.max_seq_length, self.model.max_batch_size, cache.k.data_ptr(), bool(sampling))
        if not self.compile or key in self._warm:
            return 0.0
        start = time.perf_counter()
        # Same grad mode and tensor kind as generation, or the real call would recompile.
        with torch.inference_mode():
            token = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.device)
            # Garbage written at position 0 is harmless: every position is rewritten before it is read.
            for _ in range(3):  # the first call compiles, later ones record and replay the graph
                self._mark_step()
                self._decode_fn(self._step_model, token, pos, *sampling)
        sync(self.device)
        self._warm.add(key)
        return time.perf_counter() - start

    def _mark_step(self) -> None:
        if self.compile and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()

    # -- generation ---------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; pass some text or token ids")
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer; pass the prompt as a list of token ids")
            return self.tokenizer.encode(prompt, bos=self.tokenizer.bos_id is not None)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty; pass some text or token ids")
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def _plan_lengths(self, prompt_len: int, max_new_tokens: int) -> int:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        context = self.model.args.block_size
        if prompt_len >= context:
            raise ValueError(f"the prompt has {prompt_len} tokens, but the model's context is {context}; shorten it")
        return min(max_new_tokens, context - prompt_len)  # capped by the context

    def generate_token_batches(self, prompts: Tensor, max_new_tokens: int, sampling: SamplingParams,
                               recorder: Any = None) -> Iterator[tuple[list[int], float]]:
        """The token loop, for a batch of equal-length prompts (B, T).

        Yields (tokens of this step, host time when they arrived, less any time the profiler spent on itself).
        Step i+1 is queued on the GPU before step i's tokens are read, so reading never leaves the GPU idle.
        """
        batch, prompt_len = prompts.shape
        new_tokens = self._plan_lengths(prompt_len, max_new_tokens)
        self._ensure_cache(batch, prompt_len + new_tokens)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        args = () if sampling.is_greedy else sampling.tensors(self.model.args.vocab_size, self.device)
        self._pending_compile_s = self._warm_up(batch, args)
        region = recorder.region if recorder is not None else (lambda name: contextlib.nullcontext())
        bucket = prefill_bucket(prompt_len, self.model.max_seq_length) if self.compile_prefill else prompt_len
        padded = torch.zeros(batch, bucket, dtype=torch.long, device=self.device)
        padded[:, :prompt_len] = prompts.to(self.device)
        positions = torch.arange(bucket, device=self.device)
        last = torch.tensor([prompt_len - 1], device=self.device)
        pinned = self.device.type == "cuda"
        host = torch.empty(batch, dtype=torch.long, pin_memory=pinned)
        ready = torch.cuda.Event() if pinned else None
        # Tokens go to the host on a side stream, so the device-to-host copy never sits between two replays.
        copier = torch.cuda.Stream(self.device) if pinned else None

        def to_host(token: Tensor) -> None:
            if copier is None:
                host.copy_(token.view(-1))
                return
            copier.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(copier):
                host.copy_(token.view(-1), non_blocking=True)
                ready.record(copier)
            token.record_stream(copier)  # its memory is not reused before the copy has read it

        def read_host() -> list[int]:
            if ready is not None:
                ready.synchronize()
            return host.tolist()

        with torch.inference_mode():
            with region("prefill"):
                self._mark_step()
                # Copied out of the CUDA graph's pool: the next graph replay may reuse that memory.
                token = self._prefill_fn(self.model, padded, positions, last, *args).clone()  # (B, 1)
                to_host(token)
            # Decode step i reads position prompt_len + i - 1 from this table: a slice per step instead of an
            # in-place increment, which would be one more kernel between graph replays. Made in inference mode,
            # like the warm-up's position, so the compiled step's guards match.
            decode_positions = torch.arange(prompt_len, prompt_len + new_tokens, device=self.device)  # (N,)
            paused = 0.0  # the profiler's own bookkeeping (starting, stopping) is kept out of every timing
            for step in range(1, new_tokens + 1):
                if recorder is not None:
                    before = time.perf_counter()
                    recorder.step()
                    paused += time.perf_counter() - before
                with region("decode_step"):
                    if step < new_tokens:
                        self._mark_step()
                        input_pos = decode_positions[step - 1:step]  # (1,)
                        nxt = self._decode_fn(self._step_model, token, input_pos, *args).clone()  # (B, 1)
                    tokens = read_host()  # the previous step's; the next one is already queued
                    arrived = time.perf_counter() - paused
                    if step < new_tokens:
                        to_host(nxt)
                        token = nxt
                yield tokens, arrived

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               stop: str | Sequence[str] | None = None, seed: int | None = None, profile: Any = None,
               ignore_eos: bool = False) -> Iterator[str]:
        """Yield text pieces as they are decoded; the final GenerationResult is kept in `self.last_result`."""
        return self._run(prompt, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), stop, profile,
                         ignore_eos)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 stop: str | Sequence[str] | None = None, seed: int | None = None, profile: Any = None,
                 ignore_eos: bool = False) -> GenerationResult:
        for _ in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, stop, seed, profile, ignore_eos):
            pass
        return self.last_result

    def _run(self, prompt: str | Sequence[int], max_new_tokens: int, sampling: SamplingParams,
             stop: str | Sequence[str] | None, profile: Any, ignore_eos: bool) -> Iterator[str]:
        prompt_ids = self.encode_prompt(prompt)
        self._plan_lengths(len(prompt_ids), max_new_tokens)  # validate before the generator starts
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self._run_tokens(prompt_ids, max_new_tokens, sampling, stops, profile, ignore_eos)

    def _run_tokens(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, stops: list[str],
                    profile: Any, ignore_eos: bool) -> Iterator[str]:
        eos = set() if ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        prompts = torch.tensor([prompt_ids], dtype=torch.long)
        recorder = self._recorder(profile, prompts, max_new_tokens, sampling)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        text_stream = TextStream(self.tokenizer) if self.tokenizer is not None else None
        new_ids: list[int] = []
        times: list[float] = []
        text, emitted, finish = "", 0, "length"
        with recorder if recorder is not None else contextlib.nullcontext():
            sync(self.device)
            start = time.perf_counter()
            for tokens, arrived in self.generate_token_batches(prompts, max_new_tokens, sampling, recorder):
                token = tokens[0]
                times.append(arrived)
                if token in eos:
                    finish = "eos"
                    break
                new_ids.append(token)
                if text_stream is None:
                    continue
                text += text_stream.push(token)
                cut = first_stop(text, stops)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                # Hold back a tail that could still grow into a stop string.
                safe = len(text) - max((len(s) - 1 for s in stops), default=0)
                if safe > emitted:
                    yield text[emitted:safe]
                    emitted = safe
            if finish == "length" and text_stream is not None:
                text += text_stream.flush()
                cut = first_stop(text, stops)
                if cut is not None:
                    text, finish = text[:cut], "stop"
        if len(text) > emitted:
            yield text[emitted:]
        stats = self._stats(len(prompt_ids), len(new_ids), start, times)
        self.last_result = GenerationResult(text=text, token_ids=new_ids, stats=stats, finish_reason=finish)
        if recorder is not None:
            self.last_trace = recorder.write(self._trace_stats(stats), step_seconds(times))

    def _stats(self, prompt_len: int, n_new: int, start: float, times: list[float], batch: int = 1) -> GenerationStats:
        ttft = times[0] - start
        decode_s = times[-1] - times[0]
        decode_rate = (len(times) - 1) / decode_s if len(times) > 1 and decode_s > 0 else 0.0
        peak = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else None
        return GenerationStats(
            prompt_tokens=prompt_len, new_tokens=n_new, ttft_s=ttft, prefill_tok_s=prompt_len * batch / ttft,
            decode_tok_s=decode_rate * batch, model_bytes_per_token=self.bytes_per_token,
            bandwidth_gb_s=decode_rate * self.bytes_per_token / 1e9, peak_memory_gb=peak,
            compile_s=self._pending_compile_s, batch_size=batch,
        )

    # -- profiling -----------------------------------------------------------------------------------------------------

    def _recorder(self, profile: Any, prompts: Tensor, max_new_tokens: int, sampling: SamplingParams) -> Any:
        if profile is None or profile is False:
            return None
        from profiling import ProfileConfig, TraceRecorder

        if isinstance(profile, ProfileConfig):
            config = profile
        elif profile is True:
            config = ProfileConfig.default_for(self.model_name)
        else:
            config = ProfileConfig(path=Path(profile))
        # Compile and capture outside the trace, so the window holds only steady-state steps.
        for _ in self.generate_token_batches(prompts, min(max_new_tokens, 4), sampling):
            pass
        return TraceRecorder(config, self.device)

    @property
    def model_name(self) -> str:
        if self.name is not None:
            return self.name
        return self.info.path.parent.name if self.info is not None else "model"

    def _trace_stats(self, stats: GenerationStats) -> dict[str, Any]:
        out = {k: v for k, v in stats.as_dict().items() if v is not None}
        out.update(
            model=self.model_name if self.name is not None or self.info is None else str(self.info.path),
            dtype=dtype_name(self.model.cache_dtype),
            quantization=model_quantization(self.model),  # the model as it runs: quantize= changes it after loading
            device=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            torch_version=torch.__version__,
            compiled=self.compile,
        )
        return out


def step_seconds(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


# ---------------------------------------------------------------------------------------------------------------------
# CLI.


@dataclass(frozen=True)
class GenerateArgs:
    checkpoint_path: Path
    prompt: str | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.8
    top_k: int | None = 200
    top_p: float | None = None
    seed: int | None = None
    device: str | None = None
    dtype: str | None = None
    compile: bool | None = None
    compile_prefill: bool = False
    num_samples: int = 1
    interactive: bool = False
    system: str | None = None
    stop: tuple[str, ...] = ()
    quantize: str | None = None
    profile: Path | None = None
    profile_steps: int = 16

    def __post_init__(self) -> None:
        SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)  # validates the sampling values
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise ValueError(f"--num_samples must be >= 1, got {self.num_samples}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if not self.interactive and not self.prompt:
            raise ValueError("--prompt is empty; pass some text, or use --interactive")


def parse_args(argv: Sequence[str] | None) -> GenerateArgs:
    p = argparse.ArgumentParser(description="Generate text with a Redline checkpoint.")
    p.add_argument("--checkpoint_path", type=Path, required=True, help="Redline checkpoint file or its folder")
    p.add_argument("--prompt", default=None, help="input text")
    p.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile decoding to a CUDA graph (default: on for GPU, off for CPU)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (prompt lengths are bucketed)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--interactive", action="store_true", help="chat with the model's chat template")
    p.add_argument("--system", default=None, help="system prompt for --interactive")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--quantize", default=None, help="quantize on load (int8)")
    p.add_argument("--profile", type=Path, default=None, help="write a Perfetto trace (.json.gz) here")
    p.add_argument("--profile_steps", type=int, default=16, help="decode steps recorded in the trace")
    ns = p.parse_args(argv)
    return GenerateArgs(**{**vars(ns), "stop": tuple(ns.stop)})


def run_cli(cfg: GenerateArgs, stdin: Any = None, out: Any = None, err: Any = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    llm = LLM.load(cfg.checkpoint_path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile,
                   quantize=cfg.quantize, compile_prefill=cfg.compile_prefill)
    sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                    top_p=cfg.top_p, stop=list(cfg.stop))
    if cfg.interactive:
        return chat(llm, cfg, sampling, stdin or sys.stdin, out, err)
    profile = None
    if cfg.profile is not None:
        from profiling import ProfileConfig

        profile = ProfileConfig(path=cfg.profile, record_steps=cfg.profile_steps)
    for i in range(cfg.num_samples):
        seed = cfg.seed + i if cfg.seed is not None else None
        out.write(cfg.prompt)
        for piece in llm.stream(cfg.prompt, seed=seed, profile=profile if i == 0 else None, **sampling):
            out.write(piece)
            out.flush()
        out.write("\n")
        print(f"[sample {i + 1}/{cfg.num_samples}] {llm.last_result.stats.summary()}", file=err)
        if i == 0 and profile is not None:
            print(f"trace written to {llm.last_trace}", file=err)
    return 0


def chat(llm: LLM, cfg: GenerateArgs, sampling: dict, stdin: Any, out: Any, err: Any) -> int:
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    print(f"chatting with {llm.model_name} ({llm.tokenizer.chat_format} template); an empty line or EOF ends.", file=err)
    while True:
        out.write("you> ")
        out.flush()
        line = stdin.readline()
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = llm.tokenizer.encode_chat(messages)
        out.write("assistant> ")
        for piece in llm.stream(ids, seed=cfg.seed, **sampling):
            out.write(piece)
            out.flush()
        out.write("\n")
        messages.append({"role": "assistant", "content": llm.last_result.text})
        print(llm.last_result.stats.summary(), file=err)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_cli(parse_args(argv))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
