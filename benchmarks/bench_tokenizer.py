"""A byte-level BPE tokenizer trained on this repository's own text, so that random weights can be served with a
tokenizer (structured output needs one to compile grammars) on a machine that cannot download one.

    python benchmarks/bench_tokenizer.py --out /tmp/bench-tokenizer --vocab-size 32000
    python serve.py --random-weights Llama-3-8B --dtype bfloat16 --tokenizer /tmp/bench-tokenizer

The vocabulary reaches --vocab-size where the text has enough distinct pieces (a few MB of code and prose give tens of
thousands); a grammar's token mask is then computed over a real-sized token trie, as with a checkpoint's tokenizer.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from redline.checkpoint import write_atomically

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".md", ".txt", ".sh", ".toml", ".html", ".cpp", ".jinja")


def repository_lines(root: Path) -> Iterator[str]:
    for path in sorted(root.rglob("*")):
        if path.suffix in SUFFIXES and path.is_file() and ".git" not in path.parts:
            yield from path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)


def train(out: Path, vocab_size: int, root: Path = REPO) -> int:
    """Train, write tokenizer.json and tokenizer_config.json into out; returns the vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(repository_lines(root), trainer)
    out.mkdir(parents=True, exist_ok=True)
    text = tokenizer.to_str()
    write_atomically(out / "tokenizer.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    config = json.dumps({"bos_token": "<|begin|>", "eos_token": "<|end|>"})
    write_atomically(out / "tokenizer_config.json", lambda tmp: Path(tmp).write_text(config, encoding="utf-8"))
    return tokenizer.get_vocab_size()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train a benchmark tokenizer on this repository's text.")
    p.add_argument("--out", type=Path, required=True, help="the folder to write tokenizer.json into")
    p.add_argument("--vocab-size", type=int, default=32000)
    ns = p.parse_args(argv)
    if ns.vocab_size < 300:
        print(f"error: --vocab-size must be at least 300 (the bytes and the specials), got {ns.vocab_size}",
              file=sys.stderr)
        return 2
    print(f"{train(ns.out, ns.vocab_size)} tokens in {ns.out / 'tokenizer.json'}")
    return 0


if __name__ == "__main__":
    from redline.benchmarks.bench_tokenizer import main as package_main

    sys.exit(package_main())
