"""The import direction of DESIGN.md, checked on the source with `ast`:

    models <- decode, models <- distill, everything <- train; decode and distill never import each other;
    only train/ (and benchmarks/, tests/) import accelerate, deepspeed or wandb.

and the tree's shape: scripts/ gone (or holding only what the README names), no Python file over 600 lines, no C
source inside a Python string, the vLLM worker free of the project's imports.

Static imports, relative imports (resolved against the file's package) and literal
importlib.import_module("...") / __import__("...") calls all count, at any depth (inside functions too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "decode", "distill", "train")
LAUNCHERS = ("accelerate", "deepspeed", "wandb")  # process-level tools: entrypoints only

FORBIDDEN: dict[str, set[str]] = {
    "models": {"decode", "distill", "train", *LAUNCHERS},
    "decode": {"distill", "train", *LAUNCHERS},
    "distill": {"decode", "train", *LAUNCHERS},
    "train": set(),
    "benchmarks": set(),
    "tests": set(),
}


def module_name(path: Path, root: Path) -> str:
    """tests/decode/test_x.py -> "tests.decode.test_x"; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


NAMESPACE = "specdistill."  # the installed name of the four packages (pyproject's package-dir)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module the source imports, the namespace taken off (specdistill.models.x ->
    models.x), so the rules below read the layout's folder names."""
    return {name.removeprefix(NAMESPACE) for name in raw_imports(source, module, is_package)}


def raw_imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module the source imports, as written."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(node, package)
            if node.module:
                found.add(base)
            else:  # `from . import tree` imports modules: decode.tree; `from .. import train` is train itself
                found.update(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and dynamic_import_target(node):
            found.add(dynamic_import_target(node))
    return found


def resolve_from(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    base = package.split(".") if package else []
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def dynamic_import_target(call: ast.Call) -> str | None:
    """The literal module name of importlib.import_module("x") or __import__("x"), else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that break the layout rules ([] when it follows them)."""
    area = module.split(".")[0]
    forbidden = FORBIDDEN.get(area, set())
    return sorted(name for name in imported_modules(source, module, is_package)
                  if name.split(".")[0] in forbidden)


def project_files() -> list[Path]:
    files = []
    for area in FORBIDDEN:
        if (ROOT / area).is_dir():
            files += sorted(p for p in (ROOT / area).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def test_every_package_respects_the_import_direction():
    broken = {}
    for path in project_files():
        found = violations(path.read_text(encoding="utf-8"), module_name(path, ROOT), path.name == "__init__.py")
        if found:
            broken[str(path.relative_to(ROOT))] = found
    assert not broken, f"imports against DESIGN.md's direction: {broken}"


def test_the_projects_own_packages_are_imported_under_the_namespace_only():
    """`import models` would find another project's `models` in site-packages (or none): the four packages are
    installed as specdistill.models, specdistill.decode, ... and imported so everywhere, tests included."""
    bare = {}
    for path in project_files() + sorted((ROOT / "specdistill").rglob("*.py")):
        module = NAMESPACE + module_name(path, ROOT) if path.parts[-2] != "tests" else module_name(path, ROOT)
        found = sorted(name for name in raw_imports(path.read_text(encoding="utf-8"), module,
                                                     path.name == "__init__.py")
                       if name.split(".")[0] in PACKAGES)
        if found:
            bare[str(path.relative_to(ROOT))] = found
    assert not bare, f"imports of the project's packages without the namespace: {bare}"


def test_the_check_sees_the_packages():
    """Guard against a vacuous pass: the walk finds files in each package that exists."""
    areas = {p.relative_to(ROOT).parts[0] for p in project_files()}
    assert {"models", "decode"} <= areas
    assert all(area in areas for area in PACKAGES if (ROOT / area).is_dir())


SNIPPET = """
import os
import torch
from specdistill.models.target import load_target
from . import tree
from ..models import drafters
from .. import train

def later():
    import wandb
    importlib.import_module("specdistill.distill.losses")
    __import__("accelerate")
"""


def test_checker_flags_every_kind_of_forbidden_import():
    found = violations(SNIPPET, "decode.evaluate")
    assert found == ["accelerate", "distill.losses", "train", "wandb"]
    assert violations(SNIPPET, "models.x") == ["accelerate", "distill.losses", "train", "wandb"]
    assert violations("from decode.engine import SpeculativeEngine", "models.x") == ["decode.engine"]
    assert violations("import decode", "distill.losses") == ["decode"]
    assert violations("from models.target import Target\nimport torch", "distill.losses") == []
    assert violations(SNIPPET, "train.entry") == []
    assert violations(SNIPPET, "benchmarks.bench") == []


@pytest.mark.parametrize("source, module, is_package, expected", [
    ("from . import engine", "decode.evaluate", False, {"decode.engine"}),
    ("from .engine import x", "decode.evaluate", False, {"decode.engine"}),
    ("from . import engine", "decode", True, {"decode.engine"}),
    ("from ..models import target", "decode.sub.mod", False, {"decode.models"}),
    ("from ...models import target", "decode.sub.mod", False, {"models"}),
    ("from .. import train", "decode.evaluate", False, {"train"}),
])
def test_relative_imports_resolve_against_the_package(source, module, is_package, expected):
    assert imported_modules(source, module, is_package) == expected


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "distill").glob("*.yaml")) +
                         sorted((ROOT / "configs" / "online").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_job_config_parses(path):
    from specdistill.train.config import load_config
    from specdistill.train.distill_config import DistillConfig
    from specdistill.train.online_config import OnlineConfig
    cls = DistillConfig if path.parent.name == "distill" else OnlineConfig
    cfg = load_config(cls, ["--config", str(path)])
    assert isinstance(cfg, cls)


# ---- the tree's shape ------------------------------------------------------------------------------------------

MAX_LINES = 600
TOO_LONG_ALLOWED: set[str] = set()  # a file allowed past MAX_LINES, with the reason beside it
C_SOURCE = re.compile(r"#\s*include\s*[<\"]|\b_mm(256|512)?_\w+\(|\b__m(256|512)i?\b")  # C headers, SIMD intrinsics


def python_files() -> list[Path]:
    """The project's Python files: not the virtual environments, runs, builds or llama.cpp's tree (`make llamacpp`
    puts it in .llamacpp)."""
    skip = {".venv", ".venv-vllm", ".llamacpp", "runs", ".git", "__pycache__", "build"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts))


def strings_with_c_source(source: str) -> list[str]:
    """The string constants of `source` that hold C (an #include, SIMD intrinsics or their vector types)."""
    return [node.value[:60] for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and C_SOURCE.search(node.value)]


def test_scripts_is_gone_or_holds_only_what_the_readme_names():
    scripts = ROOT / "scripts"
    if not scripts.is_dir():
        return
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    unnamed = [p.name for p in scripts.rglob("*") if p.is_file() and "__pycache__" not in p.parts
               and f"scripts/{p.relative_to(scripts)}" not in readme]
    assert not unnamed, f"scripts/ holds files the README does not name: {unnamed}"


def test_no_python_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not set(long) - TOO_LONG_ALLOWED, f"over {MAX_LINES} lines (split them): {long}"


def test_no_c_source_inside_python_strings():
    """Native code lives in source files with a build path (models/kernels/csrc), never in a Python string."""
    found = {}
    for path in python_files():
        if path.parts[len(ROOT.parts)] == "tests":  # tests may hold snippets of C to test the checks themselves
            continue
        if hits := strings_with_c_source(path.read_text(encoding="utf-8")):
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"C source inside Python strings: {found}"


def test_the_c_check_sees_c():
    include = "#" + "include <immintrin.h>"
    assert strings_with_c_source(f"SRC = {include!r}")
    assert strings_with_c_source('SRC = """float f(__m512 x) { return 0; }"""')
    assert strings_with_c_source("SRC = 'y = _mm512_fmadd_ps(a, b, c);'")
    assert not strings_with_c_source("# include <stdio.h> in a comment\nx = 'an include of headers'")


def test_the_vllm_worker_imports_nothing_of_the_project():
    """It runs by path inside .venv-vllm (models/vllm_env.WORKER), where this project is not installed."""
    from specdistill.models.vllm_env import WORKER

    path = ROOT / "models" / "vllm_worker.py"
    assert WORKER == path and path.is_file()
    imported = imported_modules(path.read_text(encoding="utf-8"), "vllm_worker")
    assert not {name.split(".")[0] for name in imported} & {*PACKAGES, "benchmarks", "tests"}
