"""The drafter store: `current` always points at a complete version, whatever a publish was doing when it died."""

from __future__ import annotations

import json
import os

import pytest

import specdistill.models.drafter_store as store_mod
from specdistill.models.drafter_store import (
    StoreError,
    current_path,
    current_version,
    init_store,
    list_versions,
    publish_version,
    set_manifest_extra,
)
from specdistill.models.drafters import MANIFEST, load_drafter
from tests.conftest import make_tiny_llama
from tests.online.support import VOCAB, make_target, save_tiny_drafter


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture
def store(tmp_path, target):
    init_store(tmp_path / "store", save_tiny_drafter(tmp_path / "d0", target))
    return tmp_path / "store"


class Crash(Exception):
    pass


def model(seed):
    return make_tiny_llama(vocab_size=VOCAB, layers=1, seed=seed)


def test_publish_moves_current_to_a_new_complete_version(store, target):
    assert current_version(store) == "v000000"
    assert publish_version(store, model(5), target, {"seed": 5}) == "v000001"
    assert current_version(store) == "v000001" and list_versions(store) == ["v000000", "v000001"]
    assert load_drafter(str(current_path(store)), target).manifest["extra"]["version"] == "v000001"


@pytest.mark.parametrize("where", ["writing weights", "before the pointer switch"])
def test_a_publish_interrupted_halfway_leaves_current_on_a_complete_version(store, target, monkeypatch, where):
    publish_version(store, model(5), target, {"seed": 5})
    if where == "writing weights":
        def broken_save(self, *a, **k):
            (a[0] if a else k["save_directory"]).mkdir(parents=True, exist_ok=True)
            raise Crash
        monkeypatch.setattr(type(model(6)), "save_pretrained", broken_save)
    else:
        monkeypatch.setattr(store_mod, "point_current", lambda *a: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        publish_version(store, model(6), target, {"seed": 6})
    monkeypatch.undo()
    assert current_version(store) == "v000001"
    drafter = load_drafter(str(current_path(store)), target)  # loads: complete
    assert drafter.manifest["config"]["seed"] == 5
    # the next publish cleans up and never reuses a number that may have been written
    name = publish_version(store, model(7), target, {"seed": 7})
    assert current_version(store) == name and name > "v000001"
    assert not [p for p in (store / "versions").iterdir() if p.name.startswith(".")]


def test_the_pointer_switch_is_one_rename(store, target, monkeypatch):
    """No instant without `current`: os.replace of a fresh link over the old one, never unlink + link."""
    calls = []
    real_replace = os.replace
    monkeypatch.setattr(store_mod.os, "replace", lambda a, b: (calls.append((str(a), str(b))), real_replace(a, b)))
    monkeypatch.setattr(store_mod.os, "unlink", lambda *a: pytest.fail("current was unlinked"), raising=False)
    publish_version(store, model(5), target, {"seed": 5})
    assert any(b.endswith("/current") for _, b in calls)


def test_a_store_without_current_is_a_clear_error(tmp_path):
    (tmp_path / "s" / "versions").mkdir(parents=True)
    with pytest.raises(StoreError, match="no current pointer"):
        current_version(tmp_path / "s")
    with pytest.raises(StoreError, match="not a drafter directory"):
        init_store(tmp_path / "s", tmp_path / "nothing")


def test_manifest_extra_is_merged_and_the_rest_kept(store, target):
    path = current_path(store)
    before = load_drafter(str(path), target).manifest
    set_manifest_extra(path, prompt_vocab=True)
    after = load_drafter(str(path), target).manifest
    assert after["extra"] == {**(before.get("extra") or {}), "prompt_vocab": True}
    assert {k: v for k, v in after.items() if k != "extra"} == {k: v for k, v in before.items() if k != "extra"}
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temp file left
    with pytest.raises(StoreError, match="not a drafter directory"):
        set_manifest_extra(store, prompt_vocab=True)


def manifest_of(path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def test_a_published_version_drafts_on_the_weights_its_parent_names(store, target):
    publish_version(store, model(5), target, {"seed": 5})
    assert "weights" not in manifest_of(current_path(store))  # the parent names none: saved as trained
    parent = manifest_of(current_path(store)) | {"weights": "q8_0"}  # as a job from a named real target saves it
    (current_path(store) / MANIFEST).write_text(json.dumps(parent))
    publish_version(store, model(6), target, {"seed": 6})
    assert current_version(store) == "v000002" and manifest_of(current_path(store))["weights"] == "q8_0"
