"""The loaded model on its device: the one place that applies the kernels and compile, sizes the static cache,
and owns the step functions (prefill, decode, verify, draft) with their captured graphs.

    runner = Runner(model, device, compile=True)
    for tokens, arrived in runner.token_batches(prompts, max_new_tokens=64, sampling=SamplingParams()):
        ...

`LLM` (generate.py) and speculative decoding are its clients; neither reaches into the model's caches or the
compiled callables, and the runner knows nothing of tokenizers, prompts as text or results.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
from torch import Tensor

from redline import tensor_parallel
from redline.kernels import FusedDecode, fused_decode_refusal, use_cpu_kernels, use_kernels
from redline.kernels import available as kernels_available
from redline.model import MoEFeedForward, PromptImages, Transformer
from redline.sampling import SamplingParams, is_int, next_token, refuse_penalized

SMALLEST_PREFILL_BUCKET = 16
# Each prefill bucket, batch size and sampling mode is its own graph; well below this, never fall back to eager.
RECOMPILE_LIMIT = 64
# Inductor settings of Redline's compiled calls, applied around each call only. emulate_precision_casts keeps the
# intermediate roundings to bf16 that eager performs (greedy tokens otherwise drift from eager's).
INDUCTOR_SETTINGS = {"triton.unique_kernel_names": True, "fx_graph_cache": True, "emulate_precision_casts": True,
                     "coordinate_descent_tuning": False}
# On the CPU the compiled step's wrapper is C++ too (inductor's cpp_wrapper): the Python wrapper's calls of the
# step's kernels and ops cost about a fifth of a decode step of the demo model (int8, 2 threads: 42-50 tok/s with
# it, 57-68 with the C++ wrapper, runs alternated in one hour).
CPU_INDUCTOR_SETTINGS = {"cpp_wrapper": True}
# The static cache grows in steps of this many positions: fewer cache shapes, fewer compiles.
CACHE_LENGTH_STEP = 256
# Calls that compile a graph, record it, then replay it once: after these a step runs from its captured graph.
WARM_UP_CALLS = 3


# ---------------------------------------------------------------------------------------------------------------------
# The two model calls of a generation.


def prefill(model: Transformer, ids: Tensor, input_pos: Tensor, last_index: Tensor, vocab_bias: Tensor | None,
            *sampling: Tensor, images: PromptImages | None = None) -> Tensor:
    """ids (B, T) -> first new token (B, 1). `last_index` (1,) is the last real prompt token (prompts may be padded).
    images: the prompt's images (an unpadded prompt)."""
    logits = model(ids, input_pos, logits_at=last_index, from_start=True, images=images)[:, -1]  # (B, V)
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

    def __init__(self, fn: Callable[..., Tensor], device: torch.device, graphs: bool = True,
                 dynamic: bool | None = False) -> None:
        """graphs: on a GPU, torch's own CUDA graphs (mode reduce-overhead); False for a caller that captures its own.
        dynamic: False, one graph per shape; None, dynamic only in the sizes the caller marks dynamic."""
        import torch._inductor.config as inductor_config

        mode = "reduce-overhead" if device.type == "cuda" and graphs else None
        self.fn = torch.compile(fn, mode=mode, fullgraph=True, dynamic=dynamic)
        settings = {**INDUCTOR_SETTINGS, **(CPU_INDUCTOR_SETTINGS if device.type == "cpu" else {})}
        # dynamic=None: the marked sizes alone. Dynamo's automatic dynamic shapes would otherwise turn other sizes
        # symbolic after a recompile (a second model in the process); torch 2.11 then failed to build a guard on
        # such a symbol (IndexError in inductor's 32-bit indexing guard).
        dynamo = {"recompile_limit": RECOMPILE_LIMIT}
        if dynamic is None:
            dynamo["automatic_dynamic_shapes"] = False
        self.settings = (inductor_config.patch(settings), torch._dynamo.config.patch(**dynamo))

    def __call__(self, *args: Any) -> Tensor:
        with self.settings[0], self.settings[1]:
            return self.fn(*args)


def model_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter and weight buffer, but only one embedding row and, in
    a mixture of experts, only the top_k chosen experts of each sparse layer."""
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
    return total - unread_expert_bytes(model)


def unread_expert_bytes(model: Transformer) -> int:
    """The bytes of the experts a token does not choose: (1 - top_k / n_experts) of each sparse layer's experts."""
    return sum(nbytes * (m.n_experts - m.top_k) // m.n_experts for m, nbytes in expert_bytes(model))


def expert_bytes(model: Transformer) -> list[tuple[MoEFeedForward, int]]:
    """Each sparse layer's mixture and the bytes of all its experts: w13 and w2 (and their int8 scales), the
    module's own tensors, not the router's."""
    out = []
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            stacked = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            out.append((module, sum(t.numel() * t.element_size() for t in stacked)))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vocab_bias(model_vocab: int, tokenizer_vocab: int | None, device: torch.device) -> Tensor | None:
    """(V,) fp32: 0 for ids the tokenizer decodes, -inf for a model's padding rows beyond them; None if none."""
    if tokenizer_vocab is None or tokenizer_vocab >= model_vocab:
        return None
    bias = torch.zeros(model_vocab, dtype=torch.float32, device=device)
    bias[tokenizer_vocab:] = float("-inf")
    return bias


@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """A batch of equal-length prompts padded to their bucket, on the device."""
    ids: Tensor  # (B, bucket) token ids, zeros after the prompt
    positions: Tensor  # (bucket,) 0..bucket-1
    last: Tensor  # (1,) index of the last real prompt token


class HostTokens:
    """Step outputs (B, 1) copied to pinned host memory on a side stream, so the device-to-host copy never sits
    between two graph replays; on the CPU a plain copy."""

    def __init__(self, batch: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.empty(batch, dtype=torch.long, pin_memory=pinned)  # (B,)
        self.ready = torch.cuda.Event() if pinned else None
        self.copier = torch.cuda.Stream(device) if pinned else None
        self.device = device

    def send(self, token: Tensor) -> None:
        if self.copier is None:
            self.host.copy_(token.view(-1))
            return
        self.copier.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copier):
            self.host.copy_(token.view(-1), non_blocking=True)
            self.ready.record(self.copier)
        token.record_stream(self.copier)  # its memory is not reused before the copy has read it

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def check_fp8_device(model: Transformer, device: torch.device, kernels: bool) -> None:
    """FP8 weights on a GPU run through the kernels, on a GPU with FP8 (never a silent dequantizing path)."""
    from redline.kernels.device import fp8_refusal
    from redline.quantize import model_quantization

    if device.type == "cpu" or model_quantization(model) != "fp8":
        return
    if (refusal := fp8_refusal(device)) is not None:
        raise ValueError(refusal)
    if not kernels:
        raise ValueError("FP8 weights on a GPU run on Redline's FP8 kernels; drop kernels=False (or --kernels off)")


class Runner:
    """Owns a model on its device: its kernels (applied once, in place), its static cache, and every compiled step.

    `kernels=None` turns Redline's Triton kernels on for a CUDA device where they run; `fuse=None` follows them
    (the fused batch-1 decode step). `tokenizer_vocab` masks the model's padding rows beyond the tokenizer's ids.
    """

    def __init__(self, model: Transformer, device: torch.device | str, compile: bool, compile_prefill: bool = False,
                 kernels: bool | None = None, fuse: bool | None = None, tokenizer_vocab: int | None = None) -> None:
        device = torch.device(device)
        self.model = model.requires_grad_(False)  # inference only: graphs are traced without autograd
        # Redline's Triton GEMVs beat cuBLAS at decode shapes (BENCHMARKS.md); default on where they run.
        self.kernels = device.type == "cuda" and kernels_available() if kernels is None else kernels
        # The fused batch-1 decode is on by default for the models whose blocks its kernels implement
        # (kernels.fused_decode_refusal says why not for the others).
        self.fuse = self.kernels and fused_decode_refusal(model.args) is None if fuse is None else fuse
        if self.kernels and (device.type != "cuda" or not kernels_available()):
            raise ValueError("kernels=True needs a CUDA/ROCm GPU with Triton installed; use kernels=False")
        if self.fuse and not self.kernels:
            raise ValueError("fuse=True needs the GPU kernels (kernels=True)")
        check_fp8_device(model, device, self.kernels)
        self.step_model: torch.nn.Module = model  # what decode steps call
        if self.kernels:
            use_kernels(model)
            if self.fuse:
                self.step_model = FusedDecode(model)
        elif device.type == "cpu" and kernels is None:  # kernels=False runs no Redline kernel, on the CPU either
            use_cpu_kernels(model)  # linears (and an exact Q8_0 head) on kernels/cpu_linear.py's C++ kernels
        self.device = device
        self.compile = compile
        self.compile_prefill = compile_prefill
        self.bytes_per_token = model_bytes_per_token(model)
        self.vocab_bias = vocab_bias(model.args.vocab_size, tokenizer_vocab, device)  # made once: no recompile
        self._prefill_fn: Callable[..., Tensor] = prefill
        self._decode_fn: Callable[..., Tensor] = decode_one_token
        if compile:
            self._decode_fn = CompiledStep(decode_one_token, device)
            if compile_prefill:  # one CUDA graph per prompt bucket too: short prompts are otherwise launch-bound
                self._prefill_fn = CompiledStep(prefill, device)
        self._steps: dict[str, Callable[..., Any]] = {}  # other compiled steps (speculative verify, draft), by name
        self._warm: set[tuple] = set()  # graphs already compiled and captured
        self._costs: dict[tuple, float] = {}  # measured step-time ratios, by key (speculative.CostGate)

    # -- sizes ---------------------------------------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.model.args.block_size

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def cache_length(self) -> int:
        """Positions the static cache holds now (0 before the first generation)."""
        return self.model.max_seq_length

    def plan_lengths(self, prompt_len: int, max_new_tokens: int) -> int:
        """New tokens a generation makes: max_new_tokens, capped by the context."""
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        context = self.context_length
        if prompt_len >= context:
            raise ValueError(f"the prompt has {prompt_len} tokens, but the model's context is {context}; shorten it")
        return min(max_new_tokens, context - prompt_len)

    def ensure_cache(self, batch_size: int, seq_len: int) -> None:
        """Keep the current cache when it is large enough (a new cache shape means a new graph)."""
        m = self.model
        if m.max_batch_size >= batch_size and m.max_seq_length >= seq_len:
            return
        length = min(max(seq_len, m.max_seq_length, CACHE_LENGTH_STEP), m.args.block_size)
        length = min(-(-length // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP, m.args.block_size)
        m.setup_caches(max(batch_size, m.max_batch_size), length)

    def cache_key(self) -> tuple:
        """Identifies the current cache: a re-allocated one needs its graphs captured again."""
        model = self.model
        return model.max_seq_length, model.max_batch_size, model.layers[0].attention.cache().k.data_ptr()

    # -- compiled steps --------------------------------------------------------------------------------------------------

    def mark_step(self) -> None:
        """Tells the CUDA-graph trees a new step begins (its outputs may overwrite the last step's)."""
        if self.compile and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()

    def step_args(self, sampling: SamplingParams) -> tuple[Tensor, ...]:
        return () if sampling.is_greedy else sampling.tensors(self.vocab_size, self.device)

    def step(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` compiled once under `name` (eager when not compiling): the speculative verify and draft steps."""
        if name not in self._steps:
            self._steps[name] = CompiledStep(fn, self.device) if self.compile else fn
        return self._steps[name]

    def is_warm(self, key: tuple) -> bool:
        return not self.compile or key in self._warm

    def warm_up(self, key: tuple, call: Callable[[], Any]) -> float:
        """Compiles, records and replays `call` once under `key` (nothing if warm or not compiling); seconds spent.
        Same grad mode and tensor kinds as generation, or the real call would recompile."""
        if self.is_warm(key):
            return 0.0
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(WARM_UP_CALLS):
                self.mark_step()
                call()
        sync(self.device)
        self._warm.add(key)
        return time.perf_counter() - start

    def measured(self, key: tuple, measure: Callable[[], float]) -> float:
        """A cost measured once per key (the speculative cost gate's verify/decode ratio) and kept."""
        if key not in self._costs:
            self._costs[key] = measure()
        return self._costs[key]

    def forget_costs(self) -> None:
        self._costs.clear()

    @property
    def costs(self) -> dict[tuple, float]:
        return dict(self._costs)

    def prepare(self, batch: int, prompt_len: int, max_new_tokens: int, sampling: SamplingParams) -> float:
        """Size the cache and compile/capture this generation's graphs; returns the seconds that took (0 if warm).
        Garbage written to the cache here is harmless: every position is rewritten before it is read."""
        refuse_penalized(sampling)
        self.ensure_cache(batch, prompt_len + self.plan_lengths(prompt_len, max_new_tokens))
        if not self.compile:
            return 0.0
        args = self.step_args(dataclasses.replace(sampling, seed=0))  # warm-ups leave the global RNG alone
        key = (batch, *self.cache_key(), bool(args))
        with torch.inference_mode():
            token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
            inputs = self.prefill_inputs(torch.zeros(batch, prompt_len, dtype=torch.long))
        seconds = self.warm_up(("decode", *key), lambda: self.decode(token, inputs.positions[:1], args))
        if self.compile_prefill:
            bucket = inputs.ids.shape[1]
            seconds += self.warm_up(("prefill", bucket, *key), lambda: self.prefill(inputs, args))
        return seconds

    def prefill_inputs(self, prompts: Tensor | Sequence[Sequence[int]], bucketed: bool = True) -> PrefillInputs:
        """Equal-length prompts (B, T) padded to their bucket (their own length without compiled prefill, or when
        not `bucketed`)."""
        prompts = torch.as_tensor(prompts, dtype=torch.long)  # (B, T)
        batch, length = prompts.shape
        bucket = prefill_bucket(length, self.cache_length) if self.compile_prefill and bucketed else length
        with torch.inference_mode():  # the same tensor kind as the warm-up's, so the compiled prefill's guards match
            ids = torch.zeros(batch, bucket, dtype=torch.long, device=self.device)  # (B, bucket)
            ids[:, :length] = prompts.to(self.device)
            positions = torch.arange(bucket, device=self.device)  # (bucket,)
            last = torch.tensor([length - 1], device=self.device)  # (1,)
        return PrefillInputs(ids, positions, last)

    def prefill(self, inputs: PrefillInputs, args: tuple[Tensor, ...], images: PromptImages | None = None) -> Tensor:
        """The first new token (B, 1) on the device, copied out of the CUDA graph's pool (the next replay may
        reuse that memory). A prompt with images runs eagerly: its embeddings and positions are its own."""
        self.mark_step()
        if images is not None:
            return prefill(self.model, inputs.ids, inputs.positions, inputs.last, self.vocab_bias, *args,
                           images=images).clone()
        return self._prefill_fn(self.model, inputs.ids, inputs.positions, inputs.last, self.vocab_bias,
                                *args).clone()

    def decode(self, token: Tensor, input_pos: Tensor, args: tuple[Tensor, ...]) -> Tensor:
        """One decode step: token (B, 1) at input_pos (1,) -> next token (B, 1) on the device (not copied)."""
        self.mark_step()
        return self._decode_fn(self.step_model, token, input_pos, self.vocab_bias, *args)

    # -- the token loop --------------------------------------------------------------------------------------------------

    def token_batches(self, prompts: Tensor, max_new_tokens: int, sampling: SamplingParams,
                      recorder: Any = None, images: PromptImages | None = None) -> Iterator[tuple[list[int], float]]:
        """The token loop, for a batch of equal-length prompts (B, T); not locked (LLM's callers are).

        Yields (tokens of this step, host time when they arrived, less any time the profiler spent on itself).
        On a GPU step i+1 is queued before step i's tokens are read, so reading never leaves the GPU idle; on the
        CPU a step runs when it is called, so step i's tokens go out first (queuing i+1 ahead would only hold
        them back by a step: the first token would wait for the prefill and a decode step).
        """
        refuse_penalized(sampling)
        batch, prompt_len = prompts.shape
        new_tokens = self.plan_lengths(prompt_len, max_new_tokens)
        sampling = tensor_parallel.agreed_sampling(sampling, self.model)  # every rank draws the same tokens
        self.prepare(batch, prompt_len, max_new_tokens, sampling)
        args = self.step_args(sampling)
        region = recorder.region if recorder is not None else (lambda name: contextlib.nullcontext())
        inputs = self.prefill_inputs(prompts, bucketed=images is None)
        host = HostTokens(batch, self.device)
        with torch.inference_mode():
            with region("prefill"):
                token = self.prefill(inputs, args, images)
                host.send(token)  # (B, 1)
            # Decode step i reads position prompt_len + i - 1 from this table: a slice per step instead of an
            # in-place increment, which would be one more kernel between graph replays. Made in inference mode,
            # like the warm-up's position, so the compiled step's guards match.
            decode_positions = torch.arange(prompt_len, prompt_len + new_tokens, device=self.device)  # (N,)
            paused = 0.0  # the profiler's own bookkeeping (starting, stopping) is kept out of every timing
            ahead = self.device.type != "cpu"
            if not ahead:
                yield host.read(), time.perf_counter()  # the prefill's tokens, before any decode step runs
            for step in range(1, new_tokens + 1 if ahead else new_tokens):
                if recorder is not None:
                    before = time.perf_counter()
                    recorder.step()
                    paused += time.perf_counter() - before
                with region("decode_step"):
                    if not ahead:  # this step's tokens, read as soon as it has run
                        token = self.decode(token, decode_positions[step - 1:step], args).clone()
                        host.send(token)  # (B, 1)
                    elif step < new_tokens:
                        nxt = self.decode(token, decode_positions[step - 1:step], args).clone()
                    tokens = host.read()  # on a GPU the previous step's; the next one is already queued
                    arrived = time.perf_counter() - paused
                    if ahead and step < new_tokens:
                        host.send(nxt)  # (B, 1)
                        token = nxt
                yield tokens, arrived

