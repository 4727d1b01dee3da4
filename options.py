"""The validated settings of an engine (EngineConfig) and of one generation (GenerationOptions), the results a
generation returns, and the checks of what callers hand in. Bad values raise ValueError with one line that names
the fix."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from redline.checkpoint import dtype_from_name
from redline.kernels.linear import PROMPT_SMALL_M
from redline.model import check_kv_cache_dtype
from redline.profiling import ProfileConfig
from redline.quantize import parse_quant_spec
from redline.sampling import SamplingParams, is_int

DEFAULT_MAX_NEW_TOKENS = 200
# Drafted tokens per verify step when a draft is given without speculate_k: gpt-fast's default, and well inside
# the range where a verify step costs about one decode step.
DEFAULT_SPECULATE_K = 5
# A verify step runs k + 1 rows; the GPU's tensor-core linear kernel takes at most this many prompt rows (above it
# cuBLAS runs, and a verify step would cost a prefill's matrix product).
MAX_SPECULATE_K = PROMPT_SMALL_M - 1
# The most alternatives per token that logprobs report.
MAX_TOP_LOGPROBS = 20
# The most stop_token_ids one generation takes (runner.penalties.MAX_BANNED_IDS leaves room for EOS ids besides).
MAX_STOP_TOKEN_IDS = 64


def check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start} (undecodable input bytes?); pass UTF-8 text") from None


def check_output_path(path: Path, what: str) -> None:
    """Fail before any work when `path` cannot be written: a folder, under a file, or in a read-only folder."""
    from redline.outputs import check_writable

    check_writable(path, what)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def physical_cores() -> int:
    """The physical cores this process may run on (hyper-thread siblings counted once), from Linux's CPU topology;
    the usable logical CPUs where the topology cannot be read."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def prompt_token_ids(prompt: Any) -> list[int]:
    """A sequence of int token ids (numpy integers too) as a list; anything else is refused in one line."""
    if isinstance(prompt, Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"a tensor prompt must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}")
        return prompt.tolist()
    if isinstance(prompt, (bytes, bytearray, Mapping, set, frozenset)) or not isinstance(prompt, Iterable):
        raise ValueError(f"the prompt must be a str or a sequence of int token ids, not {type(prompt).__name__}")
    ids = list(prompt)
    for i, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"prompt item {i} is {type(t).__name__} {t!r}; token ids must be ints")
    return [int(t) for t in ids]


# Folders named after a dtype hold one conversion of the model named by the folder above them (the demo's
# checkpoints/smollm2/float32/): a model's default name skips them.
DTYPE_FOLDERS = ("float32", "float16", "bfloat16")

@dataclass(frozen=True)
class EngineConfig:
    """How LLM.load builds an engine; the CLI's flags map onto it one to one."""
    device: str | None = None  # "cpu", "cuda" or "cuda:N"; None: cuda when a GPU is visible
    dtype: str | None = None  # bfloat16 | float16 | float32; None: the checkpoint's
    compile: bool | None = None  # compile decoding (a CUDA graph on a GPU); None: on for a GPU
    compile_prefill: bool = False  # also compile prefill, one graph per power-of-two prompt bucket
    quantize: str | None = None  # quantize the weights on load: int8, int4 or int4-gG (quantize.parse_quant_spec)
    kernels: bool | None = None  # Redline's Triton kernels; None: on where they run (a CUDA/HIP GPU with Triton)
    fuse: bool | None = None  # the fused batch-1 decode step (needs kernels); None: follows kernels
    name: str | None = None  # for stats and traces; None: the checkpoint's folder name
    max_kv_tokens: int | None = None  # the batching engine's page pool in tokens; None: from free GPU memory
    threads: int | None = None  # CPU threads (the kernels' pool), set process-wide on load; None: the physical cores
    kv_cache_dtype: str = "auto"  # the batching engine's pages: "auto" (the model's dtype) or "fp8" (e4m3 + scales)

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError, ValueError):
                device = None
            if device is None or device.type not in ("cpu", "cuda"):
                raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None:
            dtype_from_name(self.dtype)
        if self.quantize is not None:
            parse_quant_spec(self.quantize)
        for flag in ("compile", "compile_prefill", "kernels", "fuse"):
            if getattr(self, flag) is not None and not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True, False or None, got {getattr(self, flag)!r}")
        if self.max_kv_tokens is not None and (not is_int(self.max_kv_tokens) or self.max_kv_tokens < 1):
            raise ValueError(f"max_kv_tokens must be a positive integer, got {self.max_kv_tokens!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.fuse and self.kernels is False:
            raise ValueError("fuse=True needs the Triton kernels; drop kernels=False (--no-kernels) or fuse")
        if self.compile_prefill and self.compile is False:
            raise ValueError("compile_prefill needs compile; drop compile=False (--no-compile) or compile_prefill")
        if self.threads is not None and (not is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer (the CPU threads to use), got {self.threads!r}")

    def cpu_threads(self, device: torch.device) -> int | None:
        """The CPU threads to set for this engine: `threads` when given, the physical cores for a CPU device,
        else None (a GPU engine leaves torch's setting alone)."""
        if self.threads is not None:
            return int(self.threads)
        return physical_cores() if device.type == "cpu" else None

    def set_threads(self, device: torch.device) -> None:
        """Process-wide thread counts from cpu_threads(device), unless that is None. On a CPU device the count goes
        to Redline's kernels (their own pool, cpu_linear.use_threads) and torch's intra-op threads become 1; else
        to torch.set_num_threads."""
        threads = self.cpu_threads(device)
        if threads is None:
            return
        if device.type == "cpu":
            from redline.kernels.cpu_linear import use_threads

            use_threads(threads)
        else:
            torch.set_num_threads(threads)

    def torch_device(self) -> torch.device:
        if self.device is None:
            return default_device()
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} was asked for, but no CUDA/ROCm GPU is visible; use --device cpu")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {self.device}: there are only {torch.cuda.device_count()} GPUs")
        return device


@dataclass(frozen=True)
class GenerationOptions:
    """How one generation samples and when it ends; generate, stream and chat take it as `options=` or keywords."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # capped by the model's context
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()  # the text ends before the first of these; a single str is taken as one
    seed: int | None = None  # None: drawn from torch's global RNG, once per generation
    ignore_eos: bool = False
    profile: ProfileConfig | None = None  # a Perfetto trace of the run; a path (str/PathLike) is taken as one
    draft: Any = None  # speculative decoding: "prompt_lookup", a draft LLM sharing the tokenizer, or a Draft
    speculate_k: int | None = None  # tokens drafted per verify step; None: DEFAULT_SPECULATE_K with a draft
    logprobs: bool = False  # the engine reports log_softmax(fp32 logits) of each chosen token
    top_logprobs: int = 0  # ...and of the N most likely tokens at each step (0..MAX_TOP_LOGPROBS)
    prompt_logprobs: bool = False  # ...and of each prompt token given the ones before it
    grammar: Any = None  # a grammar.Grammar: the batching engine samples only the tokens it allows
    # Penalties, bias and min_p act on the logits of each step (sampling.SamplingParams says how); with any of them,
    # min_tokens, stop_token_ids or include_stop_str_in_output, LLM.generate runs the batching engine's sampler.
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token the reply holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the reply
    repetition_penalty: float = 1.0  # > 0, 1 is off: tokens of the prompt or the reply are made less (> 1) likely
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p times the most likely one
    logit_bias: Any = ()  # {token id: bias in [-100, 100]} (at most 300), added to those logits
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not end the reply before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the reply (finish reason "stop")
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token) stays in the reply
    skip_special_tokens: bool = True  # special tokens are left out of the text (their ids stay in token_ids)

    def __post_init__(self) -> None:
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        self.sampling  # validates temperature, top_k, top_p and seed
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        stop = tuple(stop) if isinstance(stop, Iterable) else (None,)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        for s in stop:
            check_text(s, "a stop string")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        profile = self.profile
        if isinstance(profile, (str, os.PathLike)):
            profile = ProfileConfig(path=Path(profile))
        if profile is not None and not isinstance(profile, ProfileConfig):
            raise ValueError(f"profile must be a ProfileConfig, a trace path or None, got {self.profile!r}")
        if profile is not None:
            check_output_path(profile.path, "the trace path")
        object.__setattr__(self, "profile", profile)
        self._check_speculation()
        for flag in ("logprobs", "prompt_logprobs"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        object.__setattr__(self, "logit_bias", self.sampling.logit_bias)
        self._check_ending()

    def _check_ending(self) -> None:
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in 0..max_new_tokens ({self.max_new_tokens}), got "
                             f"{self.min_tokens!r}")
        ids = self.stop_token_ids
        ids = tuple(ids) if isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)) else None
        if ids is None or not all(is_int(t) and t >= 0 for t in ids) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be up to {MAX_STOP_TOKEN_IDS} token ids (non-negative integers), "
                             f"got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        for flag in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")

    def _check_speculation(self) -> None:
        if isinstance(self.draft, str) and self.draft != "prompt_lookup":
            raise ValueError(f"unknown draft {self.draft!r}; use 'prompt_lookup', a draft LLM or a speculative.Draft")
        if self.draft is None:
            if self.speculate_k is not None:
                raise ValueError("speculate_k needs a draft; add draft='prompt_lookup' (or a draft model)")
            return
        k = DEFAULT_SPECULATE_K if self.speculate_k is None else self.speculate_k
        if not is_int(k) or not 1 <= k <= MAX_SPECULATE_K:
            raise ValueError(f"speculate_k must be an integer in 1..{MAX_SPECULATE_K} (a verify step's k + 1 rows "
                             f"fit the GPU kernel's {PROMPT_SMALL_M}), got {k!r}")
        object.__setattr__(self, "speculate_k", int(k))

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.presence_penalty,
                              self.frequency_penalty, self.repetition_penalty, self.min_p, self.logit_bias)

    @property
    def engine_only(self) -> bool:
        """Whether only the batching engine runs these options (penalties, bias, min_p, min_tokens, stop token ids,
        a kept stop string): LLM.generate then sends the request there instead of its batch-1 path."""
        return bool(self.sampling.penalized or self.min_tokens or self.stop_token_ids
                    or self.include_stop_str_in_output)

    def check_vocabulary(self, vocab_size: int) -> None:
        """ValueError naming a logit_bias or stop_token_ids id at or past vocab_size."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} names token id {bad}, outside the model's vocabulary (0..{vocab_size - 1})")


def resolve_options(options: GenerationOptions | None, overrides: dict[str, Any]) -> GenerationOptions:
    if options is None:
        return GenerationOptions(**overrides)
    if not isinstance(options, GenerationOptions):
        raise TypeError(f"options must be a GenerationOptions, got {type(options).__name__}; pass settings by keyword")
    return dataclasses.replace(options, **overrides) if overrides else options


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # start of prefill to the first new token on the host; never includes compiling
    prefill_tok_s: float
    decode_tok_s: float  # tokens after the first, over the time after the first
    model_bytes_per_token: int  # weights each decode step reads (the embedding table excluded: one row is read)
    bandwidth_gb_s: float
    peak_memory_gb: float | None  # None on the CPU
    compile_s: float = 0.0  # warm-up before this generation (compiling, graph capture, the speculative cost gate's
    # timing), kept out of the rates above; the stats line calls it "warm-up"
    batch_size: int = 1
    mean_accepted: float | None = None  # speculative decoding: drafts accepted per verify step (0..k); else None
    acceptance_rate: float | None = None  # accepted / drafted tokens over the verify steps; None without a draft
    verify_steps: int | None = None  # speculative decoding: steps that verified drafts (each reads the weights once)
    plain_steps: int | None = None  # speculative decoding: one-token decode steps (nothing drafted, or at the end)
    threads: int | None = None  # torch's CPU threads during a CPU generation; None on a GPU

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        mem = f", peak memory {self.peak_memory_gb:.2f} GB" if self.peak_memory_gb is not None else ""
        mem += f", {self.threads} thread{'s' if self.threads != 1 else ''}" if self.threads is not None else ""
        compiled = f", warm-up {self.compile_s:.1f} s" if self.compile_s else ""  # compiling, capture, cost gate
        if self.mean_accepted is not None:
            compiled += f", {self.mean_accepted:.2f} drafts accepted per step ({self.acceptance_rate:.0%})"
        return (f"prompt {self.prompt_tokens} tok, generated {self.new_tokens} tok | TTFT {self.ttft_s * 1e3:.1f} ms, "
                f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.2f} tok/s, "
                f"{self.bandwidth_gb_s:.1f} GB/s of {self.model_bytes_per_token / 1e9:.2f} GB/token{mem}{compiled}")


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only
    stats: GenerationStats
    finish_reason: str  # "eos" | "stop" | "length"
    trace_path: Path | None = None  # the Perfetto trace, when the run was profiled
