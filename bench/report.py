#!/usr/bin/python3
"""Run every pipeshard benchmark in one invocation and write a Markdown report with plots.

How to run, from the repository root after building (cmake --build build --target train partition
bench_sgemm bench_allreduce):
    /usr/bin/python3 bench/report.py [--quick] [--sections cpu,batch,parallel,allreduce,partition,data,gpu,python]
                                     [--out bench/reports/DATE.md] [--build-dir build] [--baseline-build DIR]
                                     [--quiet-budget SECONDS]

Sections (default all; each alternates ours and PyTorch where there is a peer):
  cpu        models A and B against PyTorch (bench/cpu_vs_pytorch.py's race)
  batch      model B's layers at batch 32..512 against PyTorch: step time and samples/s vs batch
  parallel   data, pipeline and tensor parallelism across 2 processes, and PyTorch DDP
             (bench/distributed.py's measurement): pipeline speedup vs micro-batches against P·M/(M+P−1)
  allreduce  bus bandwidth vs message size: the communicator's all-reduce, blocking and async
             (bench_allreduce under mpirun), raw MPI_Allreduce, and PyTorch's gloo; and ZeRO's
             reduce-scatter + all-gather of the same buffer, ours and raw MPI's
  partition  `partition` wall time on synthetic deep MLPs of 100..5000 layers, 2..64 stages
  data       start-up, steps/s and memory per rank with data of 0.1 to 16 GB (bench/data_size.py);
             --baseline-build DIR adds an in-memory build beside it
  gpu        only where nvidia-smi finds a GPU; otherwise the report says "not run: no GPU"
  python     pipeshard.train against the train tool on model B, paired rounds: per-step and whole-call
             times (bench/python_overhead.py; needs the module, cmake --build build --target _pipeshard);
             --quiet-budget S lets it spend up to S seconds waiting for quiet moments and running again
             the rounds that other work disturbed (a difference near zero drowns in a busy machine's noise)
The report goes to --out (default bench/reports/<UTC date>.md), its PNGs to the folder of the same
name without .md. The header records the date, machine, load average and the CPU time that other
processes used while it ran, the commit, and the versions of torch, OpenBLAS and Open MPI. A default
run takes about 6 minutes on the quiet 2-core VM; --quick (fewer rounds and steps) about 1.5.

It is a benchmark: it exits 0 whatever the figures, and 2 when it cannot run (a tool missing, no
torch, no mpirun, a section it does not know) or when a section failed (the report says which).
"""
import argparse
import datetime
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_vs_pytorch as cvp  # noqa: E402
import data_size  # noqa: E402
import python_overhead  # noqa: E402
import report_allreduce as allreduce  # noqa: E402
import report_partition as partition  # noqa: E402
import report_plots as plots  # noqa: E402
import report_training as training  # noqa: E402

ROOT = cvp.ROOT
SECTIONS = ("cpu", "batch", "parallel", "allreduce", "partition", "data", "gpu", "python")
TOOLS = {"cpu": ("train", "bench_sgemm"), "batch": ("train", "bench_sgemm"), "parallel": ("train",),
         "allreduce": ("bench_allreduce",), "partition": ("partition",), "data": ("train",), "gpu": ("train",),
         "python": ("train",)}
NEEDS_MPI = {"parallel", "allreduce", "data"}
NEEDS_TORCH = {"cpu", "batch", "parallel", "allreduce", "data", "python"}
OTHERS_NOISY = 0.05  # other processes used more than this share of the machine: say so


# --------------------------------------------------------------------------- Markdown
class Doc:
    """The report's Markdown, appended to in order."""

    def __init__(self):
        self.blocks = []

    def heading(self, level, text):
        self.blocks.append("#" * level + " " + text)

    def para(self, text):
        self.blocks.append(text)

    def raw(self, text):
        self.blocks.append(text.strip("\n"))

    def code(self, text):
        self.blocks.append("```text\n" + text + "\n```")

    def image(self, link, alt):
        self.blocks.append(f"![{alt}]({link})")

    def table(self, header, rows):
        cell = lambda value: str(value).replace("|", "\\|")
        lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.blocks.append("\n".join(lines))

    def text(self):
        return "\n\n".join(self.blocks) + "\n"


# --------------------------------------------------------------------------- the machine
class CpuMeter:
    """CPU time used by everything on the machine (/proc/stat) minus this process and its waited-for
    children (getrusage): what other processes took while a section ran. Steal is the hypervisor's
    time given to other guests."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            cols = [int(v) for v in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (cols[0] + cols[1] + cols[2] + cols[5] + cols[6]) / hz  # user nice system irq softirq
        steal = cols[7] / hz if len(cols) > 7 else 0.0
        own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for field in ("ru_utime", "ru_stime"))
        return {"wall": time.monotonic(), "busy": busy, "steal": steal, "own": own, "load": os.getloadavg()}

    def stop(self):
        end = self._sample()
        wall = end["wall"] - self.start["wall"]
        capacity = wall * os.cpu_count()
        others = max(0.0, (end["busy"] - self.start["busy"]) - (end["own"] - self.start["own"]))
        return {"wall": wall, "others_s": others, "others_share": others / capacity if capacity else 0.0,
                "steal_share": (end["steal"] - self.start["steal"]) / capacity if capacity else 0.0,
                "load_start": self.start["load"], "load_end": end["load"]}


def command_output(argv, **kwargs):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts(ctx):
    cpuinfo = open("/proc/cpuinfo").read()
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    mem = re.search(r"MemTotal:\s*(\d+)", open("/proc/meminfo").read())
    git = lambda *a: command_output(["git", "-C", ROOT, *a])
    dirty = git("diff", "--name-only", "HEAD").splitlines()
    versions = command_output([sys.executable, "-c", "import torch, onnx, numpy, matplotlib; print(torch.__version__, "
                               "onnx.__version__, numpy.__version__, matplotlib.__version__)"]).split()
    train_libs = command_output(["ldd", ctx.tools["train"]]) if os.path.exists(ctx.tools["train"]) else ""
    blas = re.search(r"=> (\S*blas\S*)", train_libs)
    # "sgemm ceiling, OpenBLAS <its config> (core <name>, <n> threads); median of ..."
    sgemm = command_output([ctx.tools["bench_sgemm"], "64", "64", "64", "1"]) \
        if os.access(ctx.tools["bench_sgemm"], os.X_OK) else ""
    openblas = re.search(r"sgemm ceiling, OpenBLAS (.*?\));", sgemm)
    return {
        "cpu": model.group(1) if model else platform.processor(), "cores": os.cpu_count(),
        "memory": f"{int(mem.group(1)) / (1 << 20):.1f} GiB" if mem else "?",
        "kernel": platform.release(), "commit": git("rev-parse", "HEAD"), "subject": git("log", "-1", "--format=%s"),
        "dirty": dirty, "torch": versions[0] if versions else "not importable",
        "python": f"{platform.python_version()} ({sys.executable}), onnx {versions[1] if len(versions) > 1 else '?'}, "
                  f"numpy {versions[2] if len(versions) > 2 else '?'}, matplotlib {versions[3] if len(versions) > 3 else '?'}",
        "openblas_file": os.path.realpath(blas.group(1)) if blas else "?",
        "openblas_banner": openblas.group(1) if openblas else "?",
        "mpi": command_output([ctx.mpirun, "--version"]).splitlines()[0] if ctx.mpirun else "no mpirun",
        "coretype": os.environ.get("OPENBLAS_CORETYPE", "(unset: OpenBLAS picks)"),
    }


def load(triple):
    return " / ".join(f"{v:.2f}" for v in triple)


def same_blas(measured):
    """What section 1 saw in /proc/PID/maps: whether train and PyTorch mapped the same OpenBLAS file."""
    if "ours_blas" not in measured:
        return ""
    files = lambda libs: {os.path.realpath(p) for p in libs if "blas" in os.path.basename(p)}
    same = files(measured["ours_blas"]) & files(measured["torch_blas"])
    return "; train and PyTorch mapped the same OpenBLAS file: " + ("yes" if same else "**NO**")


def write_header(doc, ctx, facts, total, timings, started):
    noisy = total["others_share"] > OTHERS_NOISY or total["steal_share"] > OTHERS_NOISY
    doc.heading(1, f"pipeshard benchmark report, {started:%Y-%m-%d}")
    doc.para("Every figure below states its formula and the command that produced it. Regenerate the whole "
             f"report with `{ctx.command}`; the figures of a shared machine vary from run to run (see the load "
             "and the NOISY flags).")
    dirty = (f" plus uncommitted changes to {len(facts['dirty'])} tracked file(s) ({', '.join(facts['dirty'][:6])}"
             f"{', …' if len(facts['dirty']) > 6 else ''}), which the build in `{ctx.build_rel}` may include"
             if facts["dirty"] else "")
    others = (f"{total['others_s']:.0f} CPU-seconds = {total['others_share']:.1%} of the {facts['cores']} cores over the "
              f"run; hypervisor steal {total['steal_share']:.1%}")
    doc.table(["", ""], [
        ["date", f"{started:%Y-%m-%d %H:%M} UTC, {total['wall'] / 60:.1f} minutes"],
        ["command", f"`{ctx.command}`" + (" (--quick: fewer rounds and steps, a smoke run)" if ctx.quick else "")],
        ["machine", f"{facts['cpu']}, {facts['cores']} cores, {facts['memory']}, Linux {facts['kernel']}"],
        ["load average (1 / 5 / 15 min)", f"start {load(total['load_start'])}, end {load(total['load_end'])}"],
        ["other work on the machine", ("**yes**: " if noisy else "no (below 5 %): ") + f"other processes used {others}"],
        ["commit", f"`{facts['commit'][:12]}` \"{facts['subject']}\"{dirty}"],
        ["torch", f"{facts['torch']} (Debian python3-torch)"],
        ["OpenBLAS", f"`{facts['openblas_file']}`, {facts['openblas_banner']}; OPENBLAS_CORETYPE={facts['coretype']}"
                     + same_blas(ctx.facts)],
        ["Open MPI", facts["mpi"]],
        ["Python", facts["python"]],
    ])
    if noisy:
        doc.para(f"**Other work ran on the machine during this report** ({others}). Figures taken while it ran "
                 "are slower and noisier than on an idle machine; the per-section table says when.")
    doc.table(["section", "minutes", "load average at start → end (1 min)", "other processes' CPU share", "steal"],
              [[name, f"{t['wall'] / 60:.1f}", f"{t['load_start'][0]:.2f} → {t['load_end'][0]:.2f}",
                f"{t['others_share']:.1%}{' (other work)' if t['others_share'] > OTHERS_NOISY else ''}",
                f"{t['steal_share']:.1%}"] for name, t in timings])
    doc.para("Other processes' CPU share = (busy time of all CPUs in /proc/stat − the CPU time of this script and "
             "its children) / (wall time × cores).")
    if ctx.summary:
        doc.heading(2, "Summary")
        doc.raw("\n".join(f"* {line}" for line in ctx.summary))


# --------------------------------------------------------------------------- sections
class Context:
    def __init__(self, args, folder, image_dir, image_link):
        self.quick, self.folder, self.build_dir = args.quick, folder, args.build_dir
        self.baseline_build, self.quiet_budget = args.baseline_build, args.quiet_budget
        self.tools = {t: os.path.join(args.build_dir, "bin", t) for t in ("train", "partition", "bench_sgemm",
                                                                           "bench_allreduce")}
        self.mpirun = shutil.which("mpirun")
        inside = os.path.abspath(args.build_dir).startswith(ROOT + os.sep)
        self.build_rel = os.path.relpath(args.build_dir, ROOT) if inside else os.path.abspath(args.build_dir)
        self.image_dir, self.image_link = image_dir, image_link
        self.facts, self.summary = {}, []
        self.command = " ".join(["/usr/bin/python3 bench/report.py"] + [shlex.quote(a) for a in sys.argv[1:]])

    def image(self, name):
        os.makedirs(self.image_dir, exist_ok=True)
        return os.path.join(self.image_dir, name), f"{self.image_link}/{name}"

    def progress(self, message):
        print(f"report [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mpi_env():
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def allreduce_section(ctx, doc):
    min_bytes, max_bytes = 4096, (16 if ctx.quick else 64) << 20
    reps, rounds = (3, 1) if ctx.quick else (5, 3)
    env_peer = dict(os.environ, OMP_NUM_THREADS="1")
    env_peer.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ways, banner, torch_version = allreduce.measure(ctx.tools["bench_allreduce"], ctx.mpirun, min_bytes, max_bytes, reps,
                                                    rounds, mpi_env(), env_peer, ctx.progress)
    busbw = lambda way, size: size / ways[way][size]["time_s"] * allreduce.bus_factor(way) / 1e9
    names = [("all_reduce", "ours, all_reduce"), ("async+wait", "ours, all_reduce_async + wait"),
             ("MPI_Allreduce", "raw MPI_Allreduce"), ("gloo", f"PyTorch {torch_version} gloo")]
    doc.heading(2, "4. All-reduce bus bandwidth vs message size, 2 processes")
    doc.para(f"Ours: `mpirun --oversubscribe --bind-to core -np 2 {ctx.build_rel}/bin/bench_allreduce {min_bytes} "
             f"{max_bytes} {reps}` ([bench/allreduce_rate.cc](../allreduce_rate.cc)): the communicator's "
             "`all_reduce` (MPI_Allreduce in place), `all_reduce_async` + `wait` (MPI_Iallreduce + MPI_Wait) and raw "
             "`MPI_Allreduce`, float32 sums. The peer: `torch.distributed.all_reduce` on gloo, 2 processes (not "
             "pinned: gloo works on a thread of its own). Time = the slowest rank's time for `iters` back-to-back "
             f"calls / iters, median of {reps} repetitions; {rounds} round(s) alternating ours and gloo, median over "
             "rounds. **algbw = bytes / time; busbw = algbw · 2(n−1)/n** (nccl-tests; n = 2: busbw = algbw). "
             "check: each way reduces rank-dependent integers once and every element must equal the exact sum.")
    rows = []
    for size in sorted(ways["all_reduce"]):
        row = [plots._bytes_label(size), f"{ways['all_reduce'][size]['iters']} / {ways['gloo'][size]['iters']}"]
        for way, _ in names:
            row += [f"{ways[way][size]['time_s'] * 1e6:.1f}", f"{busbw(way, size):.3f}"]
        row.append(f"{ways['gloo'][size]['time_s'] / ways['all_reduce'][size]['time_s']:.1f}")
        row.append("ok" if all(ways[w][size]["ok"] for w, _ in names) else "WRONG")
        rows.append(row)
    doc.table(["size", "iters ours / gloo"] + [h for _, label in names for h in (f"{label} µs", "busbw GB/s")]
              + ["gloo time / ours (all_reduce)", "check"], rows)
    doc.code(banner)

    split = [("all_reduce", "all_reduce"), ("rs+ag", "ours, reduce_scatter + all_gather"),
             ("rs+ag_async", "ours, both async + wait"), ("MPI_RSB+Allgather", "raw MPI_Reduce_scatter_block + MPI_Allgather"),
             ("reduce_scatter", "ours, reduce_scatter alone"), ("all_gather", "ours, all_gather alone, in place"),
             ("MPI_Reduce_scatter_block", "raw MPI_Reduce_scatter_block"), ("MPI_Allgather", "raw MPI_Allgather, in place")]
    doc.para("ZeRO's traffic, the same runs: each replica reduce-scatters the gradients (its block of the sum) and "
             "all-gathers the updated weights, which together move what one all-reduce moves. `rs+ag` is the "
             "communicator's `reduce_scatter` into a block and `all_gather` of that block back into the buffer (an "
             "all-reduce by other means); the halves alone are timed too, the all-gather in place as ZeRO calls it. "
             "**busbw = algbw · 2(n−1)/n for an all-reduce and for a pair, algbw · (n−1)/n for a half alone** "
             "(nccl-tests' reduce-scatter and all-gather convention, algbw over the whole buffer). Ours is a direct "
             "exchange over MPI point-to-point ([comm/comm_mpi.cc](../../comm/comm_mpi.cc)): Open MPI 4.1's "
             "MPI_Reduce_scatter_block reduces the whole buffer to rank 0 and scatters it at these sizes.")
    rows = []
    for size in sorted(ways["all_reduce"]):
        row = [plots._bytes_label(size)]
        for way, _ in split:
            row += [f"{ways[way][size]['time_s'] * 1e6:.1f}", f"{busbw(way, size):.3f}"]
        row.append(f"{ways['rs+ag'][size]['time_s'] / ways['all_reduce'][size]['time_s']:.2f}")
        row.append("ok" if all(ways[w][size]["ok"] for w, _ in split) else "WRONG")
        rows.append(row)
    doc.table(["size"] + [h for _, label in split for h in (f"{label} µs", "busbw GB/s")]
              + ["rs+ag time / all_reduce", "check"], rows)

    png, link = ctx.image("allreduce.png")
    styles = {"all_reduce": ("o-", plots.OURS), "async+wait": ("s-", "tab:green"), "MPI_Allreduce": (":", "black"),
              "gloo": ("^-", plots.PEER), "rs+ag": ("D-", "tab:purple"), "MPI_RSB+Allgather": ("--", "tab:red")}
    curves = [(label, [(size, busbw(way, size), slot["time_s"]) for size, slot in sorted(ways[way].items())],
               *styles[way])
              for way, label in names + [("rs+ag", "ours, reduce_scatter + all_gather"),
                                         ("MPI_RSB+Allgather", "raw MPI_Reduce_scatter_block + MPI_Allgather")]]
    plots.allreduce(png, curves, "busbw = bytes / time · 2(n−1)/n, n = 2; time = slowest rank, median of repetitions "
                    "and rounds. Source: bench/report.py --sections allreduce")
    doc.image(link, "all-reduce and reduce-scatter + all-gather bus bandwidth and time vs message size")
    big = max(ways["all_reduce"])
    best = max(ways["all_reduce"], key=lambda s: busbw("all_reduce", s))
    ctx.summary.append(f"All-reduce, 2 processes: ours peaks at {busbw('all_reduce', best):.2f} GB/s busbw "
                       f"({plots._bytes_label(best)}); at {plots._bytes_label(big)} all_reduce "
                       f"{busbw('all_reduce', big):.2f}, async+wait {busbw('async+wait', big):.2f}, "
                       f"gloo {busbw('gloo', big):.2f} GB/s; at 4 KiB gloo takes "
                       f"{ways['gloo'][min_bytes]['time_s'] / ways['all_reduce'][min_bytes]['time_s']:.0f}× our time.")
    mid = 16 << 20 if (16 << 20) in ways["rs+ag"] else big
    ctx.summary.append(f"Reduce-scatter + all-gather at {plots._bytes_label(mid)}: ours "
                       f"{ways['rs+ag'][mid]['time_s'] * 1e3:.2f} ms (async {ways['rs+ag_async'][mid]['time_s'] * 1e3:.2f}), "
                       f"all_reduce {ways['all_reduce'][mid]['time_s'] * 1e3:.2f} ms, raw MPI_Reduce_scatter_block + "
                       f"MPI_Allgather {ways['MPI_RSB+Allgather'][mid]['time_s'] * 1e3:.2f} ms.")


def partition_section(ctx, doc):
    layer_counts = (100, 1000, 5000) if ctx.quick else (100, 300, 1000, 2000, 5000)
    stage_counts, rounds = (2, 8, 64), 2 if ctx.quick else 5
    res = partition.measure(ctx.tools["partition"], ctx.folder, layer_counts, stage_counts, rounds, ctx.progress)
    doc.heading(2, "5. Partitioner speed on deep MLPs")
    doc.para(f"Synthetic MLPs written with the onnx package (`bench/report_partition.py`): L Linear layers (Gemm, "
             f"transB=1) with a ReLU after each but the last, widths cycling {partition.WIDTHS}, input 32, "
             f"{partition.CLASSES} classes. Command: `{ctx.build_rel}/bin/partition deep_mlp_L.onnx --stages P --out DIR` "
             f"(balance by parameters); wall time from outside (the tool prints no timing), median of {rounds} rounds, "
             "the order reversed every other round; it includes reading, importing, the optimal split and writing "
             "P stage files and plan.json. `--stages 1` does all but the search, so **T(P) − T(1)** is what the search "
             "and writing P files instead of one add. "
             "balance = largest / mean stage parameters, as `partition` prints it.")
    rows = []
    for (layers, stages), r in sorted(res.items()):
        base = res[(layers, 1)]["wall"]
        rows.append([f"{layers:,}", f"{r['params']:,}", f"{r['bytes'] / (1 << 20):.1f}", stages, f"{r['wall'] * 1e3:.1f}",
                     "" if stages == 1 else f"{(r['wall'] - base) * 1e3:+.1f}", f"{r['rss'] / 1024:.0f}",
                     f"{r['files']}{'' if r['files'] == stages else ' WRONG'}", f"{r['balance']:.3f}",
                     f"{r['spread']:.0%}"])
    doc.table(["layers L", "parameters", "model MiB", "stages P", "wall ms (median)", "T(P) − T(1) ms", "peak RSS MiB",
               "stage files", "balance", "spread"], rows)
    png, link = ctx.image("partition.png")
    series = [(stages, [(layers, res[(layers, stages)]["wall"]) for layers in layer_counts if (layers, stages) in res])
              for stages in (1, *stage_counts)]
    plots.partition_speed(png, series, f"median wall time of {rounds} runs, whole tool (read, import, split, write). "
                          "Source: bench/report.py --sections partition")
    doc.image(link, "partition wall time vs number of layers, per stage count")
    deepest = max(layer_counts)
    ctx.summary.append(f"partition: {deepest:,} layers into 64 stages in {res[(deepest, 64)]['wall'] * 1e3:.0f} ms "
                       f"({res[(deepest, 1)]['wall'] * 1e3:.0f} ms with --stages 1, i.e. without the search).")


def data_section(ctx, doc):
    sizes, rounds = ((0.1, 1), 1) if ctx.quick else ((0.1, 1, 4, 16), 3)
    steps, ranks = 3000, (1, 2)
    folder = "/var/tmp"
    baseline = os.path.join(ctx.baseline_build, "bin", "train") if ctx.baseline_build else ""
    built_from = subprocess.run(["git", "-C", ctx.baseline_build, "log", "-1", "--format=%h"], capture_output=True,
                                text=True).stdout.strip() if baseline else ""
    cells, floor = data_size.measure(ctx.tools["train"], baseline, sizes, ranks, steps, rounds, folder, ctx.progress)
    doc.heading(2, "6. Data at any size")
    doc.para(f"`bench/data_size.py` (whose docstring has the details): features of S GB (S·10⁹ bytes: S·976,562 rows × "
             f"256 float32) and int64 labels generated into {folder} and deleted after each size; Linear(256, 256) + ReLU "
             f"+ Linear(256, 10), {steps} steps of batch 64, shuffled, SGD; `{ctx.build_rel}/bin/train` in one process "
             "and under `mpirun -np 2` (data-parallel replicas), one unmeasured run then "
             f"{rounds} round(s). **start-up** = rank 0's `elapsed_s` at the end of step 1 − that step's time; "
             "**over 1 MB** = that − the same on a 1 MB data set (MPI_Init, the model, the groups: not the data). "
             "**steps/s** = 1 / median step time after step 10. **peak RSS / RssAnon** = the largest VmRSS / RssAnon "
             "of any rank in /proc, polled every 5 ms (RSS counts the mapped file's pages a rank has touched, shared "
             "with every process mapping it; RssAnon is memory of its own). "
             + (f"**in-memory**: `{ctx.baseline_build}/bin/train` (built from {built_from or 'an unknown commit'}), "
                "a build that reads the files into memory, where "
                "they fit (2 × the file a rank); its start-up from launch to its first metrics line; **paired ratio** "
                "= median over rounds of ours / in-memory steps/s." if baseline else
                "No in-memory columns: run with `--baseline-build DIR`, a build of a commit before the data was "
                "mapped."))
    doc.table(data_size.HEADER, data_size.table_rows(cells, floor))
    lines = data_size.verdicts(cells, floor, ranks)
    doc.code("\n".join(lines))
    ctx.summary.append("Data at any size: " + "; ".join(lines) + ".")


def gpu_section(ctx, doc):
    doc.heading(2, "7. GPU")
    smi = shutil.which("nvidia-smi")
    probe = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True) if smi else None
    if probe is None or probe.returncode != 0:
        why = "nvidia-smi not found" if probe is None else f"nvidia-smi exit status {probe.returncode}"
        doc.para(f"not run: no GPU ({why}).")
        ctx.summary.append("GPU: not run: no GPU.")
        return
    doc.para(f"`nvidia-smi`: {probe.stdout.strip()}")
    onnx_path = cvp.export("B", ctx.folder, 0)
    spec, steps = cvp.MODELS["B"], 40
    metrics = os.path.join(ctx.folder, "gpu_metrics.jsonl")
    argv = [ctx.tools["train"], onnx_path, "--data", os.path.join(ctx.folder, "B_x.npy"), "--labels",
            os.path.join(ctx.folder, "B_y.npy"), "--batch-size", str(spec["batch"]), "--steps", str(steps), "--lr",
            str(cvp.LR), "--momentum", str(cvp.MOMENTUM), "--no-shuffle", "--metrics", metrics, "--device", "cuda"]
    run = subprocess.run(argv, capture_output=True, text=True)
    command = f"`{ctx.build_rel}/bin/train B.onnx … --batch-size {spec['batch']} --steps {steps} --device cuda`"
    if run.returncode != 0:
        doc.para(f"Model B on the GPU: {command} failed: `{(run.stderr.strip().splitlines() or ['?'])[-1]}`.")
        ctx.summary.append("GPU: present, but train --device cuda did not run (see section 6).")
        return
    times = [spec["batch"] / json.loads(line)["samples_per_s"] for line in open(metrics)][5:]
    t = statistics.median(times)
    doc.table(["figure", "ours", "formula"], [["model B step time (ms)", f"{t * 1e3:.3f}", "median of steps 6.. of "
                                                                                           f"{steps}"],
                                              ["samples/s", f"{spec['batch'] / t:.0f}", "B / T"]])
    doc.para(f"Command: {command}. No PyTorch peer here: Debian's torch has no CUDA.")
    ctx.summary.append(f"GPU: model B {t * 1e3:.2f} ms/step with train --device cuda.")


def python_section(ctx, doc):
    rounds, steps = (3, 40) if ctx.quick else (9, 100)
    warmup, threads, lr, momentum = 10, training.THREADS, training.cvp.LR, training.cvp.MOMENTUM
    folder = os.path.join(ctx.folder, "python")
    os.makedirs(folder, exist_ok=True)
    res = python_overhead.measure(ctx.build_dir, folder, rounds, steps, warmup, threads, ctx.progress,
                                  ctx.quiet_budget)
    f = python_overhead.figures(res)
    batch = res["batch"]
    budget = f"--quiet-budget {ctx.quiet_budget:g} " if ctx.quiet_budget else ""
    doc.heading(2, "8. pipeshard.train against the train tool (model B)")
    doc.para(f"`bench/python_overhead.py` (whose docstring has the details): model B trains {steps} steps of batch "
             f"{batch} (SGD lr {lr} momentum {momentum}, file order) in one process, as `{ctx.build_rel}/bin/train "
             f"B.onnx --data B_x.npy --labels B_y.npy --batch-size {batch} --steps {steps} {training.TRAIN_FLAGS}` "
             f"and as `pipeshard.train(m, X, y, batch_size={batch}, lr={lr}, momentum={momentum}, shuffle=False, "
             f"steps={steps}, progress=False)` in a child /usr/bin/python3, {threads} threads each; one unmeasured "
             f"run of each, then {rounds} paired rounds alternating which goes first"
             + (f" (up to {ctx.quiet_budget:g} s spent waiting for quiet moments and running again the rounds that "
                "other work disturbed)" if ctx.quiet_budget else "") + ".")
    doc.para("**step time** = batch / samples_per_s, which both take from train's step loop (the time between "
             f"consecutive step ends), median over steps {warmup + 1}–{steps} of a run; **Python / CLI** per round, "
             "and its median over rounds. **whole call**: the train process from launch to exit, against "
             "pipeshard.load + np.load + pipeshard.train timed inside the child. This section alone: "
             f"`/usr/bin/python3 bench/python_overhead.py --rounds {rounds} --steps {steps} {budget}"
             f"--build {ctx.build_rel}`.")
    doc.table(python_overhead.ROUND_HEADER, python_overhead.round_rows(f))
    doc.table(python_overhead.SUMMARY_HEADER, python_overhead.summary_rows(f, res))
    doc.code(python_overhead.blas_line(f, res) + "\n" + python_overhead.verdict_line(f, res))
    quiet = f"; {f['quiet_rounds']} quiet rounds: {f['quiet_ratio']:.4f}" if f["quiet_rounds"] else ""
    ctx.summary.append(f"Python: pipeshard.train / train per step on model B = {f['ratio']:.4f} (median of {rounds} "
                       f"paired rounds, {python_overhead.interval(f['ratio_ci'])}{quiet}); whole call "
                       f"{f['call']['python']:.2f} s against {f['call']['cli']:.2f} s; losses equal bit for bit: "
                       f"{'yes' if f['same_losses'] else 'NO'}{'; NOISY' if f['noisy'] else ''}.")


RUNNERS = {"cpu": training.cpu_section, "batch": training.batch_section, "parallel": training.parallel_section,
           "allreduce": allreduce_section, "partition": partition_section, "data": data_section,
           "gpu": gpu_section, "python": python_section}


# --------------------------------------------------------------------------- main
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps: a smoke run (< 3 minutes)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {','.join(SECTIONS)} (default all)")
    ap.add_argument("--out", help="the Markdown file (default bench/reports/<UTC date>.md); PNGs go to the folder "
                                  "of the same name without .md")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"),
                    help="where bin/ holds the tools and python/ the module (default build/)")
    ap.add_argument("--baseline-build", default="", help="section data: a build whose train reads the data into "
                                                         "memory, for the in-memory columns")
    ap.add_argument("--quiet-budget", type=float, default=0, metavar="SECONDS",
                    help="section python: spend up to this long waiting for quiet moments and running again the "
                         "rounds that other work disturbed (default 0)")
    return ap.parse_args()


def cannot_run(ctx, sections):
    """Why the chosen sections cannot run, or None."""
    for section in sections:
        for tool in TOOLS[section]:
            if not os.access(ctx.tools[tool], os.X_OK):
                return (f"{ctx.tools[tool]} is missing (section {section}); build it first: cmake --build "
                        f"{ctx.build_rel} --target train partition bench_sgemm bench_allreduce")
    if NEEDS_MPI & set(sections) and ctx.mpirun is None:
        return "mpirun is missing (Debian openmpi-bin)"
    if NEEDS_TORCH & set(sections) and subprocess.run([sys.executable, "-c", "import torch, onnx, numpy"],
                                                      capture_output=True).returncode != 0:
        return "needs torch, onnx and numpy (Debian python3-torch, python3-onnx); run with /usr/bin/python3"
    module = os.path.join(ctx.build_dir, "python", "pipeshard")
    if "python" in sections and not os.path.isdir(module):
        return f"{module} is missing (section python); build it first: cmake --build {ctx.build_rel} --target _pipeshard"
    if "partition" in sections and subprocess.run([sys.executable, "-c", "import onnx"],
                                                  capture_output=True).returncode != 0:
        return "the partition section needs the onnx package (Debian python3-onnx)"
    return None


def main():
    args = parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        print(f"report: unknown --sections {','.join(sorted(unknown))} (choose from {','.join(SECTIONS)})", file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    out = os.path.abspath(args.out or os.path.join(ROOT, "bench", "reports", f"{started:%Y-%m-%d}.md"))
    image_dir = out[:-3] if out.endswith(".md") else out + ".files"
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    total_meter = CpuMeter()
    failures, timings, body = [], [], Doc()
    with tempfile.TemporaryDirectory(prefix="pipeshard-report-") as folder:
        ctx = Context(args, folder, image_dir, os.path.basename(image_dir))
        why = cannot_run(ctx, sections)
        if why:
            print(f"report: {why}", file=sys.stderr)
            return 2
        if os.path.isdir(image_dir):
            shutil.rmtree(image_dir)  # no stale pictures from an earlier run of the same day
        facts = machine_facts(ctx)
        ctx.progress(f"sections {','.join(sections)}{' (quick)' if args.quick else ''}; report to {out}")
        for section in sections:
            meter = CpuMeter()
            try:
                RUNNERS[section](ctx, body)
            except SystemExit as failure:  # the scripts exit on a failed run, with its log
                message = failure.code if isinstance(failure.code, str) else f"exit status {failure.code}"
                print(f"report: section {section} failed: {message}", file=sys.stderr)
                body.heading(2, f"{section}: FAILED")
                body.code(str(message)[-3000:])
                failures.append(section)
            timings.append((section, meter.stop()))
            ctx.progress(f"{section} done in {timings[-1][1]['wall'] / 60:.1f} min")
        total = total_meter.stop()
        head = Doc()
        write_header(head, ctx, facts, total, timings, started)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(head.text() + "\n" + body.text())
    ctx.progress(f"wrote {out} in {total['wall'] / 60:.1f} min" + (f"; FAILED: {','.join(failures)}" if failures else ""))
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
