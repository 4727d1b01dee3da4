"""The fused batch-1 decode: each block of a model in five kernels instead of about ten.

    fused = FusedDecode(use_kernels(model))
    logits = fused(token, input_pos)  # one token: the fused path; anything else: model(...)

Per block: norm+qkv, rope+cache write+attention (redline::decode_attention_qkv; on the batching engine's pages
redline::paged_decode_attention_qkv), wo+residual, norm+gate/up+SwiGLU, w2+residual (Qwen2's q/k/v bias rides in the
first, Qwen3's q/k norms in the second; a mixture of experts runs norm, router, redline::moe_route and
redline::moe_experts after the attention's three); the final norm rides in the output head's GEMV. Each residual
kernel also adds its output's sum of squares into a slot of an fp32 buffer, so the next norm needs no pass of its
own. Same math and roundings as model.Transformer.forward, except that the normalized input of a projection stays
fp32 (the GPU kernel does not round it to the activation dtype) and a q/k/v bias is added to the projection before
it is rounded.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from redline.model import ModelArgs, MoEFeedForward, PagedContext, RMSNorm, Transformer, TransformerBlock
from redline.quantize import Fp8Linear, Int4Linear, Int8Linear

from .attention import head_norms, paged_attention

# The fused kernels add each output's sum of squares into this many lanes (program i into lane i % lanes):
# thousands of atomic adds on one address would queue; the next kernel reads all lanes.
NORM_SUM_LANES = 32


def fused_projection(linear: nn.Module, x: Tensor, sums: Tensor, norm: RMSNorm | None = None,
                     residual: Tensor | None = None, swiglu: bool = False, sum_in: int = -1, sum_out: int = -1,
                     gelu: bool = False) -> Tensor:
    """redline::fused_linear on a kernel linear layer (KernelLinear, KernelInt8Linear, KernelInt4Linear or
    KernelFp8Linear):
    [norm(x) ->] linear [-> act(gate) * up: silu, or gelu for GeGLU] [+ residual], one GPU kernel for a single row
    of x. sums[sum_in] holds sum(x**2) for the norm when the kernel before computed it; sum(y**2) is added to
    sums[sum_out]; -1 for neither. sums is passed even then: inductor cannot lower the op with its mutable
    argument left None."""
    return torch.ops.redline.fused_linear(
        x, linear.weight, linear.scales, None if norm is None else scaling_weight(norm),
        0.0 if norm is None else norm.eps, residual, swiglu, sums, sum_in, sum_out, gelu)


def scaling_weight(norm: RMSNorm) -> Tensor:
    """What a fused GEMV scales the normalized input by: the norm's weight, or for a norm with an offset or fp32
    scaling (Gemma's 1 + w, OLMo 2's) the fp32 copy FusedDecode made of offset + w (the GEMV keeps the normalized
    input in fp32 either way, so it scales in fp32 and rounds once, as those norms do)."""
    return getattr(norm, "fused_weight", norm.weight)


def residual_projection(linear: nn.Module, x: Tensor, residual: Tensor, sums: Tensor, sum_out: int) -> Tensor:
    """linear(x) + residual in one kernel. On a tensor-parallel rank (a linear with `reduce`, such as
    tensor_parallel.RowParallelLinear) rank 0 alone adds the residual into its partial product, so the all-reduce
    adds it once."""
    reduce = getattr(linear, "reduce", None)
    if reduce is None:
        return fused_projection(linear, x, sums, residual=residual, sum_out=sum_out)
    return reduce(fused_projection(linear.inner, x, sums, residual=residual if linear.rank == 0 else None))


def sublayer_residual(block: TransformerBlock, linear: nn.Module, x: Tensor, residual: Tensor,
                      post_norm: RMSNorm | None, sums: Tensor, sum_out: int) -> Tensor:
    """residual + the sub-layer's output projection of x: added in the GEMV (residual_projection), or where the
    output is normalized first (Gemma's and OLMo 2's post-norms) the GEMV, then the norm and the add as the block
    runs them (all-reduced first on a tensor-parallel rank)."""
    if post_norm is None:
        return residual_projection(linear, x, residual, sums, sum_out)
    reduce = getattr(linear, "reduce", None)
    y = fused_projection(linear, x, sums) if reduce is None else reduce(fused_projection(linear.inner, x, sums))
    return block.residual(residual, y, post_norm)


def fused_block(block: TransformerBlock, x: Tensor, rope: Tensor, input_pos: Tensor, sums: Tensor, lanes: bool,
                index: int, sum_in: int, context: PagedContext | None = None) -> Tensor:
    """block.forward for one token (batch 1) in five ops (a mixture-of-experts block: its attention in three, then
    its norm, router and experts as the kernel modules run them, and the residual add; a post-norm, Gemma's or
    OLMo 2's, adds the norm and the add after its projection). x (1, 1, dim). With a paged context (the batching
    engine's decode step of one row) the attention between the two projections is the paged one: rope, the page
    write and the paged decode attention (paged_attention).

    With `lanes`, the residual kernels sum their outputs' squares into slots 2 * index and 2 * index + 1 of sums and
    each norm reads them: the first norm reads slot sum_in, or sums x itself for sum_in -1 (block 0, and a block after
    one whose output comes from an add: a mixture of experts, a post-norm). Without (a tensor-parallel rank) each
    norm sums the squares of its all-reduced input in its own GEMV's K loop, so every rank computes identical
    norms."""
    attn, ffn = block.attention, block.feed_forward
    # Qwen2/2.5's q/k/v bias rides in the projection's kernel as its residual (added to the fp32 product, where
    # Attention.qkv adds it to the rounded projection).
    bias = None if attn.wqkv_bias is None else attn.wqkv_bias.view(1, 1, -1)
    norm = block.attention_norm  # None: OLMo 2 normalizes outputs only
    qkv = fused_projection(attn.wqkv, x, sums, norm=norm, residual=bias,
                           sum_in=sum_in if lanes and norm is not None else -1)  # (1, 1, (H + 2 Hkv) D)
    if context is None:
        cache = attn.cache()
        norms = head_norms(attn)  # Qwen3's per-head q/k norms, in the attention kernel before it ropes q and k
        if norms is None:
            qkv = attn.normed_qkv(qkv)  # other q/k norms (or none) run before it
        out = torch.ops.redline.decode_attention_qkv(qkv, cache.k[:1], cache.v[:1], rope, input_pos,
                                                     *(norms or (None, None, 0.0)), attn.window,
                                                     attn.args.attention_scale)  # (1, 1, H D)
    else:
        out = paged_attention(attn, qkv, rope, context)  # (1, 1, H D)
    h = sublayer_residual(block, attn.wo, out, x, block.post_attention_norm, sums,
                          2 * index if lanes else -1)  # (1, 1, dim)
    norm = block.ffn_norm
    if sparse(block):  # the router's choice stays on the device: no host sync in the step
        # (1, 1, dim); all-reduced on a tensor-parallel rank
        return block.residual(h, ffn(h if norm is None else norm(h)), block.post_ffn_norm)
    summed = lanes and norm is not None and block.post_attention_norm is None  # the wo kernel summed h's squares
    act = fused_projection(ffn.w13, h, sums, norm=norm, swiglu=True, sum_in=2 * index if summed else -1,
                           gelu=ffn.gelu)  # (1, 1, I)
    return sublayer_residual(block, ffn.w2, act, h, block.post_ffn_norm, sums,
                             2 * index + 1 if lanes else -1)  # (1, 1, dim)


def sums_written(block: TransformerBlock) -> bool:
    """Whether the block's last kernel summed its output's squares for the next norm (not after an add)."""
    return not sparse(block) and block.post_ffn_norm is None


def sparse(block: TransformerBlock) -> bool:
    """Whether the block's feed-forward is a mixture of experts (on a tensor-parallel rank, wrapped for its
    all-reduce)."""
    return isinstance(getattr(block.feed_forward, "inner", block.feed_forward), MoEFeedForward)


def fused_decode_refusal(args: ModelArgs) -> str | None:
    """Why the fused kernels cannot compute this model's blocks, or None when they can. They implement Llama's
    blocks and these deltas: a q/k/v bias, q/k norms, norms with an offset or scaled in fp32 and placed on a
    sub-layer's input, output or both (Gemma, OLMo 2), GeGLU, an embedding scale, partial rotary and LongRoPE, sliding
    windows with their own rope base, an attention scale (Gemma's), mixtures of experts; not an output bias, residual
    or logit scales (Granite) or soft-capping (Gemma 2)."""
    deltas = [
        ("an output bias", args.o_bias),
        ("residual or logit scales", (args.residual_scale, args.logits_divisor) != (1.0, 1.0)),
        ("soft-capping", args.attn_softcap > 0 or args.final_softcap > 0),
    ]
    found = [name for name, present in deltas if present]
    if not found:
        return None
    return f"the fused batch-1 decode does not implement {', '.join(found)}"


class FusedDecode(nn.Module):
    """Wraps a model already passed through kernels.use_kernels (and, for a tensor-parallel rank, through
    tensor_parallel.apply_tensor_parallel): one-token steps (batch 1) run the fused path, every other call runs
    model(...)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        if not isinstance(model, Transformer):
            raise ValueError(f"FusedDecode takes a model.Transformer, got {type(model).__name__}")
        refusal = fused_decode_refusal(model.args)
        if refusal is not None:
            raise ValueError(f"{refusal}; decode through the unfused kernels (fuse=False)")
        # (attention layers the kernels do not take keep model.Attention; the fused path runs them through its ops)
        if any(type(m) in (nn.Linear, Int8Linear, Int4Linear, Fp8Linear) for m in model.modules()):
            raise ValueError("FusedDecode needs the model's layers swapped for the kernel ones first; "
                             "call kernels.use_kernels(model)")
        self.model = model
        # A rank's model computes its norms inside the GEMVs; one GPU hands them on through these lanes.
        self.parallel = any(hasattr(m, "reduce") for m in model.modules())
        device = model.norm.weight.device
        # The blocks' sums of squares, zeroed each step: (2 n_layer, NORM_SUM_LANES) fp32.
        self.register_buffer("norm_sums", torch.zeros(2 * model.args.n_layer, NORM_SUM_LANES, dtype=torch.float32,
                                                      device=device), persistent=False)
        for norm in model.modules():  # the fp32 scales of Gemma's and OLMo 2's norms, made once (scaling_weight)
            if isinstance(norm, RMSNorm) and (norm.offset or norm.scale_fp32):
                norm.register_buffer("fused_weight", norm.weight.detach().float() + norm.offset, persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor, logits_at: Tensor | None = None,
                from_start: bool = False, context: PagedContext | None = None) -> Tensor:
        """model.forward's contract; idx (1, 1) takes the fused path and returns logits (1, 1, vocab): on the static
        cache, or with a paged context when it is a decode step (the batching engine's, one row)."""
        model = self.model
        if idx.numel() != 1 or (context is not None and not context.decode):
            return model(idx, input_pos, logits_at, from_start, context)
        x = model.tok_embeddings(idx)  # (1, 1, dim)
        if context is not None:
            kv, positions = context.kv, context.positions
            if model.args.embedding_scale != 1.0:  # rounded to the activation dtype, as forward_paged does
                x = x * torch.tensor(model.args.embedding_scale, dtype=model.cache_dtype).item()
            local = kv.rope_local[positions] if kv.rope_local.numel() else None  # (1, 2, Dr/2)
            return self.token_logits(x, kv.rope[positions], positions, local, context)
        if model.max_seq_length == 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        if model.embedding_scale != 1.0:
            x = x * model.embedding_scale
        # The attention kernel reads the rope row at input_pos from the whole (S, 2, D/2) table itself: a gather here
        # would be one more kernel, which inductor re-emits before several layers' attention. No mask either: the
        # kernel reads keys 0..input_pos.
        local = model.rope_local if model.rope_local.numel() else None
        return self.token_logits(x, model.rope, input_pos, local)  # (1, 1, vocab)

    def token_logits(self, x: Tensor, rope: Tensor, input_pos: Tensor, local_rope: Tensor | None = None,
                     context: PagedContext | None = None) -> Tensor:
        """x (1, 1, dim), the token's embedding -> logits (1, 1, vocab), each block in five kernels. rope: the whole
        table (static cache), or the row's (1, 2, Dr/2) (paged); local_rope: the same of the windowed layers' own rope
        base (Gemma 3), or None."""
        model = self.model
        sums, lanes = self.norm_sums, not self.parallel
        if lanes:
            sums.zero_()
        sum_in = -1
        for i, layer in enumerate(model.layers):
            if context is not None:
                context.layer = i
            table = local_rope if layer.attention.window and local_rope is not None else rope
            x = fused_block(layer, x, table, input_pos, sums, lanes, i, sum_in, context)
            sum_in = 2 * i + 1 if lanes and sums_written(layer) else -1
        return fused_projection(model.output, x, sums, norm=model.norm, sum_in=sum_in)  # (1, 1, vocab)
