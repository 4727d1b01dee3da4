"""scripts/gguf_metadata.py and convert_gguf.py on hostile GGUF files: every metadata value type- and range-checked,
tensor data inside the file, no overwritten files, one line and exit status 2 (130 for Ctrl-C)."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
from gguf import GGUFValueType as VT  # noqa: E402

from test_convert_gguf import gpt2_tokenizer_from, write_gguf  # noqa: E402

from redline.checkpoint import read_checkpoint_info  # noqa: E402
from redline.scripts import convert_gguf as cg  # noqa: E402
from redline.scripts.gguf_metadata import checked_value  # noqa: E402
from redline.scripts.gguf_tokenizer import tokenizer_files  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from conftest import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-gguf-meta"), "gqa")[1]


def with_keys(**values):
    """A writer hook that sets (overrides) metadata keys: name -> (value, GGUF type[, array item type])."""
    def add(writer):
        for key, spec in values.items():
            writer.add_key_value(key.replace("__", "."), *spec)
    return add


def one_line_error(capsys, argv, status=2):
    assert cg.main(argv) == status
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize("key, spec, message", [
    ("llama__attention__head_count", (0, VT.UINT32), "outside 1"),
    ("llama__block_count", (1_000_000_000, VT.UINT32), "outside 1"),
    ("llama__block_count", (1_000_000, VT.UINT32), "declares 1000000 layers"),
    ("llama__embedding_length", ([64, 64], VT.ARRAY, VT.UINT32), "must be an integer"),
    ("llama__rope__freq_base", ("big", VT.STRING), "finite number"),
    ("llama__feed_forward_length", (96, VT.UINT32), "implies"),
    ("general__architecture", (7, VT.UINT32), "must be a string"),
])
def test_crafted_model_metadata_is_one_line(tmp_path, tiny_hf, capsys, key, spec, message):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf, tokenizer=with_keys(**{key: spec}))
    err = one_line_error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "o" / "m.safetensors")])
    assert message in err
    assert not (tmp_path / "o").exists()


def test_crafted_tokenizer_metadata_is_one_line(tmp_path, tiny_hf, hf_tokenizer_dir, capsys):
    base = gpt2_tokenizer_from(hf_tokenizer_dir)
    for extra, message in (({"tokenizer__ggml__eos_token_id": (10 ** 6, VT.UINT32)}, "outside the vocabulary"),
                           ({"tokenizer__ggml__merges": (["ab"], VT.ARRAY, VT.STRING)}, "not two tokens"),
                           ({"tokenizer__ggml__token_type": ([1, 1], VT.ARRAY, VT.INT32)}, "2 entries"),
                           ({"tokenizer__ggml__add_bos_token": ("yes", VT.STRING)}, "true or false")):
        def add(writer, extra=extra):
            base(writer)
            with_keys(**extra)(writer)

        path = write_gguf(tmp_path / "m.gguf", tiny_hf, tokenizer=add)
        assert message in one_line_error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "o" / "m.safetensors")])
        assert not (tmp_path / "o").exists()


def test_a_tensor_offset_that_wraps_around_is_refused(tmp_path, tiny_hf, capsys):
    """The reader adds offsets as 64-bit numbers: an offset near 2**64 wraps onto the header bytes."""
    path = write_gguf(tmp_path / "m.gguf", tiny_hf)
    reader = cg.read_gguf(path)
    t = reader.tensors[1]
    field_offset = t.field.offset + sum(p.nbytes for p in t.field.parts[:-1])  # where its offset is stored
    data = bytearray(path.read_bytes())
    wrapped = (2 ** 64 - reader.data_offset + 8) % 2 ** 64  # reads from byte 8 of the file
    data[field_offset:field_offset + 8] = struct.pack("<Q", wrapped)
    path.write_bytes(bytes(data))
    err = one_line_error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "m.safetensors")])
    assert "outside the file's data section" in err


def test_out_onto_another_models_weights_or_folder_is_refused(tmp_path, tiny_hf, hf_tokenizer_dir, sp_tokenizer_dir,
                                                              capsys):
    import shutil

    path = write_gguf(tmp_path / "m.gguf", tiny_hf, tokenizer=gpt2_tokenizer_from(hf_tokenizer_dir))
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"someone else's weights")
    shutil.copyfile(sp_tokenizer_dir / "tokenizer.model", other / "tokenizer.model")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert "not a Redline checkpoint" in one_line_error(capsys, ["--gguf", str(path), "--out",
                                                                 str(other / "model.safetensors")])
    err = one_line_error(capsys, ["--gguf", str(path), "--out", str(other / "new.safetensors")])
    assert "tokenizer.model of another model" in err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    out = tmp_path / "mine" / "m.safetensors"
    assert cg.main(["--gguf", str(path), "--out", str(out)]) == 0
    assert "--overwrite" in one_line_error(capsys, ["--gguf", str(path), "--out", str(out)])
    assert cg.main(["--gguf", str(path), "--out", str(out), "--overwrite"]) == 0
    assert cg.main(["--gguf", str(path), "--out", str(other / "new.safetensors"), "--overwrite"]) == 0
    assert not (other / "tokenizer.model").exists() and (other / "tokenizer.json").is_file()
    assert (other / "model.safetensors").read_bytes() == before["model.safetensors"]


def test_ctrl_c_during_conversion_is_one_line_and_130(tmp_path, tiny_hf, capsys, monkeypatch):
    from redline import checkpoint

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    path = write_gguf(tmp_path / "m.gguf", tiny_hf)
    monkeypatch.setattr(checkpoint, "write_safetensors", interrupted)
    one_line_error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "o" / "m.safetensors")], status=130)
    assert not list((tmp_path / "o").glob("*m.safetensors*"))


def test_a_full_disk_is_one_line(tmp_path, tiny_hf, capsys, monkeypatch):
    import errno

    from redline import checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o" / ".m.safetensors.tmp"))

    path = write_gguf(tmp_path / "m.gguf", tiny_hf)
    monkeypatch.setattr(checkpoint, "write_safetensors", full)
    assert "No space left" in one_line_error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "o" / "m.safetensors")])


def test_progress_is_shown_on_a_terminal(tmp_path, tiny_hf, monkeypatch, capsys):
    import sys

    path = write_gguf(tmp_path / "m.gguf", tiny_hf)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cg.main(["--gguf", str(path), "--out", str(tmp_path / "m.safetensors")]) == 0
    assert "converting" in capsys.readouterr().err
    assert read_checkpoint_info(tmp_path / "m.safetensors").args.n_layer == tiny_hf.config.num_hidden_layers


class FakeField:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class FakeReader:
    def __init__(self, fields, tensors=()):
        self.fields = {k: FakeField(v) for k, v in fields.items()}
        self.tensors = list(tensors)


LLAMA_FIELDS = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
                "llama.feed_forward_length": 160, "llama.attention.head_count": 4,
                "llama.attention.head_count_kv": 2, "llama.context_length": 256, "llama.rope.freq_base": 10000.0,
                "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.tokens": ["a", "b", "c", "ab"], "tokenizer.ggml.merges": ["a b"],
                "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 65, 2 ** 65),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                      st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=3), st.floats()), max_size=4))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(LLAMA_FIELDS)), value=ANY_VALUE)
def test_fuzzed_metadata_gives_a_model_or_a_one_line_value_error(key, value):
    reader = FakeReader({**LLAMA_FIELDS, key: value})
    try:
        args = cg.model_args(reader, None)
        files = tokenizer_files(reader)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert args.n_head >= 1 and args.dim >= 1 and 1 <= args.n_layer <= 1 << 24
    assert json.loads(files["tokenizer_config.json"]) is not None


@given(value=ANY_VALUE)
def test_checked_values_have_the_type_their_key_needs(value):
    for key, kind in (("llama.block_count", int), ("tokenizer.ggml.tokens", list), ("general.architecture", str),
                      ("llama.rope.freq_base", float), ("tokenizer.ggml.add_bos_token", bool)):
        try:
            checked = checked_value(key, value)
        except ValueError:
            continue
        assert isinstance(checked, kind) and not (kind is int and isinstance(checked, bool))
        if kind is float:
            assert np.isfinite(checked) and checked > 0


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory, tiny_hf, hf_tokenizer_dir):
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    write_gguf(path, tiny_hf, tokenizer=gpt2_tokenizer_from(hf_tokenizer_dir))
    return path.read_bytes(), int(cg.read_gguf(path).data_offset)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_gguf_headers_convert_or_give_one_line(small_gguf, tmp_path, capsys, data):
    """Bytes of the header (counts, keys, types, lengths, values, tensor infos) overwritten at random."""
    import uuid

    raw, header_end = small_gguf
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(8, header_end - 1))
        patch = data.draw(st.binary(min_size=1, max_size=8))
        mutated[at:at + len(patch)] = patch
    run = tmp_path / uuid.uuid4().hex
    run.mkdir()
    (run / "m.gguf").write_bytes(bytes(mutated))
    code = cg.main(["--gguf", str(run / "m.gguf"), "--out", str(run / "o" / "m.safetensors")])
    err = capsys.readouterr().err
    assert code in (0, 2), err
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1, err


def gguf_header(keys: bytes, n_keys: int, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_keys) + keys


def gguf_key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize("body, n_keys, n_tensors, message", [
    # an array of 2^40 uint32 in a 1 KB file: the gguf reader would walk the count past the file's end
    (gguf_key("general.junk") + struct.pack("<IIQ", VT.ARRAY, VT.UINT32, 1 << 40) + bytes(900), 1, 0,
     "past the file's end"),
    # the same with strings (each item at least 8 bytes) and with nested arrays
    (gguf_key("general.junk") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 1 << 40) + bytes(900), 1, 0,
     "array items"),
    (gguf_key("general.junk") + struct.pack("<IIQ", VT.ARRAY, VT.ARRAY, 1 << 62) + bytes(900), 1, 0, "array items"),
    # 2^60 keys or tensors declared
    (bytes(900), 1 << 60, 0, "metadata keys"),
    (bytes(900), 0, 1 << 60, "tensors"),
    # a key name longer than the file
    (struct.pack("<Q", 1 << 50) + bytes(900), 1, 0, "past the file's end"),
    # an unknown value type
    (gguf_key("general.junk") + struct.pack("<I", 77) + bytes(900), 1, 0, "unknown type 77"),
])
def test_counts_past_the_files_end_are_refused_at_once(tmp_path, capsys, body, n_keys, n_tensors, message):
    import time

    path = tmp_path / "crafted.gguf"
    path.write_bytes(gguf_header(body, n_keys, n_tensors))
    assert path.stat().st_size < 1100
    start = time.perf_counter()
    err = one_line_error(capsys, ["--gguf", str(path), "--out", str(tmp_path / "o" / "m.safetensors")])
    assert time.perf_counter() - start < 5
    assert message in err and str(path) in err
    assert not (tmp_path / "o").exists()
