"""`specdistill`: one command for the project's jobs and tools.

    specdistill train CONFIG [--where ACCELERATE_YAML] [--num-processes N] [--online] [--KEY VALUE ...]
    specdistill eval ARGS...         python -m decode.evaluate ARGS...
    specdistill serve ARGS...        python -m decode.serve ARGS...
    specdistill export ARGS...       python -m models.export ARGS...
    specdistill swap ARGS...         python -m train.engine_swap ARGS...
    specdistill bench NAME ARGS...   python -m benchmarks.NAME ARGS... (`specdistill bench --list`)
    specdistill TOOL ARGS...         a tool of train/tools (the list: `specdistill --help`)

`train` launches the job through accelerate (`accelerate launch train/distill.py --config CONFIG ...`, or
train/online.py with `--online`): "what to train" is the job's YAML, "where to run" the accelerate file given with
`--where` (configs/accelerate/*.yaml); without one, one process, no mixed precision (the job's own
`mixed_precision` decides), as `make demo` runs it. Options after CONFIG that this command does not know are the
job's own overrides (`--max_steps 10`). Each other command hands its arguments to the module it names, unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TOOLS = {  # subcommand: (module under train.tools, what it does)
    "speedup-model": ("speedup_model", "what each drafter of an evaluation would need for a speedup here"),
    "training-gain": ("training_gain", "what a trained drafter gained, from one evaluation report"),
    "medusa-vocab": ("medusa_vocab", "a Medusa drafter's candidate vocabulary or tree size, without retraining"),
    "tree-shape": ("tree_shape", "an EAGLE-3 or DFlash drafter's decoding tree shape, without retraining"),
    "eagle3-tree": ("tree_shape", "tree-shape's former name"),
    "head-coverage": ("head_coverage", "what share of the target's answers a reduced draft head can draft"),
    "online-demo": ("online_demo", "the online loop end to end: server, daemon, a shifted stream"),
    "plot-online": ("plot_online", "redraw the online demo's acceptance plot"),
    "replay-online": ("replay_online", "replay a served stream through the daemon's update rule, offline"),
    "vllm-check": ("vllm_check", "an exported drafter's acceptance in vLLM against ours (needs `make vllm`)"),
}
MODULES = {  # subcommand: (module whose main(argv) runs it, what it does)
    "eval": ("specdistill.decode.evaluate",
             "a drafter against plain decoding on a question file (Spec-Bench protocol)"),
    "serve": ("specdistill.decode.serve", "the OpenAI-compatible server with the speculative engine"),
    "export": ("specdistill.models.export", "a drafter in the format vLLM loads"),
    "swap": ("specdistill.train.engine_swap",
             "vLLM behind the logging front, swapped to each drafter version the online daemon publishes"),
}


def usage() -> str:
    lines = [__doc__.split("\n\n")[0], "", "commands:",
             "  train          a distillation job (or the online daemon) through accelerate",
             *(f"  {name:<14} {what}" for name, (_, what) in MODULES.items()),
             "  bench          a benchmark of benchmarks/ (`specdistill bench --list`)",
             *(f"  {name:<14} {what}" for name, (_, what) in TOOLS.items())]
    return "\n".join(lines)


def accelerate_command() -> list[str]:
    """The accelerate launcher of this environment (beside its python, else on PATH)."""
    beside = Path(sys.executable).parent / "accelerate"
    found = str(beside) if beside.is_file() else shutil.which("accelerate")
    if found is None:
        raise SystemExit("specdistill train: no `accelerate` command in this environment (pip install accelerate)")
    return [found]


def launch_argv(argv: Sequence[str]) -> list[str]:
    """The `accelerate launch ...` command line of `specdistill train ARGS`."""
    p = argparse.ArgumentParser(prog="specdistill train", description="a job through accelerate")
    p.add_argument("config", help="the job's YAML (configs/distill/*.yaml, or configs/online/*.yaml with --online)")
    p.add_argument("--where", default=None, help="an accelerate config file (configs/accelerate/*.yaml)")
    p.add_argument("--num-processes", type=int, default=None, help="accelerate's --num_processes")
    p.add_argument("--online", action="store_true", help="the online daemon (train/online.py), not train/distill.py")
    args, overrides = p.parse_known_args(argv)
    if not Path(args.config).is_file():
        p.error(f"argument config: {args.config} does not exist")
    launch = ["launch"]
    if args.where:
        launch += ["--config_file", args.where]
    else:  # as `make demo`: one machine, precision left to the job's own `mixed_precision`
        launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if args.num_processes or not args.where:
        launch += ["--num_processes", str(args.num_processes or 1)]
    script = ROOT / "train" / ("online.py" if args.online else "distill.py")
    return [*launch, str(script), "--config", args.config, *overrides]


def run_train(argv: Sequence[str]) -> int:
    return subprocess.call(accelerate_command() + launch_argv(argv), cwd=ROOT)


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in ("__init__", "harness"))


def run_bench(argv: Sequence[str]) -> int:
    """Runs benchmarks/NAME.py's main as `python -m benchmarks.NAME` does (from a checkout: benchmarks/ is not
    installed)."""
    names = benchmark_names()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("benchmarks (specdistill bench NAME --help; benchmarks/README.md):\n  " + "\n  ".join(names))
        return 0
    if argv[0] not in names:
        print(f"specdistill bench: no benchmark {argv[0]!r}; choose one of {', '.join(names)}", file=sys.stderr)
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    result = importlib.import_module(f"benchmarks.{argv[0]}").main(list(argv[1:]))  # each one's main(argv)
    return result if isinstance(result, int) else 0


def module_main(module: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        result = importlib.import_module(module).main(list(argv))
        return result if isinstance(result, int) else 0
    return run


def commands() -> dict[str, Callable[[Sequence[str]], int]]:
    table: dict[str, Callable[[Sequence[str]], int]] = {"train": run_train, "bench": run_bench}
    table.update({name: module_main(module) for name, (module, _) in MODULES.items()})
    table.update({name: module_main(f"specdistill.train.tools.{module}") for name, (module, _) in TOOLS.items()})
    return table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    table = commands()
    if argv[0] not in table:
        print(f"specdistill: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return table[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
