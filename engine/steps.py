"""The model calls of an engine step: a flattened batch of prefill chunks and decode rows, the logits it needs,
and one token per sampling row with that row's own settings."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from redline.engine.graphs import mark_dynamic, pages_bucket
from redline.engine.scheduler import Chunk
from redline.model import PagedContext, PagedKVCache, Transformer
from redline.sampling import argmax_rows, sample_rows


@dataclass
class StepBatch:
    """What one step feeds the model, and which rows of its logits mean what."""

    ids: Tensor  # (1, N) token ids of every chunk, in order
    context: PagedContext
    logits_at: Tensor  # (L,) row indices whose logits are computed
    sample_rows: Tensor  # (B,) for each chunk that samples, in order: its row in the logits
    prompt_rows: dict[int, tuple[int, int]]  # chunk index -> [begin, end) rows of logits_at for prompt logprobs


def step_batch(chunks: list[Chunk], kv: PagedKVCache, device: torch.device,
               prompt_logprobs: set[int] = frozenset(), pad_page: int | None = None) -> StepBatch:
    """The flattened batch of chunks; `prompt_logprobs` names chunks (by index) that need logits at every token.
    pad_page: a page no sequence holds; a step with prompt chunks then ends with a one-token sequence writing into
    it, and computes at least two logit rows, so that no size of the compiled prefill step is ever 0 or 1 (torch.compile
    specializes on those: each would compile the whole model again)."""
    size = kv.page_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    logits_at: list[int] = []
    sampling: list[int] = []
    prompt_rows: dict[int, tuple[int, int]] = {}
    for i, chunk in enumerate(chunks):
        seq, begin = chunk.seq, len(ids)
        span = range(chunk.start, chunk.start + chunk.length)
        ids += seq.tokens[chunk.start:chunk.start + chunk.length]
        positions += span
        slots += [seq.pages[p // size] * size + p % size for p in span]
        cu.append(len(ids))
        if i in prompt_logprobs:
            prompt_rows[i] = (len(logits_at), len(logits_at) + chunk.length)
            logits_at += range(begin, len(ids))
            if chunk.samples:
                sampling.append(len(logits_at) - 1)
        elif chunk.samples:
            sampling.append(len(logits_at))
            logits_at.append(len(ids) - 1)
    # Tables padded to the decode graphs' power-of-two widths: the attention kernels then meet only the sizes (and
    # so the compiled kernel variants) that capturing those graphs compiled, not a new one as contexts grow.
    width = pages_bucket(max(len(c.seq.pages) for c in chunks), -(-kv.rope.shape[0] // size))
    tables = [c.seq.pages + [0] * (width - len(c.seq.pages)) for c in chunks]
    single = [i for i, c in enumerate(chunks) if c.length == 1]
    decode = len(single) == len(chunks)
    q_lens, k_lens = [c.length for c in chunks], [c.start + c.length for c in chunks]
    if pad_page is not None and not decode:  # token 0 at position 0 of a sequence of its own, in pad_page
        single.append(len(chunks))
        ids.append(0)
        positions.append(0)
        slots.append(pad_page * size)
        cu.append(len(ids))
        tables.append([pad_page] * width)
        q_lens, k_lens = q_lens + [1], k_lens + [1]
        logits_at += [len(ids) - 1] * max(0, 2 - len(logits_at))
    long_, i32 = torch.long, torch.int32
    context = PagedContext(
        positions=on_device(positions, long_, device),
        slot_mapping=on_device(slots, long_, device),
        block_tables=on_device(tables, i32, device),
        seq_lens=on_device(k_lens, i32, device),
        cu_seqlens_q=on_device(cu, i32, device),
        kv=kv,
        decode=decode,
        host_lens=(q_lens, k_lens),
        singles=(on_device(single, long_, device), on_device([cu[i] for i in single], long_, device)),
    )
    return StepBatch(on_device([ids], long_, device), context, on_device(logits_at, long_, device),
                     on_device(sampling, long_, device), prompt_rows)


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a device tensor, copied from pinned memory without waiting for the device to catch up."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def vocab_bias(model_vocab: int, tokenizer: Any, device: torch.device) -> Tensor | None:
    """(V,) fp32: 0 for ids the tokenizer decodes, -inf for the model's padding rows beyond them; None if none."""
    if tokenizer is None or tokenizer.vocab_size >= model_vocab:
        return None
    bias = torch.zeros(model_vocab, dtype=torch.float32, device=device)
    bias[tokenizer.vocab_size:] = float("-inf")
    return bias


def step_logits(model: Transformer, batch: StepBatch, vocab_bias: Tensor | None,
                compiled: Callable[..., Tensor] | None = None) -> Tensor:
    """Logits (L, V) of the rows batch.logits_at, fp32, with the vocabulary bias added. The model runs even when
    L is 0 (a prefill chunk that samples nothing): it writes the chunk's keys and values. compiled: prefill_logits
    compiled with dynamic sizes, which runs a step with prompt chunks (the pool's attention must be its ops)."""
    c = batch.context
    if compiled is not None and not c.decode:
        args = (batch.ids, c.positions, c.slot_mapping, c.block_tables, c.seq_lens, c.cu_seqlens_q, batch.logits_at)
        mark_step_dynamic(*args)
        return compiled(model, c.kv, vocab_bias, *args)
    return paged_logits(model, c, batch.ids, batch.logits_at, vocab_bias)


def paged_logits(model: Transformer, context: PagedContext, ids: Tensor, logits_at: Tensor,
                 vocab_bias: Tensor | None) -> Tensor:
    """Logits (L, V) fp32 at rows logits_at (L,) of ids (1, N) at context.positions, with the vocabulary bias."""
    logits = model(ids, context.positions, logits_at=logits_at, context=context)[0].float()  # (L, V)
    return logits + vocab_bias if vocab_bias is not None else logits


def prefill_logits(model: Transformer, kv: PagedKVCache, vocab_bias: Tensor | None, ids: Tensor, positions: Tensor,
                   slots: Tensor, tables: Tensor, seq_lens: Tensor, cu_seqlens: Tensor, logits_at: Tensor) -> Tensor:
    """Logits (L, V) fp32 at rows logits_at (L,) of a step of prompt chunks and decode rows, ids (1, N) at
    positions (N,); the function the engine compiles. Its attention is the pool's ops, which read no host lists."""
    return paged_logits(model, PagedContext(positions, slots, tables, seq_lens, cu_seqlens, kv), ids, logits_at,
                        vocab_bias)


def mark_step_dynamic(ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor,
                      cu_seqlens: Tensor, logits_at: Tensor) -> None:
    """The sizes one compiled prefill step serves: tokens, sequences, page width and logit rows (a size of 0 or 1
    still specializes)."""
    mark_dynamic((ids, (1,)), (positions, (0,)), (slots, (0,)), (tables, (0, 1)), (seq_lens, (0,)), (cu_seqlens, (0,)),
                 (logits_at, (0,)))


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings as tensors (B,), so one step serves any mix of greedy and sampled rows."""

    temperature: Tensor  # float32
    top_k: Tensor  # int64
    top_p: Tensor  # float32
    seed: Tensor  # int64
    position: Tensor  # int64, the new token's position

    @classmethod
    def of(cls, rows: list[tuple[float, int, float, int, int]], device: torch.device) -> RowSettings:
        temperature, top_k, top_p, seed, position = zip(*rows)
        return cls(on_device(list(temperature), torch.float32, device), on_device(list(top_k), torch.long, device),
                   on_device(list(top_p), torch.float32, device), on_device(list(seed), torch.long, device),
                   on_device(list(position), torch.long, device))


def sample_tokens(logits: Tensor, settings: RowSettings, all_greedy: bool = False) -> Tensor:
    """logits (B, V) -> tokens (B,), each row with its own settings; all_greedy skips the sampler's sort."""
    if all_greedy:
        return argmax_rows(logits)
    return sample_rows(logits, settings.temperature, settings.top_k, settings.top_p, settings.seed, settings.position)


def chosen_logprobs(logits: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """log_softmax(logits (B, V)) at tokens (B,) -> (B,), and the `top` most likely (values, ids) (B, top) each."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logprobs.gather(-1, tokens.view(-1, 1)).squeeze(1)  # (B,)
    if top <= 0:
        return chosen, None, None
    values, ids = logprobs.topk(top, dim=-1)  # (B, top)
    return chosen, values, ids
