"""Building, caching and loading the CPU kernel library (models/kernels/csrc).

Build path: torch's own `cpp_extension.load` (ninja, the compiler and flags torch's ABI needs) compiles the
sources into a private temporary directory in a child process (`python -m models.kernels.build DIR`), which also
imports the result once; the finished library is then moved into the cache with one rename and its sha256 recorded
beside it. A build that fails or is killed leaves only its temporary directory, which is removed.

Flavours (`FLAVOURS`, `flavour_for`): "avx512" (the sources as written, AVX512-VNNI and AMX parts behind function
targets) on a CPU with avx512f; "avx2" on one with AVX2, FMA and F16C but no AVX-512: the same sources compiled
against SIMDe's AVX-512 intrinsics (the `simde-py` package's headers) with exact AVX2 integer dot products
(csrc/avx2_isa.h), native AVX2 loops where SIMDe's emulation is too slow (csrc/*_avx2.h) and no AMX forms.
$SPECDISTILL_KERNEL_ISA=avx2 builds and loads the AVX2 flavour on an AVX-512 CPU too (comparisons).

Cache: `$SPECDISTILL_CACHE/kernels/cpu-<flavour>-<digest>/`, the digest over the sources, the flavour's flags (and
SIMDe's version), torch's and Python's versions: an edited kernel is built anew, never loaded stale. Before loading,
the directory and both files must be owned by this user and writable by no one else, and the library's sha256 must
be the one recorded when it was built; anything else is refused (logged as a WARNING) and the library rebuilt. A
directory this user does not own is never built into: that is an error, not a rebuild.

Threads: `-fopenmp` for the kernels' `#pragma omp`; the library's NEEDED entry is libgomp.so.1, the soname of the
copy bundled with torch, which is already loaded when the library is, so the loader binds to torch's runtime and
there is one OpenMP thread pool in the process (tests check /proc/self/maps).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "gemm_fma.cpp", "row_ops.cpp", "gemm_amx.cpp", "int8.cpp", "kquant.cpp",
           "kquant_amx.cpp")
HEADERS = ("cpu_kernels.h", "avx2_isa.h", "kquant_avx2.h", "gemm_fma_avx2.h", "attention_avx2.h",
           "q8_0_avx2.h", "int8_avx2.h")
MODULE_NAME = "specdistill_cpu_kernels"
ISA_ENV = "SPECDISTILL_KERNEL_ISA"  # "avx2": the AVX2 flavour even where the CPU has AVX-512
# -ffp-contract=off: the weights are rebuilt as q * d, rounded, + m, rounded, as they were dequantized; a fused
# multiply-add would round once and give weights one ulp off the model's.
FLAVOURS = {
    "avx512": ("-O3", "-mavx512f", "-mfma", "-ffp-contract=off", "-fopenmp"),
    "avx2": ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-DSPECDISTILL_AVX2"),
}
FLAVOUR_FLAGS = {"avx512": ("avx512f",), "avx2": ("avx2", "fma", "f16c")}  # what each needs of /proc/cpuinfo
LDFLAGS = ("-fopenmp",)
LIBRARY = f"{MODULE_NAME}.so"
RECORD = "record.json"
BUILD_TIMEOUT_S = 900


class RefusedCache(RuntimeError):
    """A cached library that must not be loaded (owner, permissions or content hash)."""


def flavour_for(cpu_flags: frozenset[str] | set[str], requested: str = "") -> tuple[str | None, str | None]:
    """(flavour, None) for a CPU with these flags, or (None, why not). `requested` ($SPECDISTILL_KERNEL_ISA): "" for
    the best the CPU runs, or a flavour's name (an unknown name, or one the CPU cannot run, is the reason)."""
    if requested:
        if requested not in FLAVOURS:
            return None, f"${ISA_ENV}={requested!r} is not one of {sorted(FLAVOURS)}"
        missing = [f for f in FLAVOUR_FLAGS[requested] if f not in cpu_flags]
        if missing:
            return None, f"${ISA_ENV}={requested} but this CPU has no {', '.join(missing)}"
        return requested, None
    for flavour in FLAVOURS:  # the widest first
        if all(f in cpu_flags for f in FLAVOUR_FLAGS[flavour]):
            return flavour, None
    return None, "this CPU has neither avx512f nor avx2 with fma and f16c"


def simde_include() -> str:
    """SIMDe's headers (the `simde-py` package), which the AVX2 flavour compiles against."""
    try:
        import simde_py
    except ImportError:
        raise RuntimeError("the AVX2 kernel library needs SIMDe's headers: pip install simde-py") from None
    return simde_py.get_include()


def include_paths(flavour: str) -> list[str]:
    return [str(CSRC)] + ([simde_include()] if flavour == "avx2" else [])


def source_digest(flavour: str = "avx512") -> str:
    """16 hex digits over every source, the flavour's flags (and SIMDe's version), torch's and Python's versions."""
    import torch

    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    simde = importlib.metadata.version("simde-py") if flavour == "avx2" else ""
    h.update(" ".join((*FLAVOURS[flavour], "|", *LDFLAGS, "|", simde, torch.__version__, sys.version)).encode())
    return h.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_private(path: Path, kind: str) -> None:
    """RefusedCache unless `path` is a `kind` ("file" or "dir", not a symlink) owned by this user and writable by
    no one else."""
    info = os.lstat(path)
    is_kind = stat.S_ISDIR(info.st_mode) if kind == "dir" else stat.S_ISREG(info.st_mode)
    if not is_kind:
        raise RefusedCache(f"{path} is not a plain {kind}")
    if info.st_uid != os.getuid():
        raise RefusedCache(f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RefusedCache(f"{path} is writable by its group or by others (mode {stat.S_IMODE(info.st_mode):o})")


def verify_cached(directory: Path) -> Path:
    """The cached library's path once its directory, file and record pass the checks; RefusedCache (or
    FileNotFoundError when there is nothing cached) otherwise."""
    library, record = directory / LIBRARY, directory / RECORD
    for path, kind in ((directory, "dir"), (library, "file"), (record, "file")):
        check_private(path, kind)
    recorded = json.loads(record.read_text()).get("sha256")
    actual = file_sha256(library)
    if recorded != actual:
        raise RefusedCache(f"{library}'s sha256 {actual[:16]}... is not the {str(recorded)[:16]}... recorded at build")
    return library


def prepare_directory(directory: Path) -> None:
    """Create `directory` (and its parent) private to this user; refuse one that is not ours."""
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    try:
        check_private(directory, "dir")
    except RefusedCache as error:
        raise RuntimeError(f"will not build the kernel library into {directory}: {error}") from None


def remove_refused(directory: Path) -> None:
    """Delete what a refused cache left (ours to delete: the directory passed its own check)."""
    for name in (LIBRARY, RECORD):
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass


def compile_into(directory: Path, flavour: str = "avx512") -> None:
    """Build the library's `flavour` in a child process into a private temporary directory under `directory`, then
    move it into place and record its sha256. RuntimeError with the compiler's last words on failure; nothing
    partial is left either way."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        command = [sys.executable, "-m", __name__, tmp, flavour]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(project_root()),
                                                                          os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"building the kernel library took over {BUILD_TIMEOUT_S} s") from None
        built = Path(tmp) / LIBRARY
        if done.returncode != 0 or not built.is_file():
            said = (done.stderr.strip() or done.stdout.strip())[-800:]
            raise RuntimeError(f"the kernel library did not build: {said}")
        os.chmod(built, 0o700)
        digest = file_sha256(built)
        record_tmp = Path(tmp) / RECORD
        record_tmp.write_text(json.dumps({"sha256": digest, "sources": source_digest(flavour), "flavour": flavour,
                                          "cflags": list(FLAVOURS[flavour])}))
        os.chmod(record_tmp, 0o600)
        os.replace(built, directory / LIBRARY)
        os.replace(record_tmp, directory / RECORD)  # last: a library without its record is refused and rebuilt


def project_root() -> Path:
    """The folder that holds the `models` package (for the child build process's imports)."""
    return Path(__file__).resolve().parents[2]


def verified_library(directory: Path, build=compile_into, warn=None) -> Path:
    """The path of a verified library in `directory`, building it first where none is cached and rebuilding one
    the checks refuse (`warn(message)` is told why)."""
    prepare_directory(directory)
    try:
        return verify_cached(directory)
    except FileNotFoundError:
        pass
    except (RefusedCache, ValueError, OSError) as error:  # ValueError: an unreadable record
        if warn is not None:
            warn(f"refused the cached kernel library ({error}); rebuilding it")
        remove_refused(directory)
    build(directory)
    return verify_cached(directory)


def import_library(path: Path) -> ModuleType:
    """Import the extension module at `path` (torch must be imported first: the library links against it)."""
    import torch  # noqa: F401  (libtorch and torch's libgomp loaded before the library's own NEEDED entries)

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_in_this_process(out_dir: Path, flavour: str = "avx512") -> None:
    """The child's work: torch's cpp_extension compiles the sources in `out_dir` and imports the result once."""
    from torch.utils.cpp_extension import load

    load(name=MODULE_NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(FLAVOURS[flavour]),
         extra_ldflags=list(LDFLAGS), extra_include_paths=include_paths(flavour), build_directory=str(out_dir),
         is_python_module=True, verbose=False)


if __name__ == "__main__":
    build_in_this_process(Path(sys.argv[1]), sys.argv[2])
