"""kernels/fused_decode.py: FusedDecode runs the model's math in five ops per block."""
from __future__ import annotations

import pytest
import torch

from redline import kernels
from redline.kernels import attention as kernel_attention
from redline.kernels import fused_decode
from redline.model import ModelArgs, RMSNorm, Transformer


def variant_model(variant: str) -> Transformer:
    """A tiny random model of one fused-decode variant (see test_fused_decode_gives_the_unfused_logits), its
    layers swapped for the kernel ones."""
    import dataclasses

    from redline.quantize import quantize_
    from redline.rope import RopeScaling

    torch.manual_seed(0)
    args = dataclasses.replace(ModelArgs.from_name("debug-tiny-llama3"), qkv_bias=variant == "qkv_bias",
                               qk_norm="head" if variant == "qk_norm" else "none")  # GQA 4:1, llama3 rope
    if variant.startswith("gemma3"):  # layer 0 windowed (8 keys, rope base 10k), layer 1 global
        args = dataclasses.replace(args, qk_norm="head", norm_offset=1.0, norm_scale_fp32=True,
                                   norm_placement="sandwich", activation="gelu_tanh", embedding_scale=8.0,
                                   layer_windows=(8, 0), local_rope_base=10000.0)
    if variant == "olmo2":
        args = dataclasses.replace(args, qk_norm="full", norm_scale_fp32=True, norm_placement="post")
    if variant.startswith("moe"):  # layers 0 and 2 sparse, layer 1 dense: each kind follows the other
        args = dataclasses.replace(ModelArgs.from_name("debug-tiny-moe"), n_layer=3, moe_layers=(True, False, True),
                                   moe_intermediate_size=128)
    if variant == "partial_longrope":  # 12 of 16 features rotate; the 64-token cache is past the original 32
        args = dataclasses.replace(args, rotary_dim=12, rope_scaling=RopeScaling(
            rope_type="longrope", original_max_position_embeddings=32, short_factor=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0),
            long_factor=(2.0, 3.0, 4.0, 5.0, 6.0, 8.0), attention_factor=1.2))
        assert args.rotary_dim < args.head_dim and kernels.fused_decode_refusal(args) is None
    model = Transformer(args).eval()
    with torch.no_grad():
        for norm in model.modules():  # values large enough to move the logits (Gemma's scale by 1 + w)
            if isinstance(norm, RMSNorm):
                norm.weight.normal_(1 - args.norm_offset, 0.5)
        for layer in model.layers:
            if layer.attention.wqkv_bias is not None:
                layer.attention.wqkv_bias.normal_(0, 0.5)
            for experts in (getattr(layer.feed_forward, name, None) for name in ("w13", "w2")):
                if isinstance(experts, torch.Tensor) and experts.dim() == 3:  # (E, N, K), made empty
                    experts.normal_(0, experts.shape[-1] ** -0.5)
    if variant in ("int8", "moe_int8", "moe_int4", "gemma3_int4"):
        quantize_(model, variant.split("_")[-1])
    return kernels.use_kernels(model)


@pytest.mark.parametrize("variant", ["llama", "int8", "qkv_bias", "qk_norm", "partial_longrope", "moe", "moe_int8",
                                     "moe_int4", "gemma3", "gemma3_int4", "olmo2"])
def test_fused_decode_gives_the_unfused_logits(variant, monkeypatch):
    """FusedDecode (norm+qkv, rope+cache+attention, wo+residual, norm+w13+SwiGLU, w2+residual, norm+head) runs
    the same math as forward: on the CPU the ops fall back to the unfused steps, so logits match to fp32 noise.
    Also int8, with a q/k/v bias (Qwen2) or per-head q/k norms (Qwen3) between the projection and the kernel, and
    with Phi-3's partial rotary and LongRoPE (the kernel ropes the first features from the model's table), for
    mixtures of experts (a dense block after a sparse one, float, int8 and int4 experts), Gemma 3's blocks (1 + w
    norms in fp32 before and after each sub-layer, GeGLU, an embedding scale, Gemma q/k norms, a sliding-window layer
    with its own rope base over a sequence longer than its window) and OLMo 2's (norms on the outputs only, q/k norms
    over the whole width)."""
    model = variant_model(variant)
    fused = kernels.FusedDecode(model)
    ids = torch.randint(0, 512, (1, 24))

    def prefill_then_decode(step):  # logits of a 6-token prefill, then one token per step
        model.setup_caches(1, 64)
        logits = [step(ids[:, :6], torch.arange(6))]
        logits += [step(ids[:, p:p + 1], torch.tensor([p])) for p in range(6, ids.shape[1])]
        return torch.cat(logits, dim=1)

    calls = []
    original = fused_decode.fused_block
    monkeypatch.setattr(fused_decode, "fused_block", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        reference = prefill_then_decode(model)
        assert not calls
        out = prefill_then_decode(fused)
    assert len(calls) == 18 * model.args.n_layer  # every one-token step took the fused path (the prefill did not)
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_fused_decode_needs_the_kernel_modules():
    model = Transformer(ModelArgs.from_name("debug-tiny"))
    with pytest.raises(ValueError, match="use_kernels"):
        kernels.FusedDecode(model)
    with pytest.raises(ValueError, match="model.Transformer"):
        kernels.FusedDecode(model.layers[0])
    fused = kernels.FusedDecode(kernels.use_kernels(model))
    assert fused.model is model
    assert fused.norm_sums.shape == (2 * model.args.n_layer, fused_decode.NORM_SUM_LANES)
    assert fused.norm_sums.dtype == torch.float32


def test_fused_decode_zeroes_its_sums_each_step():
    """The sums of squares start from zero every step: two steps at one position give the same logits."""
    torch.manual_seed(0)
    model = kernels.use_kernels(Transformer(ModelArgs.from_name("debug-tiny")).eval())
    fused = kernels.FusedDecode(model)
    with torch.no_grad():
        model.setup_caches(1, 16)
        token, pos = torch.tensor([[7]]), torch.tensor([0])
        first = fused(token, pos)
        assert fused.norm_sums.abs().sum() > 0  # the residual kernels wrote their sums
        torch.testing.assert_close(fused(token, pos), first, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["gemma3", "olmo2"])
def test_the_compiled_fused_step_gives_the_eager_logits(variant):
    """Inductor lowers the whole fused step (fullgraph), also for blocks whose output projections run without a
    residual (post-norms), where redline::fused_linear once got sums=None: inductor could not lower that."""
    model = variant_model(variant)
    fused = kernels.FusedDecode(model)
    step = torch.compile(fused, fullgraph=True)
    token = torch.tensor([[7]])
    with torch.no_grad():
        model.setup_caches(1, 16)
        want = [fused(token, torch.tensor([p])) for p in range(3)]
        model.setup_caches(1, 16)
        got = [step(token, torch.tensor([p])) for p in range(3)]
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["llama", "qk_norm", "moe", "gemma3"])
def test_fused_paged_decode_gives_the_model_logits(variant):
    """A one-row paged decode step (the batching engine's, engine/graphs.decode_logits) through FusedDecode runs the
    fused projections around the paged attention: the logits of model.forward_paged, step after step, with the keys
    and values each path wrote to its own pool; a step of two rows goes on to the model. With the pool's attention
    ops on (the engine's GPU kernels; their references here) a layer's one-row attention is one op,
    redline::paged_decode_attention_qkv, except where Gemma's q/k norms (1 + w) keep the model's steps (norms and
    rope, then the pool's decode op)."""
    import dataclasses

    from redline.runner.paged import registered_paged_ops
    from redline.runner.decode_graphs import decode_logits
    from redline.model import PagedKVCache

    torch.manual_seed(0)
    args = dataclasses.replace(ModelArgs.from_name("debug-tiny-llama3"), qk_norm="head" if variant == "qk_norm"
                               else "none", block_size=64)
    if variant == "moe":
        args = dataclasses.replace(ModelArgs.from_name("debug-tiny-moe"), block_size=64, moe_layers=(True, False))
    if variant == "gemma3":  # a window of 8 keys (14 steps pass it) with its own rope base on layer 0
        args = dataclasses.replace(args, qk_norm="head", norm_offset=1.0, norm_scale_fp32=True,
                                   norm_placement="sandwich", activation="gelu_tanh", embedding_scale=8.0,
                                   layer_windows=(8, 0), local_rope_base=10000.0)
    model = kernels.use_kernels(Transformer(args).eval())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:  # stacked experts, made empty
                p.normal_(0, p.shape[-1] ** -0.5)
        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.normal_(1 - args.norm_offset, 0.5)
    fused = kernels.FusedDecode(model)
    page_size, pages = 4, [3, 0, 5, 1]  # a sequence's pages out of order in the pool
    ids = torch.randint(0, args.vocab_size, (14,))

    def logits_of(step_model, rows: int, ops=None) -> torch.Tensor:  # (steps, rows, V): one token a step from 0
        kv = PagedKVCache(args, 8, page_size, torch.float32, torch.device("cpu"), ops)
        tables = torch.tensor([pages] * rows, dtype=torch.int32)  # (rows, W): rows share pages (same tokens)
        out = []
        for p in range(ids.numel()):
            positions = torch.full((rows,), p)
            slots = torch.full((rows,), pages[p // page_size] * page_size + p % page_size)
            seq_lens = torch.full((rows,), p + 1, dtype=torch.int32)
            out.append(decode_logits(step_model, kv, None, ids[p].repeat(1, rows), positions, slots, tables, seq_lens))
        return torch.stack(out)

    calls, splits = [], []
    original, split = fused_decode.fused_block, kernel_attention.split_rotated_qkv
    steps = ids.numel() * args.n_layer
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_decode, "fused_block", lambda *a: calls.append(1) or original(*a))
        patch.setattr(kernel_attention, "split_rotated_qkv", lambda *a: splits.append(1) or split(*a))
        want = logits_of(model, 1)
        assert not calls
        splits.clear()  # (the model's kernel attention layers rope there too)
        got = logits_of(fused, 1)
        assert len(calls) == len(splits) == steps  # every step took the fused path, around the model's attention
        with_ops = logits_of(fused, 1, registered_paged_ops())
        assert len(splits) == steps * (2 if variant == "gemma3" else 1)  # the op ropes (Gemma's norms: the model)
        two = logits_of(fused, 2, registered_paged_ops())
        assert len(calls) == 2 * steps  # two rows: the model's path
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(with_ops, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(two, want.expand_as(two), atol=1e-4, rtol=1e-4)
