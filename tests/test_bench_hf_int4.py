"""benchmarks/bench_hf_int4.py on the CPU: the random GPTQ folder it writes converts to Redline's int4 with GPTQ's
words as Redline's bytes (the decode it times runs on a GPU)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from redline.benchmarks import bench_hf_int4
from redline.benchmarks.bench_hf_int4 import write_gptq_folder
from redline.checkpoint import load_tensors, read_checkpoint_info
from redline.model import ModelArgs
from redline.quantize import load_model
from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

TINY = ModelArgs(dim=64, n_layer=2, n_head=4, n_kv_heads=2, intermediate_size=128, vocab_size=256, block_size=128)


def test_random_gptq_folder_converts_byte_for_byte_and_decodes(tmp_path):
    folder = write_gptq_folder(tmp_path / "gptq", TINY, 32)
    path = convert_hf_checkpoint(folder, tmp_path / "m.safetensors", dtype="float32")
    info = read_checkpoint_info(path)
    assert info.scheme == "int4" and info.quantization["group_size"] == 32
    assert not any(kept.startswith("output") for kept in info.quantization["not_quantized"])  # the head is int4 too
    ours = load_tensors(info)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        down = f.get_tensor("model.layers.1.mlp.down_proj.qweight")  # (K/8, N) int32
        head_scales = f.get_tensor("lm_head.scales")  # (K/G, N)
    assert torch.equal(ours["layers.1.feed_forward.w2.weight"], down.t().contiguous().view(torch.uint8))
    assert torch.equal(ours["output.scales"][..., 0], head_scales.t())
    assert torch.equal(ours["output.scales"][..., 1], -8 * head_scales.t())
    load_model(info, "cpu")  # the structure the metadata names holds the tensors


@pytest.mark.parametrize("args,message", [
    (["--model", "Llama-9B"], "unknown model name 'Llama-9B'"),
    (["--model", "Qwen3-8B"], "plain Llama-shaped models"),
    (["--groupsize", "48"], "int4 group size must be a power of two"),
    (["--runs", "0"], "--runs must be at least 1"),
])
def test_bad_arguments_are_one_line_errors(args, message, capsys):
    assert bench_hf_int4.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_gptq_config_reads_back_as_the_registry_model():
    from redline.scripts.hf_config import args_from_hf_config

    for name in ("Llama-3-8B", "Llama-2-7B", "Mistral-7B"):
        args = ModelArgs.from_name(name)
        assert args_from_hf_config(bench_hf_int4.hf_config(args, 128)) == args, name
