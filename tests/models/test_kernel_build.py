"""models.kernels' build and cache: a cached library is loaded only when it is this user's, writable by no one else
and its content is what was recorded at build; anything else is refused and rebuilt. A failed build leaves nothing.
One OpenMP runtime in the process. A fallback from the library is a WARNING once, naming its reason and cost."""

import logging
import os
import shutil
from pathlib import Path

import pytest

from specdistill.models import kernels
from specdistill.models.kernels import build

needs_kernel = pytest.mark.skipif(kernels.unavailable() is not None,
                                  reason=f"the kernel library: {kernels.unavailable()}")


@pytest.fixture
def cached(tmp_path):
    """A private cache directory holding a copy of this process's verified library, and a build that restores that
    copy (counting its calls) in place of a compile."""
    if kernels.unavailable() is not None:
        pytest.skip(f"the kernel library: {kernels.unavailable()}")
    source = kernels.kernel_directory()
    directory = tmp_path / "cpu-test"
    directory.mkdir(mode=0o700)
    for name in (build.LIBRARY, build.RECORD):
        shutil.copy2(source / name, directory / name)
    builds = []

    def rebuild(into: Path) -> None:
        builds.append(into)
        for name in (build.LIBRARY, build.RECORD):
            shutil.copy2(source / name, into / name)
    return directory, rebuild, builds


def test_a_verified_cache_is_loaded_without_a_build(cached):
    directory, rebuild, builds = cached
    assert build.verified_library(directory, build=rebuild) == directory / build.LIBRARY and builds == []


@pytest.mark.parametrize("tamper,why", [
    (lambda lib: os.chmod(lib, 0o777), "writable by its group or by others"),
    (lambda lib: lib.write_bytes(lib.read_bytes()[:-1] + b"\x01"), "sha256"),
    (lambda lib: os.chown(lib, 65534, -1), "owned by uid 65534"),
])
def test_a_cached_library_with_the_wrong_mode_hash_or_owner_is_refused_and_rebuilt(cached, tamper, why):
    directory, rebuild, builds = cached
    library = directory / build.LIBRARY
    if why.startswith("owned") and os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    tamper(library)
    with pytest.raises(build.RefusedCache, match=why):
        build.verify_cached(directory)
    warnings = []
    assert build.verified_library(directory, build=rebuild, warn=warnings.append) == library
    assert len(builds) == 1 and why.split()[0] in warnings[0]
    assert build.file_sha256(library) == build.file_sha256(kernels.kernel_directory() / build.LIBRARY)
    build.verify_cached(directory)  # what is there now passes


def test_a_library_without_its_record_is_rebuilt(cached):
    directory, rebuild, builds = cached
    (directory / build.RECORD).unlink()
    build.verified_library(directory, build=rebuild, warn=lambda _: None)
    assert len(builds) == 1


def test_a_directory_others_may_write_is_never_built_into(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir()
    os.chmod(directory, 0o777)
    with pytest.raises(RuntimeError, match="will not build the kernel library into"):
        build.verified_library(directory, build=lambda into: pytest.fail("built into an open directory"))


def test_a_failed_build_raises_with_the_compilers_words_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # the compiler torch's cpp_extension runs, failing at once in the child
    directory = tmp_path / "cpu-broken"
    build.prepare_directory(directory)
    with pytest.raises(RuntimeError, match="did not build"):
        build.compile_into(directory)
    assert list(directory.iterdir()) == []  # no library, no record, no temporary directory


@needs_kernel
def test_the_library_runs_on_torchs_openmp_runtime_alone():
    kernels.library().rms_norm_rows(*[__import__("torch").ones(2, 16), __import__("torch").ones(16), 1e-5])
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    # the soname the library asks for (libgomp.so.1) is torch's copy; wheels that vendor a private runtime under a
    # hashed name (sentencepiece's libgomp-<hash>.so) are theirs alone and do not count
    shared = {path for path in mapped if Path(path).name.startswith("libgomp.so")}
    assert len(shared) == 1 and "torch" in next(iter(shared)), mapped


def test_a_fallback_from_the_library_is_one_warning_naming_reason_and_cost(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_load", lambda: (None, "no C++ compiler (c++ or g++) on PATH"))
    monkeypatch.setattr(kernels, "_fallbacks", {})
    with caplog.at_level(logging.WARNING, logger="specdistill.kernels"):
        assert kernels.library() is None and kernels.library() is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "no C++ compiler" in warned[0].getMessage() and "1.5x slower" in warned[0].getMessage()
    assert "no C++ compiler" in kernels.fallbacks()["the CPU kernel library"]
    from specdistill.decode.runtime_facts import kernel_facts  # what every evaluation report records
    facts = kernel_facts()
    assert facts["state"] == "unavailable" and facts["unavailable_reason"].startswith("no C++ compiler")


AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw"}
AVX2 = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("flags,requested,chosen,why", [
    (AVX512, "", "avx512", None),
    (AVX2, "", "avx2", None),
    (AVX512, "avx2", "avx2", None),  # the AVX2 flavour on an AVX-512 CPU, asked for
    ({"avx2", "fma"}, "", None, "neither avx512f nor avx2 with fma and f16c"),
    (AVX2, "avx512", None, "SPECDISTILL_KERNEL_ISA=avx512 but this CPU has no avx512f"),
    (AVX512, "sse", None, "'sse' is not one of ['avx2', 'avx512']"),
])
def test_the_flavour_is_the_widest_the_cpu_runs_or_the_one_asked_for(flags, requested, chosen, why):
    flavour, reason = build.flavour_for(frozenset(flags), requested)
    assert flavour == chosen and (reason is None if why is None else why in reason)


def test_each_flavour_is_cached_apart():
    assert kernels.kernel_directory("avx2") != kernels.kernel_directory("avx512")
    assert build.source_digest("avx2") != build.source_digest("avx512")
    assert "-DSPECDISTILL_AVX2" in build.FLAVOURS["avx2"] and "-mavx512f" not in build.FLAVOURS["avx2"]
