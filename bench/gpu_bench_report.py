"""The figures and tables of bench/gpu_vs_pytorch.py's results (bench.md), split from the runner:
that script's docstring says how each figure is measured; this one derives the ratios, MFU and
memory comparisons from its results dictionary and writes the markdown."""
import statistics

# Relative step-1 loss difference allowed. bf16: both sides round the GEMM operands to 8
# significant bits (2^-8 relative each) and PyTorch's autocast also rounds each Linear's
# output and GELU to bf16, so the logits differ by a few 2^-8 of their size — far below the
# cross-entropy of ~ln(8192) = 9 they feed; 1e-2 leaves room for that and still catches a
# wrong product, which moves the loss by order one.
LOSS_TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "bf16": 1e-2}


def fmt(value, pattern="{:.3f}", missing="—"):
    return str(missing).replace("|", "/") if value is None else pattern.format(value)


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize_runs(runs):
    """Pooled figures of one precision: median step over the rounds' medians, step-1 losses, memory."""
    def side(key):
        ok = [x for x in runs[key] if "why" not in x]
        if not ok:
            why = runs[key][0]["why"] if runs[key] else "not run"
            return {"why": why}
        s = {"median_s": statistics.median(x["median_s"] for x in ok), "loss1": ok[0]["losses"][0],
             "loss_last": ok[0]["losses"][-1], "rounds_ms": [x["median_s"] * 1e3 for x in ok],
             "peak_process_mib": max((x.get("peak_process_mib") or 0 for x in ok), default=0) or None,
             "peak_total_mib": max((x.get("peak_total_mib") or 0 for x in ok), default=0) or None}
        for k in ("max_allocated", "max_reserved", "foreach", "fused", "optimizer", "memory_breakdown"):
            if k in ok[0]:
                s[k] = ok[0][k]
        return s
    return side("ours"), side("torch")


def figures(res):
    """Derived figures, by the formulas in the module docstring; stored in res['figures']."""
    fig = {"gemm": {}, "large": {}, "small": {}}
    g = res.get("gemm", {})
    ours_by_p = {x["precision"]: x for x in g.get("ours", {}).get("results", [])}
    for p in ("fp32", "tf32", "bf16"):
        o, t = ours_by_p.get(p, {}), g.get("torch", {}).get(p, {})
        fig["gemm"][p] = {"ours_gflops": o.get("gflops"), "torch_gflops": t.get("gflops"),
                          "ratio": ratio(o.get("gflops"), t.get("gflops")),
                          "ours_status": o.get("status") or g.get("ours", {}).get("why") or "not run",
                          "ours_why": o.get("why"), "correct": o.get("correct"), "max_rel_err": o.get("max_rel_err")}
    for name in ("large", "small"):
        entry = res.get(name, {})
        for p, runs in entry.get("runs", {}).items():
            ours, torch_ = summarize_runs(runs)
            f = {"ours": ours, "torch": torch_}
            flop = 6 * entry["batch"] * entry["sum_io"]
            f["flop_per_step"] = flop
            rate = fig["gemm"].get(p, {}).get("torch_gflops") or fig["gemm"].get(p, {}).get("ours_gflops")
            f["gemm_gflops"] = rate
            f["gemm_source"] = "torch.matmul" if fig["gemm"].get(p, {}).get("torch_gflops") else "ours"
            for side, s in (("ours", ours), ("torch", torch_)):
                if "median_s" in s:
                    s["tflops"] = flop / s["median_s"] / 1e12
                    s["mfu"] = flop / s["median_s"] / (rate * 1e9) if rate else None
                    s["samples_per_s"] = entry["batch"] / s["median_s"]
            f["ratio"] = ratio(ours.get("median_s"), torch_.get("median_s"))
            f["memory_ratio"] = ratio(ours.get("peak_process_mib"), torch_.get("peak_process_mib"))
            if "loss1" in ours and "loss1" in torch_:
                f["loss_rel"] = abs(ours["loss1"] - torch_["loss1"]) / abs(torch_["loss1"])
                f["loss_ok"] = f["loss_rel"] <= LOSS_TOLERANCE[p]
            fig[name][p] = f
    res["figures"] = fig
    return fig


def markdown(res, args, titles):
    """bench.md: the tables of every section that ran; `titles` names the large and small models."""
    fig = figures(res)
    lines = []
    add = lines.append
    mode = "CPU smoke: plumbing only, the figures are not GPU figures" if args.smoke_cpu else f"device {args.device}"
    add(f"Benchmarks ({mode}); PyTorch: {res.get('torch_info', {}).get('torch', res.get('torch_why', '?'))}. "
        "Ratios are ours / PyTorch: below 1 we are faster (time) or leaner (memory), above 1 faster (rate).")
    add("")
    size = res.get("gemm", {}).get("size", args.gemm_size)
    add(f"**GEMM {size}³**, y = x·Wᵀ (+ b on our side): GFLOP/s = 2·M·N·K / median time of one call "
        "(ours: Backend::linear_forward via bench_gemm_cuda, host clock between device synchronisations; "
        "PyTorch: torch.matmul, CUDA events).")
    add("")
    add("| precision | ours GFLOP/s | PyTorch GFLOP/s | ours/PyTorch | correct (max rel err) |")
    add("|---|---|---|---|---|")
    for p, f in fig["gemm"].items():
        if f["ours_gflops"] is not None:
            ours = f"{f['ours_gflops']:,.0f}"
            corr = f"{'ok' if f['correct'] else 'WRONG'} ({fmt(f['max_rel_err'], '{:.1e}')})"
        else:
            ours = f["ours_why"] or f["ours_status"]
            ours = ours if ours.startswith("not run") or ours.startswith("failed") else f"not run: {ours}"
            ours = ours.replace("|", "/")
            corr = "—"
        torch_g = fig["gemm"][p]["torch_gflops"]
        tw = res.get("gemm", {}).get("torch", {}).get("why")
        add(f"| {p} | {ours} | {fmt(torch_g, '{:,.0f}', tw or 'not run')} | {fmt(f['ratio'])} | {corr} |")
    same = res.get("gemm", {}).get("torch", {}).get("bf16_fp32_io")
    if same and fig["gemm"].get("bf16", {}).get("ours_gflops"):
        ours_bf16 = fig["gemm"]["bf16"]["ours_gflops"]
        fig["gemm"]["bf16_fp32_io"] = {"ours_gflops": ours_bf16, "torch_gflops": same["gflops"],
                                       "ratio": ratio(ours_bf16, same["gflops"])}
        add(f"| bf16, the same work on both sides (PyTorch: `{same['op']}`) | {ours_bf16:,.0f} | "
            f"{same['gflops']:,.0f} | {fmt(ratio(ours_bf16, same['gflops']))} | — |")
    for name in ("large", "small"):
        entry = res.get(name, {})
        add("")
        add(f"**{titles[name]}** ({'' if args.smoke_cpu else 'ours: train --device cuda --precision P; '}"
            f"PyTorch eager). Step time: median over steps after the warm-up, median over rounds.")
        if "why" in entry:
            add("")
            add(f"{entry['why']}")
            continue
        if name == "large":
            add(f"Model FLOP per step F = 6·B·Σ fan_in·fan_out = {6 * entry['batch'] * entry['sum_io'] / 1e12:.2f} TFLOP; "
                "MFU = F / step time / R, R = the GEMM rate of the same precision measured above "
                "(torch.matmul where it ran, else ours).")
        add("")
        add("| precision | figure | ours | PyTorch | ours/PyTorch |")
        add("|---|---|---|---|---|")
        for p, f in fig[name].items():
            o, t = f["ours"], f["torch"]
            add(f"| {p} | step time (ms) | {fmt(o.get('median_s') and o['median_s'] * 1e3, '{:.3f}', o.get('why', '—'))} | "
                f"{fmt(t.get('median_s') and t['median_s'] * 1e3, '{:.3f}', t.get('why', '—'))} | {fmt(f['ratio'])} |")
            add(f"| {p} | samples/s | {fmt(o.get('samples_per_s'), '{:,.0f}')} | {fmt(t.get('samples_per_s'), '{:,.0f}')} | "
                f"{fmt(ratio(o.get('samples_per_s'), t.get('samples_per_s')))} |")
            if name == "large":
                add(f"| {p} | TFLOP/s = F / step | {fmt(o.get('tflops'), '{:.1f}')} | {fmt(t.get('tflops'), '{:.1f}')} | "
                    f"{fmt(ratio(o.get('tflops'), t.get('tflops')))} |")
                add(f"| {p} | MFU vs {f['gemm_source']} {fmt(f['gemm_gflops'] and f['gemm_gflops'] / 1e3, '{:.1f}')} TFLOP/s | "
                    f"{fmt(o.get('mfu'), '{:.1%}')} | {fmt(t.get('mfu'), '{:.1%}')} | |")
                add(f"| {p} | peak device memory, nvidia-smi per process (GiB) | "
                    f"{fmt(o.get('peak_process_mib') and o['peak_process_mib'] / 1024, '{:.2f}')} | "
                    f"{fmt(t.get('peak_process_mib') and t['peak_process_mib'] / 1024, '{:.2f}')} | {fmt(f['memory_ratio'])} |")
                if o.get("max_allocated") or "max_allocated" in t:
                    add(f"| {p} | peak allocated (GiB): ours the backend's allocator in use, rounding included "
                        f"(metrics backend_peak_bytes); PyTorch max_memory_allocated (reserved) | "
                        f"{fmt(o.get('max_allocated') and o['max_allocated'] / 2**30, '{:.2f}')} | "
                        f"{fmt(t.get('max_allocated') and t['max_allocated'] / 2**30, '{:.2f}')}"
                        f"{fmt(t.get('max_reserved') and t['max_reserved'] / 2**30, ' ({:.2f})', '')} | "
                        f"{fmt(ratio(o.get('max_allocated'), t.get('max_allocated')))} |")
            if name == "large" and o.get("memory_breakdown"):
                add(f"| {p} | ours at its peak (train's summary line) | {o['memory_breakdown'].replace('|', '/')} | | |")
            if "loss_rel" in f:
                add(f"| {p} | loss, step 1 (same weights and batch) | {o['loss1']:.6f} | {t['loss1']:.6f} | "
                    f"rel diff {f['loss_rel']:.1e} ({'ok' if f['loss_ok'] else 'WRONG'}, tolerance {LOSS_TOLERANCE[p]:g}) |")
    k = res.get("kernels")
    if k is not None:
        add("")
        add("**Our kernels against cuDNN** (bench_kernels_cudnn, fp32, on the same buffers; ms per call: "
            f"{k.get('timing', 'see its header')}; they agree when {k.get('agreement', 'the outputs match')}).")
        add("")
        if "why" in k:
            add(k["why"])
        else:
            add(f"cuDNN {k.get('cudnn_version', '?')}.")
            add("")
            add("| op | shape | cuDNN variant | ours ms | cuDNN ms | ours/cuDNN | faster | results agree (max diff) |")
            add("|---|---|---|---|---|---|---|---|")
            for x in k.get("results", []):
                agree = f"{'yes' if x['agree'] else 'DIFFER'} ({x['max_difference']:.1e})"
                add(f"| {x['op']} | {x['shape']} | {x['cudnn_variant']} | {x['ours_ms']:.4f} | {x['cudnn_ms']:.4f} | "
                    f"{x['ours_over_cudnn']:.2f} | {x['faster']} | {agree} |")
    if not args.smoke_cpu:
        add("")
        add("**The issue's targets** (from the tables above; \"not measured\" when a side did not run).")
        add("")
        add("| target | measured | verdict |")
        add("|---|---|---|")
        for label, value, shown, met in targets(fig):
            add(f"| {label} | {shown if value is not None else '—'} | "
                f"{'not measured' if value is None else ('met' if met else 'NOT met')} |")
    if res.get("notes"):
        add("")
        for n in res["notes"]:
            add(f"- {n}")
    return "\n".join(lines) + "\n"


def targets(fig):
    """(target, value or None, value as shown, met) for each performance target of issue 5."""
    large = fig.get("large", {}).get("bf16", {})
    small = fig.get("small", {}).get("fp32", {})
    out = []
    for p in ("bf16", "tf32"):
        r = fig.get("gemm", {}).get(p, {}).get("ratio")
        out.append((f"GEMM 8192³ {p}: ours ≥ 0.95 × torch.matmul", r, fmt(r, "{:.3f}×"), r is not None and r >= 0.95))
    mfu = large.get("ours", {}).get("mfu")
    out.append(("large MLP bf16: MFU ≥ 60%", mfu, fmt(mfu, "{:.1%}"), mfu is not None and mfu >= 0.60))
    r = large.get("ratio")
    out.append(("large MLP bf16: step time ≤ 0.9 × PyTorch eager", r, fmt(r, "{:.3f}×"), r is not None and r <= 0.9))
    r = small.get("ratio")
    speed = 1 / r if r else None
    out.append(("small MLP with --cuda-graph (fp32): ≥ 2 × PyTorch eager's speed", speed, fmt(speed, "{:.2f}×"),
                speed is not None and speed >= 2))
    r = large.get("memory_ratio")
    out.append(("large MLP bf16: peak device memory ≤ PyTorch's (nvidia-smi, per process)", r, fmt(r, "{:.3f}×"),
                r is not None and r <= 1))
    return out
