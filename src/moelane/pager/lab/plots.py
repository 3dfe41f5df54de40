"""Figures for people (optional `plot` extra: matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from moelane.errors import MoelaneError


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoelaneError("plotting needs matplotlib: pip install 'moelane[plot]'") from None
    return plt


def plot_sweep(rows: list[dict[str, Any]], out: str) -> None:
    """Decode hit rate and predicted tok/s against pool fraction, one line per policy."""
    plt = _pyplot()
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["policy"]].append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rs in by.items():
        rs.sort(key=lambda r: r["fraction"])
        x = [r["fraction"] for r in rs]
        ax1.plot(x, [r["decode_hit_rate"] for r in rs], marker="o", label=name)
        ax2.plot(x, [r["tok_s_aggregate"] for r in rs], marker="o", label=name)
    ax1.set(xlabel="pool / all experts", ylabel="decode hit rate")
    ax2.set(xlabel="pool / all experts", ylabel="predicted tok/s")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_analysis(report: dict[str, Any], out: str) -> None:
    """Coverage by predictor set (overall) and per-layer usage concentration."""
    plt = _pyplot()
    cov = report["overall"]["coverage"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(cov)
    ax1.barh(names, [cov[n]["coverage"] for n in names])
    ax1.set(xlabel="share of decode token's experts covered", xlim=(0, 1))
    layers = report["layers"]
    ax2.bar([x["layer"] for x in layers], [x["effective_experts"] for x in layers])
    ax2.set(xlabel="MoE layer", ylabel="effective number of experts used")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
