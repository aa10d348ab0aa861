"""What every benchmark here shares: warm-up, interleaved timing, the machine's fingerprint, JSON out, a table.

These machines are shared and noisy, so a benchmark compares variants measured side by side in one process:
`interleave` calls each variant once per round (the order reversed every other round, so a drift in the
machine's speed hits all alike) after untimed warm-up calls, and reports medians. Every report is one JSON file
holding the results, the arguments and `fingerprint()`: the CPU, its flags that decide which kernels run, the
core count, torch, the commit and the date, so a figure can be traced to the machine and code that gave it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from specdistill.decode.runtime_facts import KERNEL_FLAGS, git_commit

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
CPU_FLAGS = KERNEL_FLAGS  # the flags that decide which kernels run, as every evaluation report records them


def cpu_info(cpuinfo: str) -> tuple[str, list[str]]:
    """(model name, the CPU_FLAGS present) from the text of /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return model, [flag for flag in CPU_FLAGS if flag in flags]


def fingerprint() -> dict:
    """The machine and code a measurement ran on."""
    import torch

    try:
        model, flags = cpu_info(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = platform.processor() or platform.machine(), []
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": model, "cpu_flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(), "commit": git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def clock() -> float:
    """perf_counter after the GPU's queued work is done (on a CPU-only machine: perf_counter)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def interleave(variants: dict[Any, Callable[[], Any]], reps: int, warmup: int = 1,
               before: Callable[[], Any] | None = None) -> dict[Any, list[float]]:
    """Seconds of each of `reps` calls per variant, the variants taking turns (reversed every other round)
    after `warmup` untimed calls each (kernels built per shape, caches filled); `before`, untimed, ahead of every
    timed call (for example a sweep of memory that evicts the caches as decoding's other work does)."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            if before is not None:
                before()
            start = clock()
            variants[name]()
            times[name].append(clock() - start)
    return times


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """A markdown table; floats with two decimals."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")


def write_report(out: str | Path, name: str, results: dict, args: argparse.Namespace | None = None,
                 machine: dict | None = None) -> Path:
    """OUT/NAME.json: {"benchmark", "machine" (fingerprint), "args", "results"}; returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    report = {"benchmark": name, "machine": machine or fingerprint(),
              "args": {k: v for k, v in vars(args).items()} if args else {}, "results": results}
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")
    return path


def parser(doc: str, name: str, reps: int) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes: --reps, --warmup, --out."""
    p = argparse.ArgumentParser(prog=f"benchmarks.{name}", description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--reps", type=int, default=reps, help="timed calls per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per variant first")
    p.add_argument("--out", default=str(ROOT / "runs" / "benchmarks" / name), help="output directory")
    return p


@contextmanager
def env_set(env: str, value: str | None):
    """`env` set to `value` (None: unset) while the block runs, restored after; the engine reads these switches
    when a runner or engine is built."""
    old = os.environ.pop(env, None)
    if value is not None:
        os.environ[env] = value
    try:
        yield
    finally:
        os.environ.pop(env, None)
        if old is not None:
            os.environ[env] = old


def switched_off(env: str, off: bool):
    """`env` set to "1" (a feature switched off) or unset while the block runs."""
    return env_set(env, "1" if off else None)
