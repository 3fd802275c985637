"""Partitioner speed for bench/report.py: `partition` on synthetic deep MLPs.

A deep MLP of L Linear layers (Gemm, transB=1, as torch.onnx.export writes nn.Linear) with a ReLU
after every layer but the last; the widths cycle through WIDTHS, so the layers differ in size and
the balance is not trivial. `partition MODEL --stages P --out DIR` is timed from the outside (wall
time, GNU time's ru_maxrss), since the tool prints no timing of its own. Each run parses, imports,
splits optimally and writes P stage files plus plan.json; --stages 1 does everything but the
search, so T(P) - T(1) is about what the search costs (and the extra files' headers).
"""
import os
import re
import statistics
import subprocess
import time

import cpu_vs_pytorch as cvp

WIDTHS = (32, 16, 48, 24)  # hidden widths, cycled; the input is 32 wide, the output 10 classes
CLASSES = 10


def layer_shapes(layers):
    """(in, out) of each Linear of the deep MLP with `layers` layers."""
    widths = [WIDTHS[i % len(WIDTHS)] for i in range(layers)] + [CLASSES]
    return [(widths[i], widths[i + 1]) for i in range(layers)]


def write_deep_mlp(path, layers, seed=0):
    """Writes the deep MLP as ONNX (opset 14) to `path`; returns its parameter count."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    shapes = layer_shapes(layers)
    nodes, inits, value = [], [], "input"
    for i, (fan_in, fan_out) in enumerate(shapes):
        w = (rng.standard_normal((fan_out, fan_in)) / np.sqrt(fan_in)).astype(np.float32)  # [out, in]
        b = np.zeros(fan_out, np.float32)  # [out]
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"), numpy_helper.from_array(b, f"fc{i}.bias")]
        out = "output" if i + 1 == layers else f"fc{i}_out"
        nodes.append(helper.make_node("Gemm", [value, f"fc{i}.weight", f"fc{i}.bias"], [out], name=f"fc{i}",
                                      alpha=1.0, beta=1.0, transB=1))
        value = out
        if i + 1 < layers:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}_out"], name=f"relu{i}"))
            value = f"relu{i}_out"
    graph = helper.make_graph(
        nodes, f"deep_mlp_{layers}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", shapes[0][0]])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], producer_name="pipeshard-bench")
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return sum(i * o + o for i, o in shapes)


def time_partition(partition, model, stages, out_dir, log_path):
    """One `partition` run: (wall seconds, peak RSS KiB, stage files written, balance it printed)."""
    argv = [partition, model, "--stages", str(stages), "--out", out_dir]
    rss_path = log_path + ".rss"
    if os.access(cvp.GNU_TIME, os.X_OK):
        argv = [cvp.GNU_TIME, "-f", "%M", "-o", rss_path, "--"] + argv
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        status = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = open(log_path).read()
    if status != 0:
        raise SystemExit(f"report: partition failed (status {status}) on {model} --stages {stages}:\n{text[-2000:]}")
    rss = int(open(rss_path).read().split()[-1]) if argv[0] == cvp.GNU_TIME else float("nan")
    files = len([f for f in os.listdir(out_dir) if re.fullmatch(r"stage_\d+\.onnx", f)])
    match = re.search(r"largest / mean stage params = ([0-9.]+)", text)
    return wall, rss, files, float(match.group(1)) if match else float("nan")


def measure(partition, folder, layer_counts, stage_counts, rounds, progress):
    """Every (layers, stages) with stages <= layers, and stages = 1 as the baseline, `rounds` times,
    the order reversed on odd rounds. Returns {(layers, stages): {...}} with medians."""
    models = {}
    for layers in layer_counts:
        path = os.path.join(folder, f"deep_mlp_{layers}.onnx")
        params = write_deep_mlp(path, layers)
        models[layers] = {"path": path, "params": params, "bytes": os.path.getsize(path)}
    runs = [(layers, stages) for layers in layer_counts for stages in sorted({1, *stage_counts}) if stages <= layers]
    samples = {run: [] for run in runs}
    for r in range(rounds):
        for layers, stages in (runs if r % 2 == 0 else list(reversed(runs))):
            out_dir = os.path.join(folder, f"out_{layers}_{stages}_{r}")
            log = os.path.join(folder, f"partition_{layers}_{stages}_{r}.log")
            samples[(layers, stages)].append(time_partition(partition, models[layers]["path"], stages, out_dir, log))
            subprocess.run(["rm", "-rf", out_dir], check=True)  # the files are not needed, only their writing
        progress(f"partition round {r + 1}/{rounds} done")
    results = {}
    for run, runs_of in samples.items():
        walls = [s[0] for s in runs_of]
        results[run] = {"wall": statistics.median(walls), "walls": walls, "rss": max(s[1] for s in runs_of),
                        "files": runs_of[-1][2], "balance": runs_of[-1][3],
                        "spread": max(walls) / min(walls) - 1, **models[run[0]]}
    return results
