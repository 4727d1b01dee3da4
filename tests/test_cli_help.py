"""Every command-line tool: --help explains every flag with its default, and a usage error is one line, status 2."""
from __future__ import annotations

import importlib
import re

import pytest

CLIS = ["redline.generate", "redline.quantize", "redline.scripts.convert_hf_checkpoint", "redline.scripts.convert_gguf",
        "redline.scripts.perplexity", "redline.scripts.trace_summary", "redline.scripts.demo_model",
        "redline.scripts.download", "redline.serve"]


def help_text(module: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def option_blocks(text: str) -> dict[str, str]:
    """Each option's help block (its flag line and the indented lines after it), by flag name."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(2)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("module", CLIS)
def test_help_explains_every_flag_with_its_default(module, capsys):
    text = help_text(module, capsys)
    usage = text.split("\n\n", 1)[0]
    blocks = option_blocks(text)
    assert blocks
    for flag, block in blocks.items():
        if flag == "--help":
            continue
        described = re.sub(r"^\s*(-\w, )?--[\w-]+(( [A-Z_.,=]+)|(, --no-[\w-]+))?", "", block).strip()
        assert described, f"{module} {flag} has no help"
        required = re.search(rf"(?<!\[){flag}\b", usage) is not None
        assert "default" in block.lower() or required, f"{module} {flag} does not show its default: {block!r}"


def test_generate_help_states_the_sampling_defaults(capsys):
    blocks = option_blocks(help_text("redline.generate", capsys))
    assert "default: 0.8" in blocks["--temperature"] and "default: 200" in blocks["--top_k"]


@pytest.mark.parametrize("module", [m for m in CLIS if m != "redline.scripts.download"])
def test_a_usage_error_is_one_line_and_status_2(module, capsys):
    assert importlib.import_module(module).main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "see --help" in err


@pytest.mark.parametrize("module", CLIS)
def test_help_describes_the_tool_in_whole_sentences(module, capsys):
    text = help_text(module, capsys)
    description = " ".join(text.split("\n\n")[1].split())
    assert description.endswith((".", ".)")) and description[0].isupper(), description


def test_gguf_help_names_every_supported_architecture(capsys):
    from redline.scripts.convert_gguf import SUPPORTED_ARCHITECTURES

    text = " ".join(help_text("redline.scripts.convert_gguf", capsys).split())
    assert "llama architecture" not in text
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in text, arch
