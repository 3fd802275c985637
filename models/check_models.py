#!/usr/bin/python3
"""Check models/ against models/metadata.json (run by export_models.py; also standalone:
/usr/bin/python3 models/check_models.py).

For every file: onnx.load; onnx.checker.check_model + shape inference where onnx 1.12 knows the
opset (<= 17), shape inference attempted (not required) for opset 18/20; metadata fields match
the file; and a small numpy interpreter re-runs the graph on reference/<name>.input.npy and
compares with the torch output in reference/<name>.output.npy.  Exits non-zero on any failure.
"""
import json
import os
import sys

import numpy as np
import onnx
from onnx import numpy_helper
from scipy.special import erf

MODELS = os.path.dirname(os.path.abspath(__file__))


def attrs(node):
    out = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in out.items()}


def gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def run_node(op, a, x):
    """Evaluate one node; x = list of input arrays (None for omitted optional inputs)."""
    if op == "Gemm":
        A, B = x[0], x[1]
        if a.get("transA", 0):
            A = A.T
        if a.get("transB", 0):
            B = B.T
        y = a.get("alpha", 1.0) * (A @ B)
        return [y + a.get("beta", 1.0) * x[2] if len(x) > 2 and x[2] is not None else y]
    if op in ("Identity", "Dropout"):  # Dropout: evaluated in inference form only
        if op == "Dropout" and len(x) > 2 and x[2] is not None and bool(x[2]):
            raise ValueError("Dropout in training mode is random")
        return [x[0]]
    simple = {"MatMul": np.matmul, "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
              "Div": np.divide, "Pow": np.power, "Sqrt": np.sqrt, "Erf": erf, "Tanh": np.tanh,
              "Relu": lambda v: np.maximum(v, 0), "Sigmoid": lambda v: 1 / (1 + np.exp(-v))}
    if op in simple:
        return [simple[op](*x)]
    if op == "LeakyRelu":
        return [np.where(x[0] >= 0, x[0], a.get("alpha", 0.01) * x[0])]
    if op in ("Softmax", "LogSoftmax"):
        ax = a.get("axis", -1)
        z = x[0] - x[0].max(axis=ax, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=ax, keepdims=True))
        return [np.exp(z - lse) if op == "Softmax" else z - lse]
    if op == "ReduceMean":
        axes = a.get("axes", None if len(x) < 2 else list(x[1]))
        return [x[0].mean(axis=tuple(axes), keepdims=bool(a.get("keepdims", 1)))]
    if op == "LayerNormalization":
        ax = tuple(range(a.get("axis", -1) % x[0].ndim, x[0].ndim))
        mu, var = x[0].mean(axis=ax, keepdims=True), x[0].var(axis=ax, keepdims=True)
        return [(x[0] - mu) / np.sqrt(var + a.get("epsilon", 1e-5)) * x[1] + x[2]]
    if op == "BatchNormalization":
        mean, var = x[3], x[4]
        if a.get("training_mode", 0):
            mean, var = x[0].mean(axis=0), x[0].var(axis=0)
        y = (x[0] - mean) / np.sqrt(var + a.get("epsilon", 1e-5)) * x[1] + x[2]
        return [y, None, None]
    if op == "Gelu":
        return [gelu(x[0], a.get("approximate", "none"))]
    if op == "Flatten":
        ax = a.get("axis", 1)
        return [x[0].reshape(int(np.prod(x[0].shape[:ax])), -1)]
    if op == "Reshape":
        return [x[0].reshape([int(d) for d in x[1]])]
    if op == "Constant":
        return [numpy_helper.to_array(a["value"])]
    raise NotImplementedError(op)


def evaluate(model, inp):
    env = {t.name: numpy_helper.to_array(t).astype(np.float64)
           if t.data_type == onnx.TensorProto.FLOAT else numpy_helper.to_array(t)
           for t in model.graph.initializer}
    env[model.graph.input[0].name] = inp.astype(np.float64)
    for node in model.graph.node:
        outs = run_node(node.op_type, attrs(node), [env[i] if i else None for i in node.input])
        for name, val in zip(node.output, outs):
            env[name] = val
    return env[model.graph.output[0].name]


def check(name, meta):
    path = os.path.join(MODELS, name)
    model = onnx.load(path)
    problems = []
    if meta["opset"] <= 17:
        onnx.checker.check_model(path)  # by path: also reads external data
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        checked = "checker+shape_inference"
    else:
        try:
            onnx.shape_inference.infer_shapes(model, strict_mode=True)
            checked = "load + shape_inference ran (no checker)"
        except Exception as e:  # onnx 1.12 does not know opset 18/20 schemas
            checked = "load only (shape inference: %s)" % str(e).splitlines()[0][:60]
    ops = sorted({n.op_type for n in model.graph.node})
    if ops != meta["onnx_ops"]:
        problems.append("onnx_ops %s != %s" % (ops, meta["onnx_ops"]))
    for vi, want in zip(list(model.graph.input) + list(model.graph.output),
                        meta["inputs"] + meta["outputs"]):
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        if dims[0] != "batch" or vi.name != want["name"]:
            problems.append("io %s %s" % (vi.name, dims))
    if sum(l["parameters"] for l in meta["layers"]) != meta["total_parameters"]:
        problems.append("layer parameters do not sum to total_parameters")
    n_init = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    err = None
    if meta["reference"]:
        x = np.load(os.path.join(MODELS, meta["reference"]["input"]))
        want = np.load(os.path.join(MODELS, meta["reference"]["output"]))
        got = evaluate(model, x)
        err = float(np.abs(got - want).max())
        if got.shape != want.shape or err > 1e-4:
            problems.append("output mismatch: max abs err %g" % err)
    print("%-26s opset %-2d %-34s init elems %7d  max|err| %s %s" % (
        name, meta["opset"], checked, n_init, "-" if err is None else "%.1e" % err,
        "FAIL " + "; ".join(problems) if problems else "ok"))
    return not problems


def main():
    with open(os.path.join(MODELS, "metadata.json")) as f:
        meta = json.load(f)
    files = sorted(f for f in os.listdir(MODELS) if f.endswith(".onnx"))
    ok = files == sorted(meta)
    if not ok:
        print("metadata.json keys differ from the .onnx files present")
    for name in sorted(meta):
        ok = check(name, meta[name]) and ok
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(MODELS) for f in fs)
    print("models/ total size: %.2f MB" % (size / 1e6))
    ok = ok and size < 5e6
    if not ok:
        sys.exit("check_models: FAILED")


if __name__ == "__main__":
    main()
