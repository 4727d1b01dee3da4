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

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_new(self) -> int:
        return len(self.tokens) - self.prompt_len


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
