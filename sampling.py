"""Sampling a token from logits on the device: pure tensor functions, no host synchronisation, no generator state.

The noise is counter-based: a splitmix64-style hash of (seed, position, row, column), computed inside the compiled
step, so a seeded run is reproducible in any thread and new seeds or positions never recompile.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# A top_p above 1 disables the nucleus filter without a branch in the compiled graph.
TOP_P_DISABLED = 2.0
# Seeds are int64 values on the device; this is one past the largest.
SEED_LIMIT = 1 << 63
# Ids per chunk of the greedy pick's first stage: a 128k-262k vocabulary splits into 125-257 chunks, enough programs
# to spread one row over the GPU, each chunk still a single block of its reduction.
ARGMAX_CHUNK = 1024
# OpenAI's bounds: presence and frequency penalties in [-2, 2], at most 300 logit_bias entries, each in [-100, 100].
PENALTY_LIMIT = 2.0
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0


def as_int64(value: int) -> int:
    """The signed int64 with the bits of an unsigned 64-bit constant."""
    return value - (1 << 64) if value >= SEED_LIMIT else value


# splitmix64's increment (2^64 / golden ratio) and finalizer multipliers.
GOLDEN_GAMMA = as_int64(0x9E3779B97F4A7C15)
MIX_MULTIPLIERS = (as_int64(0xBF58476D1CE4E5B9), as_int64(0x94D049BB133111EB))


def shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bits: >> on int64 copies the sign bit, so mask the copies away."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 (multiplication wraps): every input bit flips about half the output bits."""
    x = (x ^ shift_right(x, 30)) * MIX_MULTIPLIERS[0]
    x = (x ^ shift_right(x, 27)) * MIX_MULTIPLIERS[1]
    return x ^ shift_right(x, 31)


def exponential_noise(seed: Tensor, position: Tensor, rows: int, cols: int) -> Tensor:
    """Exp(1) noise (rows, cols) that is a pure function of (seed, position, row, column): counter-based, so it
    needs no generator state, runs inside a compiled graph and makes seeded runs reproducible in any thread.
    position (1,), or (P,) with rows 1: then (P, cols), row i equal to the noise of position[i] alone."""
    key = mix64(mix64(seed) + (position.view(-1, 1) + 1) * GOLDEN_GAMMA)  # (1, 1) or (P, 1)
    counter = torch.arange(1, rows * cols + 1, device=position.device).view(rows, cols)  # (B, V)
    bits = mix64(key + counter * GOLDEN_GAMMA)  # (B, V)
    uniform = (shift_right(bits, 11).double() + 0.5) * 2.0 ** -53  # (B, V), 53 random bits, in (0, 1)
    return (-torch.log(uniform)).float()


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


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
           position: Tensor) -> Tensor:
    """One token per row from logits (B, V). The settings and seed are 0-d tensors and position (1,) is the new
    token's position, so new values never recompile."""
    scaled = logits.float() / temperature.clamp_min(1e-5)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    probs = probs * nucleus_keep_mask(probs, top_k, top_p)
    # argmax(p / E) with E ~ Exp(1) draws from p (normalisation does not matter) without a device sync.
    noise = exponential_noise(seed, position, *probs.shape)
    choice = torch.argmax(probs / noise, dim=-1, keepdim=True)  # (B, 1)
    return order.gather(-1, choice)


def argmax_rows(logits: Tensor) -> Tensor:
    """torch.argmax(logits (B, V), dim=-1) -> (B,), the first index of each row's maximum, in two stages: the
    maximum of each chunk of ARGMAX_CHUNK ids, then the first chunk holding the row's maximum. Compiled, one row's
    argmax over a whole vocabulary is one program looping over it (26 us for 152k bf16 logits on an H200); the
    chunks run in parallel."""
    rows, vocab = logits.shape
    chunks = -(-vocab // ARGMAX_CHUNK)
    if chunks == 1:
        return logits.argmax(dim=-1)
    padded = torch.nn.functional.pad(logits, (0, chunks * ARGMAX_CHUNK - vocab), value=float("-inf"))
    best, index = padded.view(rows, chunks, ARGMAX_CHUNK).max(dim=-1)  # (B, chunks) each
    chunk = best.argmax(dim=-1, keepdim=True)  # (B, 1)
    return (chunk * ARGMAX_CHUNK + index.gather(-1, chunk)).squeeze(-1)


def greedy(logits: Tensor) -> Tensor:
    return argmax_rows(logits).unsqueeze(-1)  # (B, 1)


def next_token(logits: Tensor, position: Tensor, vocab_bias: Tensor | None, sampling: tuple[Tensor, ...]) -> Tensor:
    """logits (B, V) -> (B, 1). vocab_bias (V,) is -inf at ids the tokenizer cannot decode, so they never win."""
    if vocab_bias is not None:
        logits = logits + vocab_bias
    return sample(logits, *sampling, position) if sampling else greedy(logits)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """A logit_bias mapping (token id -> bias; ids may be decimal strings, as OpenAI's JSON has them) or pairs, as
    sorted (id, bias) pairs; ValueError naming the bad entry. The ids are checked against a vocabulary elsewhere."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, value in pairs:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if not is_real(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must lie in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got "
                             f"{value!r} for token {key}")
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from each token generated so far (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token generated so far (OpenAI's)
    repetition_penalty: float = 1.0  # tokens of the prompt or reply: positive logits divided, negative multiplied
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's
    logit_bias: Any = ()  # token id -> bias added to its logit; kept as sorted (id, bias) pairs

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {t!r}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 is off), got {value!r}")
        if not is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 is off), got {self.repetition_penalty!r}")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 is off), got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty, bias or min_p is set: then only the batching engine's sampler applies them."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.min_p
                    or self.logit_bias)

    def tensors(self, vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(temperature, top_k, top_p, seed) as 0-d tensors; no seed draws one from torch's global RNG."""
        top_k = self.top_k if self.top_k is not None else vocab_size
        top_p = self.top_p if self.top_p is not None else TOP_P_DISABLED
        seed = self.seed if self.seed is not None else int(torch.randint(0, SEED_LIMIT - 1, ()).item())
        return (torch.tensor(float(self.temperature), device=device), torch.tensor(int(top_k), device=device),
                torch.tensor(float(top_p), device=device), torch.tensor(int(seed), device=device))


def refuse_penalized(sampling: SamplingParams) -> None:
    """The static token loop (and speculation over it) has no penalty state: such settings are the batching
    engine's (LLM.generate sends them there), never silently dropped here."""
    if sampling.penalized:
        raise ValueError("penalties, logit_bias and min_p run on the batching engine (LLM.generate, "
                         "generate_batch); the static token loop does not apply them")


def sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
                position: Tensor, min_p: Tensor | None = None) -> Tensor:
    """One token per row of logits (B, V), each row with its own settings: temperature, top_p (B,) float32, top_k,
    seed and position (B,) int64. Row r draws exactly what `sample` draws for it alone (its noise is
    exponential_noise(seed[r], position[r], 1, V)), and a row with temperature 0 is greedy. min_p (B,) float32,
    if given: tokens less likely than min_p times the row's most likely one (after temperature) are dropped too.
    Returns (B,)."""
    scaled = logits.float() / temperature.clamp_min(1e-5).unsqueeze(1)  # (B, V)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    keep = nucleus_keep_mask(probs, top_k.unsqueeze(1), top_p.unsqueeze(1))  # (B, V)
    if min_p is not None:
        keep = keep & (probs >= min_p.unsqueeze(1) * probs[:, :1])
    probs = probs * keep
    noise = exponential_noise(seed.view(-1, 1), position, 1, probs.shape[-1])  # (B, V), row r from seed r
    choice = torch.argmax(probs / noise, dim=-1, keepdim=True)  # (B, 1)
    sampled = order.gather(-1, choice).squeeze(1)  # (B,)
    return torch.where(temperature == 0, greedy(logits).squeeze(1), sampled)


def penalized_logits(logits: Tensor, counts: Tensor, in_prompt: Tensor, presence: Tensor, frequency: Tensor,
                     repetition: Tensor, bias_ids: Tensor, bias: Tensor, banned_ids: Tensor, banned: Tensor) -> Tensor:
    """logits (B, V) fp32 with each row's logit bias, bans and penalties, in vLLM's order: bias (B, N) added at
    bias_ids (B, N) (padding entries add 0), banned (B, M) added at banned_ids (B, M) (-inf bans an id, 0 is none:
    min_tokens' EOS and stop ids), then repetition (B,) over the tokens of the prompt (in_prompt (B, V) bool) or the
    reply (counts (B, V) > 0): positive logits divided by it, negative ones multiplied; last frequency (B,) times
    each token's count in the reply and presence (B,) once for each token in it are subtracted. Out of place, no
    host sync: it runs inside a captured graph."""
    logits = logits.scatter_add(1, bias_ids, bias).scatter_add(1, banned_ids, banned)
    seen = counts > 0  # (B, V)
    rep = repetition.unsqueeze(1)  # (B, 1)
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen | in_prompt, repeated, logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * seen
