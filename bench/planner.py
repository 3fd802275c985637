#!/usr/bin/python3
"""Validate the layout planner (partition --plan, issue 18): run every layout it accepts and compare.

How to run, from the repository root after building
(cmake --build build --target partition train profile):
    /usr/bin/python3 bench/planner.py [--models A,B,D] [--ranks 1,2,4] [--batch-size 64] [--steps 30]
                                      [--warmup 5] [--min-seconds 0.5] [--max-micro-batches K] [--rounds 1]
                                      [--final-rounds 3] [--out DIR]
    /usr/bin/python3 bench/planner.py --quick      # model A on 1 and 2 ranks, 15 steps, M <= 4

For each model and each rank count N:
  1. the model is exported with torch.onnx.export (cpu_vs_pytorch.py's build_module and export), with
     batch_size x steps samples of standard-normal float32 features and uniform int64 labels;
  2. the machine is profiled the way the runs are made: mpirun -np N --oversubscribe --bind-to none
     build/bin/profile MODEL --batch-size B [--max-micro-batches K] --out profile.json, every rank with
     OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = max(1, cores // N) and OMP_WAIT_POLICY=PASSIVE
     (--nominal, or no build/bin/profile: partition's nominal profile instead, and the report says so);
     taken again just before the case's runs when it is older than 2 minutes by then, since the
     machine's speed drifts over a long benchmark (by 20 % within half an hour on the 2-core VM);
  3. partition MODEL --plan --ranks N --batch-size B --optimizer OPT --profile profile.json --json lists
     every accepted layout with its predicted step time and peak memory per rank;
  4. every accepted layout runs: mpirun -np N (same flags, same environment) train MODEL --data X
     --labels Y --batch-size B --steps S --no-shuffle --optimizer OPT --metrics m.jsonl <its train_flags>,
     S = --steps, or more where the steps after the warm-up would last under --min-seconds (0.5 s) at the
     predicted step time (up to 10 x --steps);
     Its step time is the median, over the steps after the first --warmup, of B / samples_per_s of
     rank 0's --metrics rows (the wall time between consecutive steps); its peak memory is train's
     "peak memory held by the backend per process: X at most" (the largest rank).
     Runs go one at a time (the machine has few cores). A run that fails is recorded with the last
     line of its error output and the benchmark goes on: a layout the planner accepts and train
     refuses is a planner bug.
Other work on the machine distorts both the profile and the runs (with one core taken, ranks that
poll for messages lose whole scheduler time slices: steps of 8, 16, 24 ms). So every run also
measures the share of the CPUs that processes other than its own used meanwhile (python_overhead.py's
OthersMeter: /proc/stat's busy time less this script's and its children's CPU time); above --busy
(default 5 %) the run is BUSY: the script waits up to --quiet-wait seconds for a quiet second and
runs it again, up to --retries times, and keeps the quietest attempt. Layouts still BUSY are counted
and marked, with the processes that used the CPUs.

The models (the optimizer is --optimizer, default adam, passed to both partition and train):
  A  784-512-512-10, ReLU between                      (cpu_vs_pytorch.py's model A)
  B  4 x (Linear(1024, 1024) + ReLU), 1024 classes     (cpu_vs_pytorch.py's model B, as exported there)
  D  16 x Linear: 512 -> 512 fifteen times, then 512 -> 10, ReLU between (deep and narrow: many cut points)
all at --batch-size (default 64), whatever cpu_vs_pytorch.py's own batch is.

Figures per (model, N), with the issue's targets (PASS/FAIL):
  error      = |predicted - measured| / measured per layout; its median over the layouts    <= 15 %
  first      = measured ms of the planner's first choice / the fastest measured ms           <= 1.05
               (the first choice and the layouts within 10 % of the fastest, at most 8, run
               --final-rounds more times after the --rounds, default 3, steps pooled: the fastest
               of a hundred noisy medians is partly the fastest by luck)
  Spearman   = rank correlation of predicted and measured ms over the layouts (ties averaged) >= 0.8
  memory     = the largest |predicted - measured| / measured peak bytes per rank              <= 10 %
and the signed error (predicted - measured) / measured grouped by layout shape, schedule, ZeRO and
recomputation, which shows where the cost model leans one way.

It writes, into --out (default bench/reports/planner/): planner.json (every measurement, the plans and
profiles), planner.md (the tables) and planner_scatter.png (predicted against measured ms, log-log, one
colour per model, a marker per N, the line y = x).

It is a benchmark: it exits 0 whatever the figures, and 2 only when it cannot run (no build, no mpirun,
no torch, a plan that cannot be made).
"""
import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_vs_pytorch as cvp  # noqa: E402  (build_module, export)
import distributed  # noqa: E402  (read_peak_mib: train's memory line)
import python_overhead as po  # noqa: E402  (OthersMeter: what other processes use of the CPUs)
from planner_report import (MODEL_TITLES, mark_busy, print_report, report_from_json,  # noqa: E402
                            summarize, write_outputs)

MODEL_SPECS = {
    "A": dict(cvp.MODELS["A"], title=MODEL_TITLES["A"]),
    "B": dict(cvp.MODELS["B"], title=MODEL_TITLES["B"]),
    "D": {"layers": [(512, 512)] * 15 + [(512, 10)], "relu_last": False, "title": MODEL_TITLES["D"]},
}
LAUNCH_S = 1.5  # the first guess at one mpirun + train start-up and shut-down, for the estimate
QUICK = {"models": "A", "ranks": "1,2", "steps": 15, "warmup": 3, "max_micro_batches": 4, "min_seconds": 0.0}
DEFAULTS = {"models": "A,B,D", "ranks": "1,2,4", "steps": 30, "warmup": 5, "max_micro_batches": None,
            "min_seconds": 0.5}
MAX_STEPS_FACTOR = 10  # run_steps: at most this many times --steps
MIB = 1 << 20
REPROFILE_AFTER_S = 120  # a case's profile older than this when its runs start is taken again
QUIET_WINDOW_S = 1.0
CONTENDER_MARGIN = 1.10  # layouts measured within 10 % of the fastest get --final-rounds more runs
MAX_CONTENDERS = 8  # how long wait_for_quiet looks at the machine before deciding


def relative_error(predicted, measured):
    return (predicted - measured) / measured


# --------------------------------------------------------------------------- processes
def child_env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                OMP_WAIT_POLICY="PASSIVE", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def under_mpirun(args, ranks, argv):
    """argv as every run of this benchmark starts it: N ranks, unbound, the thread variables passed."""
    return [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), "-x", "OMP_NUM_THREADS",
            "-x", "OPENBLAS_NUM_THREADS", "-x", "OMP_WAIT_POLICY"] + argv


def wait_for_quiet(args):
    """Waits until other processes use at most --busy of the CPUs over QUIET_WINDOW_S, for at most
    --quiet-wait seconds; returns the last share seen."""
    deadline = time.monotonic() + args.quiet_wait
    while True:
        meter = po.OthersMeter()
        time.sleep(QUIET_WINDOW_S)
        share = meter.share()
        if share <= args.busy or time.monotonic() >= deadline:
            return share


def launch(argv, env, log_base, timeout_s):
    """Runs argv in its own session (a hung run is ended as a group); stdout and stderr go to
    log_base.out and .err. Returns (exit status, wall seconds, the share of the CPUs other processes
    used meanwhile, the 3 of them that used most); a timeout returns status None."""
    meter, began = po.OthersMeter(), time.monotonic()
    with open(log_base + ".out", "w") as out, open(log_base + ".err", "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
    return status, time.monotonic() - began, meter.share(), meter.top()


MPI_NOISE = ("---", "***", "Primary job", "mpirun", "Child job", "process rank", "Process name", "Exit code",
             "prterun", "PRTE", "a non-zero", "the job to be terminated", "was:", "Host:", "PID:", "ended", "")


def error_line(log_base):
    """The line that says why a run failed: the last line of its stderr (or stdout) that is not
    mpirun's own banner."""
    for suffix in (".err", ".out"):
        lines = [line.strip() for line in open(log_base + suffix, errors="replace")]
        ours = [line for line in lines if line and not line.startswith(MPI_NOISE) and not set(line) <= set("-*=")]
        if ours:
            return ours[-1][:300]
    return "(no output)"


# --------------------------------------------------------------------------- model, profile, plan
def export_model(name, args, folder):
    """The ONNX model (cpu_vs_pytorch.py's export) and batch_size x steps samples of data."""
    import numpy as np
    spec = dict(MODEL_SPECS[name], batch=args.batch_size)
    onnx_path = cvp.export(name, folder, args.seed, spec=spec)
    samples, fan_in, classes = args.batch_size * args.steps, spec["layers"][0][0], spec["layers"][-1][1]
    rng = np.random.default_rng(args.seed)
    data, labels = os.path.join(folder, f"{name}_x.npy"), os.path.join(folder, f"{name}_y.npy")
    np.save(data, rng.standard_normal((samples, fan_in), dtype=np.float32))
    np.save(labels, rng.integers(0, classes, samples).astype(np.int64))
    return {"onnx": onnx_path, "data": data, "labels": labels}


def threads_per_rank(ranks):
    return max(1, (os.cpu_count() or 1) // ranks)


def take_profile(name, ranks, args, paths, folder):
    """profile.json measured by N ranks at once, or None (the nominal profile) with the reason."""
    if args.nominal:
        return None, "nominal (--nominal)"
    if not os.access(args.profile_tool, os.X_OK):
        return None, f"nominal ({args.profile_tool} is not built)"
    out = os.path.join(folder, f"profile_{name}_{ranks}.json")
    argv = [args.profile_tool, paths["onnx"], "--batch-size", str(args.batch_size), "--out", out]
    if args.max_micro_batches:
        argv += ["--max-micro-batches", str(args.max_micro_batches)]
    for attempt in range(1 + args.retries):  # a profile taken while others load the machine misleads the plan
        wait_for_quiet(args)
        log = os.path.join(folder, f"profile_{name}_{ranks}_{attempt}")
        status, wall, others, top = launch(under_mpirun(args, ranks, argv), child_env(threads_per_rank(ranks)), log,
                                           args.timeout)
        if status != 0 or not os.path.exists(out):
            raise RuntimeError(f"profile of model {name} on {ranks} ranks failed (status {status}): {error_line(log)}")
        if others <= args.busy:
            break
    busy = busy_note(others, top, args)
    print(f"  profiled model {name} on {ranks} ranks in {wall:.1f} s{busy}", flush=True)
    return out, f"measured: {os.path.relpath(args.profile_tool)} on {ranks} ranks, {wall:.1f} s{busy}"


def make_plan(name, ranks, args, paths, profile):
    argv = [args.partition, paths["onnx"], "--plan", "--ranks", str(ranks), "--batch-size", str(args.batch_size),
            "--optimizer", args.optimizer, "--json"]
    if profile:
        argv += ["--profile", profile]
    if args.max_micro_batches:
        argv += ["--max-micro-batches", str(args.max_micro_batches)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"partition --plan for model {name} on {ranks} ranks failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------- measuring
def run_steps(args, predicted_ms):
    """Steps of one run: --steps, or more where the predicted step is short, so that the steps after the
    warm-up last --min-seconds (at most MAX_STEPS_FACTOR x --steps): the median of 15 steps of 3 ms
    moved by 15-20 % from one run to the next, and the launch (~1.5 s) costs more than the steps."""
    wanted = args.warmup + math.ceil(args.min_seconds * 1e3 / max(predicted_ms, 1e-3))
    return max(args.steps, min(wanted, MAX_STEPS_FACTOR * args.steps))


def train_argv(args, paths, metrics, train_flags, steps):
    flags = [] if train_flags.strip() in ("", "(none)") else train_flags.split()
    return [args.train, paths["onnx"], "--data", paths["data"], "--labels", paths["labels"],
            "--batch-size", str(args.batch_size), "--steps", str(steps), "--no-shuffle",
            "--optimizer", args.optimizer, "--metrics", metrics, *flags]


def measure_once(case, index, tag, args):
    """One train run of layout `index` of case: (step seconds after warm-up, peak MiB, the share of
    the CPUs others used meanwhile, who); raises RuntimeError with the reason it failed."""
    layout = case["plan"]["layouts"][index]
    metrics = tag + ".jsonl"
    steps = run_steps(args, layout["predicted"]["step_ms"])
    argv = under_mpirun(args, case["ranks"], train_argv(args, case["paths"], metrics, layout["train_flags"], steps))
    status, _, others, top = launch(argv, child_env(case["threads"]), tag, args.timeout)
    if status != 0:
        why = f"timed out after {args.timeout} s" if status is None else f"status {status}"
        raise RuntimeError(f"{why}: {error_line(tag)}")
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    times = [args.batch_size / row["samples_per_s"] for row in rows[args.warmup:] if row.get("samples_per_s")]
    if not times:
        raise RuntimeError(f"no --metrics rows after the warm-up ({len(rows)} rows)")
    return times, distributed.read_peak_mib(tag + ".err") or distributed.read_peak_mib(tag + ".out"), others, top


def busy_note(others, top, args):
    """"; BUSY: others used 48% of the CPUs (cc1plus 1.9 s)" when others > --busy, else ""."""
    if others <= args.busy:
        return ""
    who = ", ".join(f"{name} {cpu:.1f} s" for name, cpu in top)
    return f"; BUSY: others used {others:.0%} of the CPUs" + (f" ({who})" if who else "")


def measure_quietly(case, index, round_, args, folder, state):
    """measure_once on a quiet machine if it can: waits for quiet after a busy run, and runs again
    (up to --retries times) while other processes used more than --busy of the machine during the
    run; keeps the quietest attempt. state["busy"] carries the last run's verdict between calls."""
    best = None
    for attempt in range(1 + args.retries):
        if state.get("busy"):
            wait_for_quiet(args)
        tag = os.path.join(folder, f"run_{case['model']}_{case['ranks']}_{index}_{round_}_{attempt}")
        attempt_result = measure_once(case, index, tag, args)
        state["busy"] = attempt_result[2] > args.busy
        if best is None or attempt_result[2] < best[2]:
            best = attempt_result
        if not state["busy"]:
            break
    return best


def layout_record(case, index):
    layout = case["plan"]["layouts"][index]
    keys = ("text", "train_flags", "replicas", "stages", "tensor_parallel", "micro_batches", "schedule",
            "virtual_stages", "keep_activations", "zero")
    record = {k: layout[k] for k in keys}
    record.update(model=case["model"], ranks=case["ranks"], threads=case["threads"], plan_rank=index,
                  predicted_ms=layout["predicted"]["step_ms"], predicted=layout["predicted"],
                  predicted_peak_mib=layout["peak_bytes"] / MIB, status="ok", error=None, step_ms=[],
                  measured_peak_mib=None, wall_s=0.0, others_share=0.0, others_top=[])
    return record


def finish_record(record):
    if record["status"] == "ok":
        record["measured_ms"] = statistics.median(record["step_ms"])
        if record.get("final_step_ms"):
            record["final_ms"] = statistics.median(record["final_step_ms"])
        record["error"] = None
        record["time_error"] = relative_error(record["predicted_ms"], record["measured_ms"])
        peak = record["measured_peak_mib"]
        record["memory_error"] = relative_error(record["predicted_peak_mib"], peak) if peak else None
    return record


def estimate_s(case, args):
    """Seconds to measure every layout of a case: launches plus steps at the predicted step times."""
    return sum(args.rounds * run_guess_s(args, l["predicted"]["step_ms"]) for l in case["plan"]["layouts"])


def run_guess_s(args, predicted_ms):
    """Seconds one run of a layout should take: the launch and its steps at the predicted time."""
    return LAUNCH_S + run_steps(args, predicted_ms) * predicted_ms / 1e3


class Progress:
    """Counts runs and corrects the estimate of what is left by the pace of the runs so far."""

    def __init__(self, cases, args):
        self.total = sum(len(c["plan"]["layouts"]) for c in cases) * args.rounds
        self.left_s = sum(estimate_s(c, args) for c in cases)
        self.done, self.wall_s, self.guessed_s = 0, 0.0, 0.0

    def ran(self, guess_s, wall_s):
        self.done, self.left_s = self.done + 1, self.left_s - guess_s
        self.wall_s, self.guessed_s = self.wall_s + wall_s, self.guessed_s + guess_s

    def line(self):
        pace = self.wall_s / self.guessed_s if self.guessed_s > 0 else 1.0
        return f"[{self.done}/{self.total}, ~{max(0.0, self.left_s) * pace / 60:.1f} min left]"


def measure_layout(case, index, round_, args, folder, progress, state, into="step_ms"):
    """One round of one layout: its steps (into record[into]) and memory into its record, a progress
    line printed."""
    record = case["records"][index]
    guess = run_guess_s(args, record["predicted_ms"])
    if record["status"] != "ok":
        progress.ran(guess, 0.0)
        return  # failed in an earlier round: not again
    began = time.monotonic()
    try:
        times, peak, others, top = measure_quietly(case, index, round_, args, folder, state)
        record[into] = record.get(into, []) + [t * 1e3 for t in times]
        record["measured_peak_mib"] = peak if peak is not None else record["measured_peak_mib"]
        if others >= record["others_share"]:
            record.update(others_share=others, others_top=top)
        note = (f"measured {statistics.median(times) * 1e3:.3f} ms, predicted {record['predicted_ms']:.3f} ms, peak "
                f"{peak or float('nan'):.2f} MiB vs {record['predicted_peak_mib']:.2f} predicted" + busy_note(others, top, args))
    except RuntimeError as failure:
        record.update(status="failed", error=str(failure))
        note = f"FAILED: {failure}"
    wall = time.monotonic() - began
    record["wall_s"] += wall
    progress.ran(guess, wall)
    print(f"  {progress.line()} model {case['model']} N={case['ranks']} layout {index + 1} of "
          f"{len(case['records'])} ({record['text']}): {note}", flush=True)


def measure_case(case, args, folder, progress, state):
    """Every layout of a case, --rounds times (alternating the order), one run at a time. The machine's
    speed drifts over a long benchmark, so a profile older than REPROFILE_AFTER_S is taken again (and
    the case planned again on it) just before the case's runs."""
    if case["profile"] is not None and time.monotonic() - case["profiled_at"] > REPROFILE_AFTER_S:
        before = len(case["plan"]["layouts"])
        plan_case(case, args, folder)
        progress.total += (len(case["plan"]["layouts"]) - before) * args.rounds
        first = case["plan"]["layouts"][0]
        print(f"  model {case['model']}, N={case['ranks']}: planned again on the new profile: "
              f"{len(case['plan']['layouts'])} layouts, first choice {first['text']} "
              f"({first['predicted']['step_ms']:.3f} ms predicted)", flush=True)
    case["records"] = [layout_record(case, i) for i in range(len(case["plan"]["layouts"]))]
    n = len(case["records"])
    for round_ in range(args.rounds):
        for index in range(n) if round_ % 2 == 0 else reversed(range(n)):
            measure_layout(case, index, round_, args, folder, progress, state)
    for record in case["records"]:
        finish_record(record)
    measure_contenders(case, args, folder, progress, state)


def contenders(records):
    """The layouts the first-choice figure compares: the planner's first choice and the ones measured
    within CONTENDER_MARGIN of the fastest (at most MAX_CONTENDERS, fastest first)."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return []
    fastest = min(r["measured_ms"] for r in ok)
    near = sorted((r for r in ok if r["measured_ms"] <= CONTENDER_MARGIN * fastest), key=lambda r: r["measured_ms"])
    chosen = near[:MAX_CONTENDERS]
    if records[0]["status"] == "ok" and records[0] not in chosen:
        chosen.append(records[0])
    return chosen


def measure_contenders(case, args, folder, progress, state):
    """--final-rounds more runs of each contender, in alternating order, their steps kept apart
    (final_step_ms, final_ms). The fastest of a hundred noisy medians is biased low (it is the fastest
    partly by luck), and the machine's speed drifts between the first rounds and these, so the first
    choice is compared with the contenders on these rounds alone, run side by side."""
    chosen = contenders(case["records"])
    if args.final_rounds <= 0 or len(chosen) < 2:
        return
    progress.total += len(chosen) * args.final_rounds
    print(f"  model {case['model']} N={case['ranks']}: {args.final_rounds} more round(s) of {len(chosen)} layouts, "
          f"the first choice and those within {CONTENDER_MARGIN - 1:.0%} of the fastest", flush=True)
    for round_ in range(args.final_rounds):
        for record in chosen if round_ % 2 == 0 else reversed(chosen):
            measure_layout(case, record["plan_rank"], args.rounds + round_, args, folder, progress, state,
                           into="final_step_ms")
    for record in chosen:
        record["contender"] = True
        finish_record(record)


def run_meta(args, started):
    """What planner.md says of the run, kept in planner.json for --from-json."""
    return {"command": sys.argv, "started_utc": started, "host": os.uname().nodename, "cpus": os.cpu_count(),
            "batch_size": args.batch_size, "steps": args.steps, "min_seconds": args.min_seconds,
            "warmup": args.warmup, "rounds": args.rounds,
            "final_rounds": args.final_rounds,
            "optimizer": args.optimizer, "max_micro_batches": args.max_micro_batches, "busy": args.busy,
            "load_start": args.load_start, "load_end": os.getloadavg()[0]}


# --------------------------------------------------------------------------- main
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--models", help=f"comma-separated, of {','.join(MODEL_SPECS)} (default {DEFAULTS['models']})")
    ap.add_argument("--ranks", help=f"comma-separated N for mpirun -np N (default {DEFAULTS['ranks']})")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch per step (default 64)")
    ap.add_argument("--steps", type=int, help=f"steps per run (default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, help=f"steps discarded at the start of each run (default {DEFAULTS['warmup']})")
    ap.add_argument("--min-seconds", type=float,
                    help="a run's steps after the warm-up last at least this long at the predicted step time: more "
                         f"than --steps where steps are short, at most {MAX_STEPS_FACTOR} x --steps "
                         f"(default {DEFAULTS['min_seconds']}; 0: --steps for every layout)")
    ap.add_argument("--max-micro-batches", type=int, help="passed to partition --plan (default: its own, 16)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every layout, in alternating order; steps are pooled (default 1)")
    ap.add_argument("--final-rounds", type=int, default=3,
                    help="more runs of the first choice and of the layouts measured within 10%% of the fastest "
                         "(at most 8), after the --rounds (default 3; 0: none)")
    ap.add_argument("--optimizer", default="adam", choices=("sgd", "adam", "adamw"),
                    help="for partition --plan and train alike (default adam, the planner's default)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: model A, N in {1,2}, 15 steps, 3 warm-up, M <= 4 (flags given win)")
    ap.add_argument("--nominal", action="store_true", help="plan on partition's nominal profile, not a measured one")
    ap.add_argument("--busy", type=float, default=po.QUIET,
                    help="a run during which other processes used more than this share of the CPUs is BUSY: run "
                         f"again (--retries) after waiting for quiet (default {po.QUIET}, as python_overhead.py)")
    ap.add_argument("--retries", type=int, default=1, help="extra runs of a BUSY layout or profile (default 1)")
    ap.add_argument("--quiet-wait", type=float, default=30,
                    help="seconds to wait, at most, for the machine to be quiet before a run again (default 30)")
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    ap.add_argument("--out", default=os.path.join("bench", "reports", "planner"),
                    help="folder for planner.json, planner.md, planner_scatter.png (default bench/reports/planner)")
    ap.add_argument("--from-json", metavar="PLANNER_JSON",
                    help="run nothing: print the tables and rewrite planner.md and the plot into --out from a "
                         "planner.json an earlier run wrote")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (models, data, logs, metrics)")
    args = ap.parse_args()
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model_list = [m for m in args.models.split(",") if m]
    args.rank_list = [int(n) for n in args.ranks.split(",") if n]
    return args


def cannot_run(message):
    print(f"planner: {message}", file=sys.stderr)
    return 2


def check_setup(args):
    """The reason the benchmark cannot run, or None."""
    unknown = set(args.model_list) - set(MODEL_SPECS)
    if unknown or not args.model_list:
        return f"unknown --models {','.join(sorted(unknown))} (choose from {','.join(MODEL_SPECS)})"
    if not args.rank_list or min(args.rank_list) < 1:
        return "--ranks must list positive numbers"
    if not 0 <= args.warmup < args.steps:
        return "--warmup must be below --steps"
    if not args.min_seconds >= 0:
        return "--min-seconds must be 0 or more"
    for tool in (args.train, args.partition):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing; build it first (cmake --build {args.build_dir} --target partition train profile)"
    if args.mpirun is None:
        return "mpirun is missing (Debian openmpi-bin)"
    if subprocess.run([sys.executable, "-c", "import torch, onnx, numpy"], capture_output=True).returncode != 0:
        return "needs torch, onnx and numpy (Debian python3-torch, python3-onnx); run with /usr/bin/python3"
    return None


def plan_case(case, args, folder):
    """Profiles the machine for the case (take_profile) and plans it on that profile."""
    profile, note = take_profile(case["model"], case["ranks"], args, case["paths"], folder)
    case.update(profile_note=note, profile=json.load(open(profile)) if profile else None, profiled_at=time.monotonic(),
                plan=make_plan(case["model"], case["ranks"], args, case["paths"], profile))


def prepare_cases(args, folder):
    """Exports every model, profiles and plans every (model, N); prints the layout counts."""
    cases = []
    for name in args.model_list:
        paths = export_model(name, args, folder)
        for ranks in args.rank_list:
            case = {"model": name, "ranks": ranks, "threads": threads_per_rank(ranks), "paths": paths}
            plan_case(case, args, folder)
            cases.append(case)
            plan = case["plan"]
            print(f"  model {name}, N={ranks} ({case['threads']} thread(s) per rank): {len(plan['layouts'])} layouts "
                  f"accepted, {len(plan['rejected'])} rejected; first choice {plan['layouts'][0]['text']} "
                  f"({plan['layouts'][0]['predicted']['step_ms']:.3f} ms predicted); profile {case['profile_note']}; "
                  f"~{estimate_s(case, args) / 60:.1f} min to measure", flush=True)
    return cases


def main():
    args = parse_args()
    if args.from_json:
        return report_from_json(args.from_json, args.out)
    args.train = os.path.join(args.build_dir, "bin", "train")
    args.partition = os.path.join(args.build_dir, "bin", "partition")
    args.profile_tool = os.path.join(args.build_dir, "bin", "profile")
    args.mpirun = shutil.which("mpirun")
    problem = check_setup(args)
    if problem:
        return cannot_run(problem)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    args.load_start = os.getloadavg()[0]
    print(f"planner: {os.uname().nodename}, {os.cpu_count()} CPUs, load average {args.load_start:.2f}; models "
          f"{','.join(args.model_list)}, N in {{{','.join(map(str, args.rank_list))}}}, batch {args.batch_size}, "
          f"{args.steps} steps ({args.warmup} warm-up; more to last {args.min_seconds:g} s) x {args.rounds} round(s), --optimizer {args.optimizer}; every "
          f"run: mpirun -np N --oversubscribe --bind-to none, OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = "
          f"max(1, {os.cpu_count()} // N), OMP_WAIT_POLICY=PASSIVE", flush=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipeshard-planner-") as folder:
        try:
            cases = prepare_cases(args, folder)
        except (RuntimeError, subprocess.CalledProcessError, json.JSONDecodeError) as failure:
            return cannot_run(str(failure))
        runs = sum(len(c["plan"]["layouts"]) for c in cases) * args.rounds
        print(f"  {runs} runs, estimated {sum(estimate_s(c, args) for c in cases) / 60:.1f} min "
              f"({LAUNCH_S} s a launch + the predicted steps; the progress lines correct it as runs finish)", flush=True)
        progress, state = Progress(cases, args), {}
        for case in cases:
            measure_case(case, args, folder, progress, state)
        if args.keep:
            kept = folder + ".kept"
            shutil.copytree(folder, kept)
            print(f"kept models, data, logs and metrics in {kept}")
    mark_busy(cases, args.busy)
    summaries = [summarize(c, args.rounds) for c in cases]
    print(f"\nmeasured in {(time.monotonic() - began) / 60:.1f} min; load average at the end {os.getloadavg()[0]:.2f}")
    print_report(cases, summaries)
    write_outputs(cases, summaries, run_meta(args, started), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
