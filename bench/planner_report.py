#!/usr/bin/python3
"""The figures of bench/planner.py's layout-planner validation: from the cases it measured (or a
planner.json it wrote), the per-(model, N) summary with the issue's targets, the biases of the cost
model, planner.md and planner_scatter.png. It reads records and runs nothing; planner.py --from-json
uses it alone.
"""
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_overhead as po  # noqa: E402  (QUIET: the default --busy)

MODEL_TITLES = {
    "A": "784-512-512-10, ReLU between",
    "B": "4 x (Linear(1024, 1024) + ReLU), 1024 classes",
    "D": "16 x Linear: 512-512 x15, then 512-10, ReLU between",
}
TARGET_MEDIAN_ERROR = 0.15
TARGET_FIRST_CHOICE = 1.05
TARGET_SPEARMAN = 0.8
TARGET_MEMORY_ERROR = 0.10


# --------------------------------------------------------------------------- statistics
def average_ranks(values):
    """1-based ranks of values, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs, ys):
    """Spearman's rank correlation: Pearson's correlation of the average ranks (nan when undefined)."""
    if len(xs) < 2:
        return float("nan")
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


# --------------------------------------------------------------------------- figures
def mark_busy(cases, threshold):
    """record["busy"]: other processes used more than `threshold` of the CPUs during its kept run."""
    for case in cases:
        for record in case["records"]:
            record["busy"] = record["status"] == "ok" and record["others_share"] > threshold


def quiet(records):
    """The records measured, and measured on a quiet machine: the ones the figures are made of."""
    return [r for r in records if r["status"] == "ok" and not r["busy"]]


def round_medians(record, rounds):
    """The median step of each of the record's --rounds runs (each run of a layout has the same number
    of steps, kept one after the other in step_ms), or None with fewer than two."""
    steps = record.get("step_ms", [])
    n = len(steps) // rounds if rounds > 1 else 0
    if n == 0 or n * rounds != len(steps):
        return None
    return [statistics.median(steps[i * n:(i + 1) * n]) for i in range(rounds)]


def self_agreement(records, rounds):
    """The measurement against itself: over every pair of rounds, Spearman's correlation of the layouts'
    medians in one round with the other's, and the median over the layouts of |a - b| / b; each the mean
    over the pairs. What the machine's noise leaves for any prediction to agree with (a prediction is
    compared with the median of all rounds, somewhat steadier than one). None without two rounds."""
    medians = [round_medians(r, rounds) for r in records]
    if len(records) < 2 or any(m is None for m in medians):
        return None
    pairs = [(a, b) for a in range(rounds) for b in range(rounds) if a < b]
    rho = statistics.fmean(spearman([m[a] for m in medians], [m[b] for m in medians]) for a, b in pairs)
    diff = statistics.fmean(statistics.median(abs(m[a] - m[b]) / m[b] for m in medians) for a, b in pairs)
    return {"spearman": rho, "median_difference": diff}


def summarize(case, rounds=1):
    """The per-(model, N) figures and their verdicts, over the layouts measured quietly; with --rounds
    of 2 or more, the measurement's agreement with itself beside them."""
    measured = [r for r in case["records"] if r["status"] == "ok"]
    ok = quiet(case["records"])
    s = {"model": case["model"], "ranks": case["ranks"], "threads": case["threads"], "layouts": len(case["records"]),
         "measured": len(measured), "failed": len(case["records"]) - len(measured), "profile": case["profile_note"],
         "busy": len(measured) - len(ok)}
    first = case["records"][0]
    s["best_predicted"] = {"text": first["text"], "predicted_ms": first["predicted_ms"]}
    s["first_choice_ms"] = first.get("measured_ms")
    s["first_choice_busy"] = first["busy"]
    if not ok:
        return s
    # With --final-rounds, the first choice against the contenders on their final rounds alone (run side
    # by side, after the others fell more than 10 % behind); without, against every layout.
    final = [r for r in ok if r.get("final_ms")]
    key = "final_ms" if first in final and len(final) > 1 else "measured_ms"
    pool = final if key == "final_ms" else ok
    fastest = min(pool, key=lambda r: r[key])
    s["first_choice_on"] = "final rounds" if key == "final_ms" else "all rounds"
    s["first_choice_ms"] = first.get(key)
    s["best_measured"] = {"text": fastest["text"], "measured_ms": fastest[key],
                          "predicted_ms": fastest["predicted_ms"], "plan_rank": fastest["plan_rank"]}
    s["first_choice_ratio"] = first[key] / fastest[key] if first in pool else None
    s["median_error"] = statistics.median(abs(r["time_error"]) for r in ok)
    s["median_signed_error"] = statistics.median(r["time_error"] for r in ok)
    s["spearman"] = spearman([r["predicted_ms"] for r in ok], [r["measured_ms"] for r in ok])
    memory = [abs(r["memory_error"]) for r in ok if r["memory_error"] is not None]
    s["worst_memory_error"] = max(memory) if memory else None
    worst = max((r for r in ok if r["memory_error"] is not None), key=lambda r: abs(r["memory_error"]), default=None)
    s["worst_memory_layout"] = worst["text"] if worst else None
    s["self_agreement"] = self_agreement(ok, rounds)
    s["verdicts"] = {
        "median error <= 15%": s["median_error"] <= TARGET_MEDIAN_ERROR,
        "first choice <= 1.05 x fastest": s["first_choice_ratio"] is not None
        and s["first_choice_ratio"] <= TARGET_FIRST_CHOICE,
        "Spearman >= 0.8": s["spearman"] >= TARGET_SPEARMAN,
        "memory within 10%": s["worst_memory_error"] is not None and s["worst_memory_error"] <= TARGET_MEMORY_ERROR,
    }
    return s


def verdict(ok):
    return "PASS" if ok else "FAIL"


def pct(x, signed=False):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def first_choice_cell(s):
    if not s.get("first_choice_ms"):
        return "failed"
    return f"{s['first_choice_ms']:.2f}" + (" BUSY" if s["first_choice_busy"] else "")


def summary_rows(summaries):
    rows = []
    for s in summaries:
        v = s.get("verdicts", {})
        bm = s.get("best_measured")
        ratio = s.get("first_choice_ratio")
        rho = s.get("spearman", float("nan"))
        rows.append([
            s["model"], f"{s['ranks']} x {s['threads']}t", f"{s['layouts']} ({s['failed']} failed, {s['busy']} BUSY)",
            f"{s['best_predicted']['text']}: {s['best_predicted']['predicted_ms']:.2f}",
            f"{bm['text']}: {bm['measured_ms']:.2f} (plan #{bm['plan_rank'] + 1}"
            + (", final rounds)" if s.get("first_choice_on") == "final rounds" else ")") if bm else "-",
            first_choice_cell(s),
            f"{ratio:.3f} {verdict(v.get('first choice <= 1.05 x fastest'))}" if ratio else "-",
            f"{pct(s.get('median_error'))} {verdict(v.get('median error <= 15%'))}" if v else "-",
            pct(s.get("median_signed_error"), signed=True),
            f"{rho:.3f} {verdict(v.get('Spearman >= 0.8'))}" if v else "-",
            f"{pct(s.get('worst_memory_error'))} {verdict(v.get('memory within 10%'))}" if v else "-",
            f"{s['self_agreement']['spearman']:.3f}, {pct(s['self_agreement']['median_difference'])}"
            if s.get("self_agreement") else "-",
        ])
    return rows


SUMMARY_HEADER = ["model", "N x threads", "layouts (failed, BUSY: not in the figures)", "best predicted (ms)", "best measured (ms)",
                  "first choice measured ms", "first / fastest (<= 1.05)", "median abs. error (<= 15%)",
                  "median signed error", "Spearman (>= 0.8)", "worst memory error (<= 10%)",
                  "one round vs another: Spearman, median difference"]


def bias_rows(records, key):
    """Signed error (predicted - measured) / measured grouped by key(record): count, median, range."""
    groups = {}
    for r in quiet(records):
        groups.setdefault(key(r), []).append(r["time_error"])
    return [[g, len(e), pct(statistics.median(e), True), f"{pct(min(e), True)} .. {pct(max(e), True)}"]
            for g, e in sorted(groups.items(), key=lambda kv: str(kv[0]))]


BIAS_KEYS = {
    "shape (D x P x T)": lambda r: f"D{r['replicas']} P{r['stages']} T{r['tensor_parallel']}",
    "schedule": lambda r: r["schedule"] if r["stages"] > 1 else "(one stage)",
    "micro-batches": lambda r: r["micro_batches"],
    "ZeRO": lambda r: f"zero {r['zero']}",
    "activations": lambda r: "keep" if r["keep_activations"] else "recompute",
    "predicted bottleneck": lambda r: r["predicted"]["bottleneck"],
}


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def layout_rows(case):
    rows = []
    for r in case["records"]:
        if r["status"] == "ok":
            mem = f"{r['measured_peak_mib']:.2f}" if r["measured_peak_mib"] else "-"
            busy = (f" BUSY {r['others_share']:.0%}" if r["busy"] else "") + (f" + {r['final_ms']:.2f}" if r.get("final_ms") else "")
            rows.append([r["plan_rank"] + 1, r["text"], f"{r['predicted_ms']:.3f}", f"{r['measured_ms']:.3f}{busy}",
                         pct(r["time_error"], True), r["predicted"]["bottleneck"], f"{r['predicted_peak_mib']:.2f}",
                         mem, pct(r["memory_error"], True)])
        else:
            rows.append([r["plan_rank"] + 1, r["text"], f"{r['predicted_ms']:.3f}", "FAILED", "-",
                         r["predicted"]["bottleneck"], f"{r['predicted_peak_mib']:.2f}", "-", r["error"]])
    return rows


LAYOUT_HEADER = ["plan #", "layout", "predicted ms", "measured ms", "error", "predicted bottleneck",
                 "predicted peak MiB", "measured peak MiB", "memory error"]


def failures(cases):
    return [(c["model"], c["ranks"], r) for c in cases for r in c["records"] if r["status"] != "ok"]


def report_text(cases, summaries, meta, scatter):
    """planner.md: what ran, the summary with verdicts, the biases, the failures, every layout."""
    out = ["# Layout planner against measurement\n",
           f"`{' '.join(meta['command'])}` on {meta['host']}, {meta['cpus']} CPUs, started {meta['started_utc']} UTC; "
           f"batch {meta['batch_size']}, {meta['steps']} steps ({meta['warmup']} warm-up; more where they would last "
           f"under {meta.get('min_seconds', 0):g} s), {meta['rounds']} round(s) "
           f"and {meta.get('final_rounds', 0)} more of the first choice and the layouts within 10 % of the fastest, "
           f"--optimizer {meta['optimizer']}, max micro-batches {meta['max_micro_batches'] or 'partition default'}; "
           f"load average {meta.get('load_start', float('nan')):.2f} at start, "
           f"{meta.get('load_end', float('nan')):.2f} at the end. A run during which other processes used more than "
           f"{meta['busy']:.0%} of the CPUs is BUSY, left out of the figures and the plot's filled points.\n",
           "Models: " + "; ".join(f"{m}: {MODEL_TITLES[m]}" for m in dict.fromkeys(c["model"] for c in cases))
           + ".\n",
           "Profiles: " + "; ".join(f"{c['model']} N={c['ranks']}: {c['profile_note']}" for c in cases) + ".\n",
           "## Summary (ms per step)\n", md_table(SUMMARY_HEADER, summary_rows(summaries)), "",
           "The last column is the measurement against itself: each layout's median step in one round against "
           "another round's (Spearman over the layouts, and the median relative difference), the mean over the "
           "pairs of rounds. It is what this machine's noise lets any prediction reach; the figures before it "
           "compare the prediction with the median over all rounds, which is somewhat steadier than one round.\n",
           f"![predicted against measured]({os.path.basename(scatter)})\n" if scatter else "",
           "## Where the cost model leans (signed error = (predicted - measured) / measured; negative: "
           "predicted too fast)\n"]
    for c in cases:
        out += [f"### Model {c['model']}, N = {c['ranks']}, by shape\n",
                md_table(["shape", "layouts", "median signed error", "range"],
                         bias_rows(c["records"], BIAS_KEYS["shape (D x P x T)"])), ""]
    every = [r for c in cases for r in c["records"]]
    for name, key in BIAS_KEYS.items():
        if name != "shape (D x P x T)":
            out += [f"### All cases, by {name}\n", md_table([name, "layouts", "median signed error", "range"],
                                                            bias_rows(every, key)), ""]
    failed = failures(cases)
    out += ["## Layouts the planner accepted that train did not run\n"]
    out += [md_table(["model", "N", "layout", "train flags", "error"],
                     [[m, n, r["text"], f"`{r['train_flags']}`", r["error"]] for m, n, r in failed]) if failed
            else "None.", ""]
    for c in cases:
        out += [f"## Every layout: model {c['model']}, N = {c['ranks']}\n",
                "(+ X: a contender, run --final-rounds more times: X ms, its median over those rounds, on which the "
                "first choice is compared with the other contenders)\n" if any(r.get("contender") for r in c["records"])
                else "", md_table(LAYOUT_HEADER, layout_rows(c)), ""]
    return "\n".join(out) + "\n"


def scatter_plot(cases, path):
    """Predicted against measured ms, log-log: a colour per model, a marker per N, y = x."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("planner: no matplotlib, no scatter plot", file=sys.stderr)
        return None
    colours = dict(zip(MODEL_TITLES, ("tab:blue", "tab:orange", "tab:green")))
    markers = {1: "o", 2: "s", 4: "^"}
    fig, ax = plt.subplots(figsize=(7, 6))
    values = []
    busy_label = "BUSY run (not in the figures)"
    for c in cases:
        colour, marker = colours.get(c["model"], "tab:gray"), markers.get(c["ranks"], "D")
        ok, busy = quiet(c["records"]), [r for r in c["records"] if r["busy"]]
        for records, style in ((ok, dict(color=colour, alpha=0.7, label=f"model {c['model']}, N={c['ranks']}")),
                               (busy, dict(facecolors="none", edgecolors=colour, label=busy_label))):
            if records:
                xs, ys = [r["measured_ms"] for r in records], [r["predicted_ms"] for r in records]
                values += xs + ys
                ax.scatter(xs, ys, s=18, marker=marker, **style)
                if records is busy:
                    busy_label = "_" + busy_label  # one legend entry for all BUSY points
    if not values:
        plt.close(fig)
        return None
    lo, hi = min(values) / 1.3, max(values) * 1.3
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    ax.fill_between([lo, hi], [lo * (1 - TARGET_MEDIAN_ERROR), hi * (1 - TARGET_MEDIAN_ERROR)],
                    [lo * (1 + TARGET_MEDIAN_ERROR), hi * (1 + TARGET_MEDIAN_ERROR)], color="gray", alpha=0.15,
                    label="±15 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured ms per step (median)")
    ax.set_ylabel("predicted ms per step (partition --plan)")
    ax.set_title("Layout planner: predicted against measured step time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_report(cases, summaries):
    print("\n### Summary (ms per step; BUSY layouts left out of the figures)\n")
    print(md_table(SUMMARY_HEADER, summary_rows(summaries)))
    print("\n### Signed error (predicted - measured) / measured by shape; negative: predicted too fast\n")
    rows = []
    for c in cases:
        rows += [[c["model"], c["ranks"]] + row for row in bias_rows(c["records"], BIAS_KEYS["shape (D x P x T)"])]
    print(md_table(["model", "N", "shape", "layouts", "median signed error", "range"], rows))
    every = [r for c in cases for r in c["records"]]
    for name in ("schedule", "ZeRO", "activations"):
        print(f"\nall cases, by {name}:\n")
        print(md_table([name, "layouts", "median signed error", "range"], bias_rows(every, BIAS_KEYS[name])))
    failed = failures(cases)
    print(f"\n{len(failed)} accepted layout(s) failed under train" + (":" if failed else "."))
    for m, n, r in failed:
        print(f"- model {m}, N={n}, {r['text']} ({r['train_flags']}): {r['error']}")


CASE_KEYS = ("model", "ranks", "threads", "profile_note", "profile", "plan", "records")


def write_outputs(cases, summaries, meta, out, with_json=True):
    """planner.md, planner_scatter.png and (with_json) planner.json: meta, summaries and cases."""
    os.makedirs(out, exist_ok=True)
    scatter = scatter_plot(cases, os.path.join(out, "planner_scatter.png"))
    with open(os.path.join(out, "planner.md"), "w") as f:
        f.write(report_text(cases, summaries, meta, scatter))
    if with_json:
        with open(os.path.join(out, "planner.json"), "w") as f:
            json.dump(dict(meta, summaries=summaries, cases=[{k: c[k] for k in CASE_KEYS} for c in cases]), f)
    print(f"\nwrote {out}/planner.md" + (", planner.json" if with_json else "") + (", planner_scatter.png" if scatter else ""))

def report_from_json(path, out):
    """Prints the tables again and rewrites planner.md and the plot from a planner.json, without running
    anything (after a change to the figures or the plot)."""
    dump = json.load(open(path))
    cases = dump.pop("cases")
    dump.pop("summaries", None)
    dump.setdefault("busy", po.QUIET)
    mark_busy(cases, dump["busy"])
    summaries = [summarize(c, dump.get("rounds", 1)) for c in cases]
    print_report(cases, summaries)
    write_outputs(cases, summaries, dump, out, with_json=False)
    return 0
