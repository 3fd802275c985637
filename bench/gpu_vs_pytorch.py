#!/usr/bin/env python3
"""Race pipeshard's CUDA backend against PyTorch on the same GPU, in one invocation.

tools/device_check.sh runs it on the lent GPU machine; by hand, from the repository root:
    python3 bench/gpu_vs_pytorch.py --bin-dir build-device/bin --out /tmp/gpu_bench [--budget-s 200]
    python3 bench/gpu_vs_pytorch.py --bin-dir build-device/bin --out /tmp/smoke --smoke-cpu   # no GPU needed
`python3` must be one that imports torch, numpy and onnx for the PyTorch side (the GPU image's plain
python3 does); without torch our side still runs and the PyTorch columns say why they are empty.

What it races (bench/README.md has the CPU counterpart, bench/cpu_vs_pytorch.py):
  gemm   y = x·Wᵀ + b at 8192³: ours through Backend::linear_forward (build/bin/bench_gemm_cuda, fp32,
         tf32, bf16 — ours rounds fp32 x and W to bf16 copies inside each timed call) against
         torch.matmul on the same shapes (bf16: on bf16 tensors). GFLOP/s = 2·M·N·K / median time of
         one call.
  large  8 × (Linear(8192, 8192) + GELU), batch 8192, AdamW (torch.optim defaults), cross-entropy over
         the 8192 outputs, bf16 then tf32 (fp32 on request, --large-precisions): step time against
         PyTorch eager; model FLOP utilisation
         MFU = 6·B·Σ fan_in·fan_out / step time / R, with R the torch.matmul rate of the same precision
         measured in this run (one denominator for both sides); peak device memory of each process.
         bf16 is mixed precision on both sides, fp32 master weights and AdamW state: ours is
         `--precision bf16` (the Linear GEMMs on bf16 copies of their operands, fp32 accumulation,
         everything else fp32); PyTorch's the forward and loss under
         torch.autocast(device_type="cuda", dtype=torch.bfloat16), which also keeps the Linear
         outputs and the GELUs in bf16.
  small  784-512-512-10 ReLU, batch 128, SGD lr 0.01 momentum 0.9 (model A of cpu_vs_pytorch.py), fp32
         and tf32: step time against PyTorch eager.
  kernels  our softmax, log-softmax and BatchNorm kernels against cuDNN's (build/bin/bench_kernels_cudnn,
         its header says how): time per call of each, which is faster, and whether they agree; for the
         issue's "use cuDNN where it is the better tool, keeping the faster". Last: it is no target.
Ours is `train MODEL.onnx … --device cuda --precision P --metrics M.jsonl`; its step time is
B / samples_per_s of each metrics line (wall time between consecutive steps). PyTorch runs the same
weights and batches: the model is generated here as ONNX (Gemm + exact GELU, weights as external
data beside it) and its weights are loaded into the torch module from the same file; each step
copies its batch from host memory (x[b:e].cuda()), as train reads batches from the .npy in host
memory. Steps time from one loss.item() to the next. Each side runs in a child process of its own,
never this one, so device memory is per process: the peak is the largest `used_memory` nvidia-smi
reports for the child (polled every 0.2 s; CUDA context and library workspaces included on both
sides), and beside it each side's own count of what it allocated: ours the peak of the backend's
caching allocator (blocks in use, rounding included: train's metrics `backend_peak_bytes`), PyTorch's
torch.cuda.max_memory_allocated (and max_memory_reserved).
Correctness: the step-1 loss of both sides (same weights, same batch) must agree to 1e-4 (fp32),
5e-3 (tf32) or 1e-2 (bf16) relative (gpu_bench_report.LOSS_TOLERANCE says why); bench_gemm_cuda checks its own outputs.

--smoke-cpu checks the plumbing on a machine without a GPU: tiny models, ours on the CPU backend
(no --device flag), PyTorch on the CPU; the figures mean nothing, the loss agreement does.

Writes OUT/bench.json (every figure and raw times) and OUT/bench.md (the tables: bench/gpu_bench_report.py). Exits 0 whatever
the figures; 2 when it cannot run at all (bad arguments).
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench_report import markdown  # noqa: E402  (the tables; after the path is set)

GEMM_SIZE = 8192
LARGE = {"name": "large", "width": 8192, "layers": 8, "activation": "gelu", "batch": 8192, "optimizer": "adamw",
         "title": "8 x (Linear(8192, 8192) + GELU), batch 8192, AdamW"}
# The small model is where launches cost more than the work: ours runs it with --cuda-graph
# (forward and backward each one CUDA graph launch from the second step on), as the issue's
# target is stated for it.
SMALL = {"name": "small", "dims": [784, 512, 512, 10], "activation": "relu", "batch": 128, "optimizer": "sgd",
         "cuda_graph": True, "title": "784-512-512-10 ReLU MLP, batch 128, SGD momentum 0.9 (ours with --cuda-graph)"}
# Steps per run and the first ones discarded (warm-up: cuBLAS heuristics, allocator growth).
# Time, estimated (nothing has run on a GPU yet; figures for an H200): a large step is
# 26.4 TFLOP, ~0.5 s in fp32, ~0.1 s in tf32, ~0.05 s in bf16, so a large run is mostly its
# start (loading 2 GiB of weights, PyTorch's import), ~10 s; the four large runs (bf16, tf32)
# ~40 s, the eight small ones ~40 s, the gemm section ~25 s, generating the large model ~15 s:
# ~120 s of the ~200 s that tools/device_check.sh leaves the benchmarks within its 320 s. If it
# does not fit, the Budget stops starting runs (min_run_s) and what is left reports "not run: out
# of time budget", which the device check's verdict calls incomplete.
STEPS = {"large": {"fp32": (6, 2), "tf32": (13, 3), "bf16": (13, 3)},
         "small": {"fp32": (300, 20), "tf32": (300, 20)}}
# bf16 first: it is the target's precision, and what runs last is what a short budget drops.
# fp32 is no target and, at ~0.5 s a step, the dearest run: only on request (--large-precisions).
LARGE_PRECISIONS = ["bf16", "tf32"]
SMALL_PRECISIONS = ["fp32", "tf32"]
SMALL_ROUNDS = 2
SGD_LR, SGD_MOMENTUM = 0.01, 0.9
DISTINCT_BATCHES = 2


# --------------------------------------------------------------------------- model files
def layer_dims(spec):
    if "dims" in spec:
        return list(zip(spec["dims"][:-1], spec["dims"][1:]))
    return [(spec["width"], spec["width"])] * spec["layers"]


def generate(spec, folder, seed=0):
    """Writes spec's MLP as ONNX with external weights, its data (.npy) and a JSON description; returns
    the description. Weights are PyTorch's default Linear init, uniform in ±1/sqrt(fan_in); features
    standard normal, labels uniform over the last layer's outputs."""
    import numpy as np
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    name, dims = spec["name"], layer_dims(spec)
    weights_file = f"{name}.weights"
    layers, offset, nodes, inits = [], 0, [], []

    def external(tensor_name, shape, at, nbytes):
        t = TensorProto(name=tensor_name, data_type=TensorProto.FLOAT, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", weights_file), ("offset", str(at)), ("length", str(nbytes))):
            t.external_data.add(key=k, value=v)
        return t

    def const(value_name, value):
        nodes.append(helper.make_node("Constant", [], [value_name],
                                      value=helper.make_tensor(value_name + "_v", TensorProto.FLOAT, [], [value])))

    with open(os.path.join(folder, weights_file), "wb") as f:
        h = "input"
        if spec["activation"] == "gelu":
            const("sqrt2", math.sqrt(2.0)), const("one", 1.0), const("half", 0.5)
        for i, (fan_in, fan_out) in enumerate(dims):
            bound = 1.0 / math.sqrt(fan_in)
            w = (rng.random((fan_out, fan_in), dtype=np.float32) * 2 - 1) * np.float32(bound)
            b = (rng.random(fan_out, dtype=np.float32) * 2 - 1) * np.float32(bound)
            w_at, b_at = offset, offset + w.nbytes
            w.tofile(f)
            b.tofile(f)
            offset += w.nbytes + b.nbytes
            inits += [external(f"fc{i}.weight", w.shape, w_at, w.nbytes), external(f"fc{i}.bias", b.shape, b_at, b.nbytes)]
            layers.append({"in": fan_in, "out": fan_out, "w_offset": w_at, "b_offset": b_at})
            y = f"fc{i}"
            nodes.append(helper.make_node("Gemm", [h, f"fc{i}.weight", f"fc{i}.bias"], [y], name=f"fc{i}", transB=1))
            last = i + 1 == len(dims)
            if spec["activation"] == "relu" and not last:
                nodes.append(helper.make_node("Relu", [y], [f"act{i}"], name=f"relu{i}"))
                y = f"act{i}"
            elif spec["activation"] == "gelu":  # exact GELU as torch.onnx exports it: x·½(1 + erf(x/√2))
                nodes += [helper.make_node("Div", [y, "sqrt2"], [f"g{i}_d"]),
                          helper.make_node("Erf", [f"g{i}_d"], [f"g{i}_e"]),
                          helper.make_node("Add", [f"g{i}_e", "one"], [f"g{i}_a"]),
                          helper.make_node("Mul", [y, f"g{i}_a"], [f"g{i}_m"]),
                          helper.make_node("Mul", [f"g{i}_m", "half"], [f"act{i}"])]
                y = f"act{i}"
            h = y
    nodes.append(helper.make_node("Identity", [h], ["output"]))
    graph = helper.make_graph(nodes, name,
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", dims[0][0]])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", dims[-1][1]])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], producer_name="gpu_vs_pytorch")
    model.ir_version = 8
    onnx_path = os.path.join(folder, f"{name}.onnx")
    with open(onnx_path, "wb") as f:
        f.write(model.SerializeToString())
    samples, classes = spec["batch"] * DISTINCT_BATCHES, dims[-1][1]
    x_path, y_path = os.path.join(folder, f"{name}_x.npy"), os.path.join(folder, f"{name}_y.npy")
    np.save(x_path, rng.standard_normal((samples, dims[0][0]), dtype=np.float32))
    np.save(y_path, rng.integers(0, classes, samples).astype(np.int64))
    desc = dict(spec, onnx=onnx_path, x=x_path, y=y_path, weights=os.path.join(folder, weights_file), layer_files=layers,
                sum_io=sum(i * o for i, o in dims))
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(desc, f)
    return desc


# --------------------------------------------------------------------------- PyTorch children
def set_tf32(torch, on):
    """TF32 matrix products on or off; returns the setting as torch reports it. torch >= 2.9 has
    fp32_precision ("tf32" | "ieee") and deprecates allow_tf32, which older versions have alone."""
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
        return f"matmul.fp32_precision={torch.backends.cuda.matmul.fp32_precision}"
    except Exception:  # AttributeError, or AssertionError ("Unknown attribute") in torch 1.x
        torch.backends.cuda.matmul.allow_tf32 = on
        return f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}"


def torch_info():
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if info["available"]:
        info["device"] = torch.cuda.get_device_name(0)
    return info


def torch_gemm(job):
    """torch.matmul(x, w.T) at M=N=K, per precision: median of `repeats` calls timed with events."""
    import torch
    device = job["device"]
    n, out = job["size"], {}
    for precision in job["precisions"]:
        setting = set_tf32(torch, precision == "tf32")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        g = torch.Generator(device=device).manual_seed(0)
        x = (torch.rand(n, n, generator=g, device=device) * 2 - 1).to(dtype)
        w = (torch.rand(n, n, generator=g, device=device) * 2 - 1).to(dtype)
        for _ in range(3):
            y = torch.matmul(x, w.t())
        times = []
        for _ in range(job["repeats"]):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                y = torch.matmul(x, w.t())
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                y = torch.matmul(x, w.t())
                times.append(time.perf_counter() - t0)
        finite = bool(torch.isfinite(y).all())
        median = statistics.median(times)
        out[precision] = {"ms_median": median * 1e3, "ms_min": min(times) * 1e3, "gflops": 2 * n ** 3 / median / 1e9,
                          "finite": finite, "setting": setting}
        del x, w, y
    if "bf16" in job["precisions"] and device == "cuda":
        # The work our bf16 Linear does, in PyTorch: fp32 tensors in, bf16 copies multiplied, fp32 out
        # plus the bias. torch.matmul on bf16 tensors (above, the peer) skips the two
        # conversions and writes half the bytes; this row shows how much of a gap that is.
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.rand(n, n, generator=g, device=device) * 2 - 1
        w = torch.rand(n, n, generator=g, device=device) * 2 - 1
        b = torch.rand(n, generator=g, device=device) * 2 - 1

        def same_work():
            return torch.matmul(x.bfloat16(), w.bfloat16().t()).float() + b
        for _ in range(3):
            y = same_work()
        times = []
        for _ in range(job["repeats"]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = same_work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        median = statistics.median(times)
        out["bf16_fp32_io"] = {"ms_median": median * 1e3, "ms_min": min(times) * 1e3,
                               "gflops": 2 * n ** 3 / median / 1e9, "finite": bool(torch.isfinite(y).all()),
                               "op": "torch.matmul(x.bfloat16(), w.bfloat16().t()).float() + b, x and w float32"}
        del x, w, b, y
    return out


def torch_train(job):
    """PyTorch eager on the generated model: the same weights (read from the external-data file), the
    same batches in file order, each copied from host memory per step; returns step times and losses."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    desc, device, precision = job["desc"], job["device"], job["precision"]
    setting = set_tf32(torch, precision == "tf32")
    autocast = precision == "bf16"  # mixed precision: the parameters and AdamW's state stay fp32
    if autocast:
        setting = f'torch.autocast(device_type="{device}", dtype=torch.bfloat16), fp32 master weights; {setting}'
    mods = []
    for i, layer in enumerate(desc["layer_files"]):
        lin = nn.Linear(layer["in"], layer["out"], device=device)  # initialised there, then overwritten
        with torch.no_grad():
            w = np.fromfile(desc["weights"], np.float32, layer["in"] * layer["out"], offset=layer["w_offset"])
            b = np.fromfile(desc["weights"], np.float32, layer["out"], offset=layer["b_offset"])
            lin.weight.copy_(torch.from_numpy(w).view(layer["out"], layer["in"]))
            lin.bias.copy_(torch.from_numpy(b))
        mods.append(lin)
        last = i + 1 == len(desc["layer_files"])
        if desc["activation"] == "gelu":
            mods.append(nn.GELU())
        elif not last:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    model.train()
    if desc["optimizer"] == "adamw":
        opt = torch.optim.AdamW(model.parameters())
    else:
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=SGD_MOMENTUM)
    x_all, y_all = torch.from_numpy(np.load(desc["x"])), torch.from_numpy(np.load(desc["y"]))
    batch, batches = desc["batch"], x_all.shape[0] // desc["batch"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_s, losses = [], []
    last = time.perf_counter()
    for step in range(job["steps"]):
        begin = (step % batches) * batch
        xb, yb = x_all[begin:begin + batch].to(device), y_all[begin:begin + batch].to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        now = time.perf_counter()
        step_s.append(now - last)
        last = now
    out = {"step_s": step_s, "losses": losses, "optimizer": type(opt).__name__, "setting": setting,
           "foreach": opt.defaults.get("foreach"), "fused": opt.defaults.get("fused")}
    if device == "cuda":
        out["max_allocated"] = torch.cuda.max_memory_allocated()
        out["max_reserved"] = torch.cuda.max_memory_reserved()
    return out


WORKERS = {"info": lambda job: torch_info(), "gemm": torch_gemm, "train": torch_train,
           "generate": lambda job: generate(job["spec"], job["folder"], job.get("seed", 0))}


# --------------------------------------------------------------------------- parent
class Budget:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()

    def timeout(self, wanted, minimum=5):
        """`wanted` seconds, or what is left; None when under `minimum` is left (the caller then says
        "not run: out of time budget" rather than start what would be killed and called failed)."""
        left = self.left()
        return None if left < minimum else min(wanted, left)


class MemoryPoller(threading.Thread):
    """Largest device memory nvidia-smi reports for process `pid` (MiB), and the largest total used
    memory of GPU 0, polled every `period` seconds until stop()."""

    def __init__(self, pid, period=0.2):
        super().__init__(daemon=True)
        self.pid, self.period, self.halt = pid, period, threading.Event()
        self.process_mib, self.total_mib, self.samples = None, None, 0

    def run(self):
        smi = shutil.which("nvidia-smi")
        while smi and not self.halt.is_set():
            try:
                apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=5).stdout
                total = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                       capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                break
            for line in apps.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 2 and parts[0] == str(self.pid) and parts[1].isdigit():
                    self.process_mib = max(self.process_mib or 0, int(parts[1]))
            if total.strip().isdigit():
                self.total_mib = max(self.total_mib or 0, int(total.strip()))
            self.samples += 1
            self.halt.wait(self.period)

    def stop(self):
        self.halt.set()
        self.join(timeout=10)


def gpu_used_mib():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return int(out) if out.isdigit() else None
    except (OSError, subprocess.SubprocessError):
        return None


class Runner:
    def __init__(self, args):
        self.args = args
        self.log = open(os.path.join(args.out, "bench.log"), "a")
        self.ours_env = dict(os.environ)
        if args.ours_ld_path:
            self.ours_env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in [args.ours_ld_path, os.environ.get("LD_LIBRARY_PATH", "")] if p)
        self.torch_env = dict(os.environ)
        self.current = None
        signal.signal(signal.SIGTERM, self.terminate)

    def terminate(self, signum, frame):
        """Killed from outside (device_check.sh's timeout): take the running child's group along, and
        keep what was measured so far."""
        if self.current and self.current.poll() is None:
            os.killpg(self.current.pid, signal.SIGKILL)
        if getattr(self, "res", None) is not None:
            self.res.setdefault("notes", []).append(f"stopped by signal {signum}: the runs after this point did not run")
            self.write_results()
        sys.exit(128 + signum)

    def write_results(self):
        """bench.md and bench.json from what has run so far: after each section and when stopped, so that
        a later failure or a timeout loses nothing already measured."""
        try:
            res = self.res
            res["wall_s"] = time.time() - res["started"]
            md = markdown(res, self.args, {"large": LARGE["title"], "small": SMALL["title"]})
            with open(os.path.join(self.args.out, "bench.md"), "w") as f:
                f.write(md)
            with open(os.path.join(self.args.out, "bench.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
            return md
        except Exception as e:  # noqa: BLE001  (a report that cannot be written must not end the run)
            self.say(f"could not write the results: {e!r}")
            return ""

    def say(self, text):
        print(f"[gpu_vs_pytorch {time.strftime('%H:%M:%S')}] {text}", flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def child(self, argv, env, timeout, label, poll_memory=False):
        """Runs argv; returns (exit status or 'timeout', output, MemoryPoller or None, wall s)."""
        self.log.write(f"\n===== {label}: {' '.join(argv)}\n")
        self.log.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.current = proc
        poller = None
        if poll_memory:
            poller = MemoryPoller(proc.pid)
            poller.start()
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            status = "timeout"
        if poller:
            poller.stop()
        wall = time.monotonic() - t0
        self.log.write(out[-20000:] + f"\n===== {label}: status {status}, {wall:.1f} s\n")
        self.log.flush()
        return status, out, poller, wall

    def torch_job(self, kind, job, timeout, label, poll_memory=False):
        """A PyTorch child (this script with --worker); returns (result dict or None, why, poller)."""
        if timeout is None:
            return None, "not run: out of time budget", None
        argv = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(job)]
        status, out, poller, _ = self.child(argv, self.torch_env, timeout, label, poll_memory)
        if status != 0:
            return None, f"failed ({'timed out' if status == 'timeout' else 'exit ' + str(status)}): {last_line(out)}", poller
        try:
            return json.loads(out.strip().splitlines()[-1]), "", poller
        except (ValueError, IndexError):
            return None, f"no result: {last_line(out)}", poller


def last_line(text):
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def step_times(times, warmup):
    kept = times[warmup:] if len(times) > warmup else times
    return statistics.median(kept) if kept else None


# --------------------------------------------------------------------------- sections
def gemm_section(r, res):
    a, budget = r.args, r.budget
    size = a.gemm_size
    res["gemm"] = {"size": size, "ours": {}, "torch": {}}
    ours = res["gemm"]["ours"]
    if a.smoke_cpu:
        ours["why"] = "not run: CPU smoke (bench_gemm_cuda needs a GPU)"
    elif not os.access(a.bench_gemm, os.X_OK):
        ours["why"] = f"not run: {a.bench_gemm} was not built (it links once the CUDA launchers are merged)"
    else:
        t = budget.timeout(90)
        if t is None:
            ours["why"] = "not run: out of time budget"
        else:
            r.say(f"gemm: ours, bench_gemm_cuda {size}^3 fp32,tf32,bf16")
            status, out, _, wall = r.child([a.bench_gemm, str(size), str(size), str(size), "--repeats", "20"],
                                           r.ours_env, t, "bench_gemm_cuda")
            try:
                start = re.search(r"^\{", out, re.M)
                doc = json.loads(out[start.start():] if start else "")
                ours.update(doc)
                if status not in (0, 1):
                    ours["why"] = f"failed (exit {status}): {doc.get('error', last_line(out))}"
            except ValueError:
                ours["why"] = f"failed ({status}): {last_line(out)}"
    if not res["torch_ok"]:
        res["gemm"]["torch"]["why"] = res["torch_why"]
        return
    r.say(f"gemm: PyTorch torch.matmul {size}^3 on {a.device}")
    job = {"device": a.device, "size": size, "repeats": 20 if not a.smoke_cpu else 3,
           "precisions": ["fp32"] if a.smoke_cpu else ["fp32", "tf32", "bf16"]}
    out, why, _ = r.torch_job("gemm", job, budget.timeout(90), "torch gemm")
    res["gemm"]["torch"] = out if out else {"why": why}


def kernels_section(r, res):
    """Our softmax/BatchNorm kernels against cuDNN's (bench_kernels_cudnn); res['kernels']."""
    a = r.args
    entry = res["kernels"] = {}
    if a.smoke_cpu:
        entry["why"] = "not run: CPU smoke (bench_kernels_cudnn needs a GPU)"
        return
    if not os.access(a.bench_kernels, os.X_OK):
        entry["why"] = f"not run: {a.bench_kernels} was not built (no cuDNN beside the CUDA toolkit at build time)"
        return
    t = r.budget.timeout(60)
    if t is None:
        entry["why"] = "not run: out of time budget"
        return
    r.say("kernels: ours against cuDNN, bench_kernels_cudnn")
    status, out, _, _ = r.child([a.bench_kernels], r.ours_env, t, "bench_kernels_cudnn")
    if status == 127:
        entry["why"] = f"not run: bench_kernels_cudnn cannot load (no cuDNN 9 here?): {last_line(out)}"
        return
    try:
        start = re.search(r"^\{", out, re.M)
        entry.update(json.loads(out[start.start():] if start else ""))
        if status not in (0, 1):
            entry["why"] = f"failed (exit {status}): {entry.get('error', last_line(out))}"
    except ValueError:
        entry["why"] = f"failed ({status}): {last_line(out)}"


def ours_train(r, desc, precision, steps, label):
    """One run of our train; returns a dict of its figures or {'why': …}."""
    a = r.args
    folder = os.path.dirname(desc["onnx"])
    metrics = os.path.join(folder, f"{label}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    argv = [a.train, desc["onnx"], "--data", desc["x"], "--labels", desc["y"], "--batch-size", str(desc["batch"]),
            "--steps", str(steps), "--no-shuffle", "--metrics", metrics, "--optimizer", desc["optimizer"]]
    if desc["optimizer"] == "sgd":
        argv += ["--lr", str(SGD_LR), "--momentum", str(SGD_MOMENTUM)]
    if not a.smoke_cpu:
        argv += ["--device", "cuda", "--precision", precision]
        if desc.get("cuda_graph"):
            argv.append("--cuda-graph")
    t = r.budget.timeout(a.run_timeout, minimum=min_run_s(desc, a))
    if t is None:
        return {"why": "not run: out of time budget"}
    status, out, poller, wall = r.child(argv, r.ours_env, t, label, poll_memory=not a.smoke_cpu)
    if status != 0:
        return {"why": f"failed ({'timed out' if status == 'timeout' else 'exit ' + str(status)}): {last_line(out)}",
                "command": " ".join(argv)}
    try:
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        return {"why": f"failed: no metrics from a run that exited 0 ({e})", "command": " ".join(argv)}
    return {"step_s": [desc["batch"] / row["samples_per_s"] for row in rows], "losses": [row["loss"] for row in rows],
            "max_allocated": rows[-1].get("backend_peak_bytes") if rows else None,
            "memory_breakdown": (re.findall(r"^peak [^:]*memory held by the backend: (.*)$", out, re.M) or [None])[-1],
            "peak_process_mib": poller.process_mib if poller else None,
            "peak_total_mib": poller.total_mib if poller else None, "wall_s": wall, "command": " ".join(argv)}


def min_run_s(desc, args):
    """Seconds a training run needs at least (start, loading the weights, its steps): with less left
    it is not started. Estimates for an H200; the large model's start is most of its run."""
    if args.smoke_cpu:
        return 5
    return 30 if desc["name"] == "large" else 10


def torch_train_run(r, desc, precision, steps, label):
    a = r.args
    if not r.res["torch_ok"]:
        return {"why": r.res["torch_why"]}
    job = {"desc": desc, "device": a.device, "precision": precision, "steps": steps}
    out, why, poller = r.torch_job("train", job, r.budget.timeout(a.run_timeout, minimum=min_run_s(desc, a)), label,
                                   poll_memory=not a.smoke_cpu)
    if not out:
        return {"why": why}
    out["peak_process_mib"] = poller.process_mib if poller else None
    out["peak_total_mib"] = poller.total_mib if poller else None
    return out


def model_section(r, res, spec, precisions, rounds):
    """Generates spec's model, then for each precision `rounds` alternating rounds of ours and PyTorch."""
    name = spec["name"]
    entry = res[name] = {"title": spec["title"], "runs": {}}
    t = r.budget.timeout(120, minimum=5 if r.args.smoke_cpu else 25)
    if t is None:
        entry["why"] = "not run: out of time budget"
        return
    r.say(f"{name}: generating {spec['title']} (ONNX + external weights + data) in {r.folder}")
    job = {"spec": spec, "folder": r.folder, "seed": 0}
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "generate", json.dumps(job)]
    status, out, _, wall = r.child(argv, r.torch_env, t, f"generate {name}")
    if status != 0:
        entry["why"] = f"model generation failed: {last_line(out)}"
        return
    try:
        desc = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        entry["why"] = f"model generation failed: no description ({last_line(out)})"
        return
    entry["generate_s"] = wall
    entry["sum_io"], entry["batch"] = desc["sum_io"], desc["batch"]
    for precision in precisions:
        steps, warmup = STEPS[name][precision]
        runs = entry["runs"][precision] = {"steps": steps, "warmup": warmup, "ours": [], "torch": []}
        for rnd in range(rounds):
            order = ("ours", "torch") if rnd % 2 == 0 else ("torch", "ours")
            for side in order:
                r.say(f"{name} {precision}: {side}, round {rnd + 1}/{rounds}, {steps} steps")
                label = f"{name}_{precision}_{side}_{rnd}"
                run = (ours_train if side == "ours" else torch_train_run)(r, desc, precision, steps, label)
                if "why" in run:
                    r.say(f"  {side}: {run['why']}")
                else:
                    run["median_s"] = step_times(run["step_s"], warmup)
                    r.say(f"  {side}: median step {run['median_s'] * 1e3:.3f} ms")
                runs[side].append(run)
    for suffix in (".weights", "_x.npy"):  # the large files go as soon as they are done with
        path = os.path.join(r.folder, name + suffix)
        if os.path.exists(path):
            os.remove(path)


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "build-device", "bin"), help="where train and bench_gemm_cuda are")
    ap.add_argument("--out", required=False, help="folder for bench.json, bench.md and bench.log")
    ap.add_argument("--budget-s", type=float, default=200, help="stop starting new runs after this many seconds")
    ap.add_argument("--run-timeout", type=float, default=90, help="seconds one training run may take")
    ap.add_argument("--ours-ld-path", default=os.environ.get("PIPESHARD_OURS_LD_PATH", ""),
                    help="LD_LIBRARY_PATH entries for our binaries only (carried libraries, the machine's CUDA)")
    ap.add_argument("--sections", default="gemm,large,small,kernels",
                    help="which to run, in this order (the large MLP before the small one: it is the headline; "
                         "the kernel race last: it is no target)")
    ap.add_argument("--large-precisions", default=",".join(LARGE_PRECISIONS),
                    help="the large model's precisions, in this order (fp32 too: fp32,bf16,tf32)")
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny sizes on the CPU: checks the plumbing, no GPU")
    ap.add_argument("--keep", action="store_true", help="keep the folder with models, data and metrics")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker[0]](json.loads(args.worker[1]))))
        return 0
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    args.train = os.path.join(args.bin_dir, "train")
    args.bench_gemm = os.path.join(args.bin_dir, "bench_gemm_cuda")
    args.bench_kernels = os.path.join(args.bin_dir, "bench_kernels_cudnn")
    args.device = "cpu" if args.smoke_cpu else "cuda"
    args.gemm_size = 256 if args.smoke_cpu else GEMM_SIZE
    if args.smoke_cpu:  # tiny stand-ins with the same structure
        global LARGE, SMALL, STEPS, SMALL_ROUNDS
        LARGE = dict(LARGE, width=128, layers=3, batch=64, title="CPU smoke: 3 x (Linear(128, 128) + GELU), batch 64, AdamW")
        SMALL = dict(SMALL, title="CPU smoke: " + SMALL["title"].replace(" (ours with --cuda-graph)", ""))
        STEPS = {"large": {"fp32": (6, 2)}, "small": {"fp32": (30, 5)}}
        SMALL_ROUNDS = 1
    for p in args.large_precisions.split(","):
        if not args.smoke_cpu and p not in STEPS["large"]:
            ap.error(f"--large-precisions: '{p}' is not one of {', '.join(STEPS['large'])}")
    r = Runner(args)
    r.budget = Budget(args.budget_s)
    res = r.res = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "started": time.time(), "notes": []}

    r.say(f"python {sys.executable}; probing torch")
    status, out, _, _ = r.child([sys.executable, os.path.abspath(__file__), "--worker", "info", "{}"], r.torch_env,
                                60, "torch info")
    try:
        info = json.loads(out.strip().splitlines()[-1]) if status == 0 else None
    except (ValueError, IndexError):
        info = None
    res["torch_ok"] = bool(info) and (args.smoke_cpu or info.get("available"))
    if info:
        res["torch_info"] = info
        res["torch_why"] = "" if res["torch_ok"] else f"not run: torch {info['torch']} sees no GPU (cuda {info['cuda']})"
    else:
        res["torch_why"] = f"not run: torch is not importable by {sys.executable} ({last_line(out)})"
    r.say(f"PyTorch: {info if info else res['torch_why']}")
    if not os.access(args.train, os.X_OK):
        res["notes"].append(f"{args.train} is missing: our training runs fail")

    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as folder:
        r.folder = folder
        for section in args.sections.split(","):
            t0 = time.monotonic()
            if section == "gemm":
                gemm_section(r, res)
            elif section == "small":
                model_section(r, res, SMALL, ["fp32"] if args.smoke_cpu else SMALL_PRECISIONS, SMALL_ROUNDS)
            elif section == "large":
                model_section(r, res, LARGE, ["fp32"] if args.smoke_cpu else args.large_precisions.split(","), 1)
            elif section == "kernels":
                kernels_section(r, res)
            else:
                ap.error(f"unknown section '{section}'")
            r.say(f"{section}: {time.monotonic() - t0:.1f} s")
            r.write_results()
        if args.keep:
            shutil.copytree(folder, os.path.join(args.out, "bench_files"), dirs_exist_ok=True)
    print(r.write_results())
    return 0


if __name__ == "__main__":
    sys.exit(main())
