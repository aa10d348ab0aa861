"""The on-disk cache (converted targets) and atomic directory writes.

Every directory this package writes (a cached target, a drafter) is built in a temporary sibling and
renamed into place, so a reader never sees a half-written one. Cached targets also carry a completion
marker: a directory without it is never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

log = logging.getLogger(__name__)

CACHE_ENV = "SPECDISTILL_CACHE"
MARKER = "COMPLETE.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class CacheCorruptError(RuntimeError):
    """A cache directory that claims to be complete but cannot be used."""


def cache_root() -> Path:
    """$SPECDISTILL_CACHE, or ~/.cache/specdistill."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdistill"


def make_temp_sibling(final: Path) -> Path:
    """A fresh empty directory next to `final` (same filesystem, so os.replace is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the published directory should not be
    return tmp


def publish_dir(tmp: Path, final: Path) -> Path:
    """Move the finished directory `tmp` to `final`, replacing any directory already there.

    os.replace cannot overwrite a non-empty directory, so an old `final` is first renamed to a backup
    sibling (atomic), the new one renamed into place, then the backup deleted: at every instant `final`
    is either the complete old directory, absent for one rename, or the complete new one."""
    backup = None
    if final.exists():
        backup = final.parent / f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.replace(final, backup)
    try:
        os.replace(tmp, final)
    except OSError:
        if backup is not None and not final.exists():
            os.replace(backup, final)  # put the old one back rather than leave nothing
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    return final


def write_marker(directory: Path, info: dict) -> None:
    (directory / MARKER).write_text(json.dumps({**info, "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                                               indent=2))


def has_marker(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def check_cached_model(directory: Path) -> None:
    """Raise CacheCorruptError unless `directory` is a complete cached HF model + tokenizer."""
    fix = f"delete {directory} and load again to rebuild it"
    if not has_marker(directory):
        raise CacheCorruptError(f"cache directory {directory} has no {MARKER} marker (an interrupted build?); {fix}")
    missing = [name for name in ("config.json", *_TOKENIZER_FILES) if not (directory / name).is_file()]
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        missing.append("*.safetensors")
    if missing:
        raise CacheCorruptError(f"cache directory {directory} is missing {', '.join(missing)}; {fix}")
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise CacheCorruptError(f"cannot read {file} ({err}); {fix}") from err


def remove_incomplete(directory: Path) -> None:
    """Move aside and delete a directory left without a marker (never used as is)."""
    log.warning("removing incomplete cache directory %s (no %s marker)", directory, MARKER)
    doomed = directory.parent / f".{directory.name}.incomplete-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.replace(directory, doomed)
    except FileNotFoundError:
        return  # another process got there first
    shutil.rmtree(doomed, ignore_errors=True)
