"""`triforce plan --plot`: a PNG of predicted per-token latency against context length."""

from pathlib import Path

from triforce_cli.errors import ConfigError
from triforce_cli.plan.model import Row

OFFLOAD_STYLES = {"none": "-", "kv": "--"}


def pyplot():
    """matplotlib's pyplot drawing to files; asked for before a bench or a plan runs, so a missing package fails early."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install matplotlib") from None
    return plt


def plot_predicted_latency(curves: list[tuple[int, tuple[Row, ...]]], path: Path, title: str) -> None:
    """One line per mode (a colour each) and offload setting (solid: none, dashed: kv) over the contexts of curves
    ((context, its rows) pairs); points whose memory does not fit the device are drawn hollow."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    modes = list(dict.fromkeys(row.mode for _, rows in curves for row in rows))
    for mode, offload in dict.fromkeys((row.mode, row.offload) for _, rows in curves for row in rows):
        points = [(c, row) for c, rows in curves for row in rows if (row.mode, row.offload) == (mode, offload)]
        contexts, latencies = [c for c, _ in points], [row.ms_per_token for _, row in points]
        colour = f"C{modes.index(mode)}"
        axes.plot(contexts, latencies, OFFLOAD_STYLES[offload], color=colour, label=f"{mode}, offload {offload}")
        fills = [colour if row.fits else "none" for _, row in points]
        axes.scatter(contexts, latencies, facecolors=fills, edgecolors=colour, zorder=3)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.xaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value / 1024:g}K"))
    axes.yaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:g}"))
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("predicted latency (ms/token)")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=7, title="hollow: does not fit", title_fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
