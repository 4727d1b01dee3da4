"""A model's prompts as token ids: text through its tokenizer, chats through its chat template, each checked
against the model's context and vocabulary. LLM (generate.py) and the server's front end (which holds no model)
share it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redline.options import DEFAULT_MAX_NEW_TOKENS, check_text, prompt_token_ids

# The share of the context a chat keeps free for the reply when fit_chat drops old turns.
CHAT_REPLY_SHARE = 0.25


class Prompts:
    """Prompt ids for a model of `block_size` positions and `vocab_size` embedding rows; tokenizer may be None
    (then prompts are token ids only)."""

    def __init__(self, tokenizer: Any, block_size: int, vocab_size: int) -> None:
        self.tokenizer, self.block_size, self.vocab_size = tokenizer, block_size, vocab_size

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Text through the tokenizer (BOS/EOS as its own rules say), or token ids used exactly as given."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; pass some text or token ids")
            check_text(prompt, "the prompt")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass the prompt as a list of token ids")
            return self._in_vocabulary(self.tokenizer.encode(prompt))
        ids = prompt_token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty; pass some text or token ids")
        return self._in_vocabulary(ids)

    def _in_vocabulary(self, ids: list[int]) -> list[int]:
        """`ids`, refused when one lies past the model's embedding table (a tokenizer of another model gives such)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        return ids

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids of a conversation; a message's content is text, or a list of text parts and {"type":
        "image"} parts (generate.split_image_parts), which a multimodal chat template renders as placeholders."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), (str, list))):
                raise ValueError(f"message {i} must be a dict with str 'role' and 'content', got {m!r}")
            for text in [m["content"]] if isinstance(m["content"], str) else content_texts(m["content"], i):
                check_text(text, f"message {i}")
        return self._in_vocabulary(list(self.tokenizer.apply_chat_template([dict(m) for m in messages],
                                                                           add_generation_prompt=True)))

    def context_left(self, prompt_len: int) -> int:
        return self.block_size - prompt_len

    def chat_reply_room(self, max_new_tokens: int) -> int:
        return max(1, min(max_new_tokens, int(self.block_size * CHAT_REPLY_SHARE)))

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
        raise ValueError(f"the last message is too long for the model's context of {self.block_size} "
                         f"tokens with {room} left for the reply; shorten it")


def content_texts(parts: list[Any], index: int) -> list[str]:
    """The texts of a message's content parts; ValueError for a part that is neither text nor an image."""
    texts = []
    for part in parts:
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif not (isinstance(part, Mapping) and part.get("type") == "image"):
            raise ValueError(f"message {index}: each content part must be {{'type': 'text', 'text': str}} or "
                             f"{{'type': 'image', 'image': ...}}, got {part!r}")
    return texts
