"""The device state of the rows that use penalties, a logit bias, min_p or min_tokens: one slot per such request,
holding its settings and the counts of the tokens it generated, so that a decode step (a captured graph too) reads
and updates them by slot index alone; new requests change tensor contents, never a graph.

Slot `scratch` (the last) has neutral settings: a step's rows without penalties and its padding rows point at it
(their sampled tokens are counted there, and never read back). The tensors are made once, on the first request that
needs them, and kept (graphs hold their addresses): an engine whose requests use none of this pays nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from redline.sampling import MAX_LOGIT_BIAS, penalized_logits

# EOS ids and stop_token_ids a row may ban until it has min_tokens tokens (options.MAX_STOP_TOKEN_IDS plus EOS ids).
MAX_BANNED_IDS = 80


@dataclass(frozen=True)
class RowPenalties:
    """One request's settings as its slot holds them (the engine's RequestState makes it)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    min_banned: tuple[int, ...] = ()  # EOS and stop ids that cannot be sampled before min_tokens tokens


class PenaltySlots:
    """`slots` request slots plus the scratch slot, of a vocabulary of `vocab` ids, on `device` (see the module
    docstring)."""

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        n = slots + 1
        self.scratch, self.vocab, self.device = slots, vocab, device
        self.counts = torch.zeros(n, vocab, dtype=torch.int32, device=device)  # generated tokens per id
        self.in_prompt = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        self.params = torch.zeros(n, 4, dtype=torch.float32, device=device)  # presence, frequency, repetition, min_p
        self.params[:, 2] = 1.0
        self.bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.long, device=device)
        self.bias = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.banned_ids = torch.zeros(n, MAX_BANNED_IDS, dtype=torch.long, device=device)
        self.banned = torch.zeros(n, MAX_BANNED_IDS, dtype=torch.float32, device=device)  # -inf at real entries
        self.min_tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.generated = torch.zeros(n, dtype=torch.long, device=device)  # tokens the slot's request sampled
        self._owner: list[object | None] = [None] * slots
        self._slot: dict[int, int] = {}  # id(owner) -> slot

    def slot_of(self, owner: object) -> int | None:
        slot = self._slot.get(id(owner))
        return slot if slot is not None and self._owner[slot] is owner else None

    def assign(self, owner: object, row: RowPenalties, prompt: Sequence[int], generated: Sequence[int],
               keep: Sequence[object] = ()) -> int:
        """A slot for owner holding row's settings, prompt's presence and the counts of `generated` (its tokens so
        far: a request that lost its slot gets it rebuilt). A free slot, else one whose owner is not in `keep`
        (the step's other rows); it is written with copies ordered on the device's stream after the steps before."""
        slot = next((s for s, o in enumerate(self._owner) if o is None), None)
        if slot is None:
            kept = {id(o) for o in keep}
            slot = next(s for s, o in enumerate(self._owner) if id(o) not in kept)
            self._slot.pop(id(self._owner[slot]), None)
        self._owner[slot] = owner
        self._slot[id(owner)] = slot
        self._write(slot, row, prompt, generated)
        return slot

    def release(self, owner: object) -> None:
        slot = self.slot_of(owner)
        if slot is not None:
            del self._slot[id(owner)]
            self._owner[slot] = None

    def _write(self, slot: int, row: RowPenalties, prompt: Sequence[int], generated: Sequence[int]) -> None:
        on = self.device
        self.counts[slot] = torch.bincount(torch.tensor(list(generated), dtype=torch.long),
                                           minlength=self.vocab).to(torch.int32).to(on)
        presence = torch.zeros(self.vocab, dtype=torch.bool)
        presence[torch.tensor(list(prompt), dtype=torch.long)] = True
        self.in_prompt[slot] = presence.to(on)
        self.params[slot] = torch.tensor([row.presence, row.frequency, row.repetition, row.min_p]).to(on)
        ids, values = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.long), torch.zeros(MAX_LOGIT_BIAS)
        if row.bias:
            ids[:len(row.bias)] = torch.tensor([t for t, _ in row.bias])
            values[:len(row.bias)] = torch.tensor([b for _, b in row.bias])
        self.bias_ids[slot], self.bias[slot] = ids.to(on), values.to(on)
        banned = row.min_banned[:MAX_BANNED_IDS] if row.min_tokens else ()
        ids, values = torch.zeros(MAX_BANNED_IDS, dtype=torch.long), torch.zeros(MAX_BANNED_IDS)
        if banned:
            ids[:len(banned)] = torch.tensor(list(banned))
            values[:len(banned)] = float("-inf")
        self.banned_ids[slot], self.banned[slot] = ids.to(on), values.to(on)
        self.min_tokens[slot] = row.min_tokens
        self.generated[slot] = len(generated)

    def apply(self, logits: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(logits (B, V) with the rows' bias, min_tokens bans and penalties, their min_p (B,)) for the rows of
        slots (B,) int64."""
        presence, frequency, repetition, min_p = self.params[slots].unbind(1)  # (B,) each
        early = (self.generated[slots] < self.min_tokens[slots]).unsqueeze(1)  # (B, 1)
        banned = self.banned[slots]  # (B, M)
        banned = torch.where(early, banned, torch.zeros_like(banned))
        out = penalized_logits(logits.float(), self.counts[slots], self.in_prompt[slots], presence, frequency,
                               repetition, self.bias_ids[slots], self.bias[slots], self.banned_ids[slots], banned)
        return out, min_p

    def count(self, slots: Tensor, tokens: Tensor) -> None:
        """Count each row's sampled token (B,) in its slot (B,), in place (inside the step's graph)."""
        flat = slots * self.vocab + tokens  # (B,) into the flattened table: atomic adds, no host sync in a graph
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(tokens, dtype=torch.int32))
        self.generated.index_add_(0, slots, torch.ones_like(tokens))
