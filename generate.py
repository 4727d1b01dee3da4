"""Redline's engine, CLI and Python API, on one code path.

    from redline.generate import LLM
    llm = LLM.load("checkpoints/redline/tiny-python")
    print(llm.generate("def fibonacci(n):", max_new_tokens=64).text)

    python generate.py --checkpoint_path PATH --prompt TEXT [--max_new_tokens N] ...
    python generate.py --checkpoint_path PATH --chat --prompt "What is the capital of France?" --temperature 0
    torchrun --nproc_per_node 2 generate.py --checkpoint_path PATH --prompt TEXT   # tensor parallel (tensor_parallel.py)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from redline.checkpoint import CheckpointInfo, dtype_from_name, dtype_name, read_checkpoint_info
from redline.kernels import use_cpu_kernels, use_kernels
from redline.kernels import available as kernels_available
from redline.model import Transformer
from redline.options import (DEFAULT_MAX_NEW_TOKENS, EngineConfig, GenerationOptions, GenerationResult,  # noqa: F401
                     GenerationStats, check_text, default_device, prompt_token_ids, resolve_options)
from redline.profiling import ProfileConfig, TraceRecorder
from redline import speculative
from redline.quantize import load_model, model_quantization
from redline.sampling import SamplingParams, greedy, is_int, next_token, nucleus_keep_mask, sample  # noqa: F401
from redline.streaming import GenerationLock, Stream, TextStream, first_stop, step_seconds  # noqa: F401
from redline import tensor_parallel
from redline.tokenizer import Tokenizer, load_tokenizer

SMALLEST_PREFILL_BUCKET = 16
# Each prefill bucket, batch size and sampling mode is its own graph; well below this, never fall back to eager.
RECOMPILE_LIMIT = 64
# Inductor settings of Redline's compiled calls, applied around each call only. emulate_precision_casts keeps the
# intermediate roundings to bf16 that eager performs (greedy tokens otherwise drift from eager's).
INDUCTOR_SETTINGS = {"triton.unique_kernel_names": True, "fx_graph_cache": True, "emulate_precision_casts": True,
                     "coordinate_descent_tuning": False}
# A chat keeps this share of the context (or max_new_tokens, if fewer) free for the reply.
CHAT_REPLY_SHARE = 0.25


# ---------------------------------------------------------------------------------------------------------------------
# The two model calls of a generation.


def prefill(model: Transformer, ids: Tensor, input_pos: Tensor, last_index: Tensor, vocab_bias: Tensor | None,
            *sampling: Tensor) -> Tensor:
    """ids (B, T) -> first new token (B, 1). `last_index` (1,) is the last real prompt token (prompts may be padded)."""
    logits = model(ids, input_pos, logits_at=last_index, from_start=True)[:, -1]  # (B, V)
    return next_token(logits, last_index + 1, vocab_bias, sampling)


def decode_one_token(model: torch.nn.Module, token: Tensor, input_pos: Tensor, vocab_bias: Tensor | None,
                     *sampling: Tensor) -> Tensor:
    """token (B, 1) at position input_pos (1,) -> next token (B, 1)."""
    logits = model(token, input_pos)[:, -1]  # (B, V)
    return next_token(logits, input_pos + 1, vocab_bias, sampling)


def prefill_bucket(length: int, limit: int) -> int:
    """Prompt lengths are padded to a power of two, so each bucket compiles once."""
    bucket = SMALLEST_PREFILL_BUCKET
    while bucket < length:
        bucket *= 2
    return min(bucket, limit)


class CompiledStep:
    """torch.compile(fn) called under Redline's compiler settings, which are set around each call and undone after
    it (thread-locally where torch keeps config per thread): the process's own inductor/dynamo config is untouched."""

    def __init__(self, fn: Callable[..., Tensor], device: torch.device) -> None:
        import torch._inductor.config as inductor_config

        self.fn = torch.compile(fn, mode="reduce-overhead" if device.type == "cuda" else None, fullgraph=True,
                                dynamic=False)
        self.settings = (inductor_config.patch(INDUCTOR_SETTINGS),
                         torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT))

    def __call__(self, *args: Any) -> Tensor:
        with self.settings[0], self.settings[1]:
            return self.fn(*args)


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
    elif hasattr(model.output, "read_bytes"):  # ...unless the head reads a smaller exact form (kernels.ExactInt8Head)
        total += model.output.read_bytes() - embedding.numel() * embedding.element_size()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vocab_bias(model_vocab: int, tokenizer: Tokenizer | None, device: torch.device) -> Tensor | None:
    """(V,) fp32: 0 for ids the tokenizer decodes, -inf for a model's padding rows beyond them; None if none."""
    if tokenizer is None or tokenizer.vocab_size >= model_vocab:
        return None
    bias = torch.zeros(model_vocab, dtype=torch.float32, device=device)
    bias[tokenizer.vocab_size:] = float("-inf")
    return bias


class LLM:
    """A loaded model with its tokenizer and compiled step functions.

    Safe to share between threads: calls are serialized by a lock held for a whole generation (a stream's from its
    first next() to its end or close()). `LLM(model, ...)` rewrites the model it is handed only when kernels are on
    (`kernels=None` turns them on for a CUDA device where they run): `kernels.use_kernels` then swaps its linear,
    int8 linear and attention modules in place for Redline's Triton ops. `kernels=False` runs no Redline kernel.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, device: torch.device | str, compile: bool,
                 compile_prefill: bool = False, info: CheckpointInfo | None = None,
                 kernels: bool | None = None, name: str | None = None, fuse: bool | None = None) -> None:
        device = torch.device(device)
        self.model = model.requires_grad_(False)  # inference only: graphs are traced without autograd
        # Redline's Triton GEMVs beat cuBLAS at decode shapes (BENCHMARKS.md); default on where they run.
        self.kernels = device.type == "cuda" and kernels_available() if kernels is None else kernels
        # Batch-1 decode steps fuse norm, rope, cache write, SwiGLU and residuals into the kernels (on by default).
        self.fuse = self.kernels if fuse is None else fuse
        if self.kernels and (device.type != "cuda" or not kernels_available()):
            raise ValueError("kernels=True needs a CUDA/ROCm GPU with Triton installed; use kernels=False")
        if self.fuse and not self.kernels:
            raise ValueError("fuse=True needs the GPU kernels (kernels=True)")
        self._step_model: torch.nn.Module = model  # what decode steps call
        if self.kernels:
            use_kernels(model)
            if self.fuse:
                self._step_model = tensor_parallel.fused_decode(model)  # a rank's model: the TP one
        elif device.type == "cpu":
            use_cpu_kernels(model)  # int8/int4 linears (and an exact Q8_0 head) on the C++ GEMV of kernels/cpu_linear.py
        self.tokenizer = tokenizer
        self.device = device
        self.compile = compile
        self.compile_prefill = compile_prefill
        self.info = info
        self.name = name  # for stats and traces; by default the checkpoint's folder name
        self.bytes_per_token = model_bytes_per_token(model)
        self._vocab_bias = vocab_bias(model.args.vocab_size, tokenizer, device)  # made once: no recompile
        self._prefill_fn: Callable[..., Tensor] = prefill
        self._decode_fn: Callable[..., Tensor] = decode_one_token
        if compile:
            self._decode_fn = CompiledStep(decode_one_token, device)
            if compile_prefill:  # one CUDA graph per prompt bucket too: short prompts are otherwise launch-bound
                self._prefill_fn = CompiledStep(prefill, device)
        self._warm: set[tuple] = set()  # graphs already compiled and captured
        self._speculative_fns: dict[str, Callable[..., Any]] = {}  # speculative.py's verify/draft steps, made once
        self._speculative_costs: dict[tuple, float] = {}  # verify/decode step time ratios for speculative.CostGate
        self._lock = GenerationLock()  # held for a whole generation, a stream's included

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device | None = None, dtype: str | None = None,
             compile: bool | None = None, compile_prefill: bool = False, quantize: str | None = None,
             kernels: bool | None = None, fuse: bool | None = None, name: str | None = None,
             threads: int | None = None) -> LLM:
        """Load a Redline checkpoint (file or folder); its tokenizer is found beside it."""
        return cls.from_config(path, EngineConfig(device, dtype, compile, compile_prefill, quantize, kernels, fuse,
                                                  name, threads))

    @classmethod
    def from_config(cls, path: str | os.PathLike, config: EngineConfig) -> LLM:
        world = tensor_parallel.start(config.device)  # None unless torchrun launched several ranks
        device = config.torch_device() if world is None else world.device
        config.set_threads(device)
        info = read_checkpoint_info(path)
        tokenizer = load_tokenizer(info.path)
        dtype = dtype_from_name(config.dtype) if config.dtype is not None else None
        if world is None:
            model = load_model(info, device, dtype)
        else:  # this rank's slices only; quantize= then quantizes each rank's slices (per-channel scales per slice)
            model = tensor_parallel.load_sharded_model(info, world, dtype)
        if config.quantize is not None:
            from redline.quantize import parse_quant_spec, quantize_

            if info.scheme != "none":
                raise ValueError(f"{info.path} is already quantized ({info.scheme}); drop quantize=")
            quantize_(model, *parse_quant_spec(config.quantize))
        if world is not None:
            tensor_parallel.apply_tensor_parallel(model, world)
        compile = config.compile if config.compile is not None else device.type == "cuda" or config.compile_prefill
        return cls(model, tokenizer, device, compile, config.compile_prefill, info, config.kernels, config.name,
                   config.fuse)

    # -- compilation ---------------------------------------------------------------------------------------------------

    def _ensure_cache(self, batch_size: int, seq_len: int) -> None:
        """Keep the current cache when it is large enough (a new cache shape means a new graph)."""
        m = self.model
        if m.max_batch_size >= batch_size and m.max_seq_length >= seq_len:
            return
        length = min(max(seq_len, m.max_seq_length, 256), m.args.block_size)
        length = min(-(-length // 256) * 256, m.args.block_size)  # round up: fewer cache shapes, fewer compiles
        m.setup_caches(max(batch_size, m.max_batch_size), length)

    def _prepare(self, batch: int, prompt_len: int, max_new_tokens: int, sampling: SamplingParams) -> float:
        """Size the cache and compile/capture this generation's graphs; returns the seconds that took (0 if warm)."""
        self._ensure_cache(batch, prompt_len + self._plan_lengths(prompt_len, max_new_tokens))
        if not self.compile:
            return 0.0
        args = self._step_args(dataclasses.replace(sampling, seed=0))  # warm-ups leave the global RNG alone
        cache = self.model.layers[0].attention.kv_cache
        # A re-allocated cache (the caller may call setup_caches) needs a new capture even at the same shapes.
        key = (batch, self.model.max_seq_length, self.model.max_batch_size, cache.k.data_ptr(), bool(args))
        bucket = prefill_bucket(prompt_len, self.model.max_seq_length)
        todo = [("decode", *key)] + ([("prefill", bucket, *key)] if self.compile_prefill else [])
        todo = [k for k in todo if k not in self._warm]
        if not todo:
            return 0.0
        start = time.perf_counter()
        # Same grad mode and tensor kinds as generation, or the real call would recompile. Garbage written to the
        # cache here is harmless: every position is rewritten before it is read.
        with torch.inference_mode():
            token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
            ids = torch.zeros(batch, bucket, dtype=torch.long, device=self.device)
            positions = torch.arange(bucket, device=self.device)
            last = torch.tensor([min(prompt_len, bucket) - 1], device=self.device)
            for _ in range(3):  # the first call compiles, later ones record and replay the graph
                for kind, *_ in todo:
                    self._mark_step()
                    if kind == "decode":
                        self._decode_fn(self._step_model, token, positions[:1], self._vocab_bias, *args)
                    else:
                        self._prefill_fn(self.model, ids, positions, last, self._vocab_bias, *args)
        sync(self.device)
        self._warm.update(todo)
        return time.perf_counter() - start

    def _mark_step(self) -> None:
        if self.compile and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()

    def _step_args(self, sampling: SamplingParams) -> tuple[Tensor, ...]:
        return () if sampling.is_greedy else sampling.tensors(self.model.args.vocab_size, self.device)

    # -- generation ----------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Text through the tokenizer (BOS/EOS as its own rules say), or token ids used exactly as given."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; pass some text or token ids")
            check_text(prompt, "the prompt")
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer; pass the prompt as a list of token ids")
            return self.tokenizer.encode(prompt)
        ids = prompt_token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty; pass some text or token ids")
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def _plan_lengths(self, prompt_len: int, max_new_tokens: int) -> int:
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        context = self.model.args.block_size
        if prompt_len >= context:
            raise ValueError(f"the prompt has {prompt_len} tokens, but the model's context is {context}; shorten it")
        return min(max_new_tokens, context - prompt_len)  # capped by the context

    def generate_token_batches(self, prompts: Tensor, max_new_tokens: int, sampling: SamplingParams,
                               recorder: Any = None) -> Iterator[tuple[list[int], float]]:
        """The token loop, for a batch of equal-length prompts (B, T); not locked (generate/stream/chat are).

        Yields (tokens of this step, host time when they arrived, less any time the profiler spent on itself).
        Step i+1 is queued on the GPU before step i's tokens are read, so reading never leaves the GPU idle.
        """
        batch, prompt_len = prompts.shape
        new_tokens = self._plan_lengths(prompt_len, max_new_tokens)
        sampling = tensor_parallel.agreed_sampling(sampling, self.model)  # every rank draws the same tokens
        self._prepare(batch, prompt_len, max_new_tokens, sampling)
        args = self._step_args(sampling)
        region = recorder.region if recorder is not None else (lambda name: contextlib.nullcontext())
        bucket = prefill_bucket(prompt_len, self.model.max_seq_length) if self.compile_prefill else prompt_len
        with torch.inference_mode():  # the same tensor kind as the warm-up's, so the compiled prefill's guards match
            padded = torch.zeros(batch, bucket, dtype=torch.long, device=self.device)  # (B, bucket)
            padded[:, :prompt_len] = prompts.to(self.device)
            positions = torch.arange(bucket, device=self.device)  # (bucket,)
            last = torch.tensor([prompt_len - 1], device=self.device)  # (1,)
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
                token = self._prefill_fn(self.model, padded, positions, last, self._vocab_bias, *args).clone()
                to_host(token)  # (B, 1)
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
                        nxt = self._decode_fn(self._step_model, token, input_pos, self._vocab_bias, *args).clone()
                    tokens = read_host()  # the previous step's; the next one is already queued
                    arrived = time.perf_counter() - paused
                    if step < new_tokens:
                        to_host(nxt)  # (B, 1)
                        token = nxt
                yield tokens, arrived

    def generate(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
                 **settings: Any) -> GenerationResult:
        """Generate a continuation of `prompt` (text, or token ids used exactly)."""
        stream = self.stream(prompt, options, **settings)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
               **settings: Any) -> Stream:
        """Like generate, but yields text pieces as they are decoded; `.result` once exhausted. The prompt and
        options are checked here, before the first piece is asked for."""
        options = resolve_options(options, settings)
        ids = self.encode_prompt(prompt)
        self._plan_lengths(len(ids), options.max_new_tokens)
        speculative.Speculator.for_options(self, options)  # a bad draft is refused here, before the first piece
        return Stream(self._lock, lambda: self._pieces(ids, options))

    def chat(self, messages: Sequence[Mapping[str, str]], options: GenerationOptions | None = None,
             **settings: Any) -> GenerationResult:
        """The assistant's reply to `messages` ({"role", "content"} dicts), through the checkpoint's chat template."""
        stream = self.stream_chat(messages, options, **settings)
        for _ in stream:
            pass
        return stream.result

    def stream_chat(self, messages: Sequence[Mapping[str, str]], options: GenerationOptions | None = None,
                    **settings: Any) -> Stream:
        options = resolve_options(options, settings)
        ids = self.chat_prompt(messages)
        speculative.Speculator.for_options(self, options)
        room = self.context_left(len(ids))
        if room < self.chat_reply_room(options.max_new_tokens):
            raise ValueError(f"the conversation takes {len(ids)} of the model's {self.model.args.block_size} tokens "
                             f"and leaves {room} for the reply; drop older turns (LLM.fit_chat does)")
        return Stream(self._lock, lambda: self._pieces(ids, options))

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer, so it cannot chat")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {i} must be a dict with str 'role' and 'content', got {m!r}")
            check_text(m["content"], f"message {i}")
        return list(self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True))

    def context_left(self, prompt_len: int) -> int:
        return self.model.args.block_size - prompt_len

    def chat_reply_room(self, max_new_tokens: int) -> int:
        return max(1, min(max_new_tokens, int(self.model.args.block_size * CHAT_REPLY_SHARE)))

    def fit_chat(self, messages: Sequence[Mapping[str, str]],
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> list[dict[str, str]]:
        """The most recent turns that fit the context with room for a reply: a leading system message stays, the
        oldest other turns go first. ValueError when even the last message does not fit."""
        messages = [dict(m) for m in messages]
        system = messages[:1] if messages and messages[0].get("role") == "system" else []
        turns = messages[len(system):]
        room = self.chat_reply_room(max_new_tokens)
        while turns:
            if self.context_left(len(self.chat_prompt(system + turns))) >= room:
                return system + turns
            turns = turns[1:]
            while turns and turns[0].get("role") != "user":  # a conversation restarts at a user turn
                turns = turns[1:]
        raise ValueError(f"the last message is too long for the model's context of {self.model.args.block_size} "
                         f"tokens with {room} left for the reply; shorten it")

    def _pieces(self, prompt_ids: list[int], options: GenerationOptions) -> Generator[str, None, GenerationResult]:
        """Text pieces of one generation (the caller holds the LLM); returns its GenerationResult."""
        eos = set() if options.ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        stops, sampling, max_new = list(options.stop), options.sampling, options.max_new_tokens
        prompts = torch.tensor([prompt_ids], dtype=torch.long)
        spec = speculative.Speculator.for_options(self, options)  # None without a draft
        engine: Any = spec if spec is not None else self  # whose token loop runs
        compile_s = engine._prepare(1, len(prompt_ids), max_new, sampling)  # never inside the timings
        recorder = self._recorder(options.profile, prompts, max_new, sampling, engine)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        text_stream = TextStream(self.tokenizer) if self.tokenizer is not None else None
        new_ids: list[int] = []
        times: list[float] = []  # when each step's tokens arrived
        counts: list[int] = []  # tokens taken from each step (a speculative step brings several)
        text, emitted, finish = "", 0, "length"
        with recorder if recorder is not None else contextlib.nullcontext():
            sync(self.device)
            start = time.perf_counter()
            for tokens, arrived in engine.generate_token_batches(prompts, max_new, sampling, recorder):
                times.append(arrived)
                counts.append(0)
                for token in tokens:  # batch 1: one token, or a verify step's accepted run
                    counts[-1] += 1
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
                if finish != "length":
                    break
            if finish == "length" and text_stream is not None:
                text += text_stream.flush()
                cut = first_stop(text, stops)
                if cut is not None:
                    text, finish = text[:cut], "stop"
        if len(text) > emitted:
            yield text[emitted:]
        stats = self._stats(len(prompt_ids), len(new_ids), start, times, compile_s, counts=counts,
                            speculation=spec.stats() if spec is not None else {})
        trace = recorder.write(self._trace_stats(stats), step_seconds(times, counts)) if recorder is not None else None
        return GenerationResult(text=text, token_ids=new_ids, stats=stats, finish_reason=finish, trace_path=trace)

    def _stats(self, prompt_len: int, n_new: int, start: float, times: list[float], compile_s: float,
               batch: int = 1, counts: list[int] | None = None,
               speculation: Mapping[str, Any] | None = None) -> GenerationStats:
        ttft = times[0] - start
        decode_s = times[-1] - times[0]
        timed = len(times) > 1 and decode_s > 0
        steps = (len(times) - 1) / decode_s if timed else 0.0  # weight reads per second
        decode_rate = sum(counts[1:]) / decode_s if timed and counts else steps  # tokens (a step may bring several)
        peak = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else None
        return GenerationStats(
            prompt_tokens=prompt_len, new_tokens=n_new, ttft_s=ttft, prefill_tok_s=prompt_len * batch / ttft,
            decode_tok_s=decode_rate * batch, model_bytes_per_token=self.bytes_per_token,
            bandwidth_gb_s=steps * self.bytes_per_token / 1e9, peak_memory_gb=peak,
            compile_s=compile_s, batch_size=batch, **(speculation or {}),
            threads=torch.get_num_threads() if self.device.type == "cpu" else None,
        )

    # -- profiling -----------------------------------------------------------------------------------------------------

    def _recorder(self, profile: ProfileConfig | None, prompts: Tensor, max_new_tokens: int,
                  sampling: SamplingParams, engine: Any = None) -> TraceRecorder | None:
        if profile is None:
            return None
        # Run the whole path once outside the trace, so the window holds only steady-state steps.
        warm = dataclasses.replace(sampling, seed=0)
        for _ in (engine or self).generate_token_batches(prompts, min(max_new_tokens, 4), warm):
            pass
        return TraceRecorder(profile, self.device)

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
    stop: tuple[str, ...] = ()
    device: str | None = None
    dtype: str | None = None
    compile: bool | None = None
    compile_prefill: bool = False
    quantize: str | None = None
    kernels: bool | None = None
    fuse: bool | None = None
    num_samples: int = 1
    chat: bool = False
    interactive: bool = False
    system: str | None = None
    profile: Path | None = None
    profile_steps: int = 16
    prompt_lookup: bool = False
    draft_checkpoint_path: Path | None = None
    draft_quantize: str | None = None
    speculate_k: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        # Validate every engine and generation setting before any work (a draft model's k as prompt lookup's).
        self.engine, self.options(0, "prompt_lookup" if self.draft_checkpoint_path is not None else None)
        speculative.check_cli_draft(self.prompt_lookup, self.draft_checkpoint_path, self.draft_quantize)
        if self.num_samples < 1:
            raise ValueError(f"--num_samples must be >= 1, got {self.num_samples}")
        if self.chat and self.interactive:
            raise ValueError("--chat sends one message and --interactive holds a conversation; pick one")
        if self.interactive and (self.prompt is not None or self.profile is not None or self.num_samples > 1):
            raise ValueError("--interactive reads the conversation from stdin; drop --prompt, --profile, --num_samples")
        if self.system is not None and not (self.chat or self.interactive):
            raise ValueError("--system is the chat's system message; add --chat or --interactive")
        if not self.interactive and not self.prompt:
            raise ValueError("--prompt is empty; pass some text, or use --interactive")
        for name in ("prompt", "system"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), f"--{name}")

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(self.device, self.dtype, self.compile, self.compile_prefill, self.quantize, self.kernels,
                            self.fuse, threads=self.threads)

    def options(self, sample: int, draft: Any = None) -> GenerationOptions:
        """Sample i's options: seed + i, and the trace for the first sample only; `draft`: the loaded draft model."""
        profile = ProfileConfig(self.profile, self.profile_steps) if self.profile is not None and sample == 0 else None
        draft = "prompt_lookup" if self.prompt_lookup else draft
        return GenerationOptions(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.stop,
                                 self.seed + sample if self.seed is not None else None, profile=profile,
                                 draft=draft, speculate_k=self.speculate_k)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": prompt}]


def parse_args(argv: Sequence[str] | None) -> GenerateArgs:
    p = argparse.ArgumentParser(description="Generate text with a Redline checkpoint.")
    p.add_argument("--checkpoint_path", type=Path, required=True, help="Redline checkpoint file or its folder")
    p.add_argument("--prompt", default=None, help="input text (with --chat: the user's message)")
    p.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sample i uses seed + i; default: a fresh seed per run")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile decoding to a CUDA graph (default: on for GPU, off for CPU)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (prompt lengths are bucketed)")
    p.add_argument("--quantize", default=None, help="quantize on load: int8, int4 or int4-gG (G: group size)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="Redline's Triton kernels (default: on where they run)")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="the fused batch-1 decode step; needs the kernels (default: on with them)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--chat", action="store_true", help="send --prompt as one user message through the chat template")
    p.add_argument("--interactive", action="store_true", help="chat on stdin with the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat and --interactive")
    p.add_argument("--profile", type=Path, default=None, help="write a Perfetto trace (.json.gz) here")
    p.add_argument("--profile_steps", type=int, default=16, help="decode steps recorded in the trace")
    p.add_argument("--prompt_lookup", action="store_true", help="speculate: draft by copying from the context")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None, help="speculate with this draft model")
    p.add_argument("--draft_quantize", default=None, help="quantize the draft on load: int8, int4 or int4-gG")
    p.add_argument("--speculate_k", type=int, default=None, help="tokens drafted per verify step (default 5)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default on the CPU: the physical cores)")
    ns = p.parse_args(argv)
    return GenerateArgs(**{**vars(ns), "stop": tuple(ns.stop)})


def print_stream(stream: Stream, out: Any) -> GenerationResult:
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    return stream.result


def run_cli(cfg: GenerateArgs, stdin: Any = None, out: Any = None, err: Any = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if cfg.interactive and tensor_parallel.env_ranks() is not None:
        raise ValueError("--interactive reads stdin in one process; run it without torchrun")
    llm = LLM.from_config(cfg.checkpoint_path, cfg.engine)
    if not tensor_parallel.is_main_process():  # under torchrun rank 0 alone prints
        out = err = tensor_parallel.NullWriter()
    draft = None if cfg.draft_checkpoint_path is None else LLM.from_config(
        cfg.draft_checkpoint_path, dataclasses.replace(cfg.engine, quantize=cfg.draft_quantize))
    if cfg.interactive:
        return interactive(llm, cfg, stdin or sys.stdin, out, err, draft)
    for i in range(cfg.num_samples):
        if cfg.chat:
            stream = llm.stream_chat(cfg.messages(cfg.prompt), cfg.options(i, draft))
        else:
            stream = llm.stream(cfg.prompt, cfg.options(i, draft))  # checks the prompt before it is echoed
            out.write(cfg.prompt)
        result = print_stream(stream, out)
        print(f"[sample {i + 1}/{cfg.num_samples}] {result.stats.summary()}", file=err)
        if result.trace_path is not None:
            print(f"trace written to {result.trace_path}", file=err)
    return 0


def interactive(llm: LLM, cfg: GenerateArgs, stdin: Any, out: Any, err: Any, draft: LLM | None = None) -> int:
    """A conversation on stdin: the oldest turns are dropped (the system message kept) when it outgrows the context."""
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    options = cfg.options(0, draft)
    print(f"chatting with {llm.model_name}; an empty line or EOF ends.", file=err)
    while True:
        out.write("you> ")
        out.flush()
        line = stdin.readline()
        if not line.strip():
            return 0
        try:
            fitted = llm.fit_chat(messages + [{"role": "user", "content": line.rstrip("\n")}], options.max_new_tokens)
        except ValueError as exc:
            print(f"error: {exc}", file=err)
            continue
        dropped = len(messages) + 1 - len(fitted)
        if dropped:
            print(f"note: the conversation outgrew the context; dropped the {dropped} oldest messages", file=err)
        messages = fitted
        out.write("assistant> ")
        result = print_stream(llm.stream_chat(messages, options), out)
        messages.append({"role": "assistant", "content": result.text})
        print(result.stats.summary(), file=err)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_cli(parse_args(argv))
    except (ValueError, FileNotFoundError) as exc:
        tensor_parallel.report_error(f"error: {exc}")  # rank 0 alone prints under torchrun
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        tensor_parallel.stop()


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.generate import main as package_main

    sys.exit(package_main())
