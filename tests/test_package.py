"""The package: `pip install` then `import redline` from any folder, and every script in the README runs as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A script the README runs: `python scripts/convert_gguf.py ...`, `python generate.py ...`.
README_SCRIPT = re.compile(r"python3? ((?:scripts/|benchmarks/)?[a-z_]+\.py)\b")
# Modules that users of a project import as often as Redline's own top-level names.
SHADOWING_MODULES = ("model.py", "options.py", "generate.py", "kernels.py", "tokenizer.py", "quantize.py")


def clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH: the scripts must find `redline` through the installed package."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def readme_scripts() -> list[str]:
    return sorted(set(README_SCRIPT.findall((ROOT / "README.md").read_text())))


def test_the_readme_names_the_scripts_that_exist():
    scripts = readme_scripts()
    assert {"generate.py", "quantize.py", "scripts/convert_hf_checkpoint.py", "scripts/convert_gguf.py",
            "benchmarks/bench.py"} <= set(scripts)
    missing = [s for s in scripts if not (ROOT / s).is_file()]
    assert not missing, f"the README runs scripts that do not exist: {missing}"


@pytest.mark.parametrize("script", readme_scripts())
def test_every_readme_script_answers_help_as_written(script):
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


@pytest.mark.slow
def test_pip_install_gives_import_redline_from_a_folder_with_its_own_model_py(tmp_path, tiny_llm_checkpoint):
    """A fresh virtual environment (reusing this interpreter's torch through --system-site-packages), `pip install`
    of the checkout, then a user's project folder whose own model.py, options.py and generate.py would shadow bare
    imports: `from redline import LLM` still loads Redline's, and generates the same tokens as the checkout."""
    checkpoint = tiny_llm_checkpoint[0]
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    # The build runs in pip's own isolated environment (setuptools from the index), as on a user's machine.
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    project = tmp_path / "my_project"
    project.mkdir()
    for name in SHADOWING_MODULES:
        (project / name).write_text("raise ImportError('the user project module was imported')\n")
    code = (
        "import sys, redline\n"
        "from redline import LLM, GenerationOptions, GenerationResult\n"
        f"assert redline.__file__.startswith({str(env_dir)!r}), redline.__file__\n"
        f"llm = LLM.load({str(checkpoint)!r}, device='cpu')\n"
        "r = llm.generate('hello world', GenerationOptions(max_new_tokens=8, ignore_eos=True))\n"
        "assert isinstance(r, GenerationResult)\n"
        "print(' '.join(map(str, r.token_ids)))\n"
    )
    run = subprocess.run([str(python), "-c", code], cwd=project, env=clean_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    from redline import LLM

    expected = LLM.load(checkpoint, device="cpu").generate("hello world", max_new_tokens=8, ignore_eos=True)
    assert run.stdout.split() == [str(t) for t in expected.token_ids]
    commands = subprocess.run([str(env_dir / "bin" / "redline-generate"), "--help"], cwd=project, env=clean_env(),
                              capture_output=True, text=True, timeout=120)
    assert commands.returncode == 0 and commands.stdout.startswith("usage:"), commands.stderr[-2000:]


def declared_distributions(extras: tuple[str, ...]) -> set[str]:
    """Normalized names of pyproject's core dependencies and of the given extras."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {normalized(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in requirements}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def module_level_imports(path: Path) -> set[str]:
    """Top-level names imported by the module's own statements (not inside functions: those run only in a test)."""
    import ast

    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def undeclared_imports(files: list[Path], extras: tuple[str, ...]) -> dict[str, list[str]]:
    """{file: [imported distribution not declared in pyproject]} for third-party imports."""
    from importlib.metadata import packages_distributions

    local = {"redline", "conftest"} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    declared = declared_distributions(extras)
    owners = packages_distributions()
    found: dict[str, list[str]] = {}
    for path in files:
        for name in sorted(module_level_imports(path) - local - set(sys.stdlib_module_names)):
            dists = {normalized(d) for d in owners.get(name, [name])}
            if not dists & declared:
                found.setdefault(str(path.relative_to(ROOT)), []).append(name)
    return found


def test_every_test_module_imports_with_only_the_declared_test_extra():
    """`make test` on a fresh machine installs the core dependencies and the `test` extra, nothing else: a test
    module importing anything more fails there before a test runs (scipy once did)."""
    files = sorted((ROOT / "tests").glob("*.py"))
    assert len(files) > 40
    assert undeclared_imports(files, ("test",)) == {}


def test_every_module_of_the_package_imports_with_its_core_dependencies():
    """The core modules need only the core dependencies; the Triton kernels the `gpu` extra (they are imported only
    where Triton is); the benchmarks the `test` extra."""
    core = [*ROOT.glob("*.py"), *[p for folder in ("engine", "scripts", "kernels") for p in (ROOT / folder).glob("*.py")]]
    kernels = [p for p in core if p.parent.name == "kernels" and p.name.startswith("triton_")]
    assert len(kernels) >= 5
    assert undeclared_imports([p for p in core if p not in kernels], ()) == {}
    assert undeclared_imports(kernels, ("gpu",)) == {}
    assert undeclared_imports(sorted((ROOT / "benchmarks").glob("*.py")), ("test",)) == {}
