#!/usr/bin/python3
"""Time pipeshard's data and pipeline parallelism (mpirun -np 2 train) against one process and PyTorch DDP.

How to run, from the repository root after building (cmake --build build --target train):
    /usr/bin/python3 bench/distributed.py [--rounds 3] [--steps 60] [--build-dir build]
                                          [--sections dp,buckets,ddp,pipeline] [--model B|B8|L]

Model B of cpu_vs_pytorch.py (4 x (Linear(1024, 1024) + ReLU), batch 256, SGD lr 0.01 momentum
0.9), or with --model B8 eight such layers, exported by its own export(), the same weights and
batches everywhere. Sections:
  dp        mpirun -np 2 train (1 thread per rank) against train in one process with 2 threads,
            and against one process with 1 thread (the scaling efficiency)
  buckets   the 2-rank run with gradient buckets of 25 MiB (the default: one bucket on model B's
            16 MiB of gradients), 4 MiB (one per layer, launched while backward runs) and
            100000 MiB (one all-reduce after backward)
  ddp       the peer: PyTorch DistributedDataParallel on gloo, 2 processes x 1 thread, each rank
            128 samples (its half of 256), the same OpenBLAS file as train
  pipeline  mpirun -np 2 train --stages 2 --micro-batches M (1f1b, and gpipe, zb-h1, interleaved and
            zb-v for some M)
            against one process with 1 thread, next to the ideal P*M/(M+P-1); each run's pipeline
            bubble as train measures it, as it predicts it from the passes' mean times, and in
            theory; and zb-h1's throughput over 1f1b's at the same M
  tp        (not in the default) mpirun -np 2 train --tensor-parallel 2 against one process with
            1 thread and with 2 threads
  zero      (not in the default) mpirun -np 2 and -np 4 train --zero 1 and --zero 2 against --zero 0 with
            the same buckets: step time, peak memory per process, and the optimizer state and
            gradients rank 0 holds
Every configuration the chosen sections need runs once per round, in one order on even rounds
and the reverse on odd ones, so that ours and the peer alternate. Step times are medians over
all rounds of every step after the first --warmup of each run: ours from train's --metrics
(batch / samples_per_s of rank 0), DDP's from the wall time of one loop iteration on rank 0.
Formulas: bench/README.md.

It is a benchmark: it exits 0 whatever the figures (PASS/MISS is printed for the target), and
2 only when it cannot run (no build, no mpirun, no torch, or a run that fails).
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_vs_pytorch as cvp  # noqa: E402  (model B, its export, the BLAS probe)

# Model B of cpu_vs_pytorch.py, or (--model B8) the deeper 8 x (Linear(1024, 1024) + ReLU) at the
# same batch, for pipelines with more layers per stage.
MODEL_SPECS = {"B": cvp.MODELS["B"],
               "B8": {"layers": [(1024, 1024)] * 8, "relu_last": True, "batch": 256,
                      "title": "8 x (Linear(1024, 1024) + ReLU), batch 256"},
               # The GPU benchmark's large MLP (8 x 8192 wide) cut to what two cores train in seconds a
               # step: 134M parameters, 1.5 GiB of weights, gradients and momentum per process.
               "L": {"layers": [(4096, 4096)] * 8, "relu_last": True, "batch": 256,
                     "title": "8 x (Linear(4096, 4096) + ReLU), batch 256"}}
MODEL = "B"
SPEC = MODEL_SPECS[MODEL]
P = 2  # ranks in every multi-process run: data-parallel replicas or pipeline stages
TARGET_DP_RATIO = 0.6  # T(2 ranks x 1 thread) / T(1 rank x 2 threads)
TARGET_ZB_H1_GAIN, ZB_H1_TARGET_M = 1.10, 4  # T(1f1b) / T(zb-h1) at M = 4, model B
TARGET_BUBBLE_GAP = 5.0  # percentage points between the measured and the predicted bubble
DEFAULT_BUCKET_MB, SMALL_BUCKET_MB, ONE_SHOT_BUCKET_MB = 25, 4, 100000
CHILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Config:
    """One way of running a training: ours (train, possibly under mpirun) or the DDP peer."""
    key: str
    label: str
    ranks: int
    threads: int
    flags: tuple = ()  # extra train flags
    peer: bool = False  # PyTorch DDP instead of train


ONE_2T = Config("1x2", "1 rank x 2 threads", 1, 2)
ONE_1T = Config("1x1", "1 rank x 1 thread", 1, 1)
DP = Config("dp", f"2 ranks x 1 thread, --bucket-mb {DEFAULT_BUCKET_MB} (default)", P, 1)
DP_SMALL = Config("dp-small", f"2 ranks x 1 thread, --bucket-mb {SMALL_BUCKET_MB}", P, 1,
                  ("--bucket-mb", str(SMALL_BUCKET_MB)))
DP_ONE_SHOT = Config("dp-one-shot", f"2 ranks x 1 thread, --bucket-mb {ONE_SHOT_BUCKET_MB}", P, 1,
                     ("--bucket-mb", str(ONE_SHOT_BUCKET_MB)))
DDP = Config("ddp", "PyTorch DDP gloo, 2 ranks x 1 thread", P, 1, peer=True)
TP = Config("tp", "2 tensor-parallel shards x 1 thread", P, 1, ("--tensor-parallel", str(P)))
ZERO1 = Config("zero1", "2 ranks x 1 thread, --zero 1", P, 1, ("--zero", "1"))
ZERO1_SMALL = Config("zero1-small", f"2 ranks x 1 thread, --zero 1, --bucket-mb {SMALL_BUCKET_MB}", P, 1,
                     ("--zero", "1", "--bucket-mb", str(SMALL_BUCKET_MB)))
ZERO2_SMALL = Config("zero2-small", f"2 ranks x 1 thread, --zero 2, --bucket-mb {SMALL_BUCKET_MB}", P, 1,
                     ("--zero", "2", "--bucket-mb", str(SMALL_BUCKET_MB)))
DP4 = Config("dp4", "4 ranks x 1 thread (oversubscribed)", 4, 1)
ZERO1_D4 = Config("zero1-d4", "4 ranks x 1 thread (oversubscribed), --zero 1", 4, 1, ("--zero", "1"))
DP4_SMALL = Config("dp4-small", f"4 ranks x 1 thread (oversubscribed), --bucket-mb {SMALL_BUCKET_MB}", 4, 1,
                   ("--bucket-mb", str(SMALL_BUCKET_MB)))
ZERO2_D4_SMALL = Config("zero2-d4-small", f"4 ranks x 1 thread (oversubscribed), --zero 2, --bucket-mb "
                        f"{SMALL_BUCKET_MB}", 4, 1, ("--zero", "2", "--bucket-mb", str(SMALL_BUCKET_MB)))
# Each --zero run beside the plain data parallelism it is measured against (same ranks, same buckets).
ZERO_PAIRS = ((DP, ZERO1), (DP_SMALL, ZERO1_SMALL), (DP_SMALL, ZERO2_SMALL), (DP4, ZERO1_D4),
              (DP4_SMALL, ZERO2_D4_SMALL))
TARGET_ZERO1_RATIO = 1.05  # T(--zero 1) / T(--zero 0), D = 2, model B
SECTIONS = ("dp", "buckets", "ddp", "pipeline", "tp", "zero")
DEFAULT_SECTIONS = "dp,buckets,ddp,pipeline"


def pipeline_config(m, schedule):
    return Config(f"pp-{schedule}-{m}", f"2 stages x 1 thread, M={m}, {schedule}", P, 1,
                  ("--stages", str(P), "--micro-batches", str(m), "--schedule", schedule))


def configs_for(sections, micro_batches, gpipe_micro_batches, zb_h1_micro_batches=(), interleaved_micro_batches=(),
                zb_v_micro_batches=()):
    """The configurations the sections need, each once, in run order."""
    wanted = []
    if "dp" in sections:
        wanted += [ONE_2T, ONE_1T, DP]
    if "buckets" in sections:
        wanted += [ONE_1T, DP, DP_SMALL, DP_ONE_SHOT]
    if "ddp" in sections:
        wanted += [ONE_1T, DP, DDP]  # ONE_1T: the reference loss
    if "pipeline" in sections:
        wanted += [ONE_1T, ONE_2T] + [pipeline_config(m, "1f1b") for m in micro_batches]
        wanted += [pipeline_config(m, "gpipe") for m in gpipe_micro_batches]
        wanted += [pipeline_config(m, "zb-h1") for m in zb_h1_micro_batches]
        wanted += [pipeline_config(m, "interleaved") for m in interleaved_micro_batches]
        wanted += [pipeline_config(m, "zb-v") for m in zb_v_micro_batches]
    if "tp" in sections:
        wanted += [ONE_1T, ONE_2T, TP]
    if "zero" in sections:
        wanted += [ONE_1T, DP, ZERO1, DP_SMALL, ZERO1_SMALL, ZERO2_SMALL, DP4, ZERO1_D4, DP4_SMALL, ZERO2_D4_SMALL]
    return list(dict.fromkeys(wanted))


def gradient_bucket_count(bucket_mib):
    """train's plan_buckets on model B: from the end of the gradient buffer (laid out in the order
    the forward pass uses the parameters: weight, bias, layer by layer) backwards, a bucket closes
    once it holds at least bucket_mib MiB; a parameter is never split."""
    per_bucket = bucket_mib * (1 << 20) / 4
    sizes = [n for fan_in, fan_out in reversed(SPEC["layers"]) for n in (fan_out, fan_in * fan_out)]
    buckets, open_elements = 0, 0
    for n in sizes:
        open_elements += n
        if open_elements >= per_bucket:
            buckets, open_elements = buckets + 1, 0
    return buckets + (open_elements > 0)


def gradient_bytes():
    return 4 * sum(fan_in * fan_out + fan_out for fan_in, fan_out in SPEC["layers"])


# --------------------------------------------------------------------------- DDP child
def ddp_worker(job):
    """One DDP rank in this process; prints one JSON line."""
    global MODEL, SPEC
    MODEL, SPEC = job["model"], MODEL_SPECS[job["model"]]
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    rank, world = job["rank"], job["world"]
    if job["bind"] == "core":  # as mpirun --bind-to core places train's ranks
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method="file://" + job["rendezvous"], rank=rank, world_size=world)
    model = cvp.build_module(SPEC)
    model.load_state_dict(torch.load(job["weights"]))
    model.train()
    ddp = DistributedDataParallel(model)  # bucket_cap_mb=25, as train's default
    x_all = torch.from_numpy(np.load(job["data"]))
    y_all = torch.from_numpy(np.load(job["labels"]))
    batch, batches = SPEC["batch"], x_all.shape[0] // SPEC["batch"]
    local = batch // world  # rank r takes the r-th contiguous slice of every batch, as train does
    # Each rank's loss is the mean over its slice; DDP averages the gradients.
    step_s, losses = cvp.timed_sgd_loop(ddp, x_all, y_all, job["steps"],
                                        lambda step: ((step % batches) * batch + rank * local,
                                                      (step % batches) * batch + (rank + 1) * local))
    print(json.dumps({"rank": rank, "step_s": step_s, "losses": losses, "blas": cvp.blas_libraries(os.getpid()),
                      "threads": torch.get_num_threads(), "torch": torch.__version__}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent
@dataclass
class RunResult:
    step_s: list  # after warm-up
    first_loss: float  # of the global batch
    last_loss: float
    blas: list
    torch_version: str = None  # the peer's
    bubble: tuple = None  # a pipelined run's (measured, predicted, theory) in %, from train's last lines
    peak_mib: float = None  # the most the backend held in any process, from train's memory line
    optimizer_mib: float = None  # the optimizer state rank 0 held, from the same line
    gradients_mib: float = None  # the gradients rank 0 held (under --zero 2: windows and slices), the same
    zero_note: str = None  # train's "note: ZeRO ..." or "note: --zero ..." lines


def descendants(pid):
    found = []
    for child in cvp.children_of(pid):
        found += [child] + descendants(child)
    return found


def start(argv, env, log_path):
    with open(log_path, "w") as log:  # own session: a hung run is ended as a group
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_all(procs, what, log_paths):
    """Waits for every process; on a failure or timeout ends the others and exits 2."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            break
        time.sleep(0.01)
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- {path}\n" + open(path).read()[-2000:] for path in log_paths)
        print(f"distributed: {what} failed (status {[p.returncode for p in procs]}):\n{tails}", file=sys.stderr)
        sys.exit(2)


def run_ours(config, args, paths, env, folder, tag):
    metrics = os.path.join(folder, f"{tag}.jsonl")
    argv = [args.train, paths["onnx"], "--data", paths["data"], "--labels", paths["labels"],
            "--batch-size", str(SPEC["batch"]), "--steps", str(args.steps), "--lr", str(cvp.LR),
            "--momentum", str(cvp.MOMENTUM), "--no-shuffle", "--metrics", metrics, *config.flags]
    child_env = dict(env, OMP_NUM_THREADS=str(config.threads), OPENBLAS_NUM_THREADS=str(config.threads))
    if config.ranks > 1:
        # More ranks than cores cannot each have a core of their own: unbound, the OS shares them.
        bind = args.bind_to if config.ranks <= (os.cpu_count() or 1) else "none"
        argv = [args.mpirun, "--oversubscribe", "--bind-to", bind, "-np", str(config.ranks),
                "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS", "-x", "OMP_WAIT_POLICY"] + argv
    log = os.path.join(folder, f"{tag}.log")
    proc = start(argv, child_env, log)
    libs = []
    while proc.poll() is None and not any("blas" in p for p in libs):  # mapped before main runs
        for pid in [proc.pid] + descendants(proc.pid):
            libs = cvp.blas_libraries(pid)
            if any("blas" in p for p in libs):
                break
        time.sleep(0.005)
    wait_all([proc], f"train ({config.label})", [log])
    rows = [json.loads(line) for line in open(metrics)]
    times = [SPEC["batch"] / row["samples_per_s"] for row in rows]
    return RunResult(times[args.warmup:], rows[0]["loss"], rows[-1]["loss"], libs, bubble=read_bubble(log),
                     peak_mib=read_peak_mib(log), optimizer_mib=read_part_mib(log, "optimizer state"),
                     gradients_mib=read_part_mib(log, "gradients"), zero_note=read_zero_note(log))


BUBBLE_LINE = re.compile(r"pipeline bubble: stages idle ([0-9.]+)% .*?, ([0-9.]+)% predicted .*? = ([0-9.]+)% for P=")


def read_bubble(log_path):
    """train's "pipeline bubble: stages idle X% ..., Y% predicted ...; theory F = Z% ..." as (X, Y, Z)."""
    for line in open(log_path):
        m = BUBBLE_LINE.search(line)
        if m:
            return tuple(float(g) for g in m.groups())
    return None


PEAK_LINE = re.compile(r"peak .*?held by the backend(?: per process)?: ([0-9.]+) (B|KiB|MiB|GiB)")
UNIT_MIB = {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}


def read_peak_mib(log_path):
    """train's "peak memory held by the backend per process: X at most ..." (or its one-process
    form) as MiB."""
    for line in open(log_path):
        m = PEAK_LINE.search(line)
        if m:
            return float(m.group(1)) * UNIT_MIB[m.group(2)]
    return None


def read_part_mib(log_path, part):
    """What rank 0 holds of `part` ("optimizer state", "gradients"), from the peak memory line's
    parts, as MiB."""
    for line in open(log_path):
        if PEAK_LINE.search(line):
            m = re.search(r"\b" + part + r" ([0-9.]+) (B|KiB|MiB|GiB)", line)
            return float(m.group(1)) * UNIT_MIB[m.group(2)] if m else None
    return None


def read_zero_note(log_path):
    notes = [line.strip() for line in open(log_path) if line.startswith(("note: ZeRO", "note: --zero"))]
    return " / ".join(notes) or None


def run_ddp(config, args, paths, env, folder, tag):
    rendezvous = os.path.join(folder, f"{tag}.rendezvous")  # must not exist yet
    procs, logs = [], []
    for rank in range(config.ranks):
        job = {"rank": rank, "world": config.ranks, "threads": config.threads, "steps": args.steps,
               "data": paths["data"], "labels": paths["labels"], "weights": paths["weights"],
               "rendezvous": rendezvous, "bind": args.bind_to, "model": MODEL}
        logs.append(os.path.join(folder, f"{tag}.rank{rank}.log"))
        procs.append(start([sys.executable, os.path.abspath(__file__), "--ddp-worker", json.dumps(job)], env, logs[-1]))
    wait_all(procs, "PyTorch DDP", logs)
    outs = [json.loads(open(log).read().strip().splitlines()[-1]) for log in logs]
    # equal slices: the global batch's mean loss is the mean of the ranks' local means
    mean_loss = lambda step: statistics.fmean(out["losses"][step] for out in outs)
    return RunResult(outs[0]["step_s"][args.warmup:], mean_loss(0), mean_loss(-1), outs[0]["blas"], outs[0]["torch"])


def measure(configs, args, paths, folder):
    env_ours = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMPI_ALLOW_RUN_AS_ROOT="1",
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env_peer = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env_peer.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Debian's torch calls sgemm_ from libblas.so.3: put OpenBLAS first, as cpu_vs_pytorch.py does.
    openblas_dirs = sorted(glob.glob("/usr/lib/*/openblas-pthread"))
    if openblas_dirs:
        env_peer["LD_LIBRARY_PATH"] = os.pathsep.join(
            [openblas_dirs[0]] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    results = {c.key: {"step_s": [], "round_medians": []} for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for config in order:
            tag = f"{config.key}_{r}"
            if config.peer:
                res = run_ddp(config, args, paths, env_peer, folder, tag)
            else:
                res = run_ours(config, args, paths, env_ours, folder, tag)
            entry = results[config.key]
            entry["step_s"] += res.step_s
            entry["round_medians"].append(statistics.median(res.step_s))
            entry.update(first_loss=res.first_loss, last_loss=res.last_loss, blas=res.blas,
                         torch_version=res.torch_version)
            if res.bubble:
                entry.setdefault("bubbles", []).append(res.bubble)
            if res.peak_mib is not None:
                entry["peak_mib"] = res.peak_mib
            entry["optimizer_mib"] = res.optimizer_mib
            entry["gradients_mib"] = res.gradients_mib
            entry["zero_note"] = res.zero_note
        print(f"  round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    for entry in results.values():
        entry["median"] = statistics.median(entry["step_s"])
        entry["spread"] = max(entry["round_medians"]) / min(entry["round_medians"]) - 1
    return results


# --------------------------------------------------------------------------- report
def verdict(ok):
    return "PASS" if ok else "MISS"


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def ms(seconds):
    return f"{seconds * 1e3:.2f}"


def report_runs(configs, res, args):
    ref = res[ONE_1T.key]["first_loss"] if ONE_1T.key in res else None
    print(f"\n### Runs: median ms/step over {args.rounds} rounds x {args.steps - args.warmup} steps "
          f"(the first {args.warmup} of {args.steps} of every run discarded)\n")
    rows = []
    for c in configs:
        e = res[c.key]
        rel = abs(e["first_loss"] - ref) / abs(ref) if ref else float("nan")
        check = "ok" if rel <= cvp.LOSS_REL_TOLERANCE else "WRONG"
        noisy = " NOISY" if e["spread"] > cvp.NOISY_SPREAD else ""
        rows.append([c.label, ms(e["median"]), f"{SPEC['batch'] / e['median']:.0f}",
                     " / ".join(ms(m) for m in e["round_medians"]), f"{e['spread']:.0%}{noisy}",
                     f"{e['first_loss']:.7f}", f"{rel:.1e} {check}"])
    table(["configuration", "ms/step", "samples/s", "per-round medians (ms)", "spread", "loss, step 1",
           "vs 1 rank x 1 thread (<= 1e-5)"], rows)


def report_dp(res):
    t2, t12, t11 = res[DP.key]["median"], res[ONE_2T.key]["median"], res[ONE_1T.key]["median"]
    ratio, speedup = t2 / t12, t11 / t2
    print("\n### Data parallelism, model B (2 ranks x 1 thread against one process)\n")
    table(["figure", "measured ms/step", "baseline ms/step", "ratio", "formula", "target"], [
        ["2 ranks x 1 thread vs 1 rank x 2 threads", ms(t2), ms(t12), f"{ratio:.3f}", "T(2r x 1t) / T(1r x 2t)",
         f"<= {TARGET_DP_RATIO}: {verdict(ratio <= TARGET_DP_RATIO)}"],
        ["  the same ratio without communication (ideal)", ms(t11 / P), ms(t12), f"{t11 / P / t12:.3f}",
         "(T(1r x 1t) / 2) / T(1r x 2t)", "bound on the ratio"],
        ["2 ranks x 1 thread vs 1 rank x 1 thread", ms(t2), ms(t11), f"{t2 / t11:.3f}",
         f"speedup T(1r x 1t) / T(2r x 1t) = {speedup:.3f}; efficiency = speedup / 2 = {speedup / P:.1%}", ""],
        ["2 threads in one process vs 1", ms(t12), ms(t11), f"{t12 / t11:.3f}",
         f"speedup {t11 / t12:.3f}; efficiency {t11 / t12 / P:.1%}", ""],
    ])


def report_buckets(res):
    t11, one_shot = res[ONE_1T.key]["median"], res[DP_ONE_SHOT.key]["median"]
    size = gradient_bytes()
    print(f"\n### Gradient buckets, 2 ranks x 1 thread (gradients S = {size / (1 << 20):.2f} MiB)\n")
    rows = []
    for c, mib in ((DP, DEFAULT_BUCKET_MB), (DP_SMALL, SMALL_BUCKET_MB), (DP_ONE_SHOT, ONE_SHOT_BUCKET_MB)):
        t = res[c.key]["median"]
        exposed = t - t11 / P
        busbw = f"{size * 2 * (P - 1) / P / exposed / 1e9:.2f}" if exposed > 0 else "-"
        rows.append([f"--bucket-mb {mib}: {gradient_bucket_count(mib)} bucket(s)", ms(t), ms(one_shot),
                     f"{t / one_shot:.3f}", ms(exposed), busbw])
    table(["configuration", "ms/step", "one-shot ms/step", "ratio T / T(one-shot)",
           "exposed ms = T - T(1r x 1t)/2", "effective busbw GB/s = S*2(n-1)/n / exposed"], rows)


def report_ddp(res):
    ours, peer = res[DP.key], res[DDP.key]
    rel = abs(ours["first_loss"] - peer["first_loss"]) / abs(peer["first_loss"])
    rel_last = abs(ours["last_loss"] - peer["last_loss"]) / abs(peer["last_loss"])
    print(f"\n### Data parallelism against PyTorch {peer['torch_version']} DDP (gloo), 2 ranks x 1 thread, "
          "25 MiB buckets on both sides\n")
    table(["figure", "ours", "DDP", "ratio ours/DDP", "formula"], [
        ["ms/step", ms(ours["median"]), ms(peer["median"]), f"{ours['median'] / peer['median']:.3f}",
         "T(ours) / T(DDP); below 1: we are faster"],
        ["samples/s", f"{SPEC['batch'] / ours['median']:.0f}", f"{SPEC['batch'] / peer['median']:.0f}", "", "256 / T"],
        ["loss, step 1 (global batch)", f"{ours['first_loss']:.7f}", f"{peer['first_loss']:.7f}",
         f"{rel:.1e} {'ok' if rel <= cvp.LOSS_REL_TOLERANCE else 'WRONG'}",
         "abs(ours - DDP) / DDP <= 1e-5; DDP's loss = mean of the ranks' local losses"],
        ["loss, last step (drift)", f"{ours['last_loss']:.7f}", f"{peer['last_loss']:.7f}", f"{rel_last:.1e}", ""],
    ])


def report_pipeline(configs, res):
    t11, t12 = res[ONE_1T.key]["median"], res[ONE_2T.key]["median"]
    print(f"\n### Pipeline, 2 stages x 1 thread, against 1 rank x 1 thread ({ms(t11)} ms) "
          f"and 1 rank x 2 threads ({ms(t12)} ms)\n")
    rows, gaps, single_gaps = [], [], []
    for c in configs:
        if not c.key.startswith("pp-"):
            continue
        schedule, m = c.key[len("pp-"):].rsplit("-", 1)  # "pp-zb-h1-4"
        m = int(m)
        t = res[c.key]["median"]
        ideal = P * m / (m + P - 1)
        bubbles = res[c.key].get("bubbles") or [(float("nan"),) * 3]
        measured, predicted, theory = (statistics.median(b[i] for b in bubbles) for i in range(3))
        (gaps if m > 1 else single_gaps).append(abs(measured - predicted))
        peak = res[c.key].get("peak_mib")
        rows.append([m, schedule, ms(t), f"{t11 / t:.3f}", f"{ideal:.3f}", f"{t11 / t / ideal:.1%}", f"{t12 / t:.3f}",
                     f"{measured:.1f}%", f"{predicted:.1f}%", f"{measured - predicted:+.1f}", f"{theory:.1f}%",
                     f"{peak:.1f}" if peak is not None else "?"])
    rows.sort(key=lambda row: (row[0], row[1]))
    table(["M", "schedule", "ms/step", "speedup = T(1r x 1t) / T", "ideal P*M/(M+P-1)", "measured / ideal",
           "vs 1r x 2t = T(1r x 2t) / T", "bubble measured", "predicted", "gap (pp)", "theory",
           "peak MiB (largest rank)"], rows)
    if gaps:
        worst = max(gaps)
        print(f"\nworst gap between the measured and the predicted bubble, M >= 2: {worst:.1f} percentage points "
              f"(target <= {TARGET_BUBBLE_GAP:.0f}: {verdict(worst <= TARGET_BUBBLE_GAP)})")
    if single_gaps:
        print(f"at M = 1 the gap is {max(single_gaps):.1f} points: no receive finds its message already there, so "
              "the quickest receive, which the prediction takes for the transfer time, includes a wait")
    zb, one = f"pp-zb-h1-{ZB_H1_TARGET_M}", f"pp-1f1b-{ZB_H1_TARGET_M}"
    if zb in res and one in res:
        gain = res[one]["median"] / res[zb]["median"]
        print(f"zb-h1 throughput over 1f1b at M={ZB_H1_TARGET_M}: T(1f1b) / T(zb-h1) = {gain:.3f} "
              f"(target >= {TARGET_ZB_H1_GAIN:.2f}: {verdict(gain >= TARGET_ZB_H1_GAIN)})")
    for faster, slower in (("interleaved", "1f1b"), ("zb-v", "zb-h1"), ("zb-v", "1f1b")):
        a, b = f"pp-{faster}-{ZB_H1_TARGET_M}", f"pp-{slower}-{ZB_H1_TARGET_M}"
        if a in res and b in res:
            print(f"{faster} throughput over {slower} at M={ZB_H1_TARGET_M}: T({slower}) / T({faster}) = "
                  f"{res[b]['median'] / res[a]['median']:.3f} (no target)")


def report_tp(res):
    t, t11, t12 = res[TP.key]["median"], res[ONE_1T.key]["median"], res[ONE_2T.key]["median"]
    print(f"\n### Tensor parallelism, 2 shards x 1 thread (--tensor-parallel {P}: layers paired column- then "
          "row-parallel, one all-reduce of the activations per pair forward and one backward)\n")
    table(["figure", "measured ms/step", "baseline ms/step", "ratio", "formula"], [
        ["2 shards x 1 thread vs 1 rank x 1 thread", ms(t), ms(t11), f"{t / t11:.3f}",
         f"speedup T(1r x 1t) / T(tp) = {t11 / t:.3f} (ideal {P}); efficiency = speedup / {P} = {t11 / t / P:.1%}"],
        ["2 shards x 1 thread vs 1 rank x 2 threads", ms(t), ms(t12), f"{t / t12:.3f}", "T(tp) / T(1r x 2t)"],
    ])


def report_blas(configs, res):
    ours = next(res[c.key]["blas"] for c in configs if not c.peer)
    print("\nBLAS, from /proc/PID/maps of a running process:")
    print(f"  ours (train):  {', '.join(ours) or '?'}")
    if DDP in configs:
        peer = res[DDP.key]["blas"]
        print(f"  PyTorch DDP:   {', '.join(peer) or '?'}")
        same = {os.path.realpath(p) for p in ours if "blas" in p} & {os.path.realpath(p) for p in peer if "blas" in p}
        print(f"  same BLAS library file on both sides: {'yes' if same else 'NO: the race is not fair'}")


# --------------------------------------------------------------------------- main
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    ap.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of every run (default 5)")
    ap.add_argument("--build-dir", default=os.path.join(cvp.ROOT, "build"), help="where bin/train is (default build/)")
    ap.add_argument("--sections", default=DEFAULT_SECTIONS,
                    help=f"any of {','.join(SECTIONS)} (default {DEFAULT_SECTIONS})")
    ap.add_argument("--micro-batches", default="1,2,4,8,16", help="pipeline M values, 1f1b (default 1,2,4,8,16)")
    ap.add_argument("--gpipe", default="2,4,8,16", help="M values also run with --schedule gpipe (default 2,4,8,16; '' for none)")
    ap.add_argument("--zb-h1", default="2,4,8", help="M values also run with --schedule zb-h1 (default 2,4,8; '' for none)")
    ap.add_argument("--interleaved", default="2,4,8",
                    help="M values also run with --schedule interleaved, 2 chunks per stage (default 2,4,8; '' for none)")
    ap.add_argument("--zb-v", default="2,4,8", help="M values also run with --schedule zb-v (default 2,4,8; '' for none)")
    ap.add_argument("--bind-to", default="core", choices=("core", "none"),
                    help="mpirun --bind-to for our ranks; DDP ranks pin themselves alike (default core)")
    ap.add_argument("--model", default="B", choices=sorted(MODEL_SPECS),
                    help="B: 4 x (Linear(1024) + ReLU) (default); B8: 8 of them; L: 8 x (Linear(4096) + ReLU); "
                         "batch 256 all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (model, data, logs, metrics)")
    ap.add_argument("--ddp-worker", help=argparse.SUPPRESS)
    return ap.parse_args()


def cannot_run(message):
    print(f"distributed: {message}", file=sys.stderr)
    return 2


def report_zero(res):
    print(f"\n### ZeRO, model {MODEL} (--zero 1 and 2 against plain data parallelism, the same ranks and buckets)\n")
    rows = []
    mib = lambda e, key: f"{e[key]:.2f}" if e.get(key) is not None else "-"
    for plain, zero in ZERO_PAIRS:
        t0, t1 = res[plain.key]["median"], res[zero.key]["median"]
        target = (f"<= {TARGET_ZERO1_RATIO}: {verdict(t1 / t0 <= TARGET_ZERO1_RATIO)}" if zero is ZERO1 else "")
        for c, t in ((plain, t0), (zero, t1)):
            e = res[c.key]
            rows.append([c.label, ms(t), f"{t / t0:.3f}", mib(e, "peak_mib"), mib(e, "optimizer_mib"),
                         mib(e, "gradients_mib"), target if c is zero else ""])
    table(["configuration", "ms/step", "ratio to --zero 0", "peak MiB per process (largest)",
           "optimizer state MiB (rank 0)", "gradients MiB (rank 0)", "target"], rows)
    notes = {res[z.key]["zero_note"] for _, z in ZERO_PAIRS if res[z.key].get("zero_note")}
    for note in sorted(notes):
        print(f"- train said: {note}")


def main():
    args = parse_args()
    if args.ddp_worker:
        return ddp_worker(json.loads(args.ddp_worker))
    global MODEL, SPEC
    MODEL, SPEC = args.model, MODEL_SPECS[args.model]
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        return cannot_run(f"unknown --sections {','.join(sorted(unknown))} (choose from {','.join(SECTIONS)})")
    if not 0 <= args.warmup < args.steps:
        return cannot_run("--warmup must be below --steps")
    micro_batches = [int(m) for m in args.micro_batches.split(",") if m]
    gpipe = [int(m) for m in args.gpipe.split(",") if m]
    zb_h1 = [int(m) for m in args.zb_h1.split(",") if m]
    interleaved = [int(m) for m in args.interleaved.split(",") if m]
    zb_v = [int(m) for m in args.zb_v.split(",") if m]
    args.train = os.path.join(args.build_dir, "bin", "train")
    args.mpirun = shutil.which("mpirun")
    if not os.access(args.train, os.X_OK):
        return cannot_run(f"{args.train} is missing; build it first (cmake --build build --target train)")
    if args.mpirun is None:
        return cannot_run("mpirun is missing (Debian openmpi-bin)")
    if subprocess.run([sys.executable, "-c", "import torch, onnx, numpy"], capture_output=True).returncode != 0:
        return cannot_run("needs torch, onnx and numpy (Debian python3-torch, python3-onnx); run with /usr/bin/python3")
    configs = configs_for(sections, micro_batches, gpipe, zb_h1, interleaved, zb_v)
    mpi_version = subprocess.run([args.mpirun, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"distributed: {os.uname().nodename}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
          f"at start; model {MODEL}: {SPEC['title']}; {mpi_version}, mpirun --oversubscribe --bind-to "
          f"{args.bind_to}; every child OMP_WAIT_POLICY=PASSIVE, OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = its threads; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset: OpenBLAS picks)')}")
    print(f"  {len(configs)} configurations x {args.rounds} rounds x {args.steps} steps: "
          + ", ".join(c.label for c in configs), flush=True)
    with tempfile.TemporaryDirectory(prefix="pipeshard-distributed-") as folder:
        onnx_path = cvp.export(MODEL, folder, args.seed, spec=SPEC)
        paths = {"onnx": onnx_path, "data": os.path.join(folder, f"{MODEL}_x.npy"),
                 "labels": os.path.join(folder, f"{MODEL}_y.npy"), "weights": os.path.join(folder, f"{MODEL}.pt")}
        results = measure(configs, args, paths, folder)
        if args.keep:
            kept = folder + ".kept"
            subprocess.run(["cp", "-r", folder, kept], check=True)
            print(f"kept model, data, logs and metrics in {kept}")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); a configuration is NOISY when "
          f"its per-round medians differ by more than {cvp.NOISY_SPREAD:.0%}")
    report_blas(configs, results)
    report_runs(configs, results, args)
    if "dp" in sections:
        report_dp(results)
    if "buckets" in sections:
        report_buckets(results)
    if "ddp" in sections:
        report_ddp(results)
    if "pipeline" in sections:
        report_pipeline(configs, results)
    if "tp" in sections:
        report_tp(results)
    if "zero" in sections:
        report_zero(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
