"""What crosses the boundary between the front end and the engine core: typed msgspec structs, encoded as
MessagePack. Only token ids, settings, numbers and image file bytes travel; nothing is pickled, and a frame that
does not decode to one of these types is refused.

    front end ── CoreRequest | Abort | StatsQuery | Shutdown ──▶ core
    front end ◀── Ready | Failed | Outputs | Stats ─────────────── core
"""
from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a request: its file's bytes (PNG, JPEG, WebP or GIF; the core decodes and checks them again)
    and the run of image tokens the front end expanded its placeholder into."""

    data: bytes
    start: int  # the prompt index of its first token
    tokens: int  # how many tokens it takes


class CoreRequest(msgspec.Struct, tag=True, frozen=True):
    """One request as the core runs it: prompt ids and the settings that act on tokens (text is the front end's)."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int  # already capped by the context
    temperature: float = 0.0
    top_k: int | None = None  # None: the core's default (the vocabulary)
    top_p: float | None = None
    seed: int | None = None  # None: the core draws one
    eos: list[int] = []  # ids that end the request (empty with ignore_eos)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    grammar: str | None = None  # a lark grammar (grammar.py) the sampled tokens must follow; None: any tokens
    images: list[ImageInput] = []  # the prompt's images, in order (engine/images.py)
    presence_penalty: float = 0.0  # sampling.SamplingParams' meanings
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: list[tuple[int, float]] = []  # (token id, bias) pairs
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many new tokens
    stop_token_ids: list[int] = []  # ids that end the request with finish reason "stop"
    keep_stop_token: bool = False  # a stop_token_ids token stays in the reply's tokens


class Abort(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    reason: str = "abort"  # "abort", or "stop" when the front end matched a stop string


class StatsQuery(msgspec.Struct, tag=True, frozen=True):
    pass


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    grace_s: float = 30.0  # running requests get this long to finish, then are aborted


class CoreOutput(msgspec.Struct, frozen=True):
    """New tokens of one request since its last output; the last one carries finish_reason and the stats."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # when asked: log_softmax(float32 logits)[chosen] per new token
    top_logprobs: list[dict[int, float]] | None = None  # when asked: N most likely ids -> logprob, per new token
    finish_reason: str | None = None  # None while running; then "eos" | "length" | "abort" | "stop" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float | None] | None = None  # in the first output only, when asked
    stats: dict[str, float | int | None] | None = None  # GenerationStats' fields, in the last output
    # With prompt_logprobs and top_logprobs = N > 0: the N most likely ids -> logprob at each prompt position (None
    # for the first), in the first output only (lm-evaluation-harness reads the top one to tell a greedy match).
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class Outputs(msgspec.Struct, tag=True, frozen=True):
    outputs: list[CoreOutput]


class Stats(msgspec.Struct, tag=True, frozen=True):
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    page_size: int
    prefix_cache_queries: int  # in tokens
    prefix_cache_hits: int  # in tokens
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions: int
    requests_finished: int


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The core is serving: the limits the front end validates requests against."""

    block_size: int  # the model's context
    vocab_size: int  # the model's embedding rows
    capacity_tokens: int  # tokens the page pool holds
    bytes_per_token: int
    device: str
    startup: dict[str, float]  # seconds of each start-up phase


class Failed(msgspec.Struct, tag=True, frozen=True):
    """The core could not start (or died of an error it caught): the one-line reason."""

    error: str


ToCore = CoreRequest | Abort | StatsQuery | Shutdown
FromCore = Ready | Failed | Outputs | Stats
