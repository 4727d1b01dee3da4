"""scripts/convert_hf_checkpoint.py: format, metadata, atomic writes and clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from checkpoint import FORMAT_VERSION, read_checkpoint_info, resolve_checkpoint_path
from conftest import save_tiny_hf_checkpoint
from scripts.convert_hf_checkpoint import convert_hf_checkpoint, main


@pytest.fixture
def hf_dir(tmp_path):
    return save_tiny_hf_checkpoint(tmp_path / "hf", "gqa")[0]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_one_file_with_metadata(hf_dir, capsys):
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--dtype", "bfloat16")
    assert code == 0, err
    path = resolve_checkpoint_path(out.strip())
    assert path.parent == hf_dir and path.suffix == ".safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert meta["redline_format"] == str(FORMAT_VERSION)
    assert meta["dtype"] == "bfloat16" and dtypes == {torch.bfloat16}
    assert json.loads(meta["quantization"]) == {"scheme": "none"}
    assert json.loads(meta["config"])["n_kv_heads"] == 2
    info = read_checkpoint_info(hf_dir)  # the folder resolves to the one Redline file in it
    assert info.path == path and info.args.n_layer == 2
    assert not [p for p in hf_dir.iterdir() if p.name.endswith(".tmp")]


def test_reconverting_ignores_the_earlier_output(hf_dir, capsys):
    assert run_cli(capsys, "--checkpoint_dir", str(hf_dir))[0] == 0
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--dtype", "float32")
    assert code == 0, err
    assert read_checkpoint_info(out.strip()).dtype == torch.float32


def test_cli_out_and_dtype(hf_dir, tmp_path, capsys):
    out_file = tmp_path / "sub" / "m.safetensors"
    code, out, _ = run_cli(capsys, "--checkpoint_dir", str(hf_dir), "--out", str(out_file), "--dtype", "float16")
    assert code == 0 and out.strip() == str(out_file)
    assert read_checkpoint_info(out_file).dtype == torch.float16


def test_interrupted_write_leaves_no_file(hf_dir, tmp_path, monkeypatch):
    import checkpoint

    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", explode)
    out_file = tmp_path / "never.safetensors"
    with pytest.raises(KeyboardInterrupt):
        convert_hf_checkpoint(hf_dir, out_file)
    assert list(tmp_path.glob("*never*")) == []


@pytest.mark.parametrize(
    "break_it, message",
    [
        ("missing_dir", "does not exist"),
        ("no_weights", "no weights"),
        ("truncated", "truncated"),
        ("gpt2", "unsupported architecture 'GPT2LMHeadModel'"),
        ("missing_tensor", "model.layers.1.mlp.down_proj.weight"),
        ("extra_tensor", "model.layers.0.mlp.extra.weight"),
        ("wrong_shape", "model.layers.0.self_attn.o_proj.weight has shape (64, 63)"),
        ("no_config", "config.json not found"),
    ],
)
def test_bad_input_is_one_clear_line(hf_dir, tmp_path, capsys, break_it, message):
    from safetensors.torch import load_file, save_file

    weights = hf_dir / "model.safetensors"
    target = hf_dir
    if break_it == "missing_dir":
        target = tmp_path / "nope"
    elif break_it == "no_weights":
        weights.unlink()
    elif break_it == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif break_it == "gpt2":
        (hf_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    elif break_it == "no_config":
        (hf_dir / "config.json").unlink()
    else:
        tensors = load_file(weights)
        if break_it == "missing_tensor":
            del tensors["model.layers.1.mlp.down_proj.weight"]
        elif break_it == "extra_tensor":
            tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
        else:
            tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 63)
        save_file(tensors, weights, metadata={"format": "pt"})
    code, out, err = run_cli(capsys, "--checkpoint_dir", str(target))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err


def test_redline_file_is_required_for_loading(tmp_path):
    with pytest.raises(FileNotFoundError, match="convert_hf_checkpoint"):
        read_checkpoint_info(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_checkpoint_info(tmp_path / "missing.safetensors")
