"""benchmarks/bench_model.py: random-weight registry models and the parameter, FLOP and byte counts."""
from __future__ import annotations

import pytest
import torch

from redline.model import ModelArgs
from redline.benchmarks import bench_model


def test_prefill_flops_match_the_performance_notes():
    # PERFORMANCE.md: a 2048-token Llama-2-7B prefill is about 27.6 TFLOP.
    args = ModelArgs.from_name("Llama-2-7B")
    assert bench_model.param_counts(args)["total"] == 6_738_415_616  # the published Llama-2-7B count
    assert bench_model.prefill_flops(args, 2048) == pytest.approx(27.6e12, rel=0.005)
    assert bench_model.prefill_flops(args, 2048, batch=4) == pytest.approx(4 * bench_model.prefill_flops(args, 2048))
    assert bench_model.param_counts(ModelArgs.from_name("Llama-3-8B"))["total"] == 8_030_261_248


def test_random_model_has_realistic_weights():
    args = ModelArgs.from_name("debug-tiny")
    model = bench_model.build_random_model(args, torch.device("cpu"), torch.bfloat16, "none")
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        values = p.float()
        assert (values != 0).float().mean() > 0.95, name
        if p.dim() >= 2:
            assert values.std().item() == pytest.approx(bench_model.WEIGHT_STD, rel=0.2), name
        else:
            assert values.mean().item() == pytest.approx(1.0, abs=0.02), name


def test_random_model_int8_and_tied():
    from redline.quantize import Int8Linear

    args = ModelArgs.from_name("debug-tiny")
    dense = bench_model.build_random_model(args, torch.device("cpu"), torch.bfloat16, "none")
    quant = bench_model.build_random_model(args, torch.device("cpu"), torch.bfloat16, "int8")
    assert isinstance(quant.layers[0].attention.wqkv, Int8Linear) and isinstance(quant.output, Int8Linear)
    assert bench_model.weights_bytes(quant) < bench_model.weights_bytes(dense)
    tied_args = ModelArgs(dim=32, n_layer=1, n_head=2, intermediate_size=64, vocab_size=64, block_size=32,
                          tie_word_embeddings=True)
    tied = bench_model.build_random_model(tied_args, torch.device("cpu"), torch.float32, "none")
    assert tied.output.weight is tied.tok_embeddings.weight
    assert bench_model.weights_bytes(tied) == 4 * bench_model.param_counts(tied_args)["total"]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_random_weights_are_drawn_directly(quant, monkeypatch):
    """No float copy of the matrices is made (a 70B model in bf16 would not fit one GPU before quantizing)."""
    from redline import quantize

    def refuse(*args, **kwargs):
        raise AssertionError("the random model must not be built in float and then quantized")

    monkeypatch.setattr(quantize, "quantize_", refuse)
    monkeypatch.setattr(quantize, "quantize_int8", refuse)
    monkeypatch.setattr(quantize, "quantize_int4", refuse)
    args = ModelArgs.from_name("debug-tiny")
    model = bench_model.build_random_model(args, torch.device("cpu"), torch.bfloat16, quant, group_size=32)
    layer = model.layers[0].feed_forward.w13
    assert quantize.model_quantization(model) == quant
    if quant == "int8":
        codes = layer.weight.float()
        assert codes.abs().max() <= quantize.INT8_MAX and codes.std() > 50  # uniform over -127..127: std 73
        values = codes * layer.scales[:, None]
    else:
        values = quantize.dequantize_int4(layer.weight, layer.scales)
    assert values.std().item() == pytest.approx(bench_model.WEIGHT_STD, rel=0.25)
    assert torch.isfinite(model.tok_embeddings.weight.float()).all()


def test_kv_cache_bytes_count_both_caches_of_every_layer():
    args = ModelArgs.from_name("debug-tiny")
    model = bench_model.build_random_model(args, torch.device("cpu"), torch.float32, "none")
    assert bench_model.kv_cache_bytes(model) == 0  # no cache before setup_caches
    assert bench_model.weights_bytes(model) == 4 * bench_model.param_counts(args)["total"]
    model.setup_caches(max_batch_size=2, max_seq_length=16)
    per_layer = 2 * 2 * args.n_kv_heads * 16 * args.head_dim * model.layers[0].attention.kv_cache.k.element_size()
    assert bench_model.kv_cache_bytes(model) == args.n_layer * per_layer


def test_random_prompts_are_seeded_and_in_the_vocabulary():
    a = bench_model.random_prompts(50, 3, 7, seed=1)
    assert a.shape == (3, 7) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 50
    assert torch.equal(a, bench_model.random_prompts(50, 3, 7, seed=1))
    assert not torch.equal(a, bench_model.random_prompts(50, 3, 7, seed=2))


def test_random_moe_model_has_drawn_int8_experts():
    """Stacked int8 experts are drawn like the int8 linears: every code used, the scales set (never zeros or the
    uninitialized memory of to_empty)."""
    from redline.quantize import INT8_MAX, Int8MoEFeedForward

    args = ModelArgs(dim=32, n_layer=1, n_head=2, intermediate_size=64, vocab_size=64, block_size=32, n_experts=4,
                     n_experts_per_tok=2, moe_intermediate_size=16)
    model = bench_model.build_random_model(args, torch.device("cpu"), torch.bfloat16, "int8")
    experts = model.layers[0].feed_forward
    assert isinstance(experts, Int8MoEFeedForward)
    assert experts.gate.weight.dtype == torch.bfloat16  # the router runs in the activations' dtype
    model.setup_caches(1, 8)
    model(torch.tensor([[1, 2, 3]]), torch.arange(3), from_start=True)  # bf16 activations through the int8 experts
    for name in ("w13", "w2"):
        codes = getattr(experts, name)
        assert codes.min().item() == -INT8_MAX and codes.max().item() == INT8_MAX
        assert torch.all(getattr(experts, f"{name}_scales") == bench_model.WEIGHT_STD * 3 ** 0.5 / INT8_MAX)


def test_random_moe_model_has_drawn_int4_experts():
    """Stacked int4 experts are drawn like the int4 linears: every byte value used, scale and offset set."""
    from redline.quantize import INT4_MAX, Int4MoEFeedForward

    args = ModelArgs(dim=64, n_layer=1, n_head=2, intermediate_size=64, vocab_size=64, block_size=32, n_experts=4,
                     n_experts_per_tok=2, moe_intermediate_size=32)
    model = bench_model.build_random_model(args, torch.device("cpu"), torch.bfloat16, "int4", group_size=32)
    experts = model.layers[0].feed_forward
    assert isinstance(experts, Int4MoEFeedForward) and experts.gate.weight.dtype == torch.bfloat16
    model.setup_caches(1, 8)
    out = model(torch.tensor([[1, 2, 3]]), torch.arange(3), from_start=True)  # bf16 activations, int4 experts
    assert torch.isfinite(out.float()).all()
    for name in ("w13", "w2"):
        codes, scales = getattr(experts, name), getattr(experts, f"{name}_scales")
        assert codes.dtype == torch.uint8 and codes.min().item() == 0 and codes.max().item() == 255
        assert torch.all(scales[..., 0] == 0.005) and torch.all(scales[..., 1] == -0.005 * INT4_MAX / 2)
