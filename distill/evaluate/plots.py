"""PNG plots of the eval report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _series_label(r: dict[str, Any]) -> str:
    dsm = r.get("draft_sample_method")
    return f"{r['name']} T={r['temperature']}" + (f" {dsm}" if dsm and dsm != "greedy" else "")


def plot_per_position(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-position acceptance of each draft at its largest k (which covers every position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("method") != "draft_model" or not r.get("num_drafts"):
            continue
        label = _series_label(r)
        if label not in best or r["k"] > best[label]["k"]:
            best[label] = r
    if not best:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in sorted(best.items()):
        ys = r["per_position_acceptance"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{label} (k={r['k']})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_speedup(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Speedup over the target alone vs k, one line per draft × temperature × drafting; ngram as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("method") is None or r.get("speedup") is None:
            continue
        series.setdefault(_series_label(r), []).append((int(r["k"]), float(r["speedup"])))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=label,
            linestyle="none" if len(pts) == 1 else "-",
        )
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("k (speculative tokens per step)")
    ax.set_ylabel("speedup vs no speculation")
    ax.set_title("Speedup vs k")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
