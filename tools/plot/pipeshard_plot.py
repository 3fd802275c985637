#!/usr/bin/python3
"""Draws pipeshard's pictures with matplotlib: partition's per-stage chart and train's curves.

The C++ tools (tools/plot/plot.h) run it with Debian's /usr/bin/python3 (or $PIPESHARD_PYTHON):

  pipeshard_plot.py --check OUT.svg|OUT.png     can OUT be drawn? (matplotlib, extension, folder)
  pipeshard_plot.py DATA.json OUT.svg|OUT.png   draw the picture DATA describes

DATA is one JSON object whose "kind" is "partition" or "train" (tools/plot/pictures.h makes both).
OUT's extension chooses the format. The picture goes to a temporary file in OUT's folder
that is renamed over OUT, so a reader never sees half a file. Any problem: one line on
stderr and exit status 1 (2 for a bad command line).
"""
import json
import os
import sys
import tempfile

FORMATS = (".svg", ".png")


class PlotError(Exception):
    pass


def output_format(path):
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise PlotError(f"'{path}' must end in .svg or .png")
    return ext[1:]


def check_output(path):
    """Raises PlotError unless matplotlib imports and a file can be written as `path`."""
    output_format(path)
    if os.path.isdir(path):
        raise PlotError(f"'{path}' is a folder")
    folder = os.path.dirname(path) or "."
    if not os.path.exists(folder):
        raise PlotError(f"cannot write '{path}': folder '{folder}' does not exist")
    if not os.path.isdir(folder):
        raise PlotError(f"cannot write '{path}': '{folder}' is not a folder")
    try:  # a real write finds read-only file systems and permissions, even as root
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".pipeshard-plot-", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PlotError(f"cannot write '{path}': {e.strerror}")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotError(f"{sys.executable} cannot import matplotlib ({e}); install python3-matplotlib")


def new_figure():
    import matplotlib
    matplotlib.use("Agg")  # no display: files only
    matplotlib.rcParams.update({
        "svg.fonttype": "none",    # text stays text: searchable, smaller files
        "svg.hashsalt": "pipeshard",  # stable element ids: the same data gives the same file
        "text.parse_math": False,  # a '$' in a model's path is not TeX
        "font.size": 10,
    })
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=(8, 4.8), dpi=100)


def bytes_unit(largest):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= scale:
            return unit, scale
    return "B", 1


def bytes_text(n):
    """As partition's table writes sizes: '40 B', '468.0 KiB', '1.3 MiB'."""
    unit, scale = bytes_unit(n)
    return f"{n} B" if scale == 1 else f"{n / scale:.1f} {unit}"


def count_unit(largest):
    for unit, scale in (("millions", 1e6), ("thousands", 1e3)):
        if largest >= scale:
            return unit, scale
    return "", 1


def plural(n, word):
    """'1 stage', '2 stages', '2 processes'."""
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith(("s", "h")) else "s")


def partition_title(data):
    layout = plural(len(data["stages"]), "pipeline stage")
    if data["tensor_parallel"] > 1:
        layout += f" × {data['tensor_parallel']} tensor-parallel shards"
    return (f"{os.path.basename(data['model'])}: {data['total_parameters']:,} parameters\n"
            f"{layout}, balanced by {data['balance_by']}")


def memory_note(data):
    return (f"memory per rank: fp32 weights + gradients + {plural(data['optimizer_slots'], 'optimizer slot')}, "
            f"activations of batch {data['batch_size']} in {plural(data['micro_batches'], 'micro-batch')} "
            f"under {data['schedule']}")


def draw_partition(data):
    """One pair of bars per stage: trainable parameters (left axis) and the estimated
    memory of one rank of that stage (right axis); the mean stage and the balance."""
    fig, ax = new_figure()
    from matplotlib.ticker import MaxNLocator
    stages = data["stages"]
    x = list(range(len(stages)))
    params = [s["parameters"] for s in stages]
    memory = [s["memory_bytes"] for s in stages]
    top_p, top_m = max(max(params), 1), max(max(memory), 1)  # a frozen model has no parameters
    p_unit, p_scale = count_unit(top_p)
    m_unit, m_scale = bytes_unit(top_m)
    width = 0.38
    p_color, m_color = "tab:blue", "tab:orange"
    bars_p = ax.bar([i - width / 2 for i in x], [p / p_scale for p in params], width,
                    color=p_color, label="trainable parameters (left axis)")
    mem_ax = ax.twinx()
    bars_m = mem_ax.bar([i + width / 2 for i in x], [m / m_scale for m in memory], width,
                        color=m_color, label="estimated memory per rank (right axis)")
    # The mean stage of what was balanced, across its own bars only (the axes differ).
    if data["balance_by"] == "memory":
        mean = sum(memory) / len(memory)
        mean_line = mem_ax.hlines([mean / m_scale] * len(x), [i - 0.05 * width for i in x],
                                  [i + 1.15 * width for i in x], colors="black", linestyles="--", linewidth=1,
                                  label=f"mean stage: {bytes_text(round(mean))}")
    else:
        mean = sum(params) / len(params)
        mean_line = ax.hlines([mean / p_scale] * len(x), [i - 1.15 * width for i in x], [i + 0.05 * width for i in x],
                              colors="black", linestyles="--", linewidth=1,
                              label=f"mean stage: {mean:,.0f} parameters")
    if len(stages) <= 12:  # the values themselves, while they fit
        ax.bar_label(bars_p, labels=[f"{p:,}" for p in params], padding=2, fontsize=8)
        mem_ax.bar_label(bars_m, labels=[bytes_text(m) for m in memory], padding=2, fontsize=8)
    layers = [str(s["first_layer"]) if s["first_layer"] == s["last_layer"] else f"{s['first_layer']}-{s['last_layer']}"
              for s in stages]
    if len(stages) <= 8:
        ax.set_xticks(x, [f"{s['stage']}\nlayers {l}" for s, l in zip(stages, layers)])
    elif len(stages) <= 24:
        ax.set_xticks(x, [str(s["stage"]) for s in stages])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_xlim(-0.6, len(stages) - 0.4)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("trainable parameters" + (f" ({p_unit})" if p_unit else ""), color=p_color)
    mem_ax.set_ylabel(f"estimated memory per rank ({m_unit})", color=m_color)
    ax.tick_params(axis="y", colors=p_color)
    mem_ax.tick_params(axis="y", colors=m_color)
    ax.set_ylim(0, top_p / p_scale * 1.45)  # headroom for the labels and the legend
    mem_ax.set_ylim(0, top_m / m_scale * 1.45)
    ax.set_title(partition_title(data))
    ax.legend(handles=[bars_p, bars_m, mean_line], loc="upper left", fontsize=8)
    ax.text(0.99, 0.97, f"balance: largest / mean stage {data['balance_by']} = {data['balance']:.3f}",
            transform=ax.transAxes, ha="right", va="top", fontsize=9,
            bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.7"))
    fig.text(0.01, 0.01, memory_note(data), fontsize=7.5, color="0.3")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def train_title(data):
    lay = data["layout"]
    parts = []
    if lay["replicas"] > 1:
        parts.append(f"{lay['replicas']} data-parallel replicas")
    if lay["stages"] > 1:
        parts.append(f"{lay['stages']} pipeline stages ({lay['schedule']}, "
                     f"{plural(lay['micro_batches'], 'micro-batch')})")
    if lay["shards"] > 1:
        parts.append(f"{lay['shards']} tensor-parallel shards")
    processes = lay["replicas"] * lay["stages"] * lay["shards"]
    run = f"{os.path.basename(data['model'])}: training with {data['optimizer']}, batch {data['batch_size']}"
    if not parts:
        return run + ", 1 process"
    return f"{run}\n{plural(processes, 'process')}: " + " × ".join(parts)


def draw_train(data):
    """The loss of every optimizer step; with evaluation data, the eval loss and accuracy
    after each epoch (accuracy on the right axis); epochs along the top."""
    fig, ax = new_figure()
    from matplotlib.ticker import MaxNLocator
    steps, loss = data["steps"], data["loss"]
    evals = data.get("eval", [])
    loss_label = ("cross-entropy loss (nats)" if data["loss_name"] == "cross-entropy"
                  else "mean squared error (squared target units)")
    handles = ax.plot(steps, loss, ".-" if len(steps) <= 30 else "-", color="tab:blue", linewidth=1,
                      label=f"training loss per step (last {loss[-1]:.4f})" if loss else "training loss per step")
    if evals:
        handles += ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "s--",
                           color="tab:purple", markersize=5, linewidth=1,
                           label=f"eval loss per epoch (last {evals[-1]['loss']:.4f})")
    accuracy = [(e["step"], 100 * e["accuracy"]) for e in evals if e["accuracy"] >= 0]
    if accuracy:
        acc_ax = ax.twinx()
        handles += acc_ax.plot([a[0] for a in accuracy], [a[1] for a in accuracy], "o-",
                               color="tab:green", markersize=5,
                               label=f"eval accuracy per epoch (last {accuracy[-1][1]:.1f}%)")
        acc_ax.set_ylabel("eval accuracy (%)", color="tab:green")
        acc_ax.tick_params(axis="y", colors="tab:green")
        acc_ax.set_ylim(max(0, min(a[1] for a in accuracy) - 10), 100)
    per_epoch = data["steps_per_epoch"]
    if per_epoch > 0 and steps and steps[-1] >= per_epoch:  # at least one epoch's end to mark
        top = ax.secondary_xaxis("top", functions=(lambda s: s / per_epoch, lambda e: e * per_epoch))
        top.xaxis.set_major_locator(MaxNLocator(integer=True))
        top.set_xlabel("epochs completed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(loss_label)
    ax.set_ylim(bottom=0)
    if steps:
        pad = max(0.5, 0.015 * (steps[-1] - steps[0]))  # whole markers at both ends
        ax.set_xlim(steps[0] - pad, steps[-1] + pad)
    ax.grid(True, alpha=0.3)
    ax.set_title(train_title(data))
    # Below the axes: inside, it would cover the loss or the accuracy somewhere.
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def write_atomically(fig, path):
    fmt = output_format(path)
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            metadata = {"Date": None} if fmt == "svg" else {"Software": None}
            fig.savefig(f, format=fmt, metadata=metadata)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is not what a plain file gets
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv):
    if len(argv) == 3 and argv[1] == "--check":
        check_output(argv[2])
        return 0
    if len(argv) != 3:
        print("usage: pipeshard_plot.py --check OUT | DATA.json OUT", file=sys.stderr)
        return 2
    data_path, out = argv[1], argv[2]
    check_output(out)
    with open(data_path, encoding="utf-8") as f:
        data = json.load(f)
    draw = {"partition": draw_partition, "train": draw_train}.get(data.get("kind"))
    if draw is None:
        raise PlotError(f"{data_path}: unknown kind of picture {data.get('kind')!r}")
    write_atomically(draw(data), out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except PlotError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
    except (OSError, ValueError, KeyError) as e:  # a broken data file, a full disk
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
