"""What training bought a drafter, and what it is worth on this machine, from two `decode.evaluate` reports over the
same prompts (`make demo` prints this after its two evaluations).

    specdistill training-gain --fixed-depth runs/quickstart/eval_fixed/report.json \\
        --speed runs/quickstart/eval/report.json --trained runs/quickstart/drafter --untrained runs/quickstart/untrained

- What training bought: acceptance per draft position, trained against untrained, both drafting their full depth at
  every step (`--fixed-depth`), so it measures the drafter alone; and tau, tokens per target forward, at that depth.
  A plot of both (`--plot`, default acceptance_gain.png beside the fixed-depth report).
- What it is worth here: tokens/s over plain decoding of every method in the speed report (adaptive depth: a drafter
  that does not pay for its verification on this machine is mostly not asked to draft), the trained drafter, its
  composition with prompt lookup, and prompt lookup alone, the training-free reference.

--trained/--untrained take a method name from the reports or a drafter spec given to `--drafter`
(`speculative[SPEC]`). A method whose greedy output differs from plain decoding is an error: speculation that changed
the target's output gained nothing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdistill.decode.report import BASELINE, new_figure


def method_of(name: str, methods: dict) -> str:
    return name if name in methods else f"speculative[{name}]"


def checked(methods: dict, name: str, source: Path) -> dict:
    """The method's row; KeyError naming what the report has; ValueError for a mismatching method."""
    if name not in methods:
        raise KeyError(f"{source}: no method {name!r}; it has {', '.join(methods)}")
    row = methods[name]
    if row.get("mismatches"):
        raise ValueError(f"{source}: {name}: {row['mismatches']} of {row['turns']} turns differ from plain decoding")
    return row


def acceptance_lines(trained: dict, untrained: dict) -> list[str]:
    """Per draft position k: the share of drafted tokens accepted, trained against untrained; then tau."""
    lines = ["What training bought (acceptance at a fixed depth, the same prompts):",
             "  position   untrained   trained"]
    ours, theirs = trained["acceptance_per_position"] or [], untrained["acceptance_per_position"] or []
    for k in range(max(len(ours), len(theirs))):
        before = f"{theirs[k]:.2f}" if k < len(theirs) else "-"
        after = f"{ours[k]:.2f}" if k < len(ours) else "-"
        lines.append(f"  {k + 1:>8}   {before:>9}   {after:>7}")
    lines.append(f"  tau (tokens per target forward): {untrained['tau']:.2f} untrained, {trained['tau']:.2f} trained")
    return lines


def speed_lines(methods: dict, source: Path) -> list[str]:
    """tokens/s over plain decoding of every method of the speed report, fastest first."""
    base = checked(methods, BASELINE, source)
    rows = sorted(((name, checked(methods, name, source)) for name in methods if name != BASELINE),
                  key=lambda item: -item[1]["tokens_per_s"])
    lines = [f"What it is worth on this machine (adaptive depth; plain decoding {base['tokens_per_s']:.1f} tokens/s):"]
    for name, row in rows:
        tau = f", tau {row['tau']:.2f}" if row.get("tau") else ""
        lines.append(f"  {name}: {row['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                     f"({row['tokens_per_s']:.1f} tokens/s{tau})")
    return lines


def plot_gain(trained: dict, untrained: dict, names: tuple[str, str], path: Path) -> None:
    """Acceptance per draft position, untrained and trained, side by side."""
    fig = new_figure(6.0, 4.0)
    ax = fig.add_subplot()
    depth = 1
    for row, label, shift in ((untrained, names[1], -0.2), (trained, names[0], 0.2)):
        rates = row["acceptance_per_position"] or []
        ax.bar([k + 1 + shift for k in range(len(rates))], rates, width=0.4, label=label)
        depth = max(depth, len(rates))
    ax.set_xticks(range(1, depth + 1))
    ax.set_xlabel("draft position (fixed depth)")
    ax.set_ylabel("accepted share of drafted tokens")
    ax.set_ylim(0, 1.05)
    ax.set_title("What training bought")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixed-depth", type=Path, required=True, help="report.json of a --fixed-depth evaluation")
    parser.add_argument("--speed", type=Path, required=True, help="report.json of an adaptive-depth evaluation")
    parser.add_argument("--trained", required=True, help="the trained drafter's method or spec")
    parser.add_argument("--untrained", required=True, help="its starting point's method or spec")
    parser.add_argument("--plot", type=Path, help="default: acceptance_gain.png beside the fixed-depth report")
    args = parser.parse_args(argv)
    try:
        fixed = json.loads(args.fixed_depth.read_text())["methods"]
        speed = json.loads(args.speed.read_text())["methods"]
        trained = checked(fixed, method_of(args.trained, fixed), args.fixed_depth)
        untrained = checked(fixed, method_of(args.untrained, fixed), args.fixed_depth)
        lines = acceptance_lines(trained, untrained) + [""] + speed_lines(speed, args.speed)
    except (OSError, KeyError, ValueError) as err:
        parser.error(str(err.args[0] if err.args else err))
    plot = args.plot or args.fixed_depth.parent / "acceptance_gain.png"
    plot_gain(trained, untrained, (args.trained, args.untrained), plot)
    print("\n".join(lines + [f"plot: {plot}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
