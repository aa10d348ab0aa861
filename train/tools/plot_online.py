"""Plot online distillation: the server's live alpha per window of requests, the daemon's held-out alpha
at each update, and (for the demo) the held-out alpha before and after.

    specdistill plot-online runs/online_demo/metrics.json [--out PNG]     # the demo's summary
    specdistill plot-online WORK/metrics.jsonl [--out PNG]                # a running daemon's journal
    specdistill plot-online VLLM_RUN/metrics.json --beside BUILTIN_RUN/metrics.json   # two demos run side by side
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(metrics: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    windows = metrics["windows"]
    xs = [w["requests"][1] for w in windows]
    vllm = metrics.get("engine") == "vllm"
    ax.plot(xs, [w["alpha"] for w in windows], marker="o",
            label="vLLM's live alpha (its /metrics, per window)" if vllm else "live alpha (server log, per window)")
    beside = metrics.get("builtin_windows") or []
    if beside:  # a built-in run's curve beside vLLM's (online-demo --engine vllm --beside)
        ax.plot([w["requests"][1] for w in beside], [w["alpha"] for w in beside], marker=".", linestyle="--",
                label="built-in server's live alpha (its log, per window)")
    for swap in (e for e in metrics.get("engine_swaps", []) if e["event"] == "engine_swap"):
        ax.axvline(swap.get("requests_served", swap["requests_ingested"]), color="green", alpha=0.3)
    updates = metrics.get("daemon_updates", [])
    if updates:
        ux = [u.get("requests_served", u["requests_ingested"]) for u in updates]
        ax.plot(ux, [u["heldout_alpha_candidate"] for u in updates], "x--", label="daemon: candidate held-out alpha")
        ax.plot(ux, [u["heldout_alpha_served"] for u in updates], ".:", label="daemon: served held-out alpha")
        for u in updates:
            if not u["published"]:
                ax.axvline(u.get("requests_served", u["requests_ingested"]), color="red", alpha=0.2)
    if "alpha_first_window" not in metrics:  # a daemon journal: no demo measurements around it
        return finish(fig, ax, out, f"online distillation: {sum(u['published'] for u in updates)} published, "
                                    f"{sum(not u['published'] for u in updates)} rollbacks")
    n = metrics["requests"]
    ax.scatter([0, n], [metrics["alpha_first_window"], metrics["alpha_last_window"]], color="black", zorder=3,
               label="held-out shifted domain (engine): first / last")
    ax.scatter([0, n], [metrics["general_alpha_before"], metrics["general_alpha_after"]], color="gray",
               marker="s", zorder=3, label="general prompts (MT-bench, engine): before / after")
    return finish(fig, ax, out, f"online distillation: {metrics['versions_published']} versions published, "
                                f"{metrics['rollbacks']} rollbacks, {metrics['mismatches']} mismatches")


def finish(fig, ax, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel("requests served")
    ax.set_ylabel("alpha (accepted / drafted)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def from_daemon_journal(path: Path) -> dict:
    """WORK/metrics.jsonl -> the fields `plot` reads: live alpha per ingested batch, the updates."""
    events = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    windows = [{"requests": [0, e["requests_ingested"]], "alpha": e["live_alpha"]} for e in events
               if e["event"] == "ingest" and e.get("live_alpha") is not None]
    return {"windows": windows, "daemon_updates": [e for e in events if e["event"] == "update"]}


def builtin_windows(path: Path) -> list[dict]:
    """The live-alpha windows of a built-in demo's metrics.json (an error naming the file otherwise)."""
    metrics = json.loads(path.read_text())
    if metrics.get("engine", "builtin") != "builtin" or not metrics.get("windows"):
        raise SystemExit(f"--beside {path}: not a built-in online-demo's metrics.json (no built-in windows)")
    return metrics["windows"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="metrics.json written by specdistill online-demo")
    p.add_argument("--out", default=None, help="PNG path (default: acceptance.png beside metrics.json)")
    p.add_argument("--beside", default="", help="a built-in demo's metrics.json whose live alpha is drawn beside "
                   "(for a vLLM run made at the same time, so without online-demo's own --beside)")
    args = p.parse_args(argv)
    path = Path(args.metrics)
    out = Path(args.out) if args.out else path.with_name("acceptance.png")
    metrics = from_daemon_journal(path) if path.suffix == ".jsonl" else json.loads(path.read_text())
    if args.beside:
        metrics["builtin_windows"] = builtin_windows(Path(args.beside))
    print(plot(metrics, out))


if __name__ == "__main__":
    main()
