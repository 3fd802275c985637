#!/usr/bin/python3
"""Regenerate pipeshard's test models (models/*.onnx) and the digits data set (data/).

What it makes:
  * models/*.onnx         small MLPs exported by torch.onnx.export (torch 1.13) or, for forms
                          torch 1.13 cannot emit (opset 18/20, Gemm alpha/beta, inference
                          Dropout, Identity on an initializer), built with onnx.helper from the
                          weights of an equivalent torch module.
  * models/external_data.onnx + external_data.onnx.data   simple.onnx with external weights.
  * models/reference/<name>.input.npy / .output.npy       float32, batch 3: input is
                          torch.manual_seed(0); torch.randn(3, ...); output is the torch module's
                          output in eval mode (train mode for batchnorm_train).
  * models/metadata.json  per file: opset, inputs/outputs, torch layers with parameter counts,
                          total_parameters, onnx_ops, ir_kinds (normalized node kinds as
                          pipeshard's importer should see them), initializers, reference.
  * data/digits_*.npy     sklearn's load_digits() (ships offline): pixel values 0..16 divided by
                          16 -> float32 in [0, 1]; features [1797, 64], images [1797, 1, 8, 8],
                          labels int64 [1797].

How to run (from the repo root; needs torch 1.13, onnx 1.12, numpy, sklearn, scipy):
    /usr/bin/python3 models/export_models.py
It ends by running models/check_models.py (onnx checker + a numpy re-evaluation of every file
against its reference output).  Only needed to regenerate these files, never to build or test
pipeshard: the outputs are checked in.
"""
import copy
import json
import os
import sys

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
DATA = os.path.join(ROOT, "data")
REF = os.path.join(MODELS, "reference")
EVAL, TRAIN = torch.onnx.TrainingMode.EVAL, torch.onnx.TrainingMode.TRAINING
METADATA = {}


# ----------------------------------------------------------------------------- helpers
def torch_layers(model, x, train=False):
    """Modules with direct parameters, in the order forward first calls them.
    A parameter shared between modules is counted once, at its first use."""
    model = copy.deepcopy(model)
    order, hooks = [], []
    for name, mod in model.named_modules():
        if list(mod.parameters(recurse=False)):
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, name=name: order.append((name, m)) if name not in
                [n for n, _ in order] else None))
    model.train(train)
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    seen, layers = {}, []
    for name, mod in order:
        entry = {"module": name, "type": type(mod).__name__, "parameters": 0}
        shared = []
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                shared.append({"parameter": pname, "same_as": seen[id(p)]})
            else:
                seen[id(p)] = name + "." + pname
                entry["parameters"] += p.numel()
        if shared:
            entry["shared"] = shared
        layers.append(entry)
    return layers


def value_info_json(vi):
    dims = [d.dim_param if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
    return {"name": vi.name, "shape": dims}


def record(name, model, input_shape, ir_kinds, source, train_ref=False, reference=True,
           extra=None):
    """Write reference tensors and the metadata entry for models/<name>.onnx."""
    path = os.path.join(MODELS, name + ".onnx")
    proto = onnx.load(path)
    torch.manual_seed(0)
    x = torch.randn(3, *input_shape)
    entry = {
        "source": source,
        "opset": next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
        "ir_version": proto.ir_version,
        "inputs": [value_info_json(v) for v in proto.graph.input],
        "outputs": [value_info_json(v) for v in proto.graph.output],
        "layers": torch_layers(model, x, train_ref),
        "total_parameters": sum(p.numel() for p in model.parameters()),
        "onnx_ops": sorted({n.op_type for n in proto.graph.node}),
        "ir_kinds": ir_kinds,
        "initializers": [{"name": t.name, "shape": list(t.dims)} for t in proto.graph.initializer],
        "reference": None,
    }
    if reference:
        m = copy.deepcopy(model).train(train_ref)
        with torch.no_grad():
            y = m(x)
        np.save(os.path.join(REF, name + ".input.npy"), x.numpy().astype(np.float32))
        np.save(os.path.join(REF, name + ".output.npy"), y.numpy().astype(np.float32))
        entry["reference"] = {"input": "reference/%s.input.npy" % name,
                              "output": "reference/%s.output.npy" % name,
                              "mode": "train" if train_ref else "eval"}
    entry.update(extra or {})
    METADATA[name + ".onnx"] = entry


def export(name, model, input_shape, ir_kinds, opset=14, training=EVAL, **kw):
    """torch.onnx.export with pipeshard's conventions (dynamic batch, input/output names)."""
    m = copy.deepcopy(model)  # a TRAINING export runs forward and would update BN stats
    m.train(training == TRAIN)
    x = torch.zeros(2, *input_shape)
    torch.onnx.export(m, x, os.path.join(MODELS, name + ".onnx"), export_params=True,
                      opset_version=opset, training=training,
                      do_constant_folding=(training != TRAIN),
                      input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    if training == TRAIN:  # tracing in train mode stepped the copy's BN running stats: undo
        path, state = os.path.join(MODELS, name + ".onnx"), model.state_dict()
        proto = onnx.load(path)
        for t in proto.graph.initializer:
            if t.name in state:
                t.CopyFrom(numpy_helper.from_array(state[t.name].numpy(), t.name))
        onnx.save(proto, path)
    record(name, model, input_shape, ir_kinds, "torch.onnx.export", **kw)


def seeded(seed, fn):
    torch.manual_seed(seed)
    return fn().eval()


def init(name, tensor):
    return numpy_helper.from_array(np.asarray(tensor.detach().numpy(), np.float32), name)


def const(out, value, dtype=np.float32):
    return helper.make_node("Constant", [], [out],
                            value=numpy_helper.from_array(np.array(value, dtype), out + "_value"))


def gemm(prefix, x, out, inits, linear, **attrs):
    """Torch-style Gemm (transB=1) for an nn.Linear registered under `prefix`."""
    inits += [init(prefix + ".weight", linear.weight), init(prefix + ".bias", linear.bias)]
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1, **attrs}
    return helper.make_node("Gemm", [x, prefix + ".weight", prefix + ".bias"], [out],
                            name="/%s/Gemm" % prefix, **attrs)


def save_helper(name, nodes, inits, n_in, n_out, opset, ir_version=8):
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", n_out])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="pipeshard models/export_models.py")
    model.ir_version = ir_version
    onnx.save(model, os.path.join(MODELS, name + ".onnx"))


def mlp(*mods):
    return nn.Sequential(*mods)


# ----------------------------------------------------------------------------- model families
class PipelineParallel(nn.Module):
    """The course's two-stage model, exported as one module."""
    def __init__(self):
        super().__init__()
        self.stage1 = nn.Sequential(nn.Linear(100, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.stage2(self.stage1(x))


def basic_models():
    L, R = "Linear", "Relu"
    simple = seeded(1, lambda: mlp(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 128),
                                   nn.ReLU(), nn.Linear(128, 10)))
    export("simple", simple, [100], [L, R, L, R, L])
    export("pipeline_parallel", seeded(2, PipelineParallel), [100], [L, R, L, R, L, R, L])
    digits = seeded(3, lambda: mlp(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128),
                                   nn.ReLU(), nn.Linear(128, 10)))
    export("simple_digits", digits, [64], [L, R, L, R, L])
    export("linear_nobias", seeded(4, lambda: mlp(nn.Linear(32, 64, bias=False), nn.ReLU(),
                                                  nn.Linear(64, 10, bias=False))), [32], [L, R, L])
    # rank-3 input: torch emits MatMul + Add for the first Linear
    export("linear_matmul_add", seeded(5, lambda: mlp(nn.Linear(16, 32), nn.ReLU(), nn.Flatten(),
                                                      nn.Linear(128, 10))),
           [4, 16], [L, R, "Reshape", L])
    # simple.onnx again, with every tensor in one external file
    proto = onnx.load(os.path.join(MODELS, "simple.onnx"))
    data_file = os.path.join(MODELS, "external_data.onnx.data")
    if os.path.exists(data_file):
        os.remove(data_file)  # save_model appends to an existing file
    onnx.save_model(proto, os.path.join(MODELS, "external_data.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=True,
                    location="external_data.onnx.data", size_threshold=0)
    record("external_data", simple, [100], [L, R, L, R, L], "onnx.save_model(simple.onnx)",
           extra={"external_data": "external_data.onnx.data"})


class ScaledGemm(nn.Module):
    """0.5 * l1(x)W^T + 2.0 * b (Gemm alpha=0.5, beta=2.0), ReLU, then l2 (Gemm transB=0)."""
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = 0.5 * self.l1(x) + 1.5 * self.l1.bias  # == 0.5 * x W^T + 2.0 * b
        return self.l2(torch.relu(h))


def gemm_models():
    m = seeded(6, ScaledGemm)
    inits = []
    w2 = numpy_helper.from_array(m.l2.weight.detach().numpy().T.copy(), "l2.weight_t")  # [in,out]
    nodes = [gemm("l1", "input", "/l1/Gemm_output_0", inits, m.l1, alpha=0.5, beta=2.0),
             helper.make_node("Relu", ["/l1/Gemm_output_0"], ["/Relu_output_0"], name="/Relu"),
             helper.make_node("Gemm", ["/Relu_output_0", "l2.weight_t", "l2.bias"], ["output"],
                              name="/l2/Gemm", alpha=1.0, beta=1.0, transB=0)]
    inits += [w2, init("l2.bias", m.l2.bias)]
    save_helper("gemm_alpha_beta", nodes, inits, 16, 10, 14)
    record("gemm_alpha_beta", m, [16], ["Linear", "Relu", "Linear"], "onnx.helper")

    # Identity renaming an initializer that a Gemm then uses
    m = seeded(7, lambda: mlp(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)))
    inits = [init("0.weight", m[0].weight), init("0.bias", m[0].bias),
             init("onnx::Identity_src", m[2].weight), init("2.bias", m[2].bias)]
    nodes = [helper.make_node("Identity", ["onnx::Identity_src"], ["2.weight"], name="/Identity"),
             helper.make_node("Gemm", ["input", "0.weight", "0.bias"], ["/0/Gemm_output_0"],
                              name="/0/Gemm", alpha=1.0, beta=1.0, transB=1),
             helper.make_node("Relu", ["/0/Gemm_output_0"], ["/1/Relu_output_0"], name="/1/Relu"),
             helper.make_node("Gemm", ["/1/Relu_output_0", "2.weight", "2.bias"], ["output"],
                              name="/2/Gemm", alpha=1.0, beta=1.0, transB=1)]
    save_helper("identity_initializer", nodes, inits, 16, 10, 14)
    record("identity_initializer", m, [16], ["Linear", "Relu", "Linear"], "onnx.helper")


class SharedWeight(nn.Module):
    """fc2 reuses fc1's weight Parameter (own bias)."""
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 10)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(x + self.fc2(torch.relu(self.fc1(x))))


class DeepResidual(nn.Module):
    """Eight Linear layers, a residual connection over every pair of the middle six, and
    Dropout before the head: deep enough to cut into 2 x 2, 2 x 3 or 3 x 2 chunks
    (interleaved and V pipeline schedules), with residuals crossing the cuts."""
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 48)
        self.blocks = nn.ModuleList([nn.Linear(48, 48) for _ in range(6)])
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(48, 10)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for i in range(0, 6, 2):
            h = h + torch.relu(self.blocks[i + 1](torch.relu(self.blocks[i](h))))
        return self.head(self.drop(h))


class ReshapeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.reshape(-1, 64))))


def structure_models():
    L, R = "Linear", "Relu"
    export("shared_weight", seeded(8, SharedWeight), [32], [L, R, L, R, L])
    export("residual", seeded(9, Residual), [64], [L, R, L, "Add", L])
    export("flatten", seeded(10, lambda: mlp(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(),
                                             nn.Linear(32, 10))), [1, 8, 8], ["Reshape", L, R, L])
    export("reshape", seeded(11, ReshapeModel), [1, 8, 8], ["Reshape", L, R, L])
    export("deep_residual", seeded(24, DeepResidual), [64],
           [L, R] + [L, R, L, R, "Add"] * 3 + ["Dropout", L], training=TRAIN, reference=False)


def activation_models():
    L = "Linear"
    export("activations", seeded(12, lambda: mlp(
        nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.Sigmoid(),
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))), [32],
        [L, "LeakyRelu", L, "Sigmoid", L, "Tanh", L])
    export("gelu_erf", seeded(13, lambda: mlp(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))),
           [32], [L, "Gelu", L])
    export("gelu_tanh", seeded(14, lambda: mlp(nn.Linear(32, 64), nn.GELU(approximate="tanh"),
                                               nn.Linear(64, 10))), [32], [L, "GeluTanh", L])
    export("silu", seeded(15, lambda: mlp(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 10))),
           [32], [L, "Silu", L])
    export("softmax", seeded(16, lambda: mlp(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10),
                                             nn.Softmax(dim=-1))), [32],
           [L, "Relu", L, "Softmax"])
    export("logsoftmax", seeded(17, lambda: mlp(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10),
                                                nn.LogSoftmax(dim=1))), [32],
           [L, "Relu", L, "LogSoftmax"])

    # opset 20 standalone Gelu (default approximate, then approximate="tanh")
    m = seeded(18, lambda: mlp(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64),
                               nn.GELU(approximate="tanh"), nn.Linear(64, 10)))
    inits = []
    nodes = [gemm("0", "input", "/0/Gemm_output_0", inits, m[0]),
             helper.make_node("Gelu", ["/0/Gemm_output_0"], ["/1/Gelu_output_0"], name="/1/Gelu"),
             gemm("2", "/1/Gelu_output_0", "/2/Gemm_output_0", inits, m[2]),
             helper.make_node("Gelu", ["/2/Gemm_output_0"], ["/3/Gelu_output_0"], name="/3/Gelu",
                              approximate="tanh"),
             gemm("4", "/3/Gelu_output_0", "output", inits, m[4])]
    save_helper("gelu_op20", nodes, inits, 32, 10, 20, ir_version=9)
    record("gelu_op20", m, [32], [L, "Gelu", L, "GeluTanh", L], "onnx.helper")


def norm_models():
    L, R = "Linear", "Relu"
    ln = seeded(19, lambda: mlp(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10)))
    with torch.no_grad():  # non-trivial affine parameters
        ln[1].weight.uniform_(0.5, 1.5)
        ln[1].bias.uniform_(-0.2, 0.2)
    export("layernorm_decomposed", ln, [16], [L, "LayerNorm", R, L], opset=14)
    export("layernorm_op17", ln, [16], [L, "LayerNorm", R, L], opset=17)

    # torch-2.x-like opset 18: ReduceMean axes as a Constant-node input, GELU(erf) constants too
    m = seeded(20, lambda: mlp(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 10)))
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.2, 0.2)
    g, n = "/0/Gemm_output_0", lambda op, i, o, **a: helper.make_node(op, i, o, **a)
    inits = []
    first = gemm("0", "input", g, inits, m[0])
    inits += [init("1.weight", m[1].weight), init("1.bias", m[1].bias)]
    nodes = [first,
             const("/1/Constant_output_0", [-1], np.int64),
             n("ReduceMean", [g, "/1/Constant_output_0"], ["/1/ReduceMean_output_0"], keepdims=1),
             n("Sub", [g, "/1/ReduceMean_output_0"], ["/1/Sub_output_0"]),
             const("/1/Constant_1_output_0", 2.0),
             n("Pow", ["/1/Sub_output_0", "/1/Constant_1_output_0"], ["/1/Pow_output_0"]),
             const("/1/Constant_2_output_0", [-1], np.int64),
             n("ReduceMean", ["/1/Pow_output_0", "/1/Constant_2_output_0"],
               ["/1/ReduceMean_1_output_0"], keepdims=1),
             const("/1/Constant_3_output_0", 1e-5),
             n("Add", ["/1/ReduceMean_1_output_0", "/1/Constant_3_output_0"], ["/1/Add_output_0"]),
             n("Sqrt", ["/1/Add_output_0"], ["/1/Sqrt_output_0"]),
             n("Div", ["/1/Sub_output_0", "/1/Sqrt_output_0"], ["/1/Div_output_0"]),
             n("Mul", ["/1/Div_output_0", "1.weight"], ["/1/Mul_output_0"]),
             n("Add", ["/1/Mul_output_0", "1.bias"], ["/1/Add_1_output_0"]),
             const("/2/Constant_output_0", 1.4142135381698608),
             n("Div", ["/1/Add_1_output_0", "/2/Constant_output_0"], ["/2/Div_output_0"]),
             n("Erf", ["/2/Div_output_0"], ["/2/Erf_output_0"]),
             const("/2/Constant_1_output_0", 1.0),
             n("Add", ["/2/Erf_output_0", "/2/Constant_1_output_0"], ["/2/Add_output_0"]),
             n("Mul", ["/1/Add_1_output_0", "/2/Add_output_0"], ["/2/Mul_output_0"]),
             const("/2/Constant_2_output_0", 0.5),
             n("Mul", ["/2/Mul_output_0", "/2/Constant_2_output_0"], ["/2/Mul_1_output_0"]),
             gemm("3", "/2/Mul_1_output_0", "output", inits, m[3])]
    save_helper("layernorm_opset18", nodes, inits, 16, 10, 18, ir_version=8)
    record("layernorm_opset18", m, [16], [L, "LayerNorm", "Gelu", L], "onnx.helper")

    bn = seeded(21, lambda: mlp(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)))
    with torch.no_grad():  # non-trivial running stats and affine parameters
        bn[1].running_mean.uniform_(-0.5, 0.5)
        bn[1].running_var.uniform_(0.5, 2.0)
        bn[1].weight.uniform_(0.5, 1.5)
        bn[1].bias.uniform_(-0.2, 0.2)
    export("batchnorm_eval", bn, [16], [L, "BatchNorm", R, L])
    export("batchnorm_train", bn, [16], [L, "BatchNorm", R, L], training=TRAIN, train_ref=True)
    # Four Linear + BatchNorm + ReLU blocks and a head: deep enough for 2 x 2 chunks
    # (interleaved), BatchNorm in every chunk.
    deep = seeded(25, lambda: mlp(*[m for i in range(4) for m in (nn.Linear(16 if i == 0 else 32, 32),
                                                                 nn.BatchNorm1d(32), nn.ReLU())],
                                  nn.Linear(32, 10)))
    export("deep_batchnorm", deep, [16], [L, "BatchNorm", R] * 4 + [L], training=TRAIN, reference=False)
    # Fresh BatchNorm statistics equal its affine parameters (ones, zeros): constant
    # folding merges the equal initializers and emits Identity nodes for the statistics.
    fresh = seeded(22, lambda: mlp(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)))
    export("batchnorm_default_stats", fresh, [16], [L, "BatchNorm", R, L])


def dropout_models():
    L, R = "Linear", "Relu"
    export("dropout_train", seeded(22, lambda: mlp(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1),
                                                   nn.Linear(32, 10))),
           [16], [L, R, "Dropout", L], training=TRAIN, reference=False)

    # inference-form Dropout, which torch drops in eval: (a) data only; (b) data + ratio +
    # training_mode=false from Constant nodes, single output
    m = seeded(23, lambda: mlp(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32),
                               nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10)))
    inits = []
    nodes = [gemm("0", "input", "/0/Gemm_output_0", inits, m[0]),
             helper.make_node("Relu", ["/0/Gemm_output_0"], ["/1/Relu_output_0"], name="/1/Relu"),
             helper.make_node("Dropout", ["/1/Relu_output_0"], ["/2/Dropout_output_0"],
                              name="/2/Dropout"),
             gemm("3", "/2/Dropout_output_0", "/3/Gemm_output_0", inits, m[3]),
             helper.make_node("Relu", ["/3/Gemm_output_0"], ["/4/Relu_output_0"], name="/4/Relu"),
             const("/5/Constant_output_0", 0.1),
             const("/5/Constant_1_output_0", False, np.bool_),
             helper.make_node("Dropout", ["/4/Relu_output_0", "/5/Constant_output_0",
                                          "/5/Constant_1_output_0"], ["/5/Dropout_output_0"],
                              name="/5/Dropout"),
             gemm("6", "/5/Dropout_output_0", "output", inits, m[6])]
    save_helper("dropout_eval", nodes, inits, 16, 10, 14)
    record("dropout_eval", m, [16], [L, R, "Dropout", L, R, "Dropout", L], "onnx.helper")


def digits_data():
    from sklearn.datasets import load_digits
    d = load_digits()
    features = (d.data / 16.0).astype(np.float32)  # pixel counts 0..16 -> [0, 1]
    np.save(os.path.join(DATA, "digits_features.npy"), features)
    np.save(os.path.join(DATA, "digits_images.npy"), features.reshape(-1, 1, 8, 8))
    np.save(os.path.join(DATA, "digits_labels.npy"), d.target.astype(np.int64))
    # A fixed split for demos: every 6th sample held out for evaluation.
    held_out = np.arange(len(features)) % 6 == 5
    for name, rows in (("train", ~held_out), ("test", held_out)):
        np.save(os.path.join(DATA, f"digits_{name}_features.npy"), features[rows])
        np.save(os.path.join(DATA, f"digits_{name}_labels.npy"), d.target[rows].astype(np.int64))


def main():
    os.makedirs(REF, exist_ok=True)
    os.makedirs(DATA, exist_ok=True)
    basic_models()
    gemm_models()
    structure_models()
    activation_models()
    norm_models()
    dropout_models()
    digits_data()
    with open(os.path.join(MODELS, "metadata.json"), "w") as f:
        json.dump(dict(sorted(METADATA.items())), f, indent=1)
        f.write("\n")
    sys.dont_write_bytecode = True  # keep models/ free of __pycache__
    import check_models
    check_models.main()


if __name__ == "__main__":
    main()
