"""scripts/perplexity.py: windows, agreement with HF transformers, CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from scripts.perplexity import main, scored_windows


@pytest.mark.parametrize("n, window, stride", [(10, 4, 2), (3, 4, 2), (9, 4, 3), (1, 4, 2), (12, 5, 1), (100, 16, 15)])
def test_every_target_is_scored_once_with_context(n, window, stride):
    spans = scored_windows(n, window, stride)
    scored = [t for start, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, n))
    assert all(end - start <= window and start < first for start, end, first in spans)


def test_matches_hf_when_one_window_covers_the_text(tiny_llm_checkpoint, tmp_path, capsys):
    path, hf_model = tiny_llm_checkpoint
    text_file = tmp_path / "doc.py"
    text_file.write_text("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    out_json = tmp_path / "ppl.json"
    code = main(["--checkpoint_path", str(path), "--text", str(text_file), "--max_seq_len", "128",
                 "--device", "cpu", "--json", str(out_json)])
    assert code == 0
    record = json.loads(out_json.read_text())
    from tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    ids = torch.tensor([[tok.bos_id] + tok.encode(text_file.read_text()) + [tok.eos_ids[0]]])
    assert ids.shape[1] < 128
    with torch.no_grad():
        logits = hf_model(ids).logits.float()
    expected = math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert record["tokens"] == ids.shape[1] - 1
    assert record["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert "total:" in capsys.readouterr().out


def test_bad_arguments(tiny_llm_checkpoint, tmp_path, capsys):
    doc = tmp_path / "a.txt"
    doc.write_text("x")
    for argv, message in [
        (["--text", str(tmp_path / "missing.txt")], "does not exist"),
        (["--text", str(doc), "--stride", "64", "--max_seq_len", "64"], "--stride"),
    ]:
        assert main(["--checkpoint_path", str(tiny_llm_checkpoint[0]), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
