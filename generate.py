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
import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from PIL import Image
from torch import Tensor

from redline.checkpoint import (CheckpointInfo, OneLineArgumentParser, checkpoint_inputs, dtype_from_name, dtype_name,
                                read_checkpoint_info)
from redline.checkpoint import run_cli as cli_main
from redline.images import open_image, read_image_file
from redline.kernels.cpu_linear import kernel_threads
from redline.model import PromptImages, Transformer
from redline.options import (DEFAULT_MAX_NEW_TOKENS, DTYPE_FOLDERS, EngineConfig, GenerationOptions,  # noqa: F401
                             GenerationResult, GenerationStats, check_text, default_device, prompt_token_ids,
                             resolve_options)
from redline.outputs import check_output
from redline.prompts import CHAT_REPLY_SHARE, Prompts  # noqa: F401
from redline.profiling import ProfileConfig, TraceRecorder, is_trace_file
from redline import speculative
from redline.quantize import load_model, model_quantization
from redline.runner import Runner, sync
from redline.runner.load import load_checkpoint_model
from redline.sampling import SamplingParams, nucleus_keep_mask, sample  # noqa: F401
from redline.streaming import GenerationLock, Stream, TextStream, first_stop, print_stream, step_seconds  # noqa: F401
from redline import tensor_parallel
from redline.tokenizer import Tokenizer, load_tokenizer
from redline.vision import VisionTower, load_vision_tower, prompt_images

if TYPE_CHECKING:
    from redline.engine import Engine

# A chat keeps this share of the context (or max_new_tokens, if fewer) free for the reply.
# Guards making each LLM's batching engine once.
_ENGINE_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------------------------------
# The engine.


class LLM:
    """A loaded model with its tokenizer, on a Runner (runner.py) that owns its kernels, cache and compiled steps.

    Safe to share between threads: calls are serialized by a lock held for a whole generation (a stream's from its
    first next() to its end or close()). `LLM(model, ...)` rewrites the model it is handed only when kernels are on
    (`kernels=None` turns them on for a CUDA device where they run): `kernels.use_kernels` then swaps its linear,
    int8 linear and attention modules in place for Redline's Triton ops. `kernels=False` runs no Redline kernel.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, device: torch.device | str, compile: bool,
                 compile_prefill: bool = False, info: CheckpointInfo | None = None,
                 kernels: bool | None = None, name: str | None = None, fuse: bool | None = None) -> None:
        self.runner = Runner(model, device, compile, compile_prefill, kernels, fuse,
                             tokenizer.vocab_size if tokenizer is not None else None)
        self.tokenizer = tokenizer
        self.prompts = Prompts(tokenizer, model.args.block_size, model.args.vocab_size)
        self.info = info
        self.name = name  # for stats and traces; by default the checkpoint's folder name
        self.lock = GenerationLock()  # held for a whole generation, a stream's included

    # The runner's state, read-only here.
    model = property(lambda self: self.runner.model)
    device = property(lambda self: self.runner.device)
    compile = property(lambda self: self.runner.compile)
    compile_prefill = property(lambda self: self.runner.compile_prefill)
    kernels = property(lambda self: self.runner.kernels)
    fuse = property(lambda self: self.runner.fuse)
    bytes_per_token = property(lambda self: self.runner.bytes_per_token)
    block_size = property(lambda self: self.runner.context_length)
    vocab_size = property(lambda self: self.prompts.vocab_size)  # the embedding table's rows

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device | None = None, dtype: str | None = None,
             compile: bool | None = None, compile_prefill: bool = False, quantize: str | None = None,
             kernels: bool | None = None, fuse: bool | None = None, name: str | None = None,
             max_kv_tokens: int | None = None, threads: int | None = None, kv_cache_dtype: str = "auto") -> LLM:
        """Load a Redline checkpoint (file or folder); its tokenizer is found beside it. max_kv_tokens caps the
        batching engine's page pool (LLM.engine, generate_batch) and kv_cache_dtype sets its pages' elements ("auto":
        the model's dtype; "fp8": e4m3 with calibrated scales, twice the tokens); threads sets torch's CPU threads
        (default: the physical cores, on the CPU)."""
        return cls.from_config(path, EngineConfig(device, dtype, compile, compile_prefill, quantize, kernels, fuse,
                                                  name, max_kv_tokens, threads, kv_cache_dtype))

    @classmethod
    def from_config(cls, path: str | os.PathLike, config: EngineConfig) -> LLM:
        world = tensor_parallel.start(config.device)  # None unless torchrun launched several ranks
        device = config.torch_device() if world is None else world.device
        config.set_threads(device)
        info = read_checkpoint_info(path)
        tokenizer = load_tokenizer(info.path)
        model = load_checkpoint_model(info, device, config, world)
        compile = config.compile if config.compile is not None else device.type == "cuda" or config.compile_prefill
        llm = cls(model, tokenizer, device, compile, config.compile_prefill, info, config.kernels, config.name,
                  config.fuse)
        llm.max_kv_tokens = config.max_kv_tokens
        from redline.engine.kv_pages import kv_dtype

        kv_dtype(config.kv_cache_dtype, model.cache_dtype, device)  # refused here, not at the first batch
        llm.kv_cache_dtype = config.kv_cache_dtype
        if world is None:  # a multimodal checkpoint's tower, kept in the activations' dtype (never quantized)
            llm.vision = load_vision_tower(info.path, device, model.cache_dtype)
        return llm

    # -- generation ----------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Text through the tokenizer (BOS/EOS as its own rules say), or token ids used exactly as given."""
        return self.prompts.encode_prompt(prompt)

    def generate_token_batches(self, prompts: Tensor, max_new_tokens: int, sampling: SamplingParams,
                               recorder: Any = None) -> Iterator[tuple[list[int], float]]:
        """The runner's token loop for equal-length prompts (B, T); not locked (generate/stream/chat are)."""
        return self.runner.token_batches(prompts, max_new_tokens, sampling, recorder)

    def generate(self, prompt: str | Sequence[int], options: GenerationOptions | None = None, *,
                 images: Sequence[Any] | None = None, **settings: Any) -> GenerationResult:
        """Generate a continuation of `prompt` (text, or token ids used exactly). images: one per image placeholder
        of the prompt (vision.prompt_images), each a PIL image or the bytes of a PNG, JPEG, WebP or GIF file."""
        stream = self.stream(prompt, options, images=images, **settings)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], options: GenerationOptions | None = None, *,
               images: Sequence[Any] | None = None, **settings: Any) -> Stream:
        """Like generate, but yields text pieces as they are decoded; `.result` once exhausted. The prompt, options
        and images are checked here (the images run through the vision tower here too), before the first piece is
        asked for."""
        options = resolve_options(options, settings)
        ids = self.encode_prompt(prompt)
        ids, media = self.with_images(ids, images, options)
        self.runner.plan_lengths(len(ids), options.max_new_tokens)
        self.check_engine_only(ids, options, media)
        speculative.Speculator.for_options(self, options)  # a bad draft is refused here, before the first piece
        return Stream(self.lock, lambda: self._pieces(ids, options, media))

    vision: VisionTower | None = None  # a multimodal checkpoint's vision tower (vision.py)

    def with_images(self, ids: list[int], images: Sequence[Any] | None,
                    options: GenerationOptions) -> tuple[list[int], PromptImages | None]:
        """The prompt with each image placeholder expanded into its image's tokens, and the images' embeddings and
        positions for the prefill; (ids, None) without images."""
        if not images:
            if self.vision is not None and self.vision.args.placeholder_id in ids:
                raise ValueError(f"the prompt holds image placeholders (token {self.vision.args.placeholder_id}) "
                                 f"but no images came with it; pass images=[...]")
            return ids, None
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower, so it takes no images; convert a multimodal "
                             "checkpoint (Gemma 3 4B+, Qwen2.5-VL) with scripts/convert_hf_checkpoint.py")
        if options.draft is not None:
            raise ValueError("speculative decoding does not take images yet; drop the draft or the images")
        pictures = [image if isinstance(image, Image.Image) else open_image(image) for image in images]
        with torch.inference_mode():
            expanded, media = prompt_images(self.vision, ids, pictures)
        return self.prompts.encode_prompt(expanded), media  # ids checked against the vocabulary

    def chat(self, messages: Sequence[Mapping[str, str]], options: GenerationOptions | None = None, *,
             images: Sequence[Any] | None = None, **settings: Any) -> GenerationResult:
        """The assistant's reply to `messages` ({"role", "content"} dicts), through the checkpoint's chat template.
        images: one per image placeholder the rendered conversation holds (the model's own, e.g. <start_of_image>)."""
        stream = self.stream_chat(messages, options, images=images, **settings)
        for _ in stream:
            pass
        return stream.result

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], options: GenerationOptions | None = None, *,
                    images: Sequence[Any] | None = None, **settings: Any) -> Stream:
        options = resolve_options(options, settings)
        messages, in_parts = split_image_parts(messages)
        if in_parts and images:
            raise ValueError("give the images as content parts or as images=, not both")
        ids, media = self.with_images(self.chat_prompt(messages), in_parts or images, options)
        self.check_engine_only(ids, options, media)
        speculative.Speculator.for_options(self, options)
        room = self.context_left(len(ids))
        if room < self.chat_reply_room(options.max_new_tokens):
            raise ValueError(f"the conversation takes {len(ids)} of the model's {self.model.args.block_size} tokens "
                             f"and leaves {room} for the reply; drop older turns (LLM.fit_chat does)")
        return Stream(self.lock, lambda: self._pieces(ids, options, media))

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.prompts.chat_prompt(messages)

    def context_left(self, prompt_len: int) -> int:
        return self.prompts.context_left(prompt_len)

    def chat_reply_room(self, max_new_tokens: int) -> int:
        return self.prompts.chat_reply_room(max_new_tokens)

    def fit_chat(self, messages: Sequence[Mapping[str, str]],
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> list[dict[str, str]]:
        """The most recent turns that fit the context with room for a reply (Prompts.fit_chat)."""
        return self.prompts.fit_chat(messages, max_new_tokens)

    def check_engine_only(self, ids: list[int], options: GenerationOptions, images: PromptImages | None) -> None:
        """Options only the batching engine runs (GenerationOptions.engine_only) go there, checked now; it takes
        no draft and no images."""
        if not options.engine_only:
            return
        if options.draft is not None or images is not None or options.profile is not None:
            raise ValueError("penalties, logit_bias, min_p, min_tokens, stop_token_ids and include_stop_str_in_output "
                             "run on the batching engine, which takes no draft, images or profile; drop one side")
        self.engine.check_request(ids, options)

    def _pieces(self, prompt_ids: list[int], options: GenerationOptions,
                images: PromptImages | None = None) -> Generator[str, None, GenerationResult]:
        """Text pieces of one generation (the caller holds the LLM); returns its GenerationResult."""
        if options.engine_only:
            return (yield from self._engine_pieces(prompt_ids, options))
        eos = set() if options.ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        stops, sampling, max_new = list(options.stop), options.sampling, options.max_new_tokens
        prompts = torch.tensor([prompt_ids], dtype=torch.long)
        spec = speculative.Speculator.for_options(self, options)  # None without a draft
        loop: Any = spec if spec is not None else self.runner  # whose token loop runs
        compile_s = loop.prepare(1, len(prompt_ids), max_new, sampling)  # never inside the timings
        recorder = self._recorder(options.profile, prompts, max_new, sampling, loop)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        text_stream = TextStream(self.tokenizer, options.skip_special_tokens) if self.tokenizer is not None else None
        new_ids: list[int] = []
        times: list[float] = []  # when each step's tokens arrived
        counts: list[int] = []  # tokens taken from each step (a speculative step brings several)
        text, emitted, finish = "", 0, "length"
        with recorder if recorder is not None else contextlib.nullcontext():
            sync(self.device)
            start = time.perf_counter()
            batches = (loop.token_batches(prompts, max_new, sampling, recorder) if images is None else
                       self.runner.token_batches(prompts, max_new, sampling, recorder, images))  # never speculative
            for tokens, arrived in batches:
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
            if finish != "stop" and text_stream is not None:  # at EOS too: the held-back tail is text
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

    def _engine_pieces(self, prompt_ids: list[int],
                       options: GenerationOptions) -> Generator[str, None, GenerationResult]:
        """Text pieces of one generation run by the batching engine (options only its sampler applies); returns
        its GenerationResult. Closing the generator early aborts the request."""
        handle = self.engine.add_request(prompt_ids, options)
        outputs = []
        try:
            for output in handle:
                outputs.append(output)
                if output.text:
                    yield output.text
        finally:
            if not outputs or outputs[-1].finish_reason is None:
                handle.abort()
        return handle.result()

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
            threads=kernel_threads() if self.device.type == "cpu" else None,
        )

    # -- profiling -----------------------------------------------------------------------------------------------------

    def _recorder(self, profile: ProfileConfig | None, prompts: Tensor, max_new_tokens: int,
                  sampling: SamplingParams, loop: Any) -> TraceRecorder | None:
        if profile is None:
            return None
        # Run the whole path once outside the trace, so the window holds only steady-state steps.
        warm = dataclasses.replace(sampling, seed=0)
        for _ in loop.token_batches(prompts, min(max_new_tokens, 4), warm):
            pass
        return TraceRecorder(profile, self.device)

    @property
    def model_name(self) -> str:
        """The name given at load, else the checkpoint's folder (the one above a dtype folder such as float32/, where
        the demo and convert_gguf's outputs live), else "model"."""
        if self.name is not None:
            return self.name
        if self.info is None:
            return "model"
        folder = self.info.path.parent
        return folder.parent.name if folder.name in DTYPE_FOLDERS and folder.parent.name else folder.name

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

    # -- batching ------------------------------------------------------------------------------------------------------

    max_kv_tokens: int | None = None  # the engine's page pool in tokens; None: sized from free memory
    kv_cache_dtype: str = "auto"  # the engine's pages: "auto" (the model's dtype) or "fp8"

    @property
    def engine(self) -> Engine:
        """This LLM's continuous-batching engine (engine.Engine), made on first use and again after a shutdown."""
        from redline.engine import Engine

        with _ENGINE_LOCK:
            if self.__dict__.get("_engine") is None or self._engine.closed:
                self._engine = Engine(self, max_kv_tokens=self.max_kv_tokens, kv_cache_dtype=self.kv_cache_dtype)
            return self._engine

    def generate_batch(self, prompts: Sequence[str | Sequence[int]],
                       options: GenerationOptions | Sequence[GenerationOptions] | None = None, *,
                       images: Sequence[Sequence[Any] | None] | None = None,
                       **settings: Any) -> list[GenerationResult]:
        """Generate for many prompts at once through the engine; results in input order. `options` is one
        GenerationOptions for all or a list with one per prompt; keywords override fields as in generate.
        images: for each prompt, its images (as generate takes them) or None."""
        from redline.engine.client import generate_all

        return generate_all(self.engine, prompts, options, settings, images)


def split_image_parts(messages: Any) -> tuple[Any, list[Any]]:
    """Messages whose content lists {"type": "image", "image": PIL image or bytes} parts -> the same messages with
    those parts as {"type": "image"} (what chat templates render as the model's placeholder), and the images in
    order. Anything else is returned as it is, for chat_prompt to check."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return messages, []
    images: list[Any] = []
    out = []
    for m in messages:
        if isinstance(m, Mapping) and isinstance(m.get("content"), list):
            parts = []
            for part in m["content"]:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    if "image" not in part:
                        raise ValueError("an image part needs its picture: {'type': 'image', 'image': PIL image or "
                                         "bytes}")
                    images.append(part["image"])
                    part = {"type": "image"}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, images


# ---------------------------------------------------------------------------------------------------------------------
# CLI.


# The CLI samples by default (the Python API is greedy unless told): gpt-fast's defaults, so a first run reads like
# chat output rather than the most likely loop of text.
CLI_TEMPERATURE = 0.8
CLI_TOP_K = 200


@dataclass(frozen=True)
class GenerateArgs:
    """The CLI's settings: how to build the engine (EngineConfig, the same as LLM.load's), how each generation samples
    and ends (GenerationOptions, the same as generate's), and what the command does with them."""
    checkpoint_path: Path
    engine: EngineConfig = EngineConfig()
    options: GenerationOptions = GenerationOptions(temperature=CLI_TEMPERATURE, top_k=CLI_TOP_K)
    prompt: str | None = None
    num_samples: int = 1
    chat: bool = False
    interactive: bool = False
    system: str | None = None
    draft_checkpoint_path: Path | None = None  # a draft model, loaded by run_cli
    draft_quantize: str | None = None
    speculate_k: int | None = None  # the draft model's k (prompt lookup's is in options)
    overwrite: bool = False  # --profile may replace an earlier trace
    images: tuple[Path, ...] = ()  # image files, one per image placeholder of the prompt (or chat message)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig) or not isinstance(self.options, GenerationOptions):
            raise TypeError("GenerateArgs takes an EngineConfig and a GenerationOptions")
        if self.draft_checkpoint_path is not None:  # the draft model's k is checked as prompt lookup's would be
            dataclasses.replace(self.options, draft="prompt_lookup", speculate_k=self.speculate_k)
        elif self.speculate_k is not None:
            raise ValueError("--speculate_k needs a draft; add --prompt_lookup or --draft_checkpoint_path")
        speculative.check_cli_draft(self.options.draft == "prompt_lookup", self.draft_checkpoint_path,
                                    self.draft_quantize)
        if self.num_samples < 1:
            raise ValueError(f"--num_samples must be >= 1, got {self.num_samples}")
        if self.chat and self.interactive:
            raise ValueError("--chat sends one message and --interactive holds a conversation; pick one")
        if self.interactive and self.images:
            raise ValueError("--image goes with --prompt (its image placeholders); drop it for --interactive")
        if self.interactive and (self.prompt is not None or self.options.profile is not None or self.num_samples > 1):
            raise ValueError("--interactive reads the conversation from stdin; drop --prompt, --profile, --num_samples")
        if self.system is not None and not (self.chat or self.interactive):
            raise ValueError("--system is the chat's system message; add --chat or --interactive")
        if not self.interactive and not self.prompt:
            raise ValueError("--prompt is empty; pass some text, or use --interactive")
        for name in ("prompt", "system"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), f"--{name}")
        if self.options.profile is not None:  # before the model loads: never a file this run reads, or one it did not write
            inputs = [*checkpoint_inputs(self.checkpoint_path), *checkpoint_inputs(self.draft_checkpoint_path)]
            check_output(self.options.profile.path, inputs, "--profile", overwrite=self.overwrite,
                         replaceable=is_trace_file)

    def sample_options(self, index: int, draft: Any = None) -> GenerationOptions:
        """Sample i's options: seed + i, the trace for the first sample only, and the loaded draft model if any."""
        options = self.options
        if options.seed is not None:
            options = dataclasses.replace(options, seed=options.seed + index)
        if index > 0 and options.profile is not None:
            options = dataclasses.replace(options, profile=None)
        if draft is not None:
            options = dataclasses.replace(options, draft=draft, speculate_k=self.speculate_k)
        return options

    def messages(self, prompt: str) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": prompt}]


def parse_args(argv: Sequence[str] | None) -> GenerateArgs:
    p, Bool = OneLineArgumentParser(description="Generate text with Redline."), argparse.BooleanOptionalAction
    p.add_argument("--checkpoint_path", type=Path, required=True, help="Redline checkpoint file or its folder")
    p.add_argument("--prompt", default=None, help="input text (with --chat: the user's message)")
    p.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens generated at most")
    p.add_argument("--temperature", type=float, default=CLI_TEMPERATURE, help="sampling temperature; 0 means greedy")
    p.add_argument("--top_k", type=int, default=CLI_TOP_K, help="sample among the k most likely tokens")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling; None means off")
    p.add_argument("--seed", type=int, default=None, help="sample i uses seed + i; None means a fresh seed per run")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="> 1 makes tokens of the prompt and reply less likely (1 is off; runs the batching engine)")
    p.add_argument("--presence_penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted once from each token the reply holds (0 is off)")
    p.add_argument("--frequency_penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted per occurrence of each token in the reply (0 is off)")
    p.add_argument("--min_p", type=float, default=0.0,
                   help="in [0, 1]: drop tokens less likely than min_p times the most likely one (0 is off)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N; None means cuda when available")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32; None means the checkpoint's")
    p.add_argument("--compile", action=Bool, default=None, help="compile decoding (a CUDA graph); None: on for GPU")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (prompt lengths are bucketed)")
    p.add_argument("--quantize", default=None, help="quantize on load: int8, int4 or int4-gG; None means as stored")
    p.add_argument("--kernels", action=Bool, default=None, help="Redline's Triton kernels; None: on where they run")
    p.add_argument("--fuse", action=Bool, default=None, help="the fused batch-1 decode step; None: on with kernels")
    p.add_argument("--num_samples", type=int, default=1, help="samples generated one after another")
    p.add_argument("--chat", action="store_true", help="send --prompt as one user message through the chat template")
    p.add_argument("--interactive", action="store_true", help="chat on stdin with the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat and --interactive")
    p.add_argument("--profile", type=Path, default=None, help="write a Perfetto trace (.json.gz or .json) here")
    p.add_argument("--profile_steps", type=int, default=16, help="decode steps recorded in the trace")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier --profile trace")
    p.add_argument("--prompt_lookup", action="store_true", help="speculate: draft by copying from the context")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None, help="speculate with this draft model")
    p.add_argument("--draft_quantize", default=None, help="quantize the draft on load: int8, int4 or int4-gG")
    p.add_argument("--speculate_k", type=int, default=None, help="tokens drafted per verify step; None means 5")
    p.add_argument("--threads", type=int, default=None, help="CPU threads; None means the physical cores")
    p.add_argument("--kv_cache_dtype", "--kv-cache-dtype", default="auto",
                   help="the batching engine's KV pages (penalties run it): auto (the model's dtype) or fp8 (e4m3)")
    p.add_argument("--image", type=Path, action="append", default=[],
                   help="an image file for the prompt's next image placeholder (repeatable; multimodal checkpoints)")
    ns = p.parse_args(argv)
    engine = EngineConfig(ns.device, ns.dtype, ns.compile, ns.compile_prefill, ns.quantize, ns.kernels, ns.fuse,
                          threads=ns.threads, kv_cache_dtype=ns.kv_cache_dtype)
    lookup = ns.prompt_lookup
    options = GenerationOptions(
        ns.max_new_tokens, ns.temperature, ns.top_k, ns.top_p, tuple(ns.stop), ns.seed,
        profile=ProfileConfig(ns.profile, ns.profile_steps) if ns.profile is not None else None,
        draft="prompt_lookup" if lookup else None, speculate_k=ns.speculate_k if lookup else None,
        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        repetition_penalty=ns.repetition_penalty, min_p=ns.min_p)
    return GenerateArgs(ns.checkpoint_path, engine, options, ns.prompt, ns.num_samples, ns.chat, ns.interactive,
                        ns.system, ns.draft_checkpoint_path, ns.draft_quantize, None if lookup else ns.speculate_k,
                        ns.overwrite, tuple(ns.image))


def run_cli(cfg: GenerateArgs, stdin: Any = None, out: Any = None, err: Any = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if cfg.interactive and tensor_parallel.env_ranks() is not None:
        raise ValueError("--interactive reads stdin in one process; run it without torchrun")
    stdin = stdin or sys.stdin
    if cfg.interactive and (stdin is None or stdin.closed):
        raise ValueError("stdin is closed, and --interactive reads the conversation from it")
    llm = LLM.from_config(cfg.checkpoint_path, cfg.engine)
    if not tensor_parallel.is_main_process():  # under torchrun rank 0 alone prints
        out = err = tensor_parallel.NullWriter()
    draft = None if cfg.draft_checkpoint_path is None else LLM.from_config(
        cfg.draft_checkpoint_path, dataclasses.replace(cfg.engine, quantize=cfg.draft_quantize))
    if cfg.interactive:
        return interactive(llm, cfg, stdin, out, err, draft)
    images = [read_image_file(path) for path in cfg.images] or None
    for i in range(cfg.num_samples):
        if cfg.chat:
            stream = llm.stream_chat(cfg.messages(cfg.prompt), cfg.sample_options(i, draft), images=images)
        else:  # checks the prompt (and runs its images through the tower) before it is echoed
            stream = llm.stream(cfg.prompt, cfg.sample_options(i, draft), images=images)
            out.write(cfg.prompt)
        result = print_stream(stream, out)
        print(f"[sample {i + 1}/{cfg.num_samples}] {result.stats.summary()}", file=err)
        if result.trace_path is not None:
            print(f"trace written to {result.trace_path}", file=err)
    return 0


def interactive(llm: LLM, cfg: GenerateArgs, stdin: Any, out: Any, err: Any, draft: LLM | None = None) -> int:
    """A conversation on stdin: the oldest turns are dropped (the system message kept) when it outgrows the context."""
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    options = cfg.sample_options(0, draft)
    where = f" ({llm.info.path})" if llm.info is not None else ""
    print(f"chatting with {llm.model_name}{where}; an empty line or EOF ends.", file=err)
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
        stream = llm.stream_chat(messages, options)
        shown: list[str] = []
        try:
            for piece in stream:
                shown.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:  # Ctrl-C stops this reply; the conversation goes on with what was shown
            stream.close()
            out.write("\n")
            print("stopped; the reply so far is kept (Ctrl-C again at the prompt, or an empty line, ends)", file=err)
            messages.append({"role": "assistant", "content": "".join(shown)})
            continue
        out.write("\n")
        messages.append({"role": "assistant", "content": stream.result.text})
        print(stream.result.stats.summary(), file=err)


def main(argv: Sequence[str] | None = None) -> int:
    try:  # one line and the documented exit status for every failure; rank 0 alone prints under torchrun
        return cli_main(lambda: run_cli(parse_args(argv)), report=tensor_parallel.report_error)
    finally:
        tensor_parallel.stop()


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.generate import main as package_main

    tensor_parallel.exit_process(package_main())
