"""Full training state on disk, written atomically, so that `--resume` continues exactly."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "train_state.json"
log = logging.getLogger("specdistill.checkpoints")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed (by this process)
    best_tau: float = -1.0
    best_step: int = -1
    history: list[dict] = field(default_factory=list)  # in-loop acceptance measurements
    total_steps: int = 0  # the run's step count as max_minutes decided it (train.step_budget); 0: not decided


def checkpoint_dir(work_dir: str | Path) -> Path:
    return Path(work_dir) / "checkpoints"


def save_checkpoint(accelerator, state: TrainState, work_dir: str | Path, keep: int = 2) -> Path:
    """accelerator.save_state into a temporary directory, renamed into place once complete."""
    root = checkpoint_dir(work_dir)
    final = root / f"step-{state.step:07d}"
    tmp = root / f".tmp-step-{state.step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's files (RNG states, DeepSpeed shards) are in before the rename
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(work_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (temporary directories of an interrupted save are ignored)."""
    done = [p for p in sorted(checkpoint_dir(work_dir).glob("step-*")) if (p / STATE_FILE).is_file()]
    return done[-1] if done else None


def load_checkpoint(accelerator, path: Path) -> TrainState:
    accelerator.load_state(str(path))
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def resume_or_start(cfg, accelerator) -> TrainState:
    """A fresh state, or with `cfg.resume` the latest complete checkpoint under cfg.work_dir, loaded."""
    if not cfg.resume:
        return TrainState()
    path = latest_checkpoint(cfg.work_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {cfg.work_dir}/checkpoints")
    state = load_checkpoint(accelerator, path)
    log.info("resumed from %s at step %d", path, state.step)
    return state
