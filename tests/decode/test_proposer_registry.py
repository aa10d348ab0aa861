"""The drafter-kind registry of decode.proposers: a kind is one module that registers its builder, and
kind modules import base (or the kinds they build on), never the package, so there is no circle to dodge."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import specdistill.decode.proposers.base as base
from specdistill.decode.proposers import PromptLookupProposer, WithPromptLookup, build_proposer
from tests.test_layout import ROOT, imported_modules

KIND_MODULES = sorted(p for p in (ROOT / "decode" / "proposers").glob("*.py") if p.stem not in ("__init__", "base"))


def test_a_registered_kind_is_built_and_wrapped_like_the_shipped_ones(tiny_target, monkeypatch):
    built = PromptLookupProposer(num_tokens=2)
    monkeypatch.setitem(base._BUILDERS, "echo", lambda drafter, target, gamma, eos, **kw: built)
    assert build_proposer(SimpleNamespace(kind="echo"), tiny_target) is built
    wrapped = build_proposer(SimpleNamespace(kind="echo", with_lookup=True), tiny_target, gamma=3)
    assert isinstance(wrapped, WithPromptLookup) and wrapped.inner is built
    assert wrapped.lookup.num_tokens == 6  # the +prompt_lookup chain: 2 x gamma


def test_an_unknown_kind_names_itself_and_the_registered_kinds_sorted(tiny_target):
    with pytest.raises(ValueError, match=r"'crystal_ball' \(known: dflash, draft_model, eagle3, ensemble, lookahead, "
                                         r"medusa, prompt_lookup\)"):
        build_proposer(SimpleNamespace(kind="crystal_ball"), tiny_target)


@pytest.mark.parametrize("path", KIND_MODULES, ids=lambda p: p.stem)
def test_kind_modules_import_base_not_the_package_and_only_at_the_top(path: Path):
    source = path.read_text(encoding="utf-8")
    imported = imported_modules(source, f"decode.proposers.{path.stem}")
    assert "decode.proposers.base" in imported and "decode.proposers" not in imported
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    nested = [node.lineno for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level]
    assert not nested, f"{path.name}: imports inside functions at lines {nested}"


def test_every_kind_module_registers_its_kind():
    assert sorted(base._BUILDERS) == sorted(p.stem for p in KIND_MODULES)
