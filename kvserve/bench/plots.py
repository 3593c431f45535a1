"""PNG plots of benchmark results (matplotlib, Agg backend, imported lazily: it is
part of the ``bench`` extra, not a core dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["plot_grouped_bars", "plot_compare", "plot_roofline", "plot_serve"]


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a clear error if it is missing."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("plots need matplotlib: pip install 'kvserve[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grouped_bars(
    path: str | Path,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    ylabel: str,
    subtitle: str = "",
) -> Path:
    """Bars for each group, one bar per series, each bar labelled with its value."""
    plt = _pyplot()
    n = max(1, len(series))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) * n), 4.5))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=15 if len(groups) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def plot_compare(
    path: str | Path, rows: Sequence[Mapping[str, Any]], title: str, subtitle: str = ""
) -> Path:
    """Useful and total tok/s per system; ``rows`` have ``name``, ``useful_tok_s``,
    ``total_tok_s``."""
    return plot_grouped_bars(
        path,
        [str(r["name"]) for r in rows],
        {
            "useful output tok/s": [float(r["useful_tok_s"]) for r in rows],
            "total tok/s": [float(r["total_tok_s"]) for r in rows],
        },
        title,
        "tokens / s",
        subtitle,
    )


def plot_roofline(path: str | Path, result: Any, subtitle: str = "") -> Path:
    """GEMM GFLOP/s per shape from a :class:`~kvserve.bench.roofline.RooflineResult`."""
    shapes = list(result.gemm_gflops)
    bw = (
        f"bandwidth: sum {result.sum_bandwidth_gbs:.1f} GB/s, "
        f"GEMV {result.gemv_bandwidth_gbs:.1f} GB/s, {result.threads} threads"
    )
    return plot_grouped_bars(
        path,
        shapes,
        {"fp32 GFLOP/s": [result.gemm_gflops[s] for s in shapes]},
        "fp32 GEMM roofline",
        "GFLOP/s",
        (subtitle + "\n" if subtitle else "") + bw,
    )


def plot_serve(path: str | Path, metrics: Any, subtitle: str = "") -> Path:
    """Mean / median / P99 of TTFT, TPOT, ITL and E2EL (ms) from ServeMetrics."""
    names = ["ttft", "tpot", "itl", "e2el"]
    lat = metrics.latency_ms
    series = {
        stat: [float(lat[m].get(stat, 0.0)) for m in names] for stat in ("mean", "median", "p99")
    }
    title = (
        f"serving: {metrics.completed} ok, {metrics.request_throughput:.2f} req/s, "
        f"{metrics.output_throughput:.1f} out tok/s"
    )
    return plot_grouped_bars(path, [n.upper() for n in names], series, title, "ms", subtitle)
