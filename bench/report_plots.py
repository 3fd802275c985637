"""The pictures of bench/report.py, drawn with Debian's matplotlib (Agg: no display needed).

Each function takes the figures a section measured and writes one PNG; none measures anything.
"""
import matplotlib
import matplotlib.lines
import matplotlib.patches

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

OURS, PEER, BOUND, THEORY = "tab:blue", "tab:orange", "tab:gray", "black"
DPI = 110


def _bytes_label(value, _pos=None):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def _powers_of_two_axis(ax, values, formatter=None):
    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.xaxis.set_major_formatter(FuncFormatter(formatter or (lambda v, _p: f"{v:g}")))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(values[0] / 1.3, values[-1] * 1.3)


def _log_axis_plain(axis, values):
    """A log axis labelled with plain numbers at 1-2-5 steps covering `values`."""
    lo, hi = min(values), max(values)
    ticks = [m * 10 ** e for e in range(-3, 7) for m in (1, 2, 5) if lo / 1.5 <= m * 10 ** e <= hi * 1.5]
    axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig, path, caption, legend_from=None):
    """Writes the figure with `caption` at the bottom and, when legend_from is an axes, one legend
    for the whole figure between the plots and the caption (so that it hides no data)."""
    bottom = 0.05
    if legend_from is not None:
        handles, labels = legend_from.get_legend_handles_labels()
        columns = min(len(labels), 4)  # more in one row would run off the figure
        rows = -(-len(labels) // columns)
        fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8.5, frameon=False,
                   bbox_to_anchor=(0.5, 0.045))
        bottom = 0.08 + 0.04 * rows
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7.5, color="dimgray", wrap=True)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def batch_sweep(path, rows, caption):
    """rows: dicts with batch, ours_ms, torch_ms, bound_ms (Σ sgemm medians of a step)."""
    batches = [r["batch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    left.plot(batches, [r["ours_ms"] for r in rows], "o-", color=OURS, label="pipeshard train")
    left.plot(batches, [r["torch_ms"] for r in rows], "s-", color=PEER, label="PyTorch 1.13")
    left.plot(batches, [r["bound_ms"] for r in rows], "--", color=BOUND, label="sgemm alone (Σ bench_sgemm)")
    left.set_yscale("log")
    _log_axis_plain(left.yaxis, [v for r in rows for v in (r["ours_ms"], r["torch_ms"], r["bound_ms"])])
    left.set_ylabel("step time (ms, log scale)")
    left.set_title("Step time vs batch, 4 × Linear(1024, 1024) + ReLU")
    right.plot(batches, [r["batch"] / r["ours_ms"] * 1e3 for r in rows], "o-", color=OURS, label="pipeshard train")
    right.plot(batches, [r["batch"] / r["torch_ms"] * 1e3 for r in rows], "s-", color=PEER, label="PyTorch 1.13")
    right.plot(batches, [r["batch"] / r["bound_ms"] * 1e3 for r in rows], "--", color=BOUND,
               label="sgemm alone (Σ bench_sgemm)")
    right.set_ylabel("throughput (samples/s)")
    right.set_ylim(bottom=0)
    right.set_title("Throughput = batch / step time")
    for ax in (left, right):
        _powers_of_two_axis(ax, batches)
        ax.set_xlabel("batch size (samples per step, log scale)")
        ax.grid(True, which="major", alpha=0.3)
    _save(fig, path, caption, legend_from=left)


def parallel(path, pipeline_rows, layouts, caption):
    """pipeline_rows: (M, schedule, speedup); layouts: (label, speedup, is_peer) over 1 rank x 1 thread."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.6), gridspec_kw={"width_ratios": [1, 1.05]})
    ms = sorted({m for m, _, _ in pipeline_rows})
    fine = [2 ** (k / 20) for k in range(0, int(20 * (ms[-1].bit_length() - 1)) + 1)]
    left.plot(fine, [2 * m / (m + 1) for m in fine], "-", color=THEORY, lw=1, label="theory P·M/(M+P−1), P = 2")
    for schedule, marker, color in (("1f1b", "o-", OURS), ("gpipe", "s--", "tab:green"), ("zb-h1", "^-", "tab:orange"),
                                    ("interleaved", "D--", "tab:purple"), ("zb-v", "v-", "tab:red")):
        pts = sorted((m, s) for m, sch, s in pipeline_rows if sch == schedule)
        if pts:
            left.plot([m for m, _ in pts], [s for _, s in pts], marker, color=color, label=f"measured, {schedule}")
    left.axhline(1, color=BOUND, lw=0.8, ls=":")
    _powers_of_two_axis(left, ms)
    left.set_ylim(0, 2.1)
    left.set_xlabel("micro-batches M per step (log scale)")
    left.set_ylabel("speedup = T(1 rank × 1 thread) / T")
    left.set_title("Pipeline, 2 stages × 1 thread, batch 256")
    left.legend(loc="best", fontsize=8.5)
    left.grid(True, alpha=0.3)
    labels = [label for label, _, _ in layouts]
    values = [value for _, value, _ in layouts]
    bars = right.barh(range(len(layouts)), values, color=[PEER if peer else OURS for _, _, peer in layouts])
    right.axvline(2, color=THEORY, lw=1, ls="--", label="ideal on 2 cores: 2")
    for bar, value in zip(bars, values):
        right.text(value - 0.04, bar.get_y() + bar.get_height() / 2, f"{value:.2f}", va="center", ha="right",
                   fontsize=8.5, color="white", fontweight="bold")
    right.set_yticks(range(len(layouts)))
    right.set_yticklabels(labels, fontsize=8.5)
    right.invert_yaxis()
    right.set_xlim(0, 2.2)
    right.set_xlabel("speedup = T(1 rank × 1 thread) / T  (higher is better)")
    right.set_title("Five ways to use the 2 cores")
    right.legend(handles=[matplotlib.patches.Patch(color=OURS, label="ours"),
                          matplotlib.patches.Patch(color=PEER, label="PyTorch"),
                          matplotlib.lines.Line2D([], [], color=THEORY, ls="--", label="ideal: 2")],
                 loc="lower right", fontsize=8.5, framealpha=0.95)
    right.grid(True, axis="x", alpha=0.3)
    _save(fig, path, caption)


def allreduce(path, curves, caption):
    """curves: (label, [(bytes, busbw GB/s, time s)], style, color)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    sizes = sorted({size for _, pts, _, _ in curves for size, _, _ in pts})
    for label, pts, style, color in curves:
        left.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label, ms=4)
        right.plot([p[0] for p in pts], [p[2] * 1e6 for p in pts], style, color=color, label=label, ms=4)
    left.set_ylabel("bus bandwidth (GB/s) = bytes / time · 2(n−1)/n")
    left.set_ylim(bottom=0)
    left.set_title("Bus bandwidth, 2 processes, float32")
    right.set_yscale("log")
    right.yaxis.set_major_locator(LogLocator(base=10))
    right.set_ylabel("time per all-reduce or pair (µs, log scale)")
    right.set_title("Time")
    every_other = sizes[::2]
    for ax in (left, right):
        _powers_of_two_axis(ax, every_other, _bytes_label)
        ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.set_xlabel("message size (bytes per rank, log scale)")
        ax.grid(True, which="major", alpha=0.3)
    _save(fig, path, caption, legend_from=left)


def partition_speed(path, series, caption):
    """series: (stages, [(layers, wall seconds)])."""
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    markers = "osD^v"
    layer_counts = sorted({layers for _, pts in series for layers, _ in pts})
    for k, (stages, pts) in enumerate(series):
        label = "--stages 1 (import + write, no search)" if stages == 1 else f"--stages {stages}"
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker=markers[k % len(markers)], label=label, ms=5,
                color=BOUND if stages == 1 else None, ls="--" if stages == 1 else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(layer_counts)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    _log_axis_plain(ax.yaxis, [t * 1e3 for _, pts in series for _, t in pts])
    ax.set_xlabel("Linear layers in the model (log scale)")
    ax.set_ylabel("partition wall time (ms, log scale)")
    ax.set_title("partition: time vs model depth")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8.5)
    _save(fig, path, caption)
