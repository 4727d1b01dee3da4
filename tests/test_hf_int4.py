"""scripts/hf_int4.py through scripts/convert_hf_checkpoint.py: AWQ, GPTQ and compressed-tensors 4-bit checkpoints,
written here from known codes, scales and zero points, become Redline int4 checkpoints holding those codes exactly
and giving the logits of the model the file means (transformers' own classes on the dequantized weights)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import prefill_then_decode_logits, save_random_hf_model
from redline.checkpoint import load_tensors, read_checkpoint_info
from redline.quantize import Int4Linear, Int4MoEFeedForward, load_model, unpack_int4
from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint, main

# A tiny Llama whose every input width (128 hidden, 256 intermediate) takes groups of 32, 64 and 128.
LLAMA = ("LlamaForCausalLM", dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, initializer_range=0.05))
QWEN3_MOE = ("Qwen3MoeForCausalLM", dict(hidden_size=64, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64, head_dim=16, mlp_only_layers=[1],
                                         norm_topk_prob=True, initializer_range=0.1))

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# --- the packing rules, written from each format's published description ---

def pack_words(values: torch.Tensor) -> torch.Tensor:
    """(R, 8W) codes 0..15 -> int32 (R, W): value 8w + p in bits 4p..4p+3 of word w."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    words = sum(v[..., p] << (4 * p) for p in range(8))
    return (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)


def gptq_tensors(q, scales, zeros, g_idx, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ: qweight (K/8, N) packed along the inputs, qzeros (K/G, N/8) along the outputs, v1 storing z - 1."""
    stored = (zeros - 1) & 0xF if v1 else zeros
    return {"qweight": pack_words(q).t().contiguous(), "qzeros": pack_words(stored.t()),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def awq_tensors(q, scales, zeros) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight (K, N/8) packed along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7, qzeros likewise."""
    def interleave(m):  # (R, N): nibble p of word j holds column 8j + AWQ_ORDER[p]
        n = m.shape[1]
        cols = (torch.arange(0, n, 8).unsqueeze(1) + torch.tensor(AWQ_ORDER)).flatten()
        return pack_words(m[:, cols])
    return {"qweight": interleave(q.t()), "qzeros": interleave(zeros.t()), "scales": scales.t().contiguous()}


def known_int4(n: int, k: int, group: int, gen: torch.Generator, symmetric: bool):
    """Codes (N, K) 0..15, fp16 scales (N, K/G) and zero points (N, K/G): 8 when symmetric, else any of 0..15."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)
    scales = (0.002 + 0.004 * torch.rand(n, k // group, generator=gen)).half()
    zeros = torch.full((n, k // group), 8, dtype=torch.int64) if symmetric else torch.randint(
        0, 16, (n, k // group), generator=gen, dtype=torch.int64)
    return q, scales, zeros


def dequantized(q, scales, zeros, g_idx) -> torch.Tensor:
    """The weight a 4-bit module means: w[n, k] = s[n, g] * (q[n, k] - z[n, g]), g = g_idx[k], in fp32."""
    return (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def fp16_offset_dequantized(q, scales, zeros, g_idx) -> torch.Tensor:
    """What Redline's layout holds for it: s * q + offset with offset = -s * z rounded to fp16."""
    offsets = (-scales.float() * zeros.float()).half().float()
    return q.float() * scales.float()[:, g_idx] + offsets[:, g_idx]


def with_weights(model, known: dict, dequantize) -> torch.nn.Module:
    """A copy of the HF model whose 4-bit linears hold dequantize(codes, scales, zeros, g_idx)."""
    import copy

    model = copy.deepcopy(model)
    weights = quantizable_weights(model)
    with torch.no_grad():
        for name, parts in known.items():
            weights[name].copy_(dequantize(*parts))
    return model


def activation_order(k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """An act-order g_idx: inputs taken in a random order, every `group` of them one group."""
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    return g_idx


def quantizable_weights(model) -> dict[str, torch.Tensor]:
    """Every weight a 4-bit file holds in 4 bits (not the head or routers), under the module name files give it, as
    a view of the model's parameter; transformers' stacked experts are one module per expert in files."""
    out = {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
           and name != "lm_head" and not name.endswith("mlp.gate")}
    for name, p in model.named_parameters():
        prefix = name.rpartition(".")[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{prefix}.{e}.gate_proj"], out[f"{prefix}.{e}.up_proj"] = p[e, :half], p[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            out.update({f"{prefix}.{e}.down_proj": p[e] for e in range(p.shape[0])})
    return out


def write_4bit_checkpoint(out_dir: Path, arch, method: str, group: int = 32, symmetric: bool = True,
                          v1: bool = True, act_order: tuple[str, ...] = (), channel: bool = False, seed: int = 0,
                          config_extra: dict | None = None):
    """A random `arch` model whose linears (not the head or routers) are 4-bit in `method`'s layout, from known
    codes. Returns (folder, HF model holding the dequantized weights, {module: (codes, scales, zeros, g_idx)})."""
    hf_dir, model = save_random_hf_model(out_dir, *arch, seed, {})
    gen = torch.Generator().manual_seed(seed + 1)
    state = {name: t for name, t in model.state_dict().items() if ".experts." not in name}
    known = {}
    for name, weight in quantizable_weights(model).items():
        n, k = weight.shape
        g = k if channel else group
        q, scales, zeros = known_int4(n, k, g, gen, symmetric)
        g_idx = activation_order(k, g, gen) if any(name.endswith(a) for a in act_order) else torch.arange(k) // g
        known[name] = (q, scales, zeros, g_idx)
        state.pop(f"{name}.weight", None)
        if method == "gptq":
            state.update({f"{name}.{s}": t for s, t in gptq_tensors(q, scales, zeros, g_idx, v1).items()})
        elif method == "awq":
            state.update({f"{name}.{s}": t for s, t in awq_tensors(q, scales, zeros).items()})
        else:
            state.update({f"{name}.{s}": t for s, t in compressed_tensors_module(
                q, scales, zeros, g_idx, g, symmetric, channel).items()})
        with torch.no_grad():
            weight.copy_(dequantized(q, scales, zeros, g_idx))
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, group, symmetric, v1, bool(act_order), channel)
    config["quantization_config"].update(config_extra or {})
    (hf_dir / "config.json").write_text(json.dumps(config))
    for old in hf_dir.glob("model*.safetensors"):
        old.unlink()
    state = {name: t.contiguous() for name, t in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return hf_dir, model, known


def compressed_tensors_module(q, scales, zeros, g_idx, group, symmetric, channel) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compressor packs the module (its signed codes q - 8); act-order modules, whose
    groups its current compressor no longer takes, are packed with its pack_to_int32 and get weight_g_idx."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    n, k = q.shape
    signed_zeros = (zeros - 8).to(torch.int8)
    if not torch.equal(g_idx, torch.arange(k) // group):
        out = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), "weight_scale": scales,
               "weight_shape": torch.tensor([n, k]), "weight_g_idx": g_idx.to(torch.int32)}
        if not symmetric:
            out["weight_zero_point"] = pack_to_int32(signed_zeros, 4, packed_dim=0)
        return out
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="channel" if channel else "group",
                            group_size=None if channel else group)
    state = {"weight": dequantized(q, scales, zeros, g_idx).to(scales.dtype), "weight_scale": scales}
    if not symmetric:
        state["weight_zero_point"] = signed_zeros
    out = dict(PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args)))
    assert torch.equal(out["weight_packed"], pack_to_int32((q - 8).to(torch.int8), 4))  # it found the known codes
    return out


def quantization_config(method, group, symmetric, v1, act_order, channel) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": -1 if channel else group, "sym": symmetric,
                "desc_act": act_order, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="channel" if channel else "group",
                            group_size=None if channel else group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                format="pack-quantized", ignore=["lm_head"], quantization_status="compressed")
    out = json.loads(json.dumps(config.model_dump(), default=str))
    if act_order:
        out["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return out


def redline_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_model(read_checkpoint_info(path), "cpu", torch.float32)
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    return prefill_then_decode_logits(model, ids, ids.shape[1] - 2)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def redline_codes(tensors: dict[str, torch.Tensor], layer: int, part: str, rows: slice) -> torch.Tensor:
    return unpack_int4(tensors[f"layers.{layer}.{part}.weight"][rows])


CASES = {
    "gptq-v1-sym-g64": dict(method="gptq", group=64),
    "gptq-v1-asym-g32": dict(method="gptq", group=32, symmetric=False),
    "gptq-v2-asym-channel": dict(method="gptq", symmetric=False, v1=False, channel=True),
    "awq-g32": dict(method="awq", group=32, symmetric=False),
    "awq-g128": dict(method="awq", group=128, symmetric=False),
    "ct-sym-g32": dict(method="compressed-tensors", group=32),
    "ct-asym-g64": dict(method="compressed-tensors", group=64, symmetric=False),
    "ct-channel": dict(method="compressed-tensors", channel=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_4bit_checkpoint_converts_to_its_codes_and_logits(case, tmp_path):
    hf_dir, model, known = write_4bit_checkpoint(tmp_path / "hf", LLAMA, **CASES[case])
    path = convert_hf_checkpoint(hf_dir, tmp_path / "m.safetensors", dtype="float32")
    info = read_checkpoint_info(path)
    tensors = load_tensors(info)
    group = info.quantization["group_size"]
    assert info.scheme == "int4" and group == (min(CASES[case].get("group", 128), 128))
    assert info.quantization["source"].startswith(CASES[case]["method"])
    q_size, kv = model.config.num_attention_heads * 32, model.config.num_key_value_heads * 32
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for part, hf_name, rows in (("attention.wqkv", "self_attn.k_proj", slice(q_size, q_size + kv)),
                                    ("feed_forward.w13", "mlp.up_proj", slice(256, 512)),
                                    ("feed_forward.w2", "mlp.down_proj", slice(None))):
            q, scales, zeros, _ = known[prefix + hf_name]
            assert torch.equal(redline_codes(tensors, layer, part, rows), q.to(torch.uint8))
            pairs = tensors[f"layers.{layer}.{part}.scales"][rows]  # (N, K/G', 2)
            repeat = q.shape[1] // scales.shape[1] // group
            assert torch.equal(pairs[..., 0], scales.repeat_interleave(repeat, dim=1))  # every scale exactly
            offsets = (-scales.float() * zeros.float()).half().repeat_interleave(repeat, dim=1)
            assert torch.equal(pairs[..., 1], offsets)
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(3))
    ours = redline_logits(path, ids)
    if CASES[case].get("symmetric", True):  # every weight exact: the file's own model
        torch.testing.assert_close(ours, hf_logits(model, ids), atol=1e-4, rtol=0)
    else:  # zero points become fp16 offsets: the model of those, and within the rounding of the file's own
        torch.testing.assert_close(ours, hf_logits(with_weights(model, known, fp16_offset_dequantized), ids),
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(ours, hf_logits(model, ids), atol=3e-3, rtol=0)


def test_act_order_down_projections_are_folded_into_gate_and_up_rows(tmp_path):
    hf_dir, model, known = write_4bit_checkpoint(tmp_path / "hf", LLAMA, "gptq", group=32, act_order=("down_proj",))
    path = convert_hf_checkpoint(hf_dir, tmp_path / "m.safetensors", dtype="float32")
    info = read_checkpoint_info(path)
    assert info.quantization["act_order_folded"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    tensors = load_tensors(info)
    q, _, _, g_idx = known["model.layers.0.mlp.down_proj"]
    order = torch.argsort(g_idx, stable=True)  # the inputs, group by group
    assert torch.equal(redline_codes(tensors, 0, "feed_forward.w2", slice(None)), q[:, order].to(torch.uint8))
    up = known["model.layers.0.mlp.up_proj"][0]
    assert torch.equal(redline_codes(tensors, 0, "feed_forward.w13", slice(256, 512)), up[order].to(torch.uint8))
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(redline_logits(path, ids), hf_logits(model, ids), atol=1e-4, rtol=0)


def test_compressed_tensors_group_actorder_is_folded(tmp_path):
    hf_dir, model, _ = write_4bit_checkpoint(tmp_path / "hf", LLAMA, "compressed-tensors", group=64,
                                             act_order=("down_proj",))
    path = convert_hf_checkpoint(hf_dir, tmp_path / "m.safetensors", dtype="float32")
    assert len(read_checkpoint_info(path).quantization["act_order_folded"]) == 2
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(redline_logits(path, ids), hf_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method,symmetric", [("gptq", True), ("awq", False)])
def test_mixture_of_experts_goes_to_the_int4_experts(method, symmetric, tmp_path):
    hf_dir, model, known = write_4bit_checkpoint(tmp_path / "hf", QWEN3_MOE, method, group=32, symmetric=symmetric,
                                                 act_order=("down_proj",) if method == "gptq" else ())
    assert "model.layers.0.mlp.experts.3.down_proj" in known
    path = convert_hf_checkpoint(hf_dir, tmp_path / "m.safetensors", dtype="float32")
    info = read_checkpoint_info(path)
    loaded = load_model(info, "cpu", torch.float32)
    assert isinstance(loaded.layers[0].feed_forward, Int4MoEFeedForward)
    assert "feed_forward.gate (the expert routers)" in info.quantization["not_quantized"]
    tensors = load_tensors(info)
    q = known["model.layers.0.mlp.experts.2.up_proj"][0]
    order = torch.argsort(known["model.layers.0.mlp.experts.2.down_proj"][3], stable=True)  # the fold's row order
    assert torch.equal(unpack_int4(tensors["layers.0.feed_forward.w13"][2, 64:]), q[order].to(torch.uint8))
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(6))
    reference = model if symmetric else with_weights(model, known, fp16_offset_dequantized)
    torch.testing.assert_close(prefill_then_decode_logits(loaded, ids, 8), hf_logits(reference, ids), atol=1e-4,
                               rtol=0)


def test_awq_packing_agrees_with_compressed_tensors_converter():
    """compressed-tensors' AutoAWQ converter unpacks AWQ's interleaved words into its own layout; its dequantized
    weight is the one the codes mean, and the one this reader finds."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from redline.scripts.hf_int4 import Int4Source, dequantize_module, read_module

    q, scales, zeros = known_int4(64, 128, 32, torch.Generator().manual_seed(7), symmetric=False)
    awq = awq_tensors(q, scales, zeros)
    converted = AutoAWQConverter(group_size=32).process({f"m.{name}": t for name, t in awq.items()})
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    theirs = PackedQuantizationCompressor.decompress({name[2:]: t for name, t in converted.items()},
                                                     QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    exact = dequantized(q, scales, zeros, torch.arange(128) // 32)
    assert torch.equal(theirs, exact.half())  # theirs in fp16: one rounding of the exact product
    assert torch.equal(dequantize_module(read_module("m", dict(awq), Int4Source("awq"))), exact)


def test_gptq_v1_zero_points_read_as_autogptq_does():
    """v1 files store z - 1 in four bits; AutoGPTQ reads (stored + 1) & 15, so a stored 15 is zero point 0."""
    from redline.scripts.hf_int4 import Int4Source, read_module

    q, scales, _ = known_int4(16, 64, 32, torch.Generator().manual_seed(8), symmetric=True)
    zeros = torch.arange(32).view(16, 2) % 16  # every zero point 0..15
    t = gptq_tensors(q, scales, zeros, torch.arange(64) // 32, v1=True)
    stored = t["qzeros"].contiguous().view(torch.uint8)
    assert torch.cat((stored & 0xF, stored >> 4)).unique().numel() == 16  # a stored 15 among them
    module = read_module("m", t, Int4Source("gptq", zero_plus_one=True))
    assert torch.equal(module.zeros, zeros.to(torch.int16))


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    return write_4bit_checkpoint(tmp_path_factory.mktemp("gptq") / "hf", LLAMA, "gptq", group=32)[0]


def with_config(hf_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the folder whose quantization_config edit(qc) changed."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(hf_dir, out)
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def ct_groups(**weights):
    def edit(qc):
        qc.clear()
        qc.update(quantization_config("compressed-tensors", 32, True, True, False, False))
        qc["config_groups"]["group_0"]["weights"].update(weights)
    return edit


REFUSALS = {
    "gptq 3-bit": (lambda qc: qc.update(bits=3), "quantization_config.bits is 3"),
    "gptq 2-bit": (lambda qc: qc.update(bits=2), "quantization_config.bits is 2"),
    "gptq group 16": (lambda qc: qc.update(group_size=16), "quantization_config.group_size is 16"),
    "awq gemv": (lambda qc: qc.update(quant_method="awq", version="gemv"), "quantization_config.version is 'gemv'"),
    "unknown method": (lambda qc: qc.update(quant_method="bitsandbytes"),
                       "quantization_config.quant_method is 'bitsandbytes'"),
    "ct 2-bit": (ct_groups(num_bits=2), "quantization_config.config_groups.group_0.weights.num_bits is 2"),
    "ct tensor strategy": (ct_groups(strategy="tensor"),
                           "quantization_config.config_groups.group_0.weights.strategy is 'tensor'"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unrepresentable_layouts_are_refused_in_one_line(case, gptq_dir, tmp_path, capsys):
    edit, message = REFUSALS[case]
    folder = with_config(gptq_dir, tmp_path, edit)
    assert main(["--checkpoint_dir", str(folder)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not list(folder.glob("*.redline*")) and not (folder / "model.redline.safetensors").exists()


def test_act_order_without_a_fold_is_refused_naming_the_tensor(tmp_path):
    hf_dir, _, _ = write_4bit_checkpoint(tmp_path / "hf", LLAMA, "gptq", group=32, act_order=("q_proj",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.g_idx .*act-order.*desc_act false"):
        convert_hf_checkpoint(hf_dir, tmp_path / "m.safetensors")


def test_bf16_scales_fit_fp16_exactly_above_two_to_the_minus_17():
    from redline.scripts.hf_int4 import fp16_scales

    # bf16 keeps 8 significant bits; fp16's smallest step is 2^-24, so from 2^-17 up every bf16 value fits
    scales = torch.tensor([[2.0**-17 * 1.9921875, 0.0123, 3.5], [2.0**-18 * 1.0078125, 1e-7, 2.0**-20 * 1.5]])
    half, rounded = fp16_scales("m", scales.bfloat16())
    assert half.dtype == torch.float16 and rounded == 2  # 2^-18 * (1 + 2^-7) and 1e-7 lose low bits
    exact = torch.tensor([[True, True, True], [False, False, True]])
    assert torch.equal(half.bfloat16() == scales.bfloat16(), exact)
    with pytest.raises(ValueError, match="exceeds fp16's range"):
        fp16_scales("m", torch.tensor([[7e4]]).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gptq-v1-sym-g64", "awq-g32"])
def test_gpu_kernels_run_a_converted_checkpoint(case, tmp_path):
    """The converted checkpoint through the GPU kernels (int4 GEMV for the decode steps, the tensor-core kernel for
    the prompt) gives the CPU reference's logits within the kernels' fp16-product rounding."""
    from redline.kernels import use_kernels

    hf_dir, _, _ = write_4bit_checkpoint(tmp_path / "hf", LLAMA, **CASES[case])
    path = convert_hf_checkpoint(hf_dir, tmp_path / "m.safetensors", dtype="float32")
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(9))
    model = use_kernels(load_model(read_checkpoint_info(path), "cuda", torch.float32))
    gpu = prefill_then_decode_logits(model, ids.cuda(), ids.shape[1] - 2).cpu()
    torch.testing.assert_close(gpu, redline_logits(path, ids), atol=2e-2, rtol=0)


def moved_to_side_file(hf_dir: Path, tmp_path: Path, side_name: str | None, side: dict | None) -> Path:
    """A copy of the folder whose quantization_config left config.json (for `side_name`, when given)."""
    folder = with_config(hf_dir, tmp_path, lambda qc: None)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    if side_name is not None:
        (folder / side_name).write_text(json.dumps(side))
    return folder


def test_older_exports_quantization_files_beside_config_json(gptq_dir, tmp_path):
    """AutoGPTQ's quantize_config.json (older ones name no quant_method) and AutoAWQ's quant_config.json."""
    folder = moved_to_side_file(gptq_dir, tmp_path / "gptq", "quantize_config.json",
                                {"bits": 4, "group_size": 32, "desc_act": False, "sym": True})
    path = convert_hf_checkpoint(folder, tmp_path / "gptq.safetensors", dtype="float32")
    assert read_checkpoint_info(path).quantization["source"].startswith("gptq (gptq), group 32")
    awq_dir = write_4bit_checkpoint(tmp_path / "awq-hf", LLAMA, "awq", group=64, symmetric=False)[0]
    folder = moved_to_side_file(awq_dir, tmp_path / "awq", "quant_config.json",
                                {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"})
    path = convert_hf_checkpoint(folder, tmp_path / "awq.safetensors", dtype="float32")
    assert read_checkpoint_info(path).quantization["group_size"] == 64
    folder = moved_to_side_file(gptq_dir, tmp_path / "none", None, None)
    with pytest.raises(ValueError, match="are 4-bit, but config.json has no quantization_config"):
        convert_hf_checkpoint(folder, tmp_path / "none.safetensors")


def test_damaged_4bit_tensors_are_one_line_errors():
    from redline.scripts.hf_int4 import Int4Source, read_module

    q, scales, zeros = known_int4(16, 64, 32, torch.Generator().manual_seed(10), symmetric=True)
    good = gptq_tensors(q, scales, zeros, torch.arange(64) // 32, v1=True)
    source = Int4Source("gptq", zero_plus_one=True)
    damaged = {"float words": dict(good, qweight=good["qweight"].float()),
               "short scales": dict(good, scales=good["scales"][:1]),
               "g_idx out of range": dict(good, g_idx=good["g_idx"] + 5),
               "uneven act-order groups": dict(good, g_idx=torch.zeros(64, dtype=torch.int32))}
    for case, tensors in damaged.items():
        with pytest.raises(ValueError, match="the checkpoint is damaged|same number of inputs"):
            read_module("m", tensors, source)
