"""Registry models with random weights of a realistic scale, and the counts the benchmark derives from a config:
parameters, prefill FLOPs, bytes of weights and of the KV cache."""
from __future__ import annotations

import torch
from torch import Tensor

from redline.model import ModelArgs, Transformer

# The weight formats a random model can be built in: the dense dtype, int8 per channel, int4 per group or fp8 (e4m3,
# per channel; W8A8) (quantize.py).
QUANT_CHOICES = ("none", "int8", "int4", "fp8")
WEIGHT_STD = 0.02  # the initializer scale of Llama-family checkpoints; norm gains are drawn around 1


def param_counts(args: ModelArgs) -> dict[str, int]:
    """Parameter counts from the config: the embedding, the matmuls inside the blocks that one token uses (in a
    mixture of experts: the router and top_k experts of each sparse layer), the output head, and all."""
    attention = args.dim * (args.q_size + 2 * args.kv_size) + args.q_size * args.dim
    dense_ffn = 3 * args.dim * args.intermediate_size
    expert = 3 * args.dim * args.moe_intermediate_size
    sparse = sum(args.sparse(i) for i in range(args.n_layer))
    router = args.dim * args.n_experts
    used = args.n_layer * attention + (args.n_layer - sparse) * dense_ffn + sparse * (
        router + args.n_experts_per_tok * expert)
    stored = used + sparse * (args.n_experts - args.n_experts_per_tok) * expert
    embedding = args.vocab_size * args.dim
    head = args.vocab_size * args.dim
    norms = (2 * args.n_layer + 1) * args.dim
    total = embedding + stored + norms + (0 if args.tie_word_embeddings else head)
    return {"embedding": embedding, "block_matmuls": used, "head": head, "total": total}


def prefill_flops(args: ModelArgs, prompt_tokens: int, batch: int = 1) -> float:
    """Useful FLOPs of one prefill: block matmuls over every token, the head once, causal attention."""
    counts = param_counts(args)
    t = prompt_tokens
    attention = 4 * args.n_layer * (t * t / 2) * args.n_head * args.head_dim
    return float(batch * (2 * counts["block_matmuls"] * t + 2 * counts["head"] + attention))


@torch.no_grad()
def fill_random_(model: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 0.02), norm gains ~ N(1, 0.02): never zeros, so speed is measured on real-looking data."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for _, p in model.named_parameters():  # a tied table appears once
        mean = 0.0 if p.dim() >= 2 else 1.0
        p.normal_(mean, WEIGHT_STD, generator=gen)


@torch.no_grad()
def fill_random_int4_(model: torch.nn.Module, seed: int) -> None:
    """Random packed int4 weights drawn directly (every code 0..15 equally likely), scale 0.005 and offset
    -7.5 * scale, so the values lie within +-0.0375 around 0 like an N(0, 0.02) matrix; no float copy is made."""
    from redline.quantize import INT4_MAX, Int4Linear, Int4MoEFeedForward

    gen = torch.Generator(device=next(model.buffers()).device).manual_seed(seed + 1)
    for module in model.modules():
        pairs = [("weight", "scales")] if isinstance(module, Int4Linear) else [
            ("w13", "w13_scales"), ("w2", "w2_scales")] if isinstance(module, Int4MoEFeedForward) else []
        for codes, scales in pairs:  # int4 linears and stacked int4 experts
            weight, scale = getattr(module, codes), getattr(module, scales)
            weight.copy_(torch.randint(0, 256, weight.shape, generator=gen, device=weight.device,
                                       dtype=torch.int32).to(torch.uint8))
            scale[..., 0] = 0.005
            scale[..., 1] = -0.005 * INT4_MAX / 2


@torch.no_grad()
def fill_random_int8_(model: torch.nn.Module, seed: int) -> None:
    """Random int8 weights drawn directly, every code in -127..127 equally likely, with per-channel scales
    WEIGHT_STD * sqrt(3) / 127, so each row is uniform with the std of an N(0, 0.02) matrix; no float copy is made."""
    from redline.quantize import INT8_MAX, Int8Linear, Int8MoEFeedForward

    gen = torch.Generator(device=next(model.buffers()).device).manual_seed(seed + 2)
    for module in model.modules():
        pairs = [("weight", "scales")] if isinstance(module, Int8Linear) else [
            ("w13", "w13_scales"), ("w2", "w2_scales")] if isinstance(module, Int8MoEFeedForward) else []
        for codes, scales in pairs:  # int8 linears and stacked int8 experts
            weight = getattr(module, codes)
            weight.copy_(torch.randint(-INT8_MAX, INT8_MAX + 1, weight.shape, generator=gen, device=weight.device,
                                       dtype=torch.int8))
            getattr(module, scales).fill_(WEIGHT_STD * 3 ** 0.5 / INT8_MAX)


@torch.no_grad()
def fill_random_fp8_(model: torch.nn.Module, seed: int) -> None:
    """Random e4m3 weights drawn directly: N(0, 1) values times 100 (so codes cover most of e4m3's binades up to 448),
    rounded to e4m3, with per-channel scales WEIGHT_STD / 100: each row has the std of an N(0, 0.02) matrix; no
    float copy of the model is made (one layer's draw at a time)."""
    from redline.quantize import FP8_DTYPE, FP8_MAX, Fp8Linear

    gen = torch.Generator(device=next(model.buffers()).device).manual_seed(seed + 3)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            w = module.weight
            draw = torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32) * 100
            w.copy_(draw.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
            module.scales.fill_(WEIGHT_STD / 100)


def build_random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype, quant: str,
                       seed: int = 0, group_size: int = 128) -> Transformer:
    """The registry model on `device` in `dtype` with random weights, built in its quantized structure when asked
    (int8, int4 and fp8 weights drawn directly: a 70B model never needs a bf16 copy, on one GPU or per rank)."""
    from redline.quantize import prepare_quantized_structure, quantization_metadata

    if quant not in QUANT_CHOICES:
        raise ValueError(f"unknown quantization {quant!r}; choose from {', '.join(QUANT_CHOICES)}")
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype=dtype)
    if quant != "none":
        prepare_quantized_structure(model, quantization_metadata(
            quant, args.tie_word_embeddings, group_size if quant == "int4" else None))
    model.to_empty(device=device)
    if args.tie_word_embeddings:  # to_empty gives each module its own tensor; tie them again
        model.output.weight = model.tok_embeddings.weight
    fill_random_(model, seed)  # the float parameters left: embedding, norms, a float head
    if quant == "int4":
        fill_random_int4_(model, seed)
    elif quant == "int8":
        fill_random_int8_(model, seed)
    elif quant == "fp8":
        fill_random_fp8_(model, seed)
    return model.eval()


def weight_tensors(model: Transformer) -> list[Tensor]:
    """Every weight in memory once (parameters and quantized buffers; not the KV cache or the rope table)."""
    seen: set[int] = set()
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or "kv_cache" in name or name in ("rope", "rope_local"):
            continue
        seen.add(id(t))
        out.append(t)
    return out


def weights_bytes(model: Transformer) -> int:
    return sum(t.numel() * t.element_size() for t in weight_tensors(model))


def kv_cache_bytes(model: Transformer) -> int:
    total = 0
    for layer in model.layers:
        cache = layer.attention.kv_cache
        if cache is not None:
            total += cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
    return total


def random_prompts(vocab_size: int, batch: int, length: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)  # (B, T)

