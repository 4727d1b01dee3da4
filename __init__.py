"""Redline: a PyTorch-native LLM text-generation engine.

    from redline import LLM, GenerationOptions
    llm = LLM.load("checkpoints/smollm2/float32/model.safetensors")
    print(llm.generate("The capital of France is", max_new_tokens=16).text)

The repository root is this package (pyproject.toml maps `redline` to it), so `generate.py`, `model.py` and the
rest are `redline.generate`, `redline.model`, ... once installed with `pip install -e .` or `pip install .`.
The public names below are imported on first use, so `import redline` alone loads nothing heavy.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# Public name -> the module that defines it.
_PUBLIC = {
    "LLM": "redline.generate",
    "EngineConfig": "redline.options",
    "GenerationOptions": "redline.options",
    "GenerationResult": "redline.options",
    "GenerationStats": "redline.options",
    "ModelArgs": "redline.model",
    "Transformer": "redline.model",
    "Tokenizer": "redline.tokenizer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'redline' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
