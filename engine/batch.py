"""The engine's batch types: a request's tokens and pages (Sequence), and the run of its tokens one step computes
(Chunk)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Sequence:
    """One request's tokens and pages; the engine keeps its own state in `state`."""

    request_id: str
    tokens: list[int]  # the prompt, then each sampled token
    prompt_len: int
    max_new_tokens: int  # already capped by the context
    use_prefix_cache: bool = True
    state: Any = None
    pages: list[int] = field(default_factory=list)  # the block table
    keys: list[bytes] = field(default_factory=list)  # keys of its full, computed pages, in order
    num_computed: int = 0  # tokens whose keys and values are in its pages
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at its (last) admission
    finish_reason: str | None = None
    error: str | None = None
    images: SeqImages | None = None  # the prompt's images, if any

    @property
    def root_key(self) -> bytes:
        """The parent key of its first page: b"", or what sets its positions apart from a text prompt's."""
        return self.images.root if self.images is not None else b""

    def page_extra(self, index: int, page_size: int) -> bytes:
        """What page `index`'s key mixes in besides its tokens: the content hashes of the images whose tokens it
        holds (b"" for a page of text only)."""
        if self.images is None:
            return b""
        begin, end = index * page_size, (index + 1) * page_size
        return b"".join(d for (s, n), d in zip(self.images.runs, self.images.digests) if s < end and s + n > begin)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from `start` that would end at `end` ends: never inside an image whose tokens see
        each other (before it when the chunk holds something else, else after it, past the budget)."""
        if self.images is None or not self.images.bidirectional:
            return end
        for s, n in self.images.runs:
            if s < end < s + n:
                return s if s > start else s + n
        return end

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_new(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class SeqImages:
    """A prompt's images as the engine keeps them: where their tokens lie, their content hashes (for the prefix
    cache's keys), the decoded pictures until the tower encodes them, then what the prefill needs of them."""

    runs: list[tuple[int, int]]  # (start, count) of each image's tokens in the prompt
    digests: list[bytes]  # sha256 of each image's file bytes
    pictures: list[Any]  # the decoded images (PIL), for the tower
    bidirectional: bool  # an image's tokens see each other (Gemma 3): a prefill chunk never ends inside one
    rope_positions: Any = None  # (3, T) M-RoPE positions of the prompt (Qwen2.5-VL), on the device; None: 1D
    root: bytes = b""  # the parent key of the first page: the M-RoPE shift of the prompt's positions, if any
    media: Any = None  # model.PromptImages once the tower ran (kept across preemption)


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + length) of one sequence, computed in this step; `samples`: the chunk ends at the
    sequence's last token, so its logits give the next token."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.seq.num_tokens

    @property
    def prefills_images(self) -> bool:
        """The chunk holds prompt tokens of a request with images (its step splices their embeddings)."""
        return self.seq.images is not None and self.start < self.seq.prompt_len
