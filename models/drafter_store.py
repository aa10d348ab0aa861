"""A versioned drafter store: immutable version directories and an atomically switched `current`.

    STORE/
      versions/v000000/   a complete drafter directory (models.drafters format)
      versions/v000001/
      current -> versions/v000001    a relative symlink, replaced with one rename

Writers (the online daemon) publish a new version as a temp directory renamed into place, then
repoint `current` by renaming a fresh symlink over it: both renames are atomic on POSIX, so a reader
(the server) that resolves `current` always lands on a complete version, whatever instant a crash
hits the writer. Versions are never modified after publishing; the server keeps serving in-flight
requests with the version they started on while new requests pick up the new one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from specdistill.models.drafters import MANIFEST, read_manifest, save_drafter
from specdistill.models.target import Target

log = logging.getLogger("specdistill.store")

VERSIONS = "versions"
CURRENT = "current"
_VERSION_RE = re.compile(r"^v(\d{6})$")


class StoreError(ValueError):
    pass


def is_store(path: str | Path) -> bool:
    return (Path(path) / VERSIONS).is_dir()


def version_name(number: int) -> str:
    return f"v{number:06d}"


def list_versions(store: str | Path) -> list[str]:
    """Complete version directories (with a manifest), oldest first."""
    root = Path(store) / VERSIONS
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if _VERSION_RE.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(names)


def current_version(store: str | Path) -> str:
    """The name of the version `current` points at."""
    link = Path(store) / CURRENT
    if not link.is_symlink():
        raise StoreError(f"{store} has no {CURRENT} pointer: initialise it with init_store (or "
                         f"`python -m train.online --init-store`)")
    name = Path(os.readlink(link)).name
    if not (Path(store) / VERSIONS / name / MANIFEST).is_file():
        raise StoreError(f"{link} points at {name}, which is not a complete drafter version")
    return name


def current_path(store: str | Path) -> Path:
    return version_path(store, current_version(store))


def version_path(store: str | Path, name: str) -> Path:
    return Path(store).absolute() / VERSIONS / name


def init_store(store: str | Path, drafter_dir: str | Path) -> str:
    """Create STORE with `drafter_dir` (a drafter directory) copied in as version 0 and made current.
    An existing store is left as it is (its current version is returned)."""
    store = Path(store)
    if (store / CURRENT).is_symlink():
        return current_version(store)
    source = Path(drafter_dir)
    if not (source / MANIFEST).is_file():
        raise StoreError(f"{source} is not a drafter directory (no {MANIFEST}); train one with train/distill.py")
    name = version_name(0)
    dest = store / VERSIONS / name
    if not dest.exists():
        tmp = store / VERSIONS / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        tmp.rename(dest)
    point_current(store, name)
    return name


def set_manifest_extra(drafter_dir: str | Path, **fields) -> dict:
    """Merge `fields` into a drafter directory's manifest `extra` (e.g. prompt_vocab=True for a version about
    to be served), replacing the file atomically; returns the new manifest. Weights are not touched."""
    path = Path(drafter_dir) / MANIFEST
    if not path.is_file():
        raise StoreError(f"{drafter_dir} is not a drafter directory (no {MANIFEST})")
    manifest = json.loads(path.read_text())
    manifest["extra"] = {**(manifest.get("extra") or {}), **fields}
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return manifest


def next_version_number(store: str | Path) -> int:
    """One past the highest version ever written (complete or not), so a number is never reused."""
    root = Path(store) / VERSIONS
    numbers = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION_RE.match(p.name.strip(".").split(".")[0]))]
    return max(numbers, default=-1) + 1


def publish_version(store: str | Path, model: torch.nn.Module, target: Target, config: dict,
                    vocab_map: torch.Tensor | None = None, extra: dict | None = None) -> str:
    """Write the model as the next version (atomic directory) and switch `current` to it (atomic link). The
    version drafts on the weights the current one names (its manifest's `weights`, e.g. "q8_0" for a drafter
    started from a named real target): a version the daemon trained is the same kind of model as its parent."""
    store = Path(store)
    if not is_store(store):
        raise StoreError(f"{store} is not a drafter store (no {VERSIONS}/ directory)")
    clean_partial_versions(store)
    name = version_name(next_version_number(store))
    save_drafter(store / VERSIONS / name, model, target, "draft_model", config=config, vocab_map=vocab_map,
                 extra={"version": name, **(extra or {})}, weights=current_weights(store))
    point_current(store, name)
    log.info("published drafter version %s", name)
    return name


def current_weights(store: Path) -> str | None:
    """The `weights` the current version's manifest names (None: none, or no current version yet)."""
    if not (store / CURRENT).is_symlink():
        return None
    return read_manifest(current_path(store)).get("weights")


def point_current(store: Path, name: str) -> None:
    """Repoint STORE/current at versions/NAME with one rename (readers never see it missing)."""
    tmp = store / f".{CURRENT}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(Path(VERSIONS) / name, tmp)
    os.replace(tmp, store / CURRENT)
    fsync_dir(store)


def clean_partial_versions(store: Path) -> None:
    """Remove what an interrupted publish left: temp directories and stale link temps."""
    for p in (store / VERSIONS).iterdir():
        if p.name.startswith(".") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    for p in store.glob(f".{CURRENT}.*.tmp"):
        p.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
