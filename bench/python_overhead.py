#!/usr/bin/python3
"""pipeshard.train against the train tool on model B: what the Python entry point costs per step.

How to run, from the repository root after building (cmake --build build --target train _pipeshard):
    /usr/bin/python3 bench/python_overhead.py [--rounds 15] [--steps 100] [--warmup 10] [--threads 2]
                                              [--quiet-budget SECONDS] [--build build] [--json OUT]

Model B of bench/cpu_vs_pytorch.py (4 x (Linear(1024, 1024) + ReLU), batch 256; exported there with
its data: 8 batches of seeded normal features and int64 labels) trains --steps steps with the same
flags both ways: --batch-size 256 --lr 0.01 --momentum 0.9 --no-shuffle (SGD), in one process each:
  CLI      BUILD/bin/train B.onnx --data B_x.npy --labels B_y.npy ... --metrics m.jsonl
  Python   a child /usr/bin/python3 with PYTHONPATH=BUILD/python: import numpy, pipeshard; then
           pipeshard.load(B.onnx), np.load of both arrays (in memory; the tool maps the files),
           pipeshard.train(m, X, y, batch_size=256, lr=0.01, momentum=0.9, shuffle=False, steps=N,
           progress=False): no callback, so that no Python code runs between the steps
Both children get the same environment: OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = --threads,
OMP_WAIT_POLICY=PASSIVE, as bench/cpu_vs_pytorch.py gives train (OPENBLAS_CORETYPE is left as the
environment sets it). One unmeasured run of each side first (page cache, dynamic loader), then
--rounds paired rounds, the order alternating: CLI first in round 1, Python first in round 2, ...

Per step: step time = batch / samples_per_s, read from the --metrics rows and from result.history.
Both figures come from the same code, train's step loop (tools/train/loop.cc), which pipeshard.train
runs too: the time from one step's end to the next one's, so that the intervals add up to the whole
loop, including the CLI's metrics row and the Python side's history callback. Python runs no code
while the loop runs (the call releases the GIL and returns when the loop is done), so a cost of the
entry point could only lie outside the loop, where the whole-call figures below see it; timing N
steps from outside instead would mix that per-call cost into the per-step figure. The first
--warmup steps of every run are left out; the figure of a run is the median of the rest.
  ratio       Python / CLI of one round's two medians; the headline is the median over rounds, with
              its distribution-free 95 % interval (order statistics: no assumption about the noise)
              and the range. A round runs both sides back to back, so a slowdown of the shared machine
              that outlasts a round cancels in its ratio; many short rounds rather than a few long
              ones, because a burst of other work that hits one run of a round does not cancel.
  quiet       the rounds in which other processes used under 5 % of the CPUs during both runs, and
              their median ratio: on a shared machine, the figure that other work did not touch.
              --quiet-budget S spends up to S seconds in all on waiting, before each round, for a
              2-second window in which other processes use under 5 % of the CPUs, and on running
              again each round that other work disturbed (either run at 5 % or more); the disturbed
              rounds are counted and kept in --json, out of the figures. For a machine where others
              build in bursts; the selection looks only at other processes, never at the ratio.
Per call (the whole run, start-up included):
  CLI         wall time of the train process, from launching it to its exit
  Python      wall time of pipeshard.load + np.load (both arrays) + pipeshard.train(...), measured
              inside the child with perf_counter; the child's process wall time (interpreter start
              and `import numpy, pipeshard` added) is printed too
  outside the steps = whole call - the sum of all step times (warm-up included): set-up and teardown
Correctness: the losses of every step, both ways, must be equal bit for bit (pipeshard.train is
train's run), and both sides must map the same OpenBLAS file (read from /proc/PID/maps). Per run the
script also records the CPU share that other processes used while it ran (/proc/stat busy time less
this script's and its children's CPU time), which says which rounds the shared machine disturbed.

It is a benchmark: it exits 0 whatever the figures, 2 only when it cannot run (no train, no module,
no torch to export the model).
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_vs_pytorch as cvp  # noqa: E402

ROOT = cvp.ROOT
MODEL = "B"
SPEC = cvp.MODELS[MODEL]
SIDES = ("cli", "python")
NOISY_SPREAD = 0.10  # per-round medians of one side further apart than this: a busy machine
QUIET = 0.05  # a run during which other processes used less than this share of the CPUs


# --------------------------------------------------------------------------- the Python child
def python_worker(job):
    """One pipeshard.train run in this process; prints one JSON line."""
    import numpy as np
    import pipeshard
    start = time.perf_counter()
    model = pipeshard.load(job["model"])
    x, y = np.load(job["data"]), np.load(job["labels"])
    loaded = time.perf_counter()
    result = pipeshard.train(model, x, y, batch_size=SPEC["batch"], lr=cvp.LR, momentum=cvp.MOMENTUM, shuffle=False,
                             steps=job["steps"], progress=False)
    history = result.history  # a copy into Python objects: taken once, inside the timing
    done = time.perf_counter()
    print(json.dumps({"step_s": [SPEC["batch"] / s.samples_per_s for s in history],
                      "losses": [s.loss for s in history], "load_s": loaded - start, "train_s": done - loaded,
                      "blas": cvp.blas_libraries(os.getpid()), "module": pipeshard._pipeshard.__file__}))


# --------------------------------------------------------------------------- the parent
class OthersMeter:
    """The share of the CPUs that other processes have used since it was made: the busy time of all
    CPUs in /proc/stat (user nice system irq softirq) less the CPU time of this process and of the
    children it has waited for (getrusage); and which processes they were."""

    def __init__(self):
        self.procs = self._per_process()
        self.busy, self.own, self.start = self._busy(), self._own(), time.perf_counter()

    @staticmethod
    def _per_process():
        """{pid: (name, CPU seconds)} of every process now alive."""
        out, hz = {}, os.sysconf("SC_CLK_TCK")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # utime and stime are fields 14 and 15
            out[int(pid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / hz)
        return out

    @staticmethod
    def _busy():
        with open("/proc/stat") as f:
            cols = [int(v) for v in f.readline().split()[1:]]
        return (cols[0] + cols[1] + cols[2] + cols[5] + cols[6]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own():
        return sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for field in ("ru_utime", "ru_stime"))

    def share(self):
        wall = time.perf_counter() - self.start
        return max(0.0, (self._busy() - self.busy) - (self._own() - self.own)) / (wall * os.cpu_count())

    def top(self, count=3):
        """The `count` other processes alive now that used the most CPU since then: [(name, seconds)]
        (this process's children are gone by then: waited for)."""
        used = [(name, cpu - self.procs.get(pid, (name, 0.0))[1]) for pid, (name, cpu) in self._per_process().items()
                if pid != os.getpid()]
        return [(name, round(cpu, 2)) for name, cpu in sorted(used, key=lambda u: -u[1])[:count] if cpu >= 0.01]


def wait_quiet(limit_s, progress):
    """Waits until other processes use under QUIET of the CPUs for 2 s, or `limit_s` has passed.
    Returns the seconds waited."""
    start, said = time.perf_counter(), -60.0
    while limit_s > 0 and time.perf_counter() - start < limit_s:
        meter = OthersMeter()
        time.sleep(2.0)
        share = meter.share()
        if share < QUIET:
            break
        if time.perf_counter() - said >= 60:  # a line a minute
            said = time.perf_counter()
            progress(f"python_overhead: other processes use {share:.0%} of the CPUs; waiting for a quiet moment "
                     f"(waited {said - start:.0f} s, at most {limit_s:.0f})")
    return time.perf_counter() - start


def run_timed(argv, env, log_path, watch_blas=False):
    """Runs argv to completion. Returns (wall seconds, the CPU share other processes used
    meanwhile, the ones that used the most, the BLAS files it mapped if watch_blas: polling
    /proc for them costs CPU, so only the unmeasured runs do it)."""
    meter, start = OthersMeter(), time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    libs = []
    while watch_blas and proc.poll() is None and not any("blas" in p for p in libs):
        libs = cvp.blas_libraries(proc.pid)
        time.sleep(0.005)
    proc.wait()
    wall, others = time.perf_counter() - start, meter.share()
    culprits = meter.top()
    if proc.returncode != 0:
        sys.exit(f"python_overhead: {' '.join(argv[:3])} ... failed ({proc.returncode}), see {log_path}:\n"
                 + open(log_path).read()[-2000:])
    return wall, others, culprits, libs


class Setup:
    """Model B and its data in `folder`, the two command lines and their environment."""

    def __init__(self, build, folder, threads, seed=0):
        self.folder = folder
        self.train = os.path.join(build, "bin", "train")
        self.python_dir = os.path.join(build, "python")
        self.onnx = cvp.export(MODEL, folder, seed)
        self.data, self.labels = os.path.join(folder, f"{MODEL}_x.npy"), os.path.join(folder, f"{MODEL}_y.npy")
        env, _ = cvp.child_environments(threads)
        # No __pycache__ written into the build's package.
        self.env = dict(env, PYTHONPATH=self.python_dir, PYTHONDONTWRITEBYTECODE="1")

    def cli_argv(self, steps, metrics):
        return [self.train, self.onnx, "--data", self.data, "--labels", self.labels, "--batch-size",
                str(SPEC["batch"]), "--steps", str(steps), "--lr", str(cvp.LR), "--momentum", str(cvp.MOMENTUM),
                "--no-shuffle", "--metrics", metrics]

    def run(self, side, steps, tag, watch_blas=False):
        """One run of `side`; its step times, losses and whole-call figures."""
        log = os.path.join(self.folder, f"{side}_{tag}.log")
        if side == "cli":
            metrics = os.path.join(self.folder, f"metrics_{tag}.jsonl")
            wall, others, culprits, libs = run_timed(self.cli_argv(steps, metrics), self.env, log, watch_blas)
            rows = [json.loads(line) for line in open(metrics)]
            return {"step_s": [SPEC["batch"] / r["samples_per_s"] for r in rows], "losses": [r["loss"] for r in rows],
                    "call_s": wall, "process_s": wall, "others": others, "others_top": culprits, "blas": libs}
        job = {"model": self.onnx, "data": self.data, "labels": self.labels, "steps": steps}
        argv = [sys.executable, os.path.abspath(__file__), "--python-worker", json.dumps(job)]
        wall, others, culprits, _ = run_timed(argv, self.env, log)
        out = json.loads(open(log).read().strip().splitlines()[-1])
        return dict(out, call_s=out["load_s"] + out["train_s"], process_s=wall, others=others, others_top=culprits)


def disturbers(runs):
    """"CLI run: cc1plus 1.2 s, ...; Python run: ..." from the runs' others_top."""
    return "; ".join(f"{side} run: " + (", ".join(f"{name} {cpu:.2f} s" for name, cpu in runs[side]["others_top"]) or
                                        "none still alive") for side in SIDES)


def measure(build, folder, rounds, steps, warmup, threads, progress, quiet_budget_s=0):
    """An unmeasured run of each side, then `rounds` paired rounds (the order alternating).
    With quiet_budget_s, up to that many seconds in all go to waiting for quiet moments before
    rounds and to rerunning the rounds that other work disturbed (other processes used QUIET or
    more of the CPUs during either run); those are kept apart, out of the figures.
    Returns {"rounds": [{"order", "cli": run, "python": run}], "disturbed": [...], "blas": ...}."""
    setup = Setup(build, folder, threads)
    warm = {side: setup.run(side, min(steps, 20), "warm", watch_blas=True) for side in SIDES}
    out = {"rounds": [], "disturbed": [], "steps": steps, "warmup": warmup, "threads": threads,
           "batch": SPEC["batch"], "blas": {side: warm[side]["blas"] for side in SIDES},
           "module": warm["python"]["module"], "cli_argv": setup.cli_argv(steps, "m.jsonl"),
           "quiet_budget_s": quiet_budget_s, "load_start": os.getloadavg()}
    deadline = time.perf_counter() + quiet_budget_s
    while len(out["rounds"]) < rounds:
        r = len(out["rounds"])
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        waited = wait_quiet(deadline - time.perf_counter(), progress)
        tag = f"{r}_{len(out['disturbed'])}"
        runs = {side: setup.run(side, steps, tag) for side in order}
        disturbed = max(runs[side]["others"] for side in SIDES) >= QUIET and time.perf_counter() < deadline
        (out["disturbed"] if disturbed else out["rounds"]).append(dict(runs, order=order, waited_s=waited))
        med = {side: statistics.median(runs[side]["step_s"][warmup:]) for side in SIDES}
        progress(f"python_overhead: round {r + 1}/{rounds} ({' first, '.join(order)} second): CLI "
                 f"{med['cli'] * 1e3:.2f} ms/step, Python {med['python'] * 1e3:.2f}, ratio "
                 f"{med['python'] / med['cli']:.4f}; other processes' CPU share {runs['cli']['others']:.0%} / "
                 f"{runs['python']['others']:.0%}; load {os.getloadavg()[0]:.2f}"
                 + (f"; disturbed: run again (others: {disturbers(runs)})" if disturbed else ""))
    out["load_end"] = os.getloadavg()
    return out


# --------------------------------------------------------------------------- figures
def median_interval(values, level=0.95):
    """A distribution-free confidence interval of the median: (the k-th smallest, the k-th largest)
    with the largest k for which Binomial(n, 1/2) < k has probability at most (1 - level) / 2;
    None when there are too few values (under 6 at 95 %)."""
    n, below, k = len(values), 0.0, 0
    while below + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        below += math.comb(n, k) / 2 ** n
        k += 1
    ordered = sorted(values)
    return (ordered[k - 1], ordered[n - k]) if k > 0 else None


def figures(res):
    """Per-round and summary figures of measure()'s result: times in seconds."""
    w = res["warmup"]
    per_round = []
    for r in res["rounds"]:
        row = {"order": r["order"]}
        for side in SIDES:
            run = r[side]
            row[side] = {"step": statistics.median(run["step_s"][w:]), "call": run["call_s"],
                         "outside": run["call_s"] - sum(run["step_s"]), "process": run["process_s"],
                         "load": run.get("load_s", float("nan")), "others": run["others"]}
        row["ratio"] = row["python"]["step"] / row["cli"]["step"]
        row["same_losses"] = r["cli"]["losses"] == r["python"]["losses"]
        per_round.append(row)
    med = lambda side, key: statistics.median(r[side][key] for r in per_round)
    ratios = [r["ratio"] for r in per_round]
    quiet = [r["ratio"] for r in per_round if max(r[s]["others"] for s in SIDES) < QUIET]
    spread = max(max(r[s]["step"] for r in per_round) / min(r[s]["step"] for r in per_round) - 1 for s in SIDES)
    blas = {side: {os.path.realpath(p) for p in res["blas"][side] if "openblas" in os.path.basename(p)}
            for side in SIDES}
    return {"rounds": per_round, "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_ci": median_interval(ratios),
            "step": {s: med(s, "step") for s in SIDES}, "call": {s: med(s, "call") for s in SIDES},
            "outside": {s: med(s, "outside") for s in SIDES}, "process": {s: med(s, "process") for s in SIDES},
            "load": med("python", "load"),
            "call_ratio": statistics.median(r["python"]["call"] / r["cli"]["call"] for r in per_round),
            "spread": spread, "noisy": spread > NOISY_SPREAD, "quiet_rounds": len(quiet),
            "disturbed": len(res.get("disturbed", [])),
            "quiet_ratio": statistics.median(quiet) if quiet else None,
            "quiet_min": min(quiet, default=None), "quiet_max": max(quiet, default=None),
            "same_losses": all(r["same_losses"] for r in per_round),
            "same_blas": bool(blas["cli"] & blas["python"]), "openblas": sorted(blas["cli"] | blas["python"])}


ROUND_HEADER = ["round", "first", "CLI ms/step", "Python ms/step", "Python / CLI", "CLI whole s", "Python whole s",
                "others' CPU share (CLI / Python run)", "losses equal"]
SUMMARY_HEADER = ["figure", "CLI", "Python", "Python / CLI", "formula"]


def round_rows(f):
    return [[i + 1, r["order"][0], f"{r['cli']['step'] * 1e3:.2f}", f"{r['python']['step'] * 1e3:.2f}",
             f"{r['ratio']:.4f}", f"{r['cli']['call']:.2f}", f"{r['python']['call']:.2f}",
             f"{r['cli']['others']:.0%} / {r['python']['others']:.0%}", "yes" if r["same_losses"] else "**NO**"]
            for i, r in enumerate(f["rounds"])]


def summary_rows(f, res):
    n, w = len(f["rounds"]), res["warmup"]
    ms = lambda v: f"{v * 1e3:.2f}"
    return [
        ["step time, median over rounds (ms)", ms(f["step"]["cli"]), ms(f["step"]["python"]),
         f"**{f['ratio']:.4f}** ({interval(f['ratio_ci'])}; range {f['ratio_min']:.4f}–{f['ratio_max']:.4f})",
         f"a run's median of batch / samples_per_s over steps {w + 1}–{res['steps']}; ratio: median over the "
         f"{n} rounds of each round's Python / CLI, with its distribution-free 95 % interval"],
        ["step time ratio, quiet rounds only", "", "",
         f"{f['quiet_ratio']:.4f} (range {f['quiet_min']:.4f}–{f['quiet_max']:.4f})" if f["quiet_rounds"] else "—",
         f"the {f['quiet_rounds']} of {n} rounds in which other processes used < {QUIET:.0%} of the CPUs during both "
         "runs" + (f"; {rounds_run_again(f['disturbed'])} (--quiet-budget)" if f["disturbed"] else "")],
        ["whole call, median (s)", f"{f['call']['cli']:.3f}", f"{f['call']['python']:.3f}", f"{f['call_ratio']:.3f}",
         "CLI: the train process, launch to exit; Python: pipeshard.load + np.load + pipeshard.train; ratio: "
         "median of the rounds' ratios"],
        ["outside the steps, median (ms)", ms(f["outside"]["cli"]), ms(f["outside"]["python"]), "",
         f"whole call − Σ step times (all {res['steps']} steps): reading the model and data, set-up, teardown"],
        ["  of which pipeshard.load + np.load, median (ms)", "", ms(f["load"]), "",
         "the CLI's reading of its files is inside its process and not timed apart"],
        ["process, median (s)", f"{f['process']['cli']:.3f}", f"{f['process']['python']:.3f}", "",
         "Python: the child's wall time, interpreter start and `import numpy, pipeshard` included"],
        ["losses of every step equal, all rounds", "", "", "yes" if f["same_losses"] else "**NO**",
         "bit for bit, --metrics rows against result.history"],
    ]


def rounds_run_again(count):
    return f"{count} disturbed round{'' if count == 1 else 's'} run again"


def interval(ci):
    return f"95 % interval {ci[0]:.4f}–{ci[1]:.4f}" if ci else "too few rounds for a 95 % interval"


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])


def blas_line(f, res):
    extra = sorted(p for p in res["blas"]["python"] if os.path.realpath(p) not in f["openblas"] and "blas" in p)
    return (f"OpenBLAS: {', '.join(f['openblas'])}; the same file on both sides: {'yes' if f['same_blas'] else '**NO**'}"
            + (f" (the Python child also maps NumPy's own, idle here: {', '.join(extra)})" if extra else ""))


def verdict_line(f, res):
    """One line: the ratio against 'no measurable cost', and why the noise bounds what can be seen."""
    band = max(abs(f["ratio_max"] - 1), abs(f["ratio_min"] - 1))
    return (f"Model B, {res['threads']} thread(s), {len(f['rounds'])} paired rounds × {res['steps']} steps of batch "
            f"{res['batch']}: pipeshard.train / train per step = {f['ratio']:.4f} (median of rounds, "
            f"{interval(f['ratio_ci'])}; rounds {f['ratio_min']:.4f}–{f['ratio_max']:.4f}, i.e. within ±{band:.1%}"
            + (f"; the {f['quiet_rounds']} quiet ones {f['quiet_ratio']:.4f}" if f["quiet_rounds"] else "; no quiet round")
            + (f"; {rounds_run_again(f['disturbed'])}" if f["disturbed"] else "")
            + f"); whole call "
            f"{f['call']['python']:.2f} s against {f['call']['cli']:.2f} s; losses equal bit for bit: "
            f"{'yes' if f['same_losses'] else 'NO'}; same OpenBLAS file: {'yes' if f['same_blas'] else 'NO'}"
            + (f"; NOISY: per-round medians of one side differ by {f['spread']:.0%} (what lasts a round cancels in "
               "its ratio)" if f["noisy"] else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds, the order alternating (default 15)")
    ap.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    ap.add_argument("--warmup", type=int, default=10, help="steps of every run left out of its median (default 10)")
    ap.add_argument("--threads", type=int, default=2, help="OpenBLAS/OpenMP threads on each side (default 2)")
    ap.add_argument("--quiet-budget", type=float, default=0, metavar="SECONDS",
                    help="spend up to this long in all waiting for other processes to use < 5%% of the CPUs "
                         "before rounds, and running again the rounds they disturbed (default 0: neither)")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build: bin/train and python/ "
                                                                          "(default the checkout's build/)")
    ap.add_argument("--json", help="write every run's step times, losses and figures here")
    ap.add_argument("--python-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.python_worker:
        return python_worker(json.loads(args.python_worker))
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves nothing after --warmup {args.warmup}")
    train = os.path.join(args.build, "bin", "train")
    module = os.path.join(args.build, "python", "pipeshard")
    if not os.access(train, os.X_OK) or not os.path.isdir(module):
        print(f"python_overhead: needs {train} and {module}; build them first "
              f"(cmake --build {args.build} --target train _pipeshard)", file=sys.stderr)
        return 2
    if subprocess.run([sys.executable, "-c", "import torch, onnx, numpy"], capture_output=True).returncode != 0:
        print("python_overhead: needs torch, onnx and numpy to export model B; run with /usr/bin/python3", file=sys.stderr)
        return 2
    say = lambda message: print(message, file=sys.stderr, flush=True)
    say(f"python_overhead: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; OMP_NUM_THREADS = "
        f"OPENBLAS_NUM_THREADS = {args.threads}, OMP_WAIT_POLICY=PASSIVE; OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset: OpenBLAS picks)')}")
    with tempfile.TemporaryDirectory(prefix="pipeshard-python-overhead-") as folder:
        res = measure(args.build, folder, args.rounds, args.steps, args.warmup, args.threads, say,
                      args.quiet_budget)
    f = figures(res)
    print(f"Model B ({SPEC['title']}), {args.rounds} paired rounds × {args.steps} steps, the first {args.warmup} "
          f"left out; {args.threads} thread(s); load average {res['load_start'][0]:.2f} → {res['load_end'][0]:.2f}\n")
    print(markdown_table(ROUND_HEADER, round_rows(f)) + "\n")
    print(markdown_table(SUMMARY_HEADER, summary_rows(f, res)) + "\n")
    print(blas_line(f, res))
    print(verdict_line(f, res))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"result": res, "figures": f}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
