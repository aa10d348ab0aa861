"""Our feature drafters as llama.cpp's GGUFs, converted by llama.cpp's own `convert_hf_to_gguf.py`:

- kind eagle3: the speculators export (models.export), served with `--spec-type draft-eagle3`;
- kind dflash: the z-lab/DSpark-style checkpoint (models.export_dflash), served with `--spec-type draft-dflash`.

Each export carries the target's config and tokenizer in its target/ folder, which the converter reads through
--target-model-dir. The GGUF is cached under the cache root's llamacpp/ folder, named by the kind and a digest of the
drafter's files, the converter's sources and the output type: each drafter converts once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
# llama.cpp's converter (default: the tree make llamacpp unpacked, whose binaries we run: its GGUF is theirs)
CONVERTER_ENV = "SPECDISTILL_LLAMACPP_CONVERTER"
# the converted drafter's weights: f32, so that llama.cpp drafts with the weights we trained and the peer measures its
# runtime, not a rounding (SmolLM2's features reach 2.5e4, which an f16 copy of the activations keeps to 3 digits)
OUTTYPE = "f32"
KINDS = ("eagle3", "dflash")


class LlamacppNotBuiltError(FileNotFoundError):
    """llama.cpp is not built here (`make llamacpp`), or SPECDISTILL_LLAMACPP_BIN names a folder without it."""


def converter_script() -> Path:
    """llama.cpp's convert_hf_to_gguf.py, or LlamacppNotBuiltError saying where it is expected."""
    script = Path(os.environ.get(CONVERTER_ENV) or ROOT / ".llamacpp" / "src" / "convert_hf_to_gguf.py")
    if not script.is_file():
        raise LlamacppNotBuiltError(f"llama.cpp's converter {script} does not exist: run `make llamacpp`, or set "
                                    f"${CONVERTER_ENV} to a convert_hf_to_gguf.py")
    return script


def files_digest(paths: Iterable[Path], root: Path) -> str:
    """sha256 over each file's path relative to `root` and its bytes, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def gguf_cache_key(drafter_dir: Path, script: Path, outtype: str = OUTTYPE) -> str:
    """What the converted GGUF depends on: the drafter's files (manifest and weights), the converter's sources (the
    script and its conversion/ package) and the output type."""
    drafter_dir, tree = Path(drafter_dir), script.parent
    drafter = files_digest([p for p in drafter_dir.rglob("*") if p.is_file()], drafter_dir)
    converter = files_digest([script, *(tree / "conversion").glob("*.py")], tree)
    return hashlib.sha256(f"{drafter} {converter} {outtype}".encode()).hexdigest()[:24]


def convert_command(script: Path, export: Path, out: Path, outtype: str = OUTTYPE) -> list[str]:
    """llama.cpp's converter on an export, the target's config and tokenizer from the export's own target/ folder
    (the converter refuses an EAGLE-3 or DFlash drafter without them)."""
    from specdistill.models.export import TARGET_DIR

    return [sys.executable, str(script), str(export), "--target-model-dir", str(export / TARGET_DIR),
            "--outfile", str(out), "--outtype", outtype]


def check_converter_modules() -> None:
    """The converter imports sentencepiece before it looks for a tokenizer.model, so without the module it fails
    even on a BPE tokenizer (its requirements list it; ours do not need it otherwise)."""
    if importlib.util.find_spec("sentencepiece") is None:
        raise RuntimeError("llama.cpp's convert_hf_to_gguf.py needs the sentencepiece module (its requirements list "
                           f"it): `{sys.executable} -m pip install 'sentencepiece>=0.1.98,<0.3'`")


def export_for_llamacpp(kind: str, drafter_dir: Path, out: Path, target) -> Path:
    """The drafter in the checkpoint format llama.cpp's converter reads for its kind."""
    if kind == "eagle3":
        from specdistill.models.export import export_speculators

        return export_speculators(drafter_dir, out, target)
    if kind == "dflash":
        from specdistill.models.export_dflash import export_dflash

        return export_dflash(drafter_dir, out, target)
    raise ValueError(f"{drafter_dir}: llama.cpp runs our drafters of kinds {KINDS}, not {kind!r}")


def drafter_gguf(drafter_dir: str | Path, target, kind: str = "eagle3") -> Path:
    """The `kind` drafter at `drafter_dir` (aligned to `target`) as a GGUF llama-server loads with --spec-type
    draft-<kind>: exported, converted by llama.cpp's converter and cached under its content's key, so it converts
    once. A RuntimeError says why the converter failed (its last lines); LlamacppNotBuiltError without it."""
    from specdistill.models.cache import cache_root

    script, drafter_dir = converter_script(), Path(drafter_dir)
    final = cache_root() / "llamacpp" / f"{kind}-{gguf_cache_key(drafter_dir, script)}.gguf"
    if final.is_file():
        return final
    check_converter_modules()
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{kind}-", dir=final.parent) as work:
        export = export_for_llamacpp(kind, drafter_dir, Path(work) / "export", target)
        out, command = Path(work) / final.name, convert_command(script, export, Path(work) / final.name)
        log.info("converting %s with llama.cpp's converter: %s", drafter_dir, " ".join(command))
        done = subprocess.run(command, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-6:])
            raise RuntimeError(f"llama.cpp's converter failed on the export of {drafter_dir} (status "
                               f"{done.returncode}; {' '.join(command)}): {tail}")
        os.replace(out, final)
    return final
