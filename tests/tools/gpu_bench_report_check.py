#!/usr/bin/env python3
"""bench/gpu_bench_report.py on a made-up GPU result: the figures it derives (GEMM ratios, MFU,
step and memory ratios) and the targets table's verdicts, including "not measured" for a side
that did not run. The device check's one GPU run has no second chance to find a report bug.
Exit 0 when every check holds; prints what differs otherwise."""
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from gpu_bench_report import markdown  # noqa: E402


def run(median_s, losses, peak_mib):
    return {"median_s": median_s, "step_s": [median_s] * 3, "losses": losses, "peak_process_mib": peak_mib}


res = {
    "torch_info": {"torch": "2.x"},
    "gemm": {"size": 8192,
             "ours": {"results": [{"precision": "bf16", "status": "ran", "gflops": 700e3, "correct": True, "max_rel_err": 1e-3},
                                  {"precision": "tf32", "status": "ran", "gflops": 300e3, "correct": True, "max_rel_err": 1e-4}]},
             "torch": {"bf16": {"gflops": 800e3}, "tf32": {"gflops": 310e3},
                       "bf16_fp32_io": {"gflops": 650e3, "op": "same work"}}},
    # F = 6 * 8192 * 8 * 8192^2 = 26.4 TFLOP; ours 0.05 s -> 527.7 TFLOP/s = 66% of 800
    "large": {"batch": 8192, "sum_io": 8 * 8192 * 8192, "runs": {
        "bf16": {"steps": 13, "warmup": 3, "ours": [run(0.05, [2.0, 1.9], 12000)],
                 "torch": [run(0.06, [2.001, 1.9], 11000)]}}},
    "small": {"batch": 128, "sum_io": 784 * 512 + 512 * 512 + 512 * 10, "runs": {
        "fp32": {"steps": 300, "warmup": 20, "ours": [run(0.0002, [2.3], 500)], "torch": [{"why": "not run: out of time budget"}]}}},
}
args = types.SimpleNamespace(smoke_cpu=False, device="cuda", gemm_size=8192)
md = markdown(res, args, {"large": "large", "small": "small"})
fig = res["figures"]
want = {
    "GEMM 8192³ bf16: ours ≥ 0.95 × torch.matmul": ["0.875×", "NOT met"],
    "GEMM 8192³ tf32: ours ≥ 0.95 × torch.matmul": ["0.968×", "met"],
    "large MLP bf16: MFU ≥ 60%": ["66.0%", "met"],
    "large MLP bf16: step time ≤ 0.9 × PyTorch eager": ["0.833×", "met"],
    "small MLP with --cuda-graph (fp32): ≥ 2 × PyTorch eager's speed": ["—", "not measured"],
    "large MLP bf16: peak device memory ≤ PyTorch's (nvidia-smi, per process)": ["1.091×", "NOT met"],
}
rows = {}
for line in md.splitlines():
    cells = [c.strip() for c in line.split("|")[1:-1]]
    if cells and cells[0] in want:
        rows[cells[0]] = cells[1:]
bad = [f"{k}: want {v}, got {rows.get(k)}" for k, v in want.items() if rows.get(k) != v]
if abs(fig["gemm"]["bf16_fp32_io"]["ratio"] - 700 / 650) > 1e-9:
    bad.append(f"same-work ratio {fig['gemm']['bf16_fp32_io']['ratio']}")
if "| bf16, the same work on both sides" not in md:
    bad.append("no same-work row")
print(md if bad else "gpu_bench_report_check: every figure and verdict as computed by hand")
for b in bad:
    print("MISMATCH:", b)
sys.exit(1 if bad else 0)
