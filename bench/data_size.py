#!/usr/bin/python3
"""Data at any size: train's start-up, step rate and memory per rank against the data's size.

How to run, from the repository root after building (cmake --build build --target train):
    /usr/bin/python3 bench/data_size.py [--sizes 0.1,1,4,16] [--ranks 1,2] [--steps 3000] [--rounds 3]
                                        [--build-dir build] [--baseline-build DIR] [--folder /var/tmp]

For each size S (GB, 10^9 bytes of features), a features file of S * 10^9 / 1024 rows x 256 float32
(a 64 MiB block of standard normals, repeated) and int64 labels in [0, 10) are generated into a
temporary folder under --folder and deleted after that size. A 2-layer MLP, Linear(256, 256) + ReLU
+ Linear(256, 10), exported with torch.onnx.export, trains --steps steps of batch 64 (shuffled,
SGD), in one process and under mpirun -np N (data-parallel replicas): one unmeasured run of the
same command (the pages it reads are then cached), then --rounds paired rounds. Measured per run:
  start-up   rank 0's seconds from its start to the end of the first step (--metrics' elapsed_s),
             less that step's own time; and that less the median of five runs on a 1 MB data set
             (the floor: MPI_Init, the model, the groups), which the target applies to under mpirun
  steps/s    the median over the steps after the first 10 of batch / samples_per_s; against the
             in-memory case the paired ratio: the median over rounds of each round's ratio
  peak RSS, peak RssAnon
             the largest VmRSS and RssAnon of /proc/PID/status over every rank, polled every 10 ms
             (RSS counts the file's pages a rank has mapped in; RssAnon is memory of its own)
With --baseline-build (a build of the commit before the data was mapped: it reads the files into
memory), the same runs with that train, where they fit in memory (2 x the file per rank), give
the in-memory step rate to compare with, and its start-up (from launching it to its first metrics
line, polled every 5 ms, less that step: it has no elapsed_s).

Targets (issue "Data at any size"): start-up under 0.2 s at every size; RssAnon per rank
independent of the size (within 10 MB); steps/s within 5 % of the in-memory case. It is a
benchmark: it exits 0 whatever the figures, 2 only when it cannot run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

FEATURES, HIDDEN, CLASSES, BATCH = 256, 256, 10, 64
BLOCK_ROWS = (64 << 20) // (4 * FEATURES)


def export_model(path):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, CLASSES))
    torch.onnx.export(model, torch.zeros(2, FEATURES), path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, opset_version=17)


def write_data(folder, gigabytes):
    rows = int(gigabytes * 1e9) // (4 * FEATURES)
    rng = np.random.default_rng(1)
    block = rng.standard_normal((BLOCK_ROWS, FEATURES), dtype=np.float32)
    x = np.lib.format.open_memmap(os.path.join(folder, "x.npy"), mode="w+", dtype=np.float32,
                                  shape=(rows, FEATURES))
    for first in range(0, rows, BLOCK_ROWS):
        n = min(BLOCK_ROWS, rows - first)
        x[first:first + n] = block[:n]
    x.flush()
    del x
    np.save(os.path.join(folder, "y.npy"), rng.integers(0, CLASSES, rows, dtype=np.int64))
    return rows


def train_pids(root):
    """The train processes under `root` (itself, or mpirun's children)."""
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "train":
                    pids.append(pid)
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                frontier += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids


def status_kib(pid, keys):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in keys:
                    out[name] = int(value.split()[0])
    except OSError:
        pass
    return out


def run(train, model, folder, ranks, steps, env):
    metrics = os.path.join(folder, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    argv = [train, model, "--data", os.path.join(folder, "x.npy"), "--labels", os.path.join(folder, "y.npy"),
            "--steps", str(steps), "--batch-size", str(BATCH), "--lr", "0.01", "--metrics", metrics]
    if ranks > 1:
        argv = ["mpiexec", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + argv
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_rss, peak_anon, first_line = {}, {}, None
    while proc.poll() is None:
        if first_line is None and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            first_line = time.perf_counter() - start  # for a train without elapsed_s
        for pid in train_pids(proc.pid):
            s = status_kib(pid, ("VmHWM", "VmRSS", "RssAnon"))
            peak_rss[pid] = max(peak_rss.get(pid, 0), s.get("VmHWM", 0), s.get("VmRSS", 0))
            peak_anon[pid] = max(peak_anon.get(pid, 0), s.get("RssAnon", 0))
        time.sleep(0.005)
    err = proc.stderr.read().decode()
    if proc.returncode != 0:
        sys.exit(f"data_size.py: {' '.join(argv)} failed ({proc.returncode}):\n{err}")
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    step_s = [BATCH / r["samples_per_s"] for r in rows]
    return {"startup": rows[0].get("elapsed_s", first_line or float("nan")) - step_s[0], "steps_per_s": 1 / statistics.median(step_s[10:]),
            "rss_mib": max(peak_rss.values()) / 1024, "anon_mib": max(peak_anon.values()) / 1024}


def mem_total_gb():
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024 / 1e9


def measure(train, baseline, sizes, ranks, steps, rounds, folder, progress):
    """Every (size, ranks) cell: ours and, where it fits, the baseline, in `rounds` paired rounds
    (the order alternating), after one unmeasured run of each. Returns (cells, floor)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cells, floor = [], {}
    with tempfile.TemporaryDirectory(dir=folder, prefix="pipeshard-data-size-") as top:
        model = os.path.join(top, "mlp.onnx")
        export_model(model)
        tiny = os.path.join(top, "tiny")
        os.makedirs(tiny)
        write_data(tiny, 0.001)
        for n in ranks:
            floor[n] = statistics.median(run(train, model, tiny, n, 20, env)["startup"] for _ in range(5))
        for size in sizes:
            data = os.path.join(top, f"{size:g}GB")
            os.makedirs(data)
            t = time.perf_counter()
            rows = write_data(data, size)
            progress(f"data: {size:g} GB ({rows} rows) written in {time.perf_counter() - t:.1f} s")
            for n in ranks:
                sides = [("ours", train)]
                if baseline and 2 * size * n < 0.6 * mem_total_gb():  # the old loader holds 2 x the file a rank
                    sides.append(("base", baseline))
                runs = {name: [] for name, _ in sides}
                for name, tool in sides:
                    run(tool, model, data, n, steps, env)  # caches the pages it reads
                for r in range(rounds):
                    for name, tool in (sides if r % 2 == 0 else sides[::-1]):
                        runs[name].append(run(tool, model, data, n, steps, env))
                cell = {"gb": size, "rows": rows, "ranks": n, "runs": runs}
                cells.append(cell)
                progress("data: " + json.dumps({k: v for k, v in cell.items() if k != "runs"} |
                                              {name: summary(rs) for name, rs in runs.items()}))
            shutil.rmtree(data)
    return cells, floor


def summary(runs):
    """Medians over rounds; the largest memory of any round."""
    return {"startup": statistics.median(r["startup"] for r in runs),
            "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
            "rss_mib": max(r["rss_mib"] for r in runs), "anon_mib": max(r["anon_mib"] for r in runs)}


def ratio(cell):
    """Paired: the median over rounds of ours / the baseline's steps/s."""
    if "base" not in cell["runs"]:
        return None
    return statistics.median(o["steps_per_s"] / b["steps_per_s"] for o, b in zip(cell["runs"]["ours"],
                                                                                  cell["runs"]["base"]))


HEADER = ["size", "rows", "ranks", "start-up s", "start-up over 1 MB s", "steps/s", "in-memory steps/s",
          "paired ratio", "in-memory start-up s", "peak RSS / rank MiB", "peak RssAnon / rank MiB",
          "in-memory RssAnon MiB"]


def table_rows(cells, floor):
    rows = []
    for c in cells:
        o = summary(c["runs"]["ours"])
        b = summary(c["runs"]["base"]) if "base" in c["runs"] else None
        rows.append([f"{c['gb']:g} GB", f"{c['rows']:,}", c["ranks"], f"{o['startup']:.3f}",
                     f"{o['startup'] - floor[c['ranks']]:+.3f}", f"{o['steps_per_s']:.0f}",
                     f"{b['steps_per_s']:.0f}" if b else "—", f"{ratio(c):.3f}" if b else "—",
                     f"{b['startup']:.2f}" if b else "—", f"{o['rss_mib']:.0f}", f"{o['anon_mib']:.1f}",
                     f"{b['anon_mib']:.0f}" if b else "—"])
    return rows


def verdicts(cells, floor, ranks):
    """One line per target, each ending in PASS or MISS."""
    # The data's share of the start-up: all of it for one process; over the floor for mpirun,
    # whose MPI_Init alone takes longer than the target on some machines.
    startup = [summary(c["runs"]["ours"])["startup"] - (floor[c["ranks"]] if c["ranks"] > 1 else 0) for c in cells]
    lines = [f"start-up (one process: all of it; mpirun: over the 1 MB run's "
             f"{', '.join(f'{floor[n]:.3f} s' for n in ranks if n > 1)}): at most {max(startup):.3f} s: "
             f"{'PASS' if max(startup) < 0.2 else 'MISS'} (target < 0.2 s)"]
    for n in ranks:
        anon = [summary(c["runs"]["ours"])["anon_mib"] for c in cells if c["ranks"] == n]
        spread = max(anon) - min(anon)
        lines.append(f"peak RssAnon per rank, {n} process{'es' if n > 1 else ''}: {min(anon):.1f}-{max(anon):.1f} MiB "
                     f"over the sizes, spread {spread:.1f} MiB: {'PASS' if spread <= 10 else 'MISS'} "
                     "(target within 10 MB)")
    ratios = [ratio(c) for c in cells if ratio(c) is not None]
    if ratios:
        lines.append(f"steps/s over the in-memory case (paired): {min(ratios):.3f}-{max(ratios):.3f}: "
                     f"{'PASS' if min(ratios) >= 0.95 else 'MISS'} (target within 5 %)")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.1,1,4,16", help="GB of features, comma-separated")
    p.add_argument("--ranks", default="1,2", help="process counts, comma-separated")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--build-dir", default="build")
    p.add_argument("--baseline-build", default="", help="a build whose train reads data into memory")
    p.add_argument("--folder", default="/var/tmp", help="where the data is generated (needs the largest size free)")
    a = p.parse_args()
    train = os.path.join(a.build_dir, "bin", "train")
    baseline = os.path.join(a.baseline_build, "bin", "train") if a.baseline_build else ""
    for tool in [train] + ([baseline] if baseline else []):
        if not os.access(tool, os.X_OK):
            sys.exit(f"data_size.py: no {tool}: build it first (cmake --build {a.build_dir} --target train)")
    if shutil.which("mpiexec") is None:
        sys.exit("data_size.py: no mpiexec")
    ranks = [int(r) for r in a.ranks.split(",")]
    cells, floor = measure(train, baseline, [float(s) for s in a.sizes.split(",")], ranks, a.steps, a.rounds,
                           a.folder, lambda m: print(m, file=sys.stderr, flush=True))
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in table_rows(cells, floor):
        print("| " + " | ".join(str(x) for x in row) + " |")
    print()
    for line in verdicts(cells, floor, ranks):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
