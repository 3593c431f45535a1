"""PNG plots of benchmark results (matplotlib, Agg backend, imported lazily: it is
part of the ``bench`` extra, not a core dependency)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["plot_grouped_bars", "plot_compare", "plot_roofline", "plot_serve", "plot_memory"]


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a clear error if it is missing."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("plots need matplotlib: pip install 'kvserve[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write (creating the folder) and close a figure; returns its path."""
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p


def _label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


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
    fig, ax = plt.subplots(figsize=(min(14.0, max(7.0, 0.7 * len(groups) * n + 2)), 4.8))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[_label(v) for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=15 if len(groups) > 4 else 0)
    ax.set_ylabel(ylabel)
    sub = "\n".join(textwrap.fill(line, 100) for line in subtitle.splitlines())
    ax.set_title(title + (f"\n{sub}" if sub else ""), fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.margins(y=0.15)
    return _save(plt, fig, path)


def plot_compare(
    path: str | Path, rows: Sequence[Mapping[str, Any]], title: str, subtitle: str = ""
) -> Path:
    """Useful and total tok/s per system; ``rows`` have ``name``, ``useful_tok_s``,
    ``total_tok_s`` and optionally ``vs_hf_static``, a PairedRatio (its median shown
    under the name)."""
    names = [
        str(r["name"]) + (f"\n{r['vs_hf_static'].median:.2f}x HF static"
                          if r.get("vs_hf_static") else "")
        for r in rows
    ]
    return plot_grouped_bars(
        path,
        names,
        {
            "useful output tok/s": [float(r["useful_tok_s"]) for r in rows],
            "total tok/s": [float(r["total_tok_s"]) for r in rows],
        },
        title,
        "tokens / s",
        subtitle,
    )


def plot_roofline(path: str | Path, result: Any, subtitle: str = "") -> Path:
    """GEMM GFLOP/s per shape from a
    :class:`~kvserve.bench.instruments.roofline.RooflineResult`."""
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
    """Mean / median / P99 of TTFT, TPOT, ITL and E2EL (ms) from ServeMetrics, one
    panel per metric (their scales differ by orders of magnitude)."""
    plt = _pyplot()
    stats = ("mean", "median", "p99")
    fig, axes = plt.subplots(1, 4, figsize=(12.0, 4.2))
    for ax, name in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        values = [float(metrics.latency_ms[name].get(s, 0.0)) for s in stats]
        bars = ax.bar(stats, values, color=["C0", "C1", "C2"])
        ax.bar_label(bars, labels=[_label(v) for v in values], fontsize=8, padding=2)
        ax.set_title(name.upper(), fontsize=9)
        ax.set_ylabel("ms")
        ax.margins(y=0.15)
    title = (
        f"serving: {metrics.completed} ok, {metrics.failed} failed, "
        f"{metrics.request_throughput:.2f} req/s, {metrics.output_throughput:.1f} out tok/s, "
        f"peak concurrency {metrics.peak_concurrency}"
    )
    sub = "\n".join(textwrap.fill(line, 120) for line in subtitle.splitlines())
    fig.suptitle(title + (f"\n{sub}" if sub else ""), fontsize=9)
    return _save(plt, fig, path)


def plot_memory(path: str | Path, results: Sequence[Any], subtitle: str = "") -> Path:
    """Four panels: utilisation and fragmentation, throughput, P99 latency, concurrency."""
    plt = _pyplot()
    short = {"length-bucket": "len-bucket"}
    labels = [f"{r.kv_manager}\n{short.get(r.batching, r.batching)}" for r in results]
    xs = list(range(len(results)))
    fig, axes = plt.subplots(2, 2, figsize=(max(11.0, 1.7 * len(results)), 9.0))

    def bars(ax, series: dict[str, list[float]], title: str, ylabel: str, fmt: str) -> None:
        if not any(v for values in series.values() for v in values):
            ax.text(0.5, 0.5, "not measured (dry run)", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_title(title, fontsize=10)
            ax.set_xticks([])
            ax.set_yticks([])
            return
        n = len(series)
        width = 0.8 / n
        for i, (name, values) in enumerate(series.items()):
            pos = [x + (i - (n - 1) / 2) * width for x in xs]
            b = ax.bar(pos, values, width, label=name)
            ax.bar_label(b, labels=[format(v, fmt) for v in values], fontsize=6, padding=1)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        if n > 1:
            ax.legend(fontsize=7)

    bars(axes[0][0], {"KV utilisation": [100 * r.kv_utilization for r in results],
                      "internal frag.": [100 * r.internal_fragmentation for r in results],
                      "external frag.": [100 * r.external_fragmentation for r in results]},
         "KV memory (share of slots / free blocks)", "%", ".0f")
    bars(axes[0][1], {"per wall second": [r.output_tok_s or 0.0 for r in results],
                      "per CPU second": [r.output_tok_per_cpu_s or 0.0 for r in results]},
         "useful output tokens / s", "tok/s", ".0f")
    bars(axes[1][0], {"P99 latency": [r.p99_latency_s or 0.0 for r in results]},
         "P99 end-to-end latency", "s", ".1f")
    bars(axes[1][1], {"peak running": [float(r.peak_running) for r in results],
                      "mean running": [r.mean_running for r in results],
                      "preemptions": [float(r.preemptions) for r in results]},
         "concurrency and preemptions", "requests", ".0f")
    fig.suptitle("kvserve bench memory" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    return _save(plt, fig, path, dpi=110)
