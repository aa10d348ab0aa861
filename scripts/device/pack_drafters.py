"""Ship trained drafters back from the lent GPU machine: for each run directory, the published drafter (else the
best held-out snapshot, work_dir/best), its float weights as fp16 (the CPU drafts in fp16 weights wherever FBGEMM
runs), tarred, gzipped and split into 15 MB pieces OUT/ship.tgz.NN. scripts/device/unpack_drafters.py undoes it.

    python scripts/device/pack_drafters.py OUT runs/gpu_a runs/gpu_b
"""
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

PIECE_BYTES = 15_000_000  # the device tool returns files of at most 16 MiB, 64 MiB in all


def shipped_copy(run: Path, stage: Path) -> str | None:
    """Copy the run's drafter into stage/<run name> with fp16 weights; which one ('final', 'best') or None."""
    for src, tag in ((run / "drafter", "final"), (run / "drafter.work" / "best", "best")):
        if (src / "manifest.json").is_file():
            dst = stage / run.name
            shutil.copytree(src, dst)
            for f in dst.rglob("*.safetensors"):
                save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(f).items()}, f)
            return tag
    return None


def main(out: Path, runs: list[Path], piece_bytes: int = PIECE_BYTES) -> list[Path]:
    """Pack `runs` into out/ship.tgz.NN; returns the pieces."""
    with tempfile.TemporaryDirectory() as work:
        stage = Path(work) / "ship"
        stage.mkdir()
        for run in runs:
            tag = shipped_copy(run, stage)
            extra = json.loads((stage / run.name / "manifest.json").read_text())["extra"] if tag else {}
            print(run.name, tag or "no drafter", "step", extra.get("step"), "held-out tau",
                  extra.get("held_out_tau"), "history", extra.get("history"))
        tar_path = Path(work) / "ship.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(stage, arcname="ship")
        subprocess.run(f"gzip -1 -c {tar_path} | split -b {piece_bytes} -d - {out / 'ship.tgz.'}", shell=True,
                       check=True)
    return sorted(out.glob("ship.tgz.*"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
