"""Two versions of the engine side by side: every method's tokens/s under an older commit and under this checkout.

    python -m benchmarks.compare_commits --old REF [--rounds 3] [--out DIR] -- DECODE_EVALUATE_ARGS...

A change that must not cost speed (a refactor, a move of the kernels) is checked here: `python -m decode.evaluate`
with the same arguments runs alternately in a git worktree of REF and in this checkout (the order swapped every
round, so a drift in the machine's speed hits both alike), each side importing its own code; the table gives each
method's median tokens/s per side, new / old, and both sides' mismatches against their own plain decoding. Drafter
directories must load under both versions (train them with the older one). Processes, not one process: two versions
of one package cannot share an interpreter, so compare the ratios over several rounds, never a single pair.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, fingerprint, parser, print_table, write_report

PACKAGE_FOLDERS = ("models", "decode", "distill", "train")  # pyproject.toml's package-dir under specdistill.


def worktree(ref: str, into: Path) -> Path:
    """A detached git worktree of `ref` under `into` (removed by the caller's `remove_worktree`), its packages
    importable from it as the installed names."""
    path = into / f"old-{ref[:12]}"
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), ref], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    link_packages(path)
    return path


def link_packages(tree: Path) -> None:
    """specdistill.models etc. found in `tree`: the checkout's editable install maps those names to the checkout's
    own folders, and a tree on PYTHONPATH supplies only specdistill/ itself, so without links in it every submodule
    would come from the checkout (both sides the new code). Links in the tree's specdistill/ to its own folders are
    found first. A commit from before the namespace (no specdistill/) runs its bare folders and needs none."""
    package = tree / "specdistill"
    if not (package / "__init__.py").is_file():
        return
    for name in PACKAGE_FOLDERS:
        if (tree / name).is_dir() and not (package / name).exists():
            (package / name).symlink_to(Path("..") / name, target_is_directory=True)


def check_imports_from(tree: Path) -> None:
    """Raises unless the evaluation module that `evaluate` runs in `tree` is `tree`'s own file."""
    module = evaluate_module(tree)
    found = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"], cwd=tree,
                           env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    where = Path(found.stdout.strip()).resolve() if found.returncode == 0 else None
    if where is None or not where.is_relative_to(tree.resolve()):
        raise RuntimeError(f"{module} run from {tree} imports {where or found.stderr.strip()[-400:]}, not that "
                           "tree's own code: the comparison would measure one version twice")


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True, text=True)


def evaluate_module(tree: Path) -> str:
    """The evaluation command's module in `tree`: under the installed namespace since the packages have one, the
    bare folder name before (an older commit, run from its own tree)."""
    return "specdistill.decode.evaluate" if (tree / "specdistill" / "__init__.py").is_file() else "decode.evaluate"


def evaluate(tree: Path, args: list[str], out: Path) -> dict:
    """decode.evaluate run from `tree` with its own code first on the path -> its report's methods."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", evaluate_module(tree), *args, "--out", str(out)], cwd=tree, env=env,
                          capture_output=True, text=True)
    report = out / "report.json"
    if not report.is_file():  # a mismatch exit still writes the report; anything else is a failure
        raise RuntimeError(f"decode.evaluate in {tree} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return json.loads(report.read_text())["methods"]


def summarize(runs: dict[str, list[dict]]) -> dict:
    """{method: {side: median tokens/s, side_mismatches: the most any round had}, ratio new/old}."""
    table: dict[str, dict] = {}
    for side, reports in runs.items():
        for methods in reports:
            for name, row in methods.items():
                entry = table.setdefault(name, {"old": [], "new": [], "old_mismatches": 0, "new_mismatches": 0})
                entry[side].append(row["tokens_per_s"])
                entry[f"{side}_mismatches"] = max(entry[f"{side}_mismatches"], row.get("mismatches") or 0)
    for entry in table.values():
        for side in ("old", "new"):
            entry[f"{side}_tokens_per_s"] = statistics.median(entry[side]) if entry[side] else None
        old, new = entry["old_tokens_per_s"], entry["new_tokens_per_s"]
        entry["new_over_old"] = new / old if old and new else None
    return table


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, evaluate_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = parser(__doc__, "compare_commits", reps=3)
    p.add_argument("--old", required=True, help="the older commit (any git ref)")
    p.add_argument("--rounds", type=int, default=3, help="runs per side, alternating")
    args = p.parse_args(ours)
    out = Path(args.out).resolve()  # the evaluations run from their own trees
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = worktree(args.old, Path(tmp))
        try:
            check_imports_from(old_tree)
            for i in range(args.rounds):
                order = [("old", old_tree), ("new", ROOT)]
                for side, tree in order if i % 2 == 0 else order[::-1]:
                    runs[side].append(evaluate(tree, evaluate_args, out / side / f"round{i}"))
                    print(f"round {i} {side}: baseline {runs[side][-1]['baseline']['tokens_per_s']:.1f} tokens/s")
        finally:
            remove_worktree(old_tree)
    table = summarize(runs)
    print_table(["method", f"old {args.old} tok/s", "new tok/s", "new / old", "mismatches old / new"],
                [[name, e["old_tokens_per_s"], e["new_tokens_per_s"], e["new_over_old"],
                  f"{e['old_mismatches']} / {e['new_mismatches']}"] for name, e in table.items()])
    write_report(out, "compare_commits", {"old": args.old, "evaluate_args": evaluate_args, "methods": table},
                 args, fingerprint())
    return table


if __name__ == "__main__":
    main()
