"""The shipped demo model (checkpoints/redline/tiny-python) and the README's first command."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from checkpoint import read_checkpoint_info
from quantize import load_model
from scripts.convert_hf_checkpoint import convert_hf_checkpoint
from scripts.perplexity import main as perplexity_main

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "checkpoints" / "redline" / "tiny-python"
# Held-out perplexity bound for the demo model, per token; its vocabulary has 8192 tokens, and the trained model
# scores about 23-25 on the whole held-out set (recipe.json, BENCHMARKS.md).
HELDOUT_PPL_BOUND = 40.0
# A few held-out files (never trained on), small enough for a CPU test.
HELDOUT_SAMPLE = ("codeop.py", "netrc.py", "multiprocessing/context.py", "asyncio/base_tasks.py")


@pytest.fixture(scope="module")
def demo_fp32(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model.safetensors"
    path = convert_hf_checkpoint(DEMO, out, dtype="float32")
    shutil.copy(DEMO / "tokenizer.model", out.parent / "tokenizer.model")
    return path


def test_demo_recipe_records_how_it_was_made():
    recipe = json.loads((DEMO / "recipe.json").read_text())
    assert recipe["training"]["tokens_seen"] > 10_000_000
    assert recipe["results"]["heldout_ppl"] < HELDOUT_PPL_BOUND
    assert (DEMO / "model.safetensors").stat().st_size <= 20_000_000


def test_demo_converts_and_matches_hf_logits(demo_fp32):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    model = load_model(read_checkpoint_info(demo_fp32), "cpu", torch.float32)
    ids = torch.randint(3, 8192, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.setup_caches(1, 64)
        diff = (model(ids, torch.arange(64)) - hf(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4


def test_demo_heldout_perplexity_is_below_the_bound(demo_fp32, tmp_path, capsys):
    recipe = json.loads((DEMO / "recipe.json").read_text())
    held_out = set(recipe["data"]["heldout_files"])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in HELDOUT_SAMPLE if name in held_out and (stdlib / name).is_file()]
    assert len(files) >= 3, "the held-out sample files should exist in any CPython 3.11+ standard library"
    out = tmp_path / "ppl.json"
    assert perplexity_main(["--checkpoint_path", str(demo_fp32), "--text", *map(str, files), "--max_seq_len", "512",
                            "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] > 3000
    assert result["perplexity"] < HELDOUT_PPL_BOUND


def test_readme_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:lines.index("```bash") + 3]
    assert block[0].startswith("make demo") and block[1].startswith("make test")


def test_make_demo_works_on_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or shutil.which("make") is None or not (REPO / ".git").exists():
        pytest.skip("needs git, make and a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True)
    # The install step is what `make test` already ran; skip it so the clone does not re-point the editable install.
    run = subprocess.run(["make", "-s", "demo", f"PYTHON={sys.executable}", "SKIP_SETUP=1"], cwd=clone,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[1].startswith("def fibonacci(n):")
    assert "decode" in run.stderr and "tok/s" in run.stderr
