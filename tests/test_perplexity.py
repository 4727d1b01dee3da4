"""scripts/perplexity.py: windows, agreement with HF transformers, CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redline.scripts.perplexity import main, scored_windows


@pytest.mark.parametrize("n, window, stride", [(10, 4, 2), (3, 4, 2), (9, 4, 3), (1, 4, 2), (12, 5, 1), (100, 16, 15)])
def test_every_target_is_scored_once_with_context(n, window, stride):
    spans = scored_windows(n, window, stride)
    scored = [t for start, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, n))
    assert all(end - start <= window and start < first for start, end, first in spans)


def test_matches_hf_when_one_window_covers_the_text(llama_checkpoint, tmp_path, capsys):
    path, hf_model = llama_checkpoint
    text_file = tmp_path / "doc.py"
    text_file.write_text("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    out_json = tmp_path / "ppl.json"
    code = main(["--checkpoint_path", str(path), "--text", str(text_file), "--max_seq_len", "128",
                 "--device", "cpu", "--json", str(out_json)])
    assert code == 0
    record = json.loads(out_json.read_text())
    ids = torch.tensor([hf_ids(path, text_file.read_text())])
    assert ids.shape[1] < 128 and ids[0, 1] != ids[0, 0]  # one BOS, as the tokenizer gives it
    with torch.no_grad():
        expected = math.exp(hf_model(ids, labels=ids).loss.item())  # transformers' own loss on the same ids
    assert record["tokens"] == ids.shape[1] - 1
    assert record["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert "total:" in capsys.readouterr().out


@pytest.fixture(scope="module")
def llama_checkpoint(tiny_llm_checkpoint, tmp_path_factory):
    """The tiny model with its SentencePiece tokenizer declared a LlamaTokenizer (BOS added, as in Llama 2)."""
    import shutil

    path, hf_model = tiny_llm_checkpoint
    folder = tmp_path_factory.mktemp("ppl") / "llama"
    shutil.copytree(path.parent, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}))
    return folder / path.name, hf_model


def hf_ids(path, text: str) -> list[int]:
    """The ids transformers' tokenizer gives for `text` (its own BOS rule), then EOS: what perplexity must score."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent)
    return tok(text)["input_ids"] + [tok.eos_token_id]


def test_a_tokenizer_that_adds_no_bos_gets_none(llama_checkpoint, tmp_path):
    import shutil

    folder = tmp_path / "no-bos"
    shutil.copytree(llama_checkpoint[0].parent, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "add_bos_token": False}))
    doc = tmp_path / "doc.txt"
    doc.write_text("hello world, hello tokens")
    out_json = tmp_path / "r.json"
    assert main(["--checkpoint_path", str(folder), "--text", str(doc), "--device", "cpu", "--json", str(out_json)]) == 0
    ids = hf_ids(folder / "x", doc.read_text())
    assert ids[0] != 1  # no BOS: transformers gives none, and neither may perplexity
    assert json.loads(out_json.read_text())["tokens"] == len(ids) - 1


def test_bad_arguments(llama_checkpoint, tmp_path, capsys):
    doc = tmp_path / "a.txt"
    doc.write_text("x")
    for argv, message in [
        (["--text", str(tmp_path / "missing.txt")], "does not exist"),
        (["--text", str(doc), "--stride", "64", "--max_seq_len", "64"], "--stride"),
    ]:
        assert main(["--checkpoint_path", str(llama_checkpoint[0]), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


def one_line(code: int, err: str, message: str) -> None:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


@pytest.fixture
def long_doc(tmp_path, llama_checkpoint):
    """A text longer than the tiny model's 256-token context, and its token count with BOS and EOS."""
    doc = tmp_path / "long.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b\n" * 30)
    n_ids = len(hf_ids(llama_checkpoint[0], doc.read_text()))
    assert n_ids > 2 * 256
    return doc, n_ids


@pytest.mark.parametrize("max_seq_len", ["257", "1024", "2048"])
def test_window_over_the_context_is_refused_naming_it(llama_checkpoint, long_doc, capsys, max_seq_len):
    code = main(["--checkpoint_path", str(llama_checkpoint[0]), "--text", str(long_doc[0]),
                 "--max_seq_len", max_seq_len, "--device", "cpu"])
    one_line(code, capsys.readouterr().err, f"--max_seq_len {max_seq_len} is longer than the model's context (256 tokens)")


@pytest.mark.parametrize("argv", [[], ["--max_seq_len", "256"], ["--max_seq_len", "256", "--stride", "255"],
                                  ["--max_seq_len", "100", "--stride", "7"]])
def test_every_token_is_scored_once_whatever_the_window(llama_checkpoint, long_doc, tmp_path, argv):
    """The default window (512) exceeds this model's context, so the default run must use the context instead."""
    out_json = tmp_path / "r.json"
    assert main(["--checkpoint_path", str(llama_checkpoint[0]), "--text", str(long_doc[0]), "--device", "cpu",
                 "--json", str(out_json), *argv]) == 0
    record = json.loads(out_json.read_text())
    assert record["tokens"] == long_doc[1] - 1
    assert record["max_seq_len"] <= 256 and 1 <= record["stride"] < record["max_seq_len"]


def test_sliding_windows_match_hf_scored_window_by_window(llama_checkpoint, long_doc, tmp_path):
    path, hf_model = llama_checkpoint
    ids = torch.tensor(hf_ids(path, long_doc[0].read_text()))
    nll = 0.0
    with torch.no_grad():
        for start, end, first in scored_windows(len(ids), 200, 150):
            logits = hf_model(ids[start:end].unsqueeze(0)).logits[0].float()
            nll += F.cross_entropy(logits[first - start - 1:end - start - 1], ids[first:end], reduction="sum").item()
    out_json = tmp_path / "r.json"
    assert main(["--checkpoint_path", str(path), "--text", str(long_doc[0]), "--device", "cpu", "--max_seq_len", "200",
                 "--stride", "150", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-4)


def test_folder_as_text_is_named_a_folder(llama_checkpoint, tmp_path, capsys):
    code = main(["--checkpoint_path", str(llama_checkpoint[0]), "--text", str(tmp_path)])
    one_line(code, capsys.readouterr().err, "is a folder")


@pytest.mark.parametrize("where", ["under_a_file", "a_folder", "the_text"])
def test_bad_json_path_fails_before_the_model_loads(llama_checkpoint, tmp_path, capsys, monkeypatch, where):
    from redline.scripts import perplexity

    doc = tmp_path / "a.txt"
    doc.write_text("hello")
    target = {"under_a_file": doc / "r.json", "a_folder": tmp_path, "the_text": doc}[where]

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the --json path was checked")

    monkeypatch.setattr(perplexity.LLM, "load", must_not_load)
    code = main(["--checkpoint_path", str(llama_checkpoint[0]), "--text", str(doc), "--json", str(target)])
    one_line(code, capsys.readouterr().err, "--json")
    assert doc.read_text() == "hello"


def test_ctrl_c_is_one_line_and_status_130(llama_checkpoint, tmp_path, capsys, monkeypatch):
    from redline.scripts import perplexity

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(perplexity, "evaluate", interrupted)
    doc = tmp_path / "a.txt"
    doc.write_text("hello")
    assert main(["--checkpoint_path", str(llama_checkpoint[0]), "--text", str(doc), "--json", str(tmp_path / "r.json")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_stride_not_below_the_window_is_refused_by_the_window_function():
    with pytest.raises(ValueError, match="stride"):
        scored_windows(100, 16, 16)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arguments_give_a_result_or_one_line(llama_checkpoint, tmp_path, capsys, data):
    from redline.checkpoint import TEMP_FILE

    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox.\n" * 3)
    values = [str(llama_checkpoint[0]), str(doc), str(tmp_path), str(tmp_path / "r.json"), str(doc / "r.json"),
              str(tmp_path / "missing.txt"), "0", "1", "2", "64", "300", "-5", "x", "cpu", "float32", "int8", "int4", ""]
    flags = ["--checkpoint_path", "--text", "--max_seq_len", "--stride", "--json", "--device", "--dtype", "--quantize",
             "--no-compile"]
    text = st.text("-abcdefgijklmnopqrstuvwxyz_=./0123456789", max_size=8).filter(lambda a: not a.startswith("-h"))
    argv = data.draw(st.lists(st.sampled_from(flags + values) | text, max_size=8))
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if code == 0:
        assert "total:" in out
    else:
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert doc.read_text() == "The quick brown fox.\n" * 3
    assert not [p for p in tmp_path.iterdir() if TEMP_FILE.fullmatch(p.name)]


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer_config.json", "generation_config.json", "notes.json"])
def test_json_never_replaces_a_file_the_run_reads_or_did_not_write(llama_checkpoint, tmp_path, capsys, name):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(llama_checkpoint[0].parent, folder)
    (folder / "notes.json").write_text('{"mine": 1}')
    target = folder / name
    link = tmp_path / "link.json"
    link.symlink_to(target)  # through a symlink too
    before = target.read_bytes()
    doc = tmp_path / "doc.txt"
    doc.write_text("hello world")
    for out in (target, link):
        code = main(["--checkpoint_path", str(folder), "--text", str(doc), "--device", "cpu", "--json", str(out)])
        one_line(code, capsys.readouterr().err, "--json")
    assert target.read_bytes() == before


def test_json_replaces_an_earlier_record_only_with_overwrite(llama_checkpoint, tmp_path, capsys):
    doc, out = tmp_path / "doc.txt", tmp_path / "r.json"
    doc.write_text("hello world")
    argv = ["--checkpoint_path", str(llama_checkpoint[0]), "--text", str(doc), "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    one_line(main(argv), capsys.readouterr().err, "pass --overwrite")
    assert main([*argv, "--overwrite"]) == 0
