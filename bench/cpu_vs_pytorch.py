#!/usr/bin/python3
"""Race pipeshard's CPU training (build/bin/train) against PyTorch on the same MLPs.

How to run, from the repository root after building (cmake --build build):
    /usr/bin/python3 bench/cpu_vs_pytorch.py [--threads 2] [--rounds 5] [--build-dir build]

Two models, both exported here with torch.onnx.export from torch modules seeded alike:
  A  784-512-512-10 ReLU MLP, batch 128         (small: per-call overheads matter)
  B  4 x (Linear(1024, 1024) + ReLU), batch 256 (large: the sgemms are nearly all the time)
For each model the script runs, alternately and --rounds times, our `train` and the same
loop in PyTorch (same initial weights, batches in file order, SGD lr 0.01 momentum 0.9,
F.cross_entropy, zero_grad(set_to_none=True), float32), each in its own process with the
same threads: OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = T and torch.set_num_threads(T),
OMP_WAIT_POLICY=PASSIVE. Both must use OpenBLAS: the PyTorch child gets the OpenBLAS
folder first on LD_LIBRARY_PATH, and each side's loaded BLAS is read from /proc/PID/maps
and printed. build/bin/bench_sgemm times the model's own GEMM shapes in the same
invocation, which gives the ceiling. Formulas and targets: bench/README.md.

It is a benchmark: it exits 0 whatever the figures (PASS/MISS per target is printed), and
2 only when it cannot run (no build, no torch).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# layers: (in, out) per Linear; relu_last: a ReLU after the last Linear too; the classes are
# the last layer's out.
MODELS = {
    "A": {"layers": [(784, 512), (512, 512), (512, 10)], "relu_last": False, "batch": 128,
          "title": "784-512-512-10 ReLU MLP, batch 128"},
    "B": {"layers": [(1024, 1024)] * 4, "relu_last": True, "batch": 256,
          "title": "4 x (Linear(1024,1024) + ReLU), batch 256"},
}
LR, MOMENTUM = 0.01, 0.9
DISTINCT_BATCHES = 8  # the data set: 8 batches, taken in file order, round and round
TARGET_RATIO, TARGET_CEILING = 0.9, 0.8
LOSS_REL_TOLERANCE = 1e-5
NOISY_SPREAD = 0.10  # per-round medians of one side further apart than this: a busy machine


def build_module(spec):
    import torch.nn as nn
    mods = []
    for i, (fan_in, fan_out) in enumerate(spec["layers"]):
        mods.append(nn.Linear(fan_in, fan_out))
        if i + 1 < len(spec["layers"]) or spec["relu_last"]:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def blas_libraries(pid):
    """Mapped files of a live process whose names say BLAS, LAPACK or OpenMP."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    keys = ("blas", "lapack", "mkl", "gomp", "iomp", "libomp")
    return sorted(p for p in paths if any(k in os.path.basename(p).lower() for k in keys))


# --------------------------------------------------------------------------- PyTorch child
def timed_sgd_loop(module, x_all, y_all, steps, rows):
    """The PyTorch side's training loop: SGD(LR, MOMENTUM), F.cross_entropy on rows(step) = (begin,
    end) of the data, zero_grad(set_to_none=True); returns each step's wall seconds and loss."""
    import torch
    import torch.nn.functional as F
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    step_s, losses = [], []
    last = time.perf_counter()
    for step in range(steps):
        begin, end = rows(step)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(x_all[begin:end]), y_all[begin:end])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        now = time.perf_counter()
        step_s.append(now - last)
        last = now
    return step_s, losses


def torch_worker(job):
    """One PyTorch run in this process; prints one JSON line."""
    import resource
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(job["threads"])
    rss_after_import_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = job.get("spec") or MODELS[job["model"]]
    model = build_module(spec)
    model.load_state_dict(torch.load(job["weights"]))
    model.train()
    x_all = torch.from_numpy(np.load(job["data"]))
    y_all = torch.from_numpy(np.load(job["labels"]))
    batch, batches = spec["batch"], x_all.shape[0] // spec["batch"]
    step_s, losses = timed_sgd_loop(model, x_all, y_all, job["steps"],
                                    lambda step: ((step % batches) * batch, (step % batches + 1) * batch))
    print(json.dumps({"step_s": step_s, "losses": losses, "blas": blas_libraries(os.getpid()),
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "rss_after_import_kib": rss_after_import_kib}))


# --------------------------------------------------------------------------- parent
GNU_TIME = "/usr/bin/time"


def child_environments(threads):
    """(ours, PyTorch's): OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = threads, OMP_WAIT_POLICY=PASSIVE;
    PyTorch's also has OpenBLAS first on LD_LIBRARY_PATH."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               OMP_WAIT_POLICY="PASSIVE")
    env_torch = dict(env)
    # Debian's torch calls sgemm_ from libblas.so.3; put OpenBLAS's first on its path so
    # that it is OpenBLAS whatever update-alternatives says (checked from its maps).
    openblas_dirs = sorted(glob.glob("/usr/lib/*/openblas-pthread"))
    if openblas_dirs:
        env_torch["LD_LIBRARY_PATH"] = os.pathsep.join(
            [openblas_dirs[0]] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env, env_torch


def children_of(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def run_child(argv, env, log_path):
    """Runs argv to completion; returns (exit status, peak RSS in KiB, BLAS files it mapped).

    The peak RSS is ru_maxrss, which Linux carries across fork and exec: a child of this
    script would report at least this script's own RSS. So the command runs under GNU
    time (a process of ~2 MiB), which reports its child's ru_maxrss (-f %M)."""
    rss_path = log_path + ".rss"
    wrapped = [GNU_TIME, "-f", "%M", "-o", rss_path, "--"] + argv if os.access(GNU_TIME, os.X_OK) else argv
    with open(log_path, "w") as log:
        proc = subprocess.Popen(wrapped, env=env, stdout=log, stderr=subprocess.STDOUT)
    libs = []
    while proc.poll() is None:  # the loader maps the libraries before main runs
        for pid in [proc.pid] + children_of(proc.pid):
            libs = blas_libraries(pid)
            if any("blas" in p for p in libs):
                break
        if any("blas" in p for p in libs):
            break
        time.sleep(0.005)
    proc.wait()
    if wrapped is argv:
        rss = float("nan")  # no GNU time: not measured
    else:
        with open(rss_path) as f:
            rss = int(f.read().split()[-1])
    return proc.returncode, rss, libs


def export_worker(job):
    """Writes model job["model"] as ONNX, its weights (.pt) and synthetic data (.npy)."""
    import numpy as np
    import torch
    name, folder, seed = job["model"], job["folder"], job["seed"]
    spec = job.get("spec") or MODELS[name]
    torch.manual_seed(seed)
    module = build_module(spec).eval()
    fan_in = spec["layers"][0][0]
    torch.onnx.export(module, torch.zeros(2, fan_in), os.path.join(folder, f"{name}.onnx"), opset_version=14,
                      input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    torch.save(module.state_dict(), os.path.join(folder, f"{name}.pt"))
    rng = np.random.default_rng(seed)
    samples, classes = spec["batch"] * DISTINCT_BATCHES, spec["layers"][-1][1]
    np.save(os.path.join(folder, f"{name}_x.npy"), rng.standard_normal((samples, fan_in), dtype=np.float32))
    np.save(os.path.join(folder, f"{name}_y.npy"), rng.integers(0, classes, samples).astype(np.int64))


def export(name, folder, seed, spec=None):
    """Runs export_worker in a child, so that this process never holds torch's memory. `spec`
    (layers, relu_last, batch, as in MODELS) defaults to MODELS[name]; the files are named after
    `name`."""
    job = json.dumps({"model": name, "folder": folder, "seed": seed, "spec": spec})
    subprocess.run([sys.executable, os.path.abspath(__file__), "--export-worker", job], check=True,
                   stdout=subprocess.DEVNULL)
    return os.path.join(folder, f"{name}.onnx")


def sgemm_ceiling(bench_sgemm, spec, env, repeats):
    """Σ over the model's GEMMs of the median sgemm time (s), and the bench's banner."""
    total, banner = 0.0, ""
    for i, (fan_in, fan_out) in enumerate(spec["layers"]):
        out = subprocess.run([bench_sgemm, str(spec["batch"]), str(fan_out), str(fan_in), str(repeats)],
                             env=env, capture_output=True, text=True, check=True).stdout
        banner = out.splitlines()[0]
        rows = {line.split()[1]: float(line.split()[-3]) / 1e3 for line in out.splitlines()
                if line.startswith(("forward", "backward"))}
        # rows: "y=x*W^T" forward, "dx=dy*W" input gradient, "dW+=dy^T*x" weight gradient
        total += rows["y=x*W^T"] + rows["dW+=dy^T*x"]
        if i > 0:  # the first layer's input needs no gradient: neither side computes it
            total += rows["dx=dy*W"]
    return total, banner


def race(name, spec, args, folder, env_ours, env_torch, steps=None):
    """args.rounds alternating rounds of ours and PyTorch on `spec` (any MLP in MODELS' form, named
    `name` in the files); steps per run default to --steps-a for model A, else --steps-b."""
    onnx_path = export(name, folder, args.seed, spec)
    data, labels = os.path.join(folder, f"{name}_x.npy"), os.path.join(folder, f"{name}_y.npy")
    if steps is None:
        steps = args.steps_a if name == "A" else args.steps_b
    warmup = min(args.warmup, steps - 1)
    job = {"model": name, "spec": spec, "threads": args.threads, "steps": steps, "data": data, "labels": labels,
           "weights": os.path.join(folder, f"{name}.pt")}
    ours_s, torch_s, ours_rss, torch_rss, ceiling_s = [], [], [], [], []
    rounds = []
    result = {}
    for r in range(args.rounds):
        ceiling, banner = sgemm_ceiling(args.bench_sgemm, spec, env_ours, args.sgemm_repeats)
        ceiling_s.append(ceiling)
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
        medians = {}
        for side in order:
            log = os.path.join(folder, f"{name}_{side}_{r}.log")
            if side == "ours":
                metrics = os.path.join(folder, f"{name}_metrics_{r}.jsonl")
                argv = [args.train, onnx_path, "--data", data, "--labels", labels, "--batch-size", str(spec["batch"]),
                        "--steps", str(steps), "--lr", str(LR), "--momentum", str(MOMENTUM), "--no-shuffle",
                        "--metrics", metrics]
                status, rss, libs = run_child(argv, env_ours, log)
                if status != 0:
                    sys.exit(f"cpu_vs_pytorch: train failed on model {name}, see {log}:\n" + open(log).read()[-2000:])
                rows = [json.loads(line) for line in open(metrics)]
                times = [spec["batch"] / row["samples_per_s"] for row in rows]
                result["ours_losses"] = [row["loss"] for row in rows]
                result["ours_blas"] = libs
                ours_s += times[warmup:]
                ours_rss.append(rss)
            else:
                argv = [sys.executable, os.path.abspath(__file__), "--torch-worker", json.dumps(job)]
                status, rss, libs = run_child(argv, env_torch, log)
                if status != 0:
                    sys.exit(f"cpu_vs_pytorch: the PyTorch run failed on model {name}, see {log}:\n" +
                             open(log).read()[-2000:])
                out = json.loads(open(log).read().strip().splitlines()[-1])
                times = out["step_s"]
                result["torch_losses"], result["torch_blas"] = out["losses"], out["blas"]
                result["torch_import_rss"] = out["rss_after_import_kib"]
                result["torch_version"] = out["torch"]
                torch_s += times[warmup:]
                torch_rss.append(rss)
            medians[side] = statistics.median(times[warmup:])
        rounds.append(medians)
    result.update(ours_s=ours_s, torch_s=torch_s, ours_rss=max(ours_rss), torch_rss=max(torch_rss),
                  ceiling_s=statistics.median(ceiling_s), sgemm_banner=banner, rounds=rounds, steps=steps,
                  warmup=warmup)
    return result


def verdict(ok):
    return "PASS" if ok else "MISS"


def derived_figures(spec, res):
    """The figures of one race (res from race()), by the formulas of bench/README.md: times in
    seconds, F in FLOP per step, rates in FLOP/s, the ratios ours/PyTorch."""
    b = spec["batch"]
    sum_io = sum(i * o for i, o in spec["layers"])
    first_io = spec["layers"][0][0] * spec["layers"][0][1]
    executed = 2 * b * (3 * sum_io - first_io)
    ours, torch_ = statistics.median(res["ours_s"]), statistics.median(res["torch_s"])
    ceiling_rate = executed / res["ceiling_s"]
    l_ours, l_torch = res["ours_losses"][0], res["torch_losses"][0]
    # Each round runs both sides back to back, so a slowdown of the whole machine that
    # outlasts a round (a noisy neighbour on a shared VM) shifts both and cancels in the
    # round's ratio; the pooled medians mix slow rounds of one side with fast ones of the other.
    paired = statistics.median(r["ours"] / r["torch"] for r in res["rounds"])
    spread = max(max(r[side] for r in res["rounds"]) / min(r[side] for r in res["rounds"]) - 1
                 for side in ("ours", "torch"))
    return {
        "batch": b, "sum_io": sum_io, "first_io": first_io, "nominal": 6 * b * sum_io, "executed": executed,
        "ours": ours, "torch": torch_, "ratio": ours / torch_, "paired": paired, "spread": spread,
        "noisy": spread > NOISY_SPREAD, "ceiling_rate": ceiling_rate,
        "pct_ours": executed / ours / ceiling_rate, "pct_torch": executed / torch_ / ceiling_rate,
        "first_rel": abs(l_ours - l_torch) / abs(l_torch),
        "last_rel": abs(res["ours_losses"][-1] - res["torch_losses"][-1]) / abs(res["torch_losses"][-1]),
    }


def report(name, spec, res, args):
    f = derived_figures(spec, res)
    b, sum_io, first_io, nominal, executed = f["batch"], f["sum_io"], f["first_io"], f["nominal"], f["executed"]
    ours, torch_, ratio, ceiling_rate = f["ours"], f["torch"], f["ratio"], f["ceiling_rate"]
    mib = lambda kib: kib / 1024
    l_ours, l_torch = res["ours_losses"][0], res["torch_losses"][0]
    rel, last_rel = f["first_rel"], f["last_rel"]
    n_steps = res["steps"]
    print(f"\nModel {name}: {spec['title']}; {args.rounds} rounds x {n_steps} steps each side, "
          f"the first {res['warmup']} of every run discarded; {args.threads} threads")
    print(f"  B = {b},  sum in*out = {sum_io:,},  first layer in*out = {first_io:,}")
    print(f"  F_nominal  = 6*B*sum(in*out)                    = {nominal / 1e9:.3f} GFLOP/step")
    print(f"  F_executed = 2*B*(3*sum(in*out) - in1*out1)     = {executed / 1e9:.3f} GFLOP/step"
          "  (no input gradient for layer 1, on either side)")
    print(f"  ceiling    = F_executed / sum of bench_sgemm medians over the same GEMMs "
          f"({res['ceiling_s'] * 1e3:.2f} ms) = {ceiling_rate / 1e9:.1f} GFLOP/s")
    w = 34
    print(f"  {'figure':{w}s} {'ours':>12s} {'PyTorch':>12s}   derived / target")
    print(f"  {'step time, median (ms)':{w}s} {ours * 1e3:12.3f} {torch_ * 1e3:12.3f}   "
          f"ratio ours/PyTorch = {ratio:.3f}  (target <= {TARGET_RATIO}: {verdict(ratio <= TARGET_RATIO)})")
    per_round = "  ".join(f"{r['ours'] * 1e3:.2f}/{r['torch'] * 1e3:.2f}" for r in res["rounds"])
    print(f"  {'  per round, ours/PyTorch (ms)':{w}s} {per_round}")
    paired = f["paired"]
    print(f"  {'  paired: median of per-round ratios':{w}s} {'':25s}   ratio ours/PyTorch = {paired:.3f}  "
          f"(target <= {TARGET_RATIO}: {verdict(paired <= TARGET_RATIO)})")
    spread = f["spread"]
    if spread > NOISY_SPREAD:
        print(f"  {'':{w}s} NOISY: per-round medians of one side differ by {spread:.0%} (> {NOISY_SPREAD:.0%}); "
              "something else ran on the machine, so rerun before trusting the ratio")
    print(f"  {'samples/s = B / step time':{w}s} {b / ours:12.0f} {b / torch_:12.0f}")
    print(f"  {'GFLOP/s = F_nominal / step time':{w}s} {nominal / ours / 1e9:12.1f} {nominal / torch_ / 1e9:12.1f}")
    print(f"  {'GFLOP/s = F_executed / step time':{w}s} {executed / ours / 1e9:12.1f} {executed / torch_ / 1e9:12.1f}")
    pct_ours, pct_torch = f["pct_ours"], f["pct_torch"]
    target = f"(target >= {TARGET_CEILING:.0%}: {verdict(pct_ours >= TARGET_CEILING)})" if name == "B" else "(no target)"
    print(f"  {'% of sgemm ceiling = GFLOP/s / ceil':{w}s} {pct_ours:12.1%} {pct_torch:12.1%}   {target}")
    print(f"  {'peak RSS, ru_maxrss (MiB)':{w}s} {mib(res['ours_rss']):12.1f} {mib(res['torch_rss']):12.1f}   "
          f"ours <= PyTorch: {verdict(res['ours_rss'] <= res['torch_rss'])}  "
          f"(PyTorch after `import torch` alone: {mib(res['torch_import_rss']):.1f})")
    print(f"  {'loss, step 1 (same weights, batch)':{w}s} {l_ours:12.7f} {l_torch:12.7f}   "
          f"|diff|/|PyTorch| = {rel:.1e}  (<= {LOSS_REL_TOLERANCE:g}: {'ok' if rel <= LOSS_REL_TOLERANCE else 'WRONG'})")
    print(f"  {'loss, step ' + str(n_steps) + ' (drift, for information)':{w}s} {res['ours_losses'][-1]:12.7f} "
          f"{res['torch_losses'][-1]:12.7f}   |diff|/|PyTorch| = {last_rel:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads on each side (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per model (default 5)")
    ap.add_argument("--steps-a", type=int, default=300, help="steps per run, model A (default 300)")
    ap.add_argument("--steps-b", type=int, default=40, help="steps per run, model B (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of every run (default 5)")
    ap.add_argument("--sgemm-repeats", type=int, default=30, help="timed calls per GEMM shape (default 30)")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"), help="where bin/train is (default build/)")
    ap.add_argument("--models", default="AB", help="which models to race (default AB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (models, data, logs)")
    ap.add_argument("--torch-worker", help=argparse.SUPPRESS)
    ap.add_argument("--export-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        return torch_worker(json.loads(args.torch_worker))
    if args.export_worker:
        return export_worker(json.loads(args.export_worker))
    args.train = os.path.join(args.build_dir, "bin", "train")
    args.bench_sgemm = os.path.join(args.build_dir, "bin", "bench_sgemm")
    for tool in (args.train, args.bench_sgemm):
        if not os.access(tool, os.X_OK):
            print(f"cpu_vs_pytorch: {tool} is missing; build it first (cmake --build build --target train bench_sgemm)",
                  file=sys.stderr)
            return 2
    if subprocess.run([sys.executable, "-c", "import torch, onnx, numpy"], capture_output=True).returncode != 0:
        print("cpu_vs_pytorch: needs torch, onnx and numpy (Debian python3-torch, python3-onnx); "
              "run with /usr/bin/python3", file=sys.stderr)
        return 2
    if not os.access(GNU_TIME, os.X_OK):
        print(f"cpu_vs_pytorch: {GNU_TIME} (Debian package time) is missing: peak RSS is not measured")

    env, env_torch = child_environments(args.threads)
    print(f"cpu_vs_pytorch: {os.uname().nodename}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f} at start; env for both: OMP_NUM_THREADS={args.threads} "
          f"OPENBLAS_NUM_THREADS={args.threads} OMP_WAIT_POLICY=PASSIVE; PyTorch also "
          f"LD_LIBRARY_PATH={env_torch.get('LD_LIBRARY_PATH', '')}; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset: OpenBLAS picks)')}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeshard-bench-") as folder:
        for name in args.models:
            results[name] = race(name, MODELS[name], args, folder, env, env_torch)
        if args.keep:
            kept = folder + ".kept"
            subprocess.run(["cp", "-r", folder, kept], check=True)
            print(f"kept models, data and logs in {kept}")
    first = next(iter(results.values()))
    print(f"\nBLAS, from /proc/PID/maps of each running process (load average now {os.getloadavg()[0]:.2f}):")
    print(f"  ours (train):   {', '.join(first['ours_blas']) or '?'}")
    print(f"  PyTorch {first['torch_version']}: {', '.join(first['torch_blas']) or '?'}")
    ours_blas = {os.path.realpath(p) for p in first["ours_blas"] if "blas" in p}
    torch_blas = {os.path.realpath(p) for p in first["torch_blas"] if "blas" in p}
    same = bool(ours_blas & torch_blas)
    print(f"  same BLAS library file on both sides: {'yes' if same else 'NO: the race is not fair'}")
    print(f"  {first['sgemm_banner']}")
    for name, res in results.items():
        report(name, MODELS[name], res, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
