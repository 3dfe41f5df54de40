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


# One look per policy of a sweep: a base policy's own colour and marker, its "+ahead" variant the same colour dashed
# with hollow markers (so the pairs read together and no two lines look alike).
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h", "<", ">", "p")
DASHED = "+ahead"


def sweep_styles(policies: list[str]) -> dict[str, dict[str, Any]]:
    """matplotlib line keywords for each policy, distinct for up to 20 base policies (each with its +ahead)."""
    from matplotlib import colormaps

    bases = list(dict.fromkeys(p.removesuffix(DASHED) for p in policies))
    colours = colormaps["tab10" if len(bases) <= 10 else "tab20"].colors  # type: ignore[attr-defined]
    styles = {}
    for p in policies:
        i = bases.index(p.removesuffix(DASHED))
        colour, marker = colours[i % len(colours)], MARKERS[i % len(MARKERS)]
        ahead = p.endswith(DASHED)
        styles[p] = {"color": colour, "marker": marker, "linestyle": "--" if ahead else "-",
                     "markerfacecolor": "white" if ahead else colour, "markeredgecolor": colour}  # fmt: skip
    return styles


def plot_sweep(rows: list[dict[str, Any]], out: str) -> None:
    """Decode hit rate and predicted tok/s against the pool's share of all experts, one line per policy."""
    plt = _pyplot()
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["policy"]].append(r)
    styles = sweep_styles(list(by))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, rs in by.items():
        rs.sort(key=lambda r: r["fraction"])
        x = [100 * r["fraction"] for r in rs]
        ax1.plot(x, [100 * r["decode_hit_rate"] for r in rs], label=name, **styles[name])
        ax2.plot(x, [r["tok_s_aggregate"] for r in rs], label=name, **styles[name])
    ax1.set(xlabel="pool, % of all experts", ylabel="decode hit rate, %", title="hit rate")
    ax2.set(xlabel="pool, % of all experts", ylabel="predicted decode tokens/s", title="speed (replay's cost model)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, title="policy")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
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
