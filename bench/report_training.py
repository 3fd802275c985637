"""Training sections of bench/report.py: CPU against PyTorch, step time vs batch, and 2-process
parallelism. The measurements are cpu_vs_pytorch.py's race() and distributed.py's measure(); this
module only chooses their settings and writes their figures as Markdown tables and plots.

Every section function takes (ctx, doc): ctx carries the options, tools, a scratch folder and
progress(); doc collects the Markdown (report.py defines both).
"""
import contextlib
import io
import os
import sys
from argparse import Namespace

import cpu_vs_pytorch as cvp
import distributed as dist
import report_plots as plots

THREADS = 2
SWEEP_BATCHES = (32, 64, 128, 256, 512)
SWEEP_BATCHES_QUICK = (32, 128, 512)
TRAIN_FLAGS = f"--lr {cvp.LR} --momentum {cvp.MOMENTUM} --no-shuffle --metrics M.jsonl"


def captured(function, *args):
    """What function(*args) prints, as a string (the scripts' own tables, reused verbatim)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        function(*args)
    return out.getvalue().strip("\n")


def race_args(ctx, rounds, steps_a=300, steps_b=40):
    return Namespace(threads=THREADS, rounds=rounds, steps_a=steps_a, steps_b=steps_b, warmup=5,
                     sgemm_repeats=10 if ctx.quick else 30, seed=0, train=ctx.tools["train"],
                     bench_sgemm=ctx.tools["bench_sgemm"])


def ms(seconds):
    return f"{seconds * 1e3:.2f}"


def verdict(ok):
    return "PASS" if ok else "MISS"


# --------------------------------------------------------------------------- 1. CPU against PyTorch
def cpu_section(ctx, doc):
    args = race_args(ctx, rounds=2 if ctx.quick else 5, steps_a=100 if ctx.quick else 300,
                     steps_b=15 if ctx.quick else 40)
    env, env_torch = cvp.child_environments(THREADS)
    doc.heading(2, "1. CPU training against PyTorch (models A and B)")
    doc.para(f"`bench/cpu_vs_pytorch.py`'s race, {args.rounds} rounds alternating which side goes first, "
             f"{THREADS} threads each (`OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = {THREADS}`, "
             "`OMP_WAIT_POLICY=PASSIVE`; PyTorch also `torch.set_num_threads` and OpenBLAS first on "
             "`LD_LIBRARY_PATH`). Same weights, same batches in file order, SGD lr 0.01 momentum 0.9, fp32. "
             "Formulas: [bench/README.md](../README.md).")
    doc.para("Commands: ours `train MODEL.onnx --data X.npy --labels Y.npy --batch-size B --steps N "
             f"{TRAIN_FLAGS}`; PyTorch `python3 bench/cpu_vs_pytorch.py --torch-worker JOB` (the same loop in "
             f"torch). This section alone: `/usr/bin/python3 bench/cpu_vs_pytorch.py --rounds {args.rounds} "
             f"--steps-a {args.steps_a} --steps-b {args.steps_b}`.")
    results = {}
    for name in "AB":
        ctx.progress(f"cpu: racing model {name}")
        results[name] = cvp.race(name, cvp.MODELS[name], args, ctx.folder, env, env_torch)
        ctx.facts.setdefault("torch", results[name]["torch_version"])
        ctx.facts.setdefault("ours_blas", results[name]["ours_blas"])
        ctx.facts.setdefault("torch_blas", results[name]["torch_blas"])
        model_table(doc, name, cvp.MODELS[name], results[name])
        f = cvp.derived_figures(cvp.MODELS[name], results[name])
        ctx.summary.append(
            f"CPU, model {name} ({cvp.MODELS[name]['title']}): ours {ms(f['ours'])} ms/step, PyTorch {ms(f['torch'])} ms, "
            f"ratio {f['ratio']:.3f} (paired {f['paired']:.3f}; target ≤ {cvp.TARGET_RATIO}: "
            f"{verdict(f['paired'] <= cvp.TARGET_RATIO)}){' NOISY' if f['noisy'] else ''}; ours at "
            f"{f['pct_ours']:.0%} of the sgemm ceiling; first-step losses agree to {f['first_rel']:.0e}.")
    doc.para("As `cpu_vs_pytorch.py` prints it:")
    doc.code("\n\n".join(captured(cvp.report, name, cvp.MODELS[name], results[name], args) for name in "AB"))


def model_table(doc, name, spec, res):
    f = cvp.derived_figures(spec, res)
    b, x = f["batch"], f["executed"]
    rel_ok = "ok" if f["first_rel"] <= cvp.LOSS_REL_TOLERANCE else "WRONG"
    noisy = f"NOISY ({f['spread']:.0%})" if f["noisy"] else f"{f['spread']:.0%}"
    doc.heading(3, f"Model {name}: {spec['title']}")
    doc.table(["figure", "ours", "PyTorch", "ours / PyTorch", "formula"], [
        ["step time T (ms), median", ms(f["ours"]), ms(f["torch"]), f"{f['ratio']:.3f}",
         f"median of all steps after warm-up of all rounds; target ratio ≤ {cvp.TARGET_RATIO}: "
         f"{verdict(f['ratio'] <= cvp.TARGET_RATIO)}"],
        ["paired ratio", "", "", f"{f['paired']:.3f}",
         f"median over rounds of each round's T_ours / T_PyTorch: {verdict(f['paired'] <= cvp.TARGET_RATIO)}"],
        ["per-round medians (ms)", " / ".join(ms(r["ours"]) for r in res["rounds"]),
         " / ".join(ms(r["torch"]) for r in res["rounds"]), noisy, "spread = max / min − 1 of one side, NOISY > 10 %"],
        ["samples/s", f"{b / f['ours']:.0f}", f"{b / f['torch']:.0f}", f"{f['torch'] / f['ours']:.3f}", "B / T"],
        ["GFLOP/s", f"{x / f['ours'] / 1e9:.1f}", f"{x / f['torch'] / 1e9:.1f}", f"{f['torch'] / f['ours']:.3f}",
         f"F_executed / T, F_executed = 2·B·(3·Σ in·out − in₁·out₁) = {x / 1e9:.3f} GFLOP"],
        ["% of sgemm ceiling", f"{f['pct_ours']:.1%}", f"{f['pct_torch']:.1%}", "",
         f"(F_executed / T) / ceiling, ceiling = F_executed / Σ bench_sgemm medians = {f['ceiling_rate'] / 1e9:.1f} GFLOP/s"
         + (f"; target ≥ {cvp.TARGET_CEILING:.0%}: {verdict(f['pct_ours'] >= cvp.TARGET_CEILING)}" if name == "B" else "")],
        ["peak RSS (MiB)", f"{res['ours_rss'] / 1024:.1f}", f"{res['torch_rss'] / 1024:.1f}",
         f"{res['ours_rss'] / res['torch_rss']:.3f}",
         f"ru_maxrss (GNU time); PyTorch after `import torch` alone: {res['torch_import_rss'] / 1024:.1f} MiB"],
        ["loss, step 1", f"{res['ours_losses'][0]:.7f}", f"{res['torch_losses'][0]:.7f}",
         f"{f['first_rel']:.1e} {rel_ok}", "abs(ours − PyTorch) / PyTorch ≤ 1e-5 (same weights and batch)"],
    ])


# --------------------------------------------------------------------------- 2. step time vs batch
def sweep_steps(batch, budget_s):
    """Steps per run so that a run lasts about budget_s (model B at 2 threads: ~0.11 ms per sample)."""
    return max(15, min(300, round(budget_s / (batch * 0.11e-3))))


def batch_section(ctx, doc):
    batches = SWEEP_BATCHES_QUICK if ctx.quick else SWEEP_BATCHES
    rounds, budget = (2, 0.4) if ctx.quick else (3, 1.0)
    args = race_args(ctx, rounds)
    env, env_torch = cvp.child_environments(THREADS)
    rows = []
    for batch in batches:
        spec = dict(cvp.MODELS["B"], batch=batch, title=f"4 x (Linear(1024,1024) + ReLU), batch {batch}")
        steps = sweep_steps(batch, budget)
        ctx.progress(f"batch: batch {batch}, {rounds} rounds x {steps} steps")
        res = cvp.race(f"B{batch}", spec, args, ctx.folder, env, env_torch, steps=steps)
        f = cvp.derived_figures(spec, res)
        rows.append({"batch": batch, "steps": steps, "f": f, "ours_ms": f["ours"] * 1e3, "torch_ms": f["torch"] * 1e3,
                     "bound_ms": res["ceiling_s"] * 1e3})
    doc.heading(2, "2. Step time vs batch size (model B's layers)")
    doc.para(f"4 × (Linear(1024, 1024) + ReLU) at batch {', '.join(map(str, batches))}: the race of section 1 "
             f"(`cvp.race`), {rounds} rounds alternating ours and PyTorch, {THREADS} threads, steps per run chosen "
             f"for ~{budget:g} s of steps (first 5 dropped). The sgemm bound is Σ `bench_sgemm B out in` medians "
             "over the GEMMs of one step (no input gradient for layer 1): the step if it were nothing but sgemm "
             "at its isolated speed.")
    table = []
    for r in rows:
        f = r["f"]
        table.append([r["batch"], r["steps"], f"{r['ours_ms']:.2f}", f"{r['torch_ms']:.2f}", f"{f['ratio']:.3f}",
                      f"{f['paired']:.3f}", f"{r['batch'] / f['ours']:.0f}", f"{r['batch'] / f['torch']:.0f}",
                      f"{f['executed'] / f['ours'] / 1e9:.1f}", f"{f['executed'] / f['torch'] / 1e9:.1f}",
                      f"{f['ceiling_rate'] / 1e9:.1f}", f"{f['pct_ours']:.0%}",
                      f"{f['first_rel']:.0e} {'ok' if f['first_rel'] <= cvp.LOSS_REL_TOLERANCE else 'WRONG'}",
                      f"{f['spread']:.0%}{' NOISY' if f['noisy'] else ''}"])
    doc.table(["batch B", "steps/run", "ours ms", "PyTorch ms", "ratio ours/PyTorch", "paired ratio",
               "ours samples/s", "PyTorch samples/s", "ours GFLOP/s", "PyTorch GFLOP/s", "sgemm ceiling GFLOP/s",
               "ours % of ceiling", "loss step 1 rel. diff", "spread"], table)
    doc.para("Formulas: ms = median step time T; ratio = T_ours / T_PyTorch; paired = median over rounds of the "
             "per-round ratio; samples/s = B / T; GFLOP/s = F_executed / T with F_executed = 2·B·(3·Σ in·out − "
             "in₁·out₁); ceiling = F_executed / Σ sgemm medians; spread = max / min − 1 of one side's per-round "
             "medians (NOISY > 10 %).")
    ctx.summary.append("Step time vs batch (model B's layers): ratio ours/PyTorch " + ", ".join(
        f"{r['f']['ratio']:.2f} at {r['batch']}" for r in rows) + f"; ours at {rows[-1]['f']['pct_ours']:.0%} of the "
        f"sgemm ceiling at batch {rows[-1]['batch']}, {rows[0]['f']['pct_ours']:.0%} at {rows[0]['batch']}.")
    png, link = ctx.image("batch_sweep.png")
    plots.batch_sweep(png, rows, "T = median step time over all rounds; throughput = B / T; dashed: "
                      "Σ bench_sgemm medians of one step. Source: bench/report.py --sections batch")
    doc.image(link, "step time and samples/s vs batch size, ours and PyTorch")


# --------------------------------------------------------------------------- 3. parallelism
def config_command(c, steps):
    if c.peer:
        return "2 × `python3 bench/distributed.py --ddp-worker JOB` (DDP, gloo, 1 thread each)"
    launcher = f"mpirun --oversubscribe --bind-to core -np {c.ranks} " if c.ranks > 1 else ""
    flags = (" " + " ".join(c.flags)) if c.flags else ""
    return (f"`OMP_NUM_THREADS={c.threads} {launcher}train B.onnx --data B_x.npy --labels B_y.npy "
            f"--batch-size 256 --steps {steps} {TRAIN_FLAGS}{flags}`")


def parallel_section(ctx, doc):
    sections = list(dist.SECTIONS)
    rounds, steps = (1, 20) if ctx.quick else (3, 60)
    micro, gpipe = ((1, 2, 4), (2, 4)) if ctx.quick else ((1, 2, 4, 8, 16), (2, 4, 8, 16))
    split = (4,) if ctx.quick else (2, 4, 8)  # zb-h1, interleaved (2 chunks per stage) and zb-v
    configs = dist.configs_for(sections, micro, gpipe, split, split, split)
    args = Namespace(rounds=rounds, steps=steps, warmup=5, train=ctx.tools["train"], mpirun=ctx.mpirun,
                     bind_to="core", seed=0)
    ctx.progress(f"parallel: {len(configs)} configurations x {rounds} rounds x {steps} steps")
    onnx_path = cvp.export(dist.MODEL, ctx.folder, args.seed)
    paths = {"onnx": onnx_path, "data": os.path.join(ctx.folder, f"{dist.MODEL}_x.npy"),
             "labels": os.path.join(ctx.folder, f"{dist.MODEL}_y.npy"),
             "weights": os.path.join(ctx.folder, f"{dist.MODEL}.pt")}
    with contextlib.redirect_stdout(sys.stderr):  # its per-round progress lines
        res = dist.measure(configs, args, paths, ctx.folder)
    doc.heading(2, "3. Data, pipeline and tensor parallelism across 2 processes (model B)")
    doc.para(f"`bench/distributed.py`'s measurement, sections {','.join(sections)}: {rounds} round(s), every "
             f"configuration once per round in one order and reversed on odd rounds (ours and DDP alternate), "
             f"{steps} steps per run, the first 5 dropped; global batch 256. This section alone: "
             f"`/usr/bin/python3 bench/distributed.py --sections {','.join(sections)} --rounds {rounds} "
             f"--steps {steps} --micro-batches {','.join(map(str, micro))} --gpipe {','.join(map(str, gpipe))} "
             f"--zb-h1 {','.join(map(str, split))} --interleaved {','.join(map(str, split))} "
             f"--zb-v {','.join(map(str, split))}`.")
    doc.table(["configuration", "command"], [[c.label, config_command(c, steps)] for c in configs])
    doc.code(captured(dist.report_blas, configs, res))
    doc.raw(captured(dist.report_runs, configs, res, args))
    for report in (dist.report_dp, dist.report_buckets, dist.report_ddp):
        doc.raw(captured(report, res))
    doc.raw(captured(dist.report_pipeline, configs, res))
    doc.raw(captured(dist.report_tp, res))
    parallel_plot(ctx, doc, configs, res)


def parallel_plot(ctx, doc, configs, res):
    t11 = res[dist.ONE_1T.key]["median"]
    pipeline_rows = []
    for c in configs:
        if c.key.startswith("pp-"):
            schedule, m = c.key[len("pp-"):].rsplit("-", 1)  # "pp-zb-h1-4"
            pipeline_rows.append((int(m), schedule, t11 / res[c.key]["median"]))
    best_m, _, best = max((r for r in pipeline_rows if r[1] == "1f1b"), key=lambda r: r[2])
    layouts = [("1 rank × 2 threads", t11 / res[dist.ONE_2T.key]["median"], False),
               ("data parallel, 2 ranks × 1 thread", t11 / res[dist.DP.key]["median"], False),
               ("PyTorch DDP (gloo), 2 ranks × 1 thread", t11 / res[dist.DDP.key]["median"], True),
               ("tensor parallel, 2 shards × 1 thread", t11 / res[dist.TP.key]["median"], False),
               (f"pipeline, 2 stages, best M = {best_m} (1F1B)", best, False)]
    png, link = ctx.image("parallel.png")
    plots.parallel(png, pipeline_rows, layouts,
                   f"speedup = T(1 rank × 1 thread) / T, T(1r×1t) = {t11 * 1e3:.1f} ms, median step times; theory "
                   "P·M/(M+P−1): equal stages, free transfers. Source: bench/report.py --sections parallel")
    doc.image(link, "pipeline speedup vs micro-batches against P·M/(M+P−1), and each 2-core layout's speedup")
    m_ideal = 2 * best_m / (best_m + 1)
    ctx.summary.append(
        f"2 processes, model B: data parallel {res[dist.DP.key]['median'] * 1e3:.1f} ms/step = "
        f"{res[dist.DP.key]['median'] / res[dist.ONE_2T.key]['median']:.3f} × one process with 2 threads and "
        f"{res[dist.DP.key]['median'] / res[dist.DDP.key]['median']:.3f} × PyTorch DDP; speedups over 1 rank × 1 thread: "
        f"data parallel {layouts[1][1]:.2f}, tensor parallel {layouts[3][1]:.2f}, pipeline {best:.2f} at M = {best_m} "
        f"(theory {m_ideal:.2f}), 2 threads {layouts[0][1]:.2f}.")
    doc.para("Left: measured pipeline speedup against its theory. Right: each way of using the 2 cores against one "
             "process on one core; 2 would be perfect. " + ", ".join(f"{label}: {value:.2f}" for label, value, _ in layouts)
             + ".")
