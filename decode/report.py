"""Summaries of an evaluation run: per method, per category and overall, as a table, JSON and plots.

tokens_per_s = total new tokens / total wall time over every turn of the method (not a mean of
per-turn rates, which would overweight short answers); speedup = tokens_per_s / the baseline's
over the same turns. tau, alpha and acceptance per draft position come from the engine's
statistics, summed over the turns (decode.metrics.aggregate_stats); transformers' peers have none.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from specdistill.decode.metrics import RequestStats, aggregate_stats

OVERALL = "overall"
BASELINE = "baseline"


@dataclass
class TurnResult:
    question_id: str
    category: str
    turn: int  # 0-based index into the question's turns
    method: str
    prompt_tokens: int
    tokens: list[int]  # new tokens
    text: str  # the decoded answer, which the next turn's conversation carries
    wall_s: float
    stats: RequestStats | None


def summarize(results: list[TurnResult], methods: list[str], greedy: bool) -> dict:
    """{method: summary with "by_category": {category: summary}}; speedups against BASELINE."""
    baseline_tokens = {(r.question_id, r.turn): r.tokens for r in results if r.method == BASELINE}
    mismatched = {r.method: set() for r in results}
    for r in results:
        if greedy and baseline_tokens.get((r.question_id, r.turn), r.tokens) != r.tokens:
            mismatched[r.method].add((r.question_id, r.turn))
    categories = list(dict.fromkeys(r.category for r in results))
    summary = {}
    for method in methods:
        mine = [r for r in results if r.method == method]
        summary[method] = summarize_turns(mine, mismatched.get(method, set()), greedy)
        summary[method]["by_category"] = {
            c: summarize_turns([r for r in mine if r.category == c], mismatched.get(method, set()), greedy)
            for c in categories}
    add_speedups(summary)
    return summary


def summarize_turns(turns: list[TurnResult], mismatched: set, greedy: bool) -> dict:
    new_tokens = sum(len(r.tokens) for r in turns)
    wall_s = sum(r.wall_s for r in turns)
    out = {"tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0, "speedup": None,
           "tau": None, "alpha": None, "target_forwards": None, "acceptance_per_position": None,
           "draft_time_s": None, "verify_time_s": None,
           "mismatches": sum((r.question_id, r.turn) in mismatched for r in turns) if greedy else None,
           "mismatched_turns": sorted([r.question_id, r.turn] for r in turns if (r.question_id, r.turn) in mismatched),
           "new_tokens": new_tokens, "wall_s": wall_s, "turns": len(turns)}
    stats = [r.stats for r in turns if r.stats is not None]
    if turns and len(stats) == len(turns):
        agg = aggregate_stats(stats)
        out.update({key: agg[key] for key in ("tau", "alpha", "target_forwards", "acceptance_per_position",
                                               "draft_time_s", "verify_time_s")})
    return out


def add_speedups(summary: dict) -> None:
    """speedup = tokens/s over the baseline's, overall and per category (None without a baseline)."""
    base = summary.get(BASELINE)
    if base is None:
        return
    for method in summary.values():
        method["speedup"] = ratio(method["tokens_per_s"], base["tokens_per_s"])
        for category, row in method["by_category"].items():
            row["speedup"] = ratio(row["tokens_per_s"], base["by_category"][category]["tokens_per_s"])


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def lossless_failures(summary: dict) -> dict[str, str]:
    """{method: "k of n turns"} for each method bound to the baseline's greedy output ("lossless") whose turns
    differ from it; empty under sampling (no token-for-token check) and for peers whose arithmetic differs."""
    return {name: f"{row['mismatches']} of {row['turns']} turns" for name, row in summary.items()
            if row.get("lossless") and row.get("mismatches")}


# ---- tables ----------------------------------------------------------------------------------------

COLUMNS = ("method", "tokens/s", "speedup", "tau", "alpha", "mismatches")


def table_rows(summary: dict, category: str = OVERALL) -> list[tuple[str, ...]]:
    rows = []
    for name, method in summary.items():
        row = method if category == OVERALL else method["by_category"].get(category)
        if row is None:
            continue
        rows.append((name, fmt(row["tokens_per_s"], "{:.1f}"), fmt(row["speedup"], "{:.2f}x"),
                     fmt(row["tau"], "{:.2f}"), fmt(row["alpha"], "{:.3f}"),
                     "-" if row["mismatches"] is None else f"{row['mismatches']}/{row['turns']}"))
    return rows


def fmt(value, pattern: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else pattern.format(value)


def section_names(summary: dict) -> list[str]:
    first = next(iter(summary.values()), {"by_category": {}})
    return list(first["by_category"]) + [OVERALL]


def format_tables(summary: dict) -> str:
    """Plain-text tables, one per category and one overall, for the terminal."""
    blocks = []
    for section in section_names(summary):
        rows = [COLUMNS] + table_rows(summary, section)
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        blocks.append(f"[{section}]\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def format_markdown(summary: dict, title: str = "Evaluation") -> str:
    parts = [f"# {title}\n"]
    for section in section_names(summary):
        parts.append(f"## {section}\n")
        parts.append("| " + " | ".join(COLUMNS) + " |")
        parts.append("|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|")
        parts += ["| " + " | ".join(row) + " |" for row in table_rows(summary, section)]
        parts.append("")
    return "\n".join(parts)


def format_runtime(runtime: dict) -> str:
    """The runtime section (decode.runtime_facts) as a short Markdown list: one item per fact, its parts inline,
    so that a fact added there shows here without a change."""
    return "\n".join(f"- {key}: {inline(value)}" for key, value in runtime.items())


def inline(value, nested: bool = False) -> str:
    """A fact on one line: a dict as "key value, ..." (in parentheses when nested), a list space-separated."""
    if isinstance(value, dict):
        text = ", ".join(f"{key} {inline(part, True)}" for key, part in value.items()) or "none"
        return f"({text})" if nested and value else text
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-" if value is None else str(value)


# ---- files -----------------------------------------------------------------------------------------

def write_report(out_dir: str | Path, config: dict, summary: dict, results: list[TurnResult],
                 skipped: dict[str, str], runtime: dict | None = None) -> Path:
    """report.json, report.md, turns.jsonl and the two plots under out_dir; returns out_dir. runtime: what ran,
    resolved (decode.runtime_facts), a section of both reports."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": config, "runtime": runtime, "methods": summary, "skipped": skipped}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    notes = "".join(f"- `{name}` skipped: {reason}\n" for name, reason in skipped.items())
    notes += "".join(f"- `{name}` LOSSLESSNESS VIOLATED: greedy output differs from `{BASELINE}`'s in {count}\n"
                     for name, count in lossless_failures(summary).items())
    runtime_md = f"\n## runtime\n\n{format_runtime(runtime)}\n" if runtime is not None else ""
    (out / "report.md").write_text(format_markdown(summary) + ("\n" + notes if notes else "") + runtime_md)
    with (out / "turns.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(turn_record(r)) + "\n")
    plot_speedup_by_category(summary, out / "speedup_by_category.png")
    plot_acceptance_per_position(summary, out / "acceptance_per_position.png")
    return out


def turn_record(r: TurnResult) -> dict:
    stats = r.stats
    return {"question_id": r.question_id, "category": r.category, "turn": r.turn, "method": r.method,
            "prompt_tokens": r.prompt_tokens, "new_tokens": len(r.tokens), "wall_s": r.wall_s,
            "tau": stats.tau if stats else None, "alpha": stats.alpha if stats else None,
            "tokens": r.tokens, "text": r.text}


def new_figure(width: float, height: float):
    """A figure on the Agg canvas, without pyplot's global state (works headless, in threads)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_speedup_by_category(summary: dict, path: Path) -> None:
    """Grouped bars: one group per category (and overall), one bar per non-baseline method."""
    methods = [m for m in summary if m != BASELINE]
    sections = section_names(summary)
    fig = new_figure(max(8.0, 2.0 + 0.35 * len(sections) * max(1, len(methods))), 4.0)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        rows = [summary[method] if s == OVERALL else summary[method]["by_category"][s] for s in sections]
        heights = [row["speedup"] or 0.0 for row in rows]
        ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(sections))], heights, width, label=method)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="baseline")
    ax.set_xticks(range(len(sections)), sections, rotation=30, ha="right")
    ax.set_ylabel("speedup over baseline (tokens/s)")
    ax.set_title("Speedup per category")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: bars stay visible
    fig.savefig(path, dpi=100)


def plot_acceptance_per_position(summary: dict, path: Path) -> None:
    """P(draft at position k accepted | drafted), one line per method that drafts."""
    fig = new_figure(6.0, 4.0)
    ax = fig.add_subplot()
    drew = False
    for method, row in summary.items():
        rates = row["acceptance_per_position"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
            drew = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per draft position")
    if drew:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no method drafted tokens", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=100)
