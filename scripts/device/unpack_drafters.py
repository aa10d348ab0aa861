"""Reassemble drafters shipped by scripts/device/pack_drafters.py (SRC/ship.tgz.NN) into DEST/<run>/drafter,
their weights back in fp32 (the values are the fp16 ones: the CPU drafts in fp16 weights wherever FBGEMM runs).
Each drafter directory appears whole or not at all; missing or damaged pieces are refused by name.

    python scripts/device/unpack_drafters.py /work/.device/2 runs/s36
"""
import gzip
import io
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file


def read_pieces(src: Path) -> bytes:
    """The tar inside src/ship.tgz.00, .01, ...: every piece present, in order, the gzip stream complete."""
    parts = sorted(src.glob("ship.tgz.*"))
    if not parts:
        raise SystemExit(f"{src}: no ship.tgz.NN pieces")
    expected = [f"ship.tgz.{i:02d}" for i in range(len(parts))]
    if [p.name for p in parts] != expected:
        missing = sorted(set(expected) - {p.name for p in parts})
        raise SystemExit(f"{src}: pieces out of sequence, missing {missing or 'the last ones'}")
    try:
        return gzip.decompress(b"".join(p.read_bytes() for p in parts))
    except (OSError, EOFError) as err:
        raise SystemExit(f"{src}: the pieces do not make a whole gzip stream ({err}); was the last one cut short?")


def install(run: Path, out: Path) -> None:
    """Copy one shipped drafter to `out` with fp32 weights, atomically (a sibling, then a rename)."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(run, partial)
    for f in partial.rglob("*.safetensors"):
        save_file({k: v.float() if v.is_floating_point() else v for k, v in load_file(f).items()}, f)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def main(src: Path, dest: Path) -> list[Path]:
    """Unpack src/ship.tgz.NN into dest/<run>/drafter; returns the drafter directories."""
    data = read_pieces(src)
    written = []
    with tempfile.TemporaryDirectory() as work:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(work, filter="data")
        for run in sorted((Path(work) / "ship").iterdir()):
            out = dest / run.name / "drafter"
            out.parent.mkdir(parents=True, exist_ok=True)
            install(run, out)
            print(out)
            written.append(out)
    return written


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
