"""The layers import one way only: generate.py (LLM) over engine/ over runner/. An import inside
`if TYPE_CHECKING:` names a type and runs nothing, so it does not count; an import inside a function does."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"generate": 2, "engine": 1, "runner": 0}  # a layer may import only layers below it


def layer(module: str) -> str | None:
    """The layer of a module named redline.X[.Y], or None outside the three."""
    parts = module.split(".")
    if parts[0] != "redline" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def imports(path: Path) -> set[str]:
    """Modules path imports at run time (anywhere but an `if TYPE_CHECKING:` block)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
               for child in node.body for n in ast.walk(child)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def layer_files() -> dict[str, list[Path]]:
    return {"generate": [ROOT / "generate.py"], "engine": sorted((ROOT / "engine").glob("*.py")),
            "runner": sorted((ROOT / "runner").glob("*.py"))}


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for name, files in layer_files().items():
        for path in files:
            for module in imports(path):
                target = layer(module)
                if target is not None and target != name and LAYERS[target] > LAYERS[name]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, wrong


def test_the_check_sees_a_wrong_way_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from redline.generate import LLM\n"
                   "def f():\n    from redline.engine import Engine\n")
    assert {layer(m) for m in imports(bad)} - {None} == {"engine"}
