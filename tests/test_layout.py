"""The import direction of DESIGN.md, checked on the source with `ast`:

    models <- decode, models <- distill, everything <- train; decode and distill never import each other;
    only train/ (and scripts/, tests/) import accelerate, deepspeed or wandb.

Static imports, relative imports (resolved against the file's package) and literal
importlib.import_module("...") / __import__("...") calls all count, at any depth (inside functions too).
"""

from __future__ import annotations

import ast
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
    "scripts": set(),
    "tests": set(),
}


def module_name(path: Path, root: Path) -> str:
    """tests/decode/test_x.py -> "tests.decode.test_x"; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module the source imports."""
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


def test_the_check_sees_the_packages():
    """Guard against a vacuous pass: the walk finds files in each package that exists."""
    areas = {p.relative_to(ROOT).parts[0] for p in project_files()}
    assert {"models", "decode"} <= areas
    assert all(area in areas for area in PACKAGES if (ROOT / area).is_dir())


SNIPPET = """
import os
import torch
from models.target import load_target
from . import tree
from ..models import drafters
from .. import train

def later():
    import wandb
    importlib.import_module("distill.losses")
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
    assert violations(SNIPPET, "scripts.bench") == []


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
    from train.config import load_config
    from train.distill_config import DistillConfig
    from train.online_config import OnlineConfig
    cls = DistillConfig if path.parent.name == "distill" else OnlineConfig
    cfg = load_config(cls, ["--config", str(path)])
    assert isinstance(cfg, cls)
