"""The model calls of an engine step: a flattened batch of prefill chunks and decode rows, the logits it needs,
and one token per sampling row with that row's own settings."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from redline.runner.decode_graphs import chosen_tokens, mark_dynamic, pages_bucket
from redline.model import FP8_KV_MAX, PagedContext, PagedImages, PagedKVCache, Transformer
from redline.rope import mrope_table

if TYPE_CHECKING:  # the engine's batch type; the runner reads its fields only
    from redline.engine.batch import Chunk


@dataclass
class StepBatch:
    """What one step feeds the model, and which rows of its logits mean what."""

    ids: Tensor  # (1, N) token ids of every chunk, in order
    context: PagedContext
    logits_at: Tensor  # (L,) row indices whose logits are computed
    sample_rows: Tensor  # (B,) for each chunk that samples, in order: its row in the logits
    prompt_rows: dict[int, tuple[int, int]]  # chunk index -> [begin, end) rows of logits_at for prompt logprobs

    def message(self) -> dict[str, Any]:
        """What another tensor-parallel rank needs to run this step's model call (tensor_parallel.StepChannel)."""
        c = self.context
        return {"ids": self.ids, "positions": c.positions, "slots": c.slot_mapping, "tables": c.block_tables,
                "seq_lens": c.seq_lens, "cu_seqlens": c.cu_seqlens_q, "decode": c.decode,
                "host_lens": [list(lens) for lens in c.host_lens], "singles": list(c.singles),
                "logits_at": self.logits_at}

    @classmethod
    def from_message(cls, fields: dict[str, Any], kv: PagedKVCache, device: torch.device) -> StepBatch:
        """The step of message(), over this rank's pool `kv` (its own KV heads of the same pages)."""
        on = {name: value.to(device) for name, value in fields.items() if isinstance(value, Tensor)}
        context = PagedContext(positions=on["positions"], slot_mapping=on["slots"], block_tables=on["tables"],
                               seq_lens=on["seq_lens"], cu_seqlens_q=on["cu_seqlens"], kv=kv,
                               decode=fields["decode"], host_lens=tuple(fields["host_lens"]),
                               singles=tuple(t.to(device) for t in fields["singles"]))
        return cls(on["ids"], context, on["logits_at"], torch.empty(0, dtype=torch.long, device=device), {})


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
    images = None
    if any(c.seq.images is not None for c in chunks):
        images = chunk_images(chunks, cu, kv.args, device)
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
        images=images,
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
    if compiled is not None and not c.decode and c.images is None:  # a step with images runs eagerly
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


class GrammarMasks:
    """The token bitmasks (B, ceil(V / 32)) int32 of a step's rows, filled on the host from each row's grammar
    matcher (all ones for a row without one) and copied to the device; llguidance's executor fills many rows in
    parallel threads."""

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int = 256) -> None:
        from redline.grammar import mask_words

        self.device, self.words = device, mask_words(vocab_size)
        self.host = torch.full((max_rows, self.words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.executor: Any = None

    def fill(self, matchers: list[Any]) -> Tensor:
        """The rows' masks (B, W) on the device (all ones where a row has no matcher). The host buffer is reused:
        call it only once the sampler that read the last masks was launched after them (the copy is queued first on
        the same stream)."""
        import llguidance

        rows = len(matchers)
        if rows > self.host.shape[0]:
            self.host = torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = self.host[:rows]
        host.fill_(-1)
        grammar_rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if len(grammar_rows) == 1:
            row = host[grammar_rows[0][1]]
            grammar_rows[0][0].unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        elif grammar_rows:
            if self.executor is None:
                self.executor = llguidance.LLExecutor()
            self.executor.unsafe_compute_mask_ptr(grammar_rows, host.data_ptr(), self.words * 4, rows)
        return host.to(self.device, non_blocking=True)

    @staticmethod
    def apply(logits: Tensor, masks: Tensor) -> Tensor:
        from redline.grammar import apply_masks

        return apply_masks(logits, masks)


def sample_tokens(logits: Tensor, settings: RowSettings, all_greedy: bool = False,
                  penalties: tuple[Any, Tensor] | None = None) -> Tensor:
    """logits (B, V) -> tokens (B,), each row with its own settings; all_greedy skips the sampler's sort. penalties:
    (runner.penalties.PenaltySlots, the rows' slots (B,)): the rows' bias, bans, penalties and min_p apply, and
    the tokens are counted in their slots."""
    return chosen_tokens(logits, all_greedy, settings.temperature, settings.top_k, settings.top_p, settings.seed,
                         settings.position, penalties)


def chosen_logprobs(logits: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """log_softmax(logits (B, V)) at tokens (B,) -> (B,), and the `top` most likely (values, ids) (B, top) each."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logprobs.gather(-1, tokens.view(-1, 1)).squeeze(1)  # (B,)
    if top <= 0:
        return chosen, None, None
    values, ids = logprobs.topk(top, dim=-1)  # (B, top)
    return chosen, values, ids


# ---------------------------------------------------------------------------------------------------------------------
# The runner's model over a paged KV cache.


class PagedModel:
    """The runner's model over a paged KV cache of `num_pages` pages: the cache itself, the compiled prefill step
    (optional), the decode steps (CUDA graphs at batch buckets where the runner compiles) and the prefill graphs.

    The pages' owner (the engine's pool and scheduler) decides which page each row uses; this class only computes.
    Padding rows of graphs write `scratch_page`, a page nobody holds (None when nothing is compiled)."""

    def __init__(self, runner: Any, num_pages: int, page_size: int, scratch_page: int | None,
                 compile_prefill: bool, prefill_graphs: bool, max_rows: int,
                 graph_tokens: int | None = None, ranks: Any = None, kv_dtype: torch.dtype | None = None) -> None:
        """ranks: with tensor parallel, the tensor_parallel.StepChannel of this rank's engine: on rank 0 each model
        call is sent to the other ranks before it runs; the others run them in follow(). kv_dtype: the pages'
        element type (None: the model's dtype); e4m3 pages get their scales from calibrated_kv_scales here, before
        any step (every rank runs the same calibration, so their all-reduces meet)."""
        from redline.kernels import FusedDecode
        from redline.runner.decode_graphs import DecodeGraphs, TokenReader
        from redline.runner.prefill_graphs import PrefillGraphs

        model, device = runner.model, runner.device
        args = model.args
        if compile_prefill and args.attn_softcap:
            raise ValueError("compile_prefill runs the paged attention kernels, which have no soft-capping yet; drop "
                             "compile_prefill=True (--compile-prefill) for this model")
        if prefill_graphs and not compile_prefill:
            raise ValueError("prefill_graphs replays the compiled prefill step; add compile_prefill=True "
                             "(--compile-prefill), or drop prefill_graphs")
        if prefill_graphs and ranks is not None:
            raise ValueError("prefill_graphs is not available with tensor parallel yet; drop it (--prefill-graphs)")
        self.ranks = ranks
        self.model, self.device, self.vocab_bias = model, device, runner.vocab_bias
        kernel_ops = paged_attention_ops(runner.kernels)
        ops = kernel_ops or (registered_paged_ops() if compile_prefill else None)
        pages_dtype = kv_dtype or model.cache_dtype
        if device.type == "cpu":  # decode rows on the C++ kernel (fp32 pages)
            from redline.kernels.cpu_linear import paged_ops

            ops = paged_ops(ops[0] if ops is not None else None, pages_dtype)
        self.kv = PagedKVCache(args, num_pages, page_size, pages_dtype, device, ops)
        if self.kv.fp8:
            self.kv.set_scales(*calibrated_kv_scales(model, runner.vocab_bias))
        # Steps with prompt chunks, compiled once with dynamic sizes (their attention is the ops: the references'
        # host lists would specialize every step).
        self.prefill_step = compiled_prefill(device) if compile_prefill else None
        # A one-row step runs the fused batch-1 decode's blocks where the runner fuses its own (its own sums buffer:
        # the static path may run beside the engine).
        fused = FusedDecode(model) if runner.fuse else None
        self.graphs = DecodeGraphs(model, self.kv, self.vocab_bias, device, scratch_page, fused, max_rows,
                                   graph_tokens) if runner.compile else None
        self.pad_page = scratch_page if compile_prefill else None  # the compiled prefill step's padding sequence
        pool = self.graphs.pool if self.graphs is not None else None
        self.prefill_graphs = PrefillGraphs(self.prefill_step, model, self.kv, self.vocab_bias, device, scratch_page,
                                            pool) if prefill_graphs else None
        self.reader = TokenReader(device)
        self.max_rows = max_rows
        self._penalties: Any = None

    @property
    def penalties(self) -> Any:
        """The slots of the rows with penalties (runner.penalties.PenaltySlots), made on first use: one per row a
        step may hold."""
        if self._penalties is None:
            from redline.runner.penalties import PenaltySlots

            self._penalties = PenaltySlots(self.max_rows, self.model.args.vocab_size, self.device)
            if self.graphs is not None:
                self.graphs.penalties = self._penalties
        return self._penalties

    def capture(self, max_tokens: int, progress: Callable[[int, int], None] | None = None) -> int:
        """Capture every decode graph for sequences of up to max_tokens tokens now; returns how many were made."""
        if self.graphs is None:
            return 0
        if self.ranks is not None:
            self.ranks.send("capture", max_tokens=max_tokens)
        return self.graphs.capture(max_tokens, progress)

    def fits_graph(self, rows: int) -> bool:
        return self.graphs is not None and self.graphs.fits(rows)

    def launch_decode(self, tokens: list[int] | Tensor, positions: list[int], pages: list[list[int]],
                      settings: list[tuple[float, int, float, int]],
                      masks: Callable[[], Tensor] | None = None,
                      penalty_slots: list[int] | None = None) -> tuple[Tensor, Tensor, Any]:
        """Replay the decode graph of these rows (masks: the grammar rows' masks, DecodeGraphs.run); returns (tokens
        (B,) on the device, their pinned host copy, the event after which the copy is valid, None on the CPU).
        Nothing waits for the device but the masks' host work. Under tensor parallel the other ranks replay the same
        step (they sample too, but only rank 0's tokens are used). penalty_slots: the rows' slots in `penalties`,
        for a step with rows that use them (tensor parallel refuses such rows)."""
        if self.ranks is not None:  # tokens on the device: each rank reads its own last step's, which are equal
            self.ranks.send("graph", tokens=None if isinstance(tokens, Tensor) else tokens, positions=positions,
                            pages=pages, settings=settings)
        out = self.graphs.run(tokens, positions, pages, settings, masks, penalty_slots)
        host, ready = self.reader.start(out)
        return out, host, ready

    def step(self, chunks: list[Chunk], wants_prompt: set[int]) -> tuple[Tensor, dict[int, tuple[int, int]], Any]:
        """Run the model on chunks (eagerly, through the compiled prefill step, or as a prefill graph): logits
        (L, V) fp32, each prompt-logprob chunk's [begin, end) rows, and the rows of the sampling chunks."""
        with_images = any(c.prefills_images for c in chunks)
        graphs = self.prefill_graphs and not wants_prompt and not with_images
        bucket = self.prefill_graphs.bucket(chunks) if graphs else None
        if bucket is not None:  # one short chunk: a replayed graph; its logits row 0 is the chunk's last token
            return self.prefill_graphs.logits(chunks[0], bucket), {}, slice(0, 1)
        batch = step_batch(chunks, self.kv, self.device, wants_prompt, self.pad_page)
        if self.ranks is not None:
            self.ranks.send("eager", **batch.message())
        logits = step_logits(self.model, batch, self.vocab_bias, self.prefill_step)  # (L, V)
        return logits, batch.prompt_rows, batch.sample_rows

    def release(self) -> None:
        """Rank 0 of tensor parallel: tell the other ranks that no call follows (their follow() returns)."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None and ranks.rank == 0:
            ranks.send("stop")

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run the model calls rank 0 sends (graph captures, decode graph steps,
        eager and compiled steps) on this rank's part of the model and KV cache, until it releases them. Every rank
        runs them in the same order, so their all-reduces meet."""
        if self.ranks is None or self.ranks.rank == 0:
            raise RuntimeError("follow() runs on a tensor-parallel rank other than 0; rank 0 serves requests")
        last: Tensor | None = None  # the last decode graph step's tokens (B,), which the next may read
        with torch.inference_mode():
            while True:
                kind, fields = self.ranks.receive()
                if kind == "stop":
                    self.ranks = None
                    return
                if kind == "capture":
                    self.graphs.capture(fields["max_tokens"])
                elif kind == "graph":
                    tokens = last if fields["tokens"] is None else fields["tokens"]
                    last = self.graphs.run(tokens, fields["positions"], fields["pages"],
                                           [tuple(s) for s in fields["settings"]])
                elif kind == "eager":
                    step_logits(self.model, StepBatch.from_message(fields, self.kv, self.device), self.vocab_bias,
                                self.prefill_step)
                else:
                    raise RuntimeError(f"rank 0 sent an unknown step {kind!r}")


# The calibration of an fp8 KV cache's scales: one prefill of this many token ids, drawn from a generator of this
# seed (the same ids for every start of a model, so its pages' bytes are too), through pages of the model's dtype;
# each layer's and KV head's largest |k| and |v| times the margin become e4m3's largest value, 448. The margin of 2
# leaves room for keys larger than the calibration's at the cost of one of e4m3's binades at the small end
# (docs/kv-cache-fp8.md).
KV_CALIBRATION_TOKENS = 256
KV_CALIBRATION_SEED = 0
KV_SCALE_MARGIN = 2.0


def calibrated_kv_scales(model: Transformer, vocab_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The fp8 KV cache's (k_scale, v_scale), (n_layer, Hkv) fp32 each: amax * KV_SCALE_MARGIN / 448 per layer and
    KV head over one prefill of KV_CALIBRATION_TOKENS fixed pseudo-random ids (of the ids the tokenizer decodes,
    where vocab_bias says which); a head that never stored a non-zero value gets 1.0."""
    args, device = model.args, model.norm.weight.device
    vocab = args.vocab_size if vocab_bias is None else int(torch.isfinite(vocab_bias).sum())
    length = min(KV_CALIBRATION_TOKENS, args.block_size)
    page_size = 16
    pages = -(-length // page_size)
    probe = PagedKVCache(args, pages, page_size, model.cache_dtype, device)  # the references' attention
    ids = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(KV_CALIBRATION_SEED))
    positions = torch.arange(length, device=device)  # (T,) one sequence from position 0, in pages 0..pages-1
    context = PagedContext(positions=positions, slot_mapping=positions,
                           block_tables=torch.arange(pages, dtype=torch.int32, device=device)[None],
                           seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
                           cu_seqlens_q=torch.tensor([0, length], dtype=torch.int32, device=device), kv=probe,
                           host_lens=([length], [length]),
                           singles=(torch.zeros(0, dtype=torch.long, device=device),) * 2)
    with torch.inference_mode():
        model(ids.to(device), context.positions, logits_at=torch.tensor([length - 1], device=device), context=context)
    amax = [torch.stack([pool.abs().amax(dim=(0, 1, 3)).float() for pool in pools]) for pools in (probe.k, probe.v)]
    return tuple(torch.where(a > 0, a * KV_SCALE_MARGIN / FP8_KV_MAX, 1.0) for a in amax)  # (n_layer, Hkv) each


def compile_prefill_default(runner: Any, requested: bool | None) -> bool:
    """Whether the steps with prompt chunks compile: as asked, else where it pays (a compiling runner on a GPU,
    with the kernels, and a model without soft-caps)."""
    if requested is not None:
        return requested
    return bool(runner.compile and runner.device.type == "cuda" and paged_attention_ops(runner.kernels)
                and not runner.model.args.attn_softcap)


def paged_attention_ops(kernels: bool) -> tuple[Any, Any] | None:
    """The GPU's paged attention kernels (torch.ops.redline.paged_prefill_attention, paged_decode_attention) when
    the runner runs Redline's kernels and they are registered; None: model.py's references."""
    if not kernels:
        return None
    namespace = torch.ops.redline
    names = ("paged_prefill_attention", "paged_decode_attention")
    if not all(hasattr(namespace, name) for name in names):
        return None
    return tuple(getattr(namespace, name) for name in names)


def compiled_prefill(device: torch.device) -> Any:
    """prefill_logits under torch.compile, dynamic in the sizes mark_step_dynamic names, no CUDA graphs."""
    from redline.runner.runner import CompiledStep

    return CompiledStep(prefill_logits, device, graphs=False, dynamic=None)


def registered_paged_ops() -> tuple[Any, Any]:
    """torch.ops.redline's paged attention ops (importing their module registers them); on the CPU, or where no
    kernel config fits, they run the references."""
    importlib.import_module("redline.kernels.paged_attention")
    return torch.ops.redline.paged_prefill_attention, torch.ops.redline.paged_decode_attention


def chunk_images(chunks: Sequence[Any], cu: Sequence[int], args: Any, device: torch.device) -> Any:
    """The model.PagedImages of a step's chunks (cu: where each chunk's rows begin; one more entry, the padding
    sequence, may follow), or None when no chunk holds prompt tokens of a request with images."""
    embeds, rows, rope_rows, ropes = [], [], [], []
    spans: list[tuple[tuple[int, int], ...]] = []
    for chunk, begin in zip(chunks, cu):
        images = chunk.seq.images
        media = images.media if images is not None else None
        start, end = chunk.start, min(chunk.start + chunk.length, chunk.seq.prompt_len)
        if media is None or start >= end:
            spans.append(())
            continue
        inside = (media.slots >= start) & (media.slots < end)  # (N,) this chunk's image tokens
        embeds.append(media.embeds[inside])
        rows.append(media.slots[inside] - start + begin)
        if media.rope_positions is not None:
            ropes.append(mrope_table(args, media.rope_positions[:, start:end]))  # (end - start, 2, Dr/2)
            rope_rows.append(torch.arange(begin, begin + end - start, device=device))
        spans.append(tuple((s, s + n) for s, n in images.runs) if images.bidirectional else ())
    if not embeds:
        return None
    spans += [()] * (len(cu) - 1 - len(spans))  # the padding sequence, if any
    return PagedImages(torch.cat(embeds).to(device), torch.cat(rows).to(device),
                       torch.cat(rope_rows) if ropes else None, torch.cat(ropes).to(device) if ropes else None,
                       tuple(spans) if any(spans) else None)
