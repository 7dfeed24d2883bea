"""A suite's PNG: per series, the figure against size and the ratio to the baseline beside it."""

from __future__ import annotations

import sys
from pathlib import Path

from .table import size_label


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (after a note on stderr) where it does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("adaattn bench: matplotlib is not installed; skipping the PNG plot", file=sys.stderr)
        return None
    return plt


def size_ticks(ax, xs: list[int]) -> None:
    """A log2 size axis with a tick at each size, labelled 128, 1k, 4k, 64k."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([size_label(x) for x in xs])
    ax.minorticks_off()


def save_figure(plt, fig, path: Path, title: str) -> Path:
    """Title, tight layout, write `path` (its folder made), close; returns path."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_suite_plot(path: Path, rows: list[dict], title: str) -> Path | None:
    """One row of two panels per series (figure; x baseline), sizes on a log axis labelled 1k, 4k, ...

    Returns None, after a note on stderr, where matplotlib does not import.
    """
    plt = pyplot()
    if plt is None:
        return None
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["ms"] is not None:
            series.setdefault(r["series"], []).append(r)
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 2, figsize=(12, 3.6 * len(series)), squeeze=False)
    for (name, group), (ax_fig, ax_ratio) in zip(series.items(), axes):
        xs = sorted({r["x"] for r in group})
        for peer in dict.fromkeys(r["peer"] for r in group):
            pts = sorted((r["x"], r["figure"], r.get("x_baseline")) for r in group if r["peer"] == peer)
            ax_fig.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=peer)
            ratio = [(p[0], p[2]) for p in pts if p[2] is not None]
            if ratio:
                ax_ratio.plot([p[0] for p in ratio], [p[1] for p in ratio], marker="o", label=peer)
        ax_fig.set_title(name, fontsize=9)
        ax_fig.set_ylabel(group[0]["figure_unit"])
        ax_ratio.set_title(f"{name}: x {group[0]['baseline']}", fontsize=9)
        ax_ratio.set_ylabel(f"{group[0]['baseline']} time / this time")
        ax_ratio.axhline(1.0, color="grey", lw=0.8)
        for ax in (ax_fig, ax_ratio):
            size_ticks(ax, xs)
            ax.set_xlabel("size")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    return save_figure(plt, fig, path, title)
