"""outputs.py: the one output check every command runs, and the side files written beside an output."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from redline.checkpoint import CheckpointInfo, read_checkpoint_info, save_checkpoint
from redline.model import ModelArgs
from redline.outputs import check_inside, check_output, side_files_to_write


def test_an_output_that_is_an_input_through_links_is_refused(tmp_path):
    source = tmp_path / "tokenizer.json"
    source.write_text("{}")
    (tmp_path / "sym.json").symlink_to(source)
    os.link(source, tmp_path / "hard.json")
    for name in ("tokenizer.json", "sym.json", "hard.json"):
        with pytest.raises(ValueError, match="is an input of this command"):
            check_output(tmp_path / name, [tmp_path / "config.json", source], "--json", overwrite=True,
                         replaceable=lambda p: True)


def test_an_existing_file_is_replaced_only_when_it_is_ours_and_overwrite_is_given(tmp_path):
    out = tmp_path / "result.json"
    out.write_text("someone's notes")
    with pytest.raises(ValueError, match="exists and is not a perplexity record"):
        check_output(out, [], "--json", overwrite=True, replaceable=lambda p: False, kind="perplexity record")
    with pytest.raises(ValueError, match="pass --overwrite"):
        check_output(out, [], "--json", replaceable=lambda p: True)
    check_output(out, [], "--json", overwrite=True, replaceable=lambda p: True)
    check_output(tmp_path / "new.json", [], "--json")


def test_side_files_never_replace_another_models_files_without_overwrite(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"another model")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    files = {"tokenizer.json": b"{}", "generation_config.json": b'{"eos_token_id": [7]}'}
    with pytest.raises(ValueError, match="generation_config.json beside the output .* pass --overwrite"):
        side_files_to_write(files, tmp_path, exclusive=("tokenizer.model", "tokenizer.json"))
    (tmp_path / "generation_config.json").write_bytes(files["generation_config.json"])  # the same: left alone
    with pytest.raises(ValueError, match="holds tokenizer.model of another model"):
        side_files_to_write(files, tmp_path, exclusive=("tokenizer.model", "tokenizer.json"))
    todo = side_files_to_write(files, tmp_path, overwrite=True, exclusive=("tokenizer.model", "tokenizer.json"))
    assert todo == {"tokenizer.json": b"{}"}


def test_a_symlink_out_of_the_folder_is_refused(tmp_path):
    folder, elsewhere = tmp_path / "model", tmp_path / "secret.txt"
    folder.mkdir()
    elsewhere.write_text("private")
    (folder / "tokenizer.json").symlink_to(elsewhere)
    (folder / "inside.json").write_text("{}")
    (folder / "link.json").symlink_to(folder / "inside.json")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        check_inside(folder / "tokenizer.json", folder)
    assert check_inside(folder / "link.json", folder) == folder / "link.json"


def test_a_checkpoint_is_written_without_safetensors_own_writer(tmp_path, monkeypatch):
    """safetensors' writer makes a temp file of its own, which a killed process leaves behind; Redline writes the
    format itself, into its own temp file that the next write cleans up."""
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("safetensors' own writer was used")

    monkeypatch.setattr(safetensors.torch, "save_file", refuse)
    monkeypatch.setattr(safetensors.torch, "serialize_file", refuse)
    args = ModelArgs(dim=16, n_layer=1, n_head=2, intermediate_size=32, vocab_size=8, block_size=16)
    tensors = {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int8),
               "c": torch.tensor(2.5)}
    path = save_checkpoint(tmp_path / "m.safetensors", tensors, CheckpointInfo(tmp_path / "m.safetensors", args,
                                                                               torch.bfloat16))
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["redline_format"] == "1"
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_an_absurd_layer_count_or_dimension_in_the_metadata_is_refused(tiny_checkpoint, tmp_path):
    import json

    from safetensors.torch import load_file

    path = tiny_checkpoint[0]
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    for field, value, message in (("n_layer", 10 ** 9, "declares 1000000000 layers"),
                                  ("dim", 1 << 40, "tok_embeddings.weight has shape"),
                                  ("block_size", 1 << 40, "declares a context")):
        config = {**json.loads(meta["config"]), field: value}
        out = tmp_path / f"{field}.safetensors"
        from safetensors.torch import save_file

        save_file(tensors, str(out), metadata={**meta, "config": json.dumps(config)})
        with pytest.raises(ValueError, match=message):
            read_checkpoint_info(out)
