"""A small ONNX -> PyTorch interpreter: the reference that pipeshard's training is held to.

OnnxModule(model_proto) is an nn.Module that executes the ONNX graph node by node with torch
ops, so autograd and torch.optim train it exactly as they would train the PyTorch module the
file was exported from. It shares no code with pipeshard (the golden fixtures would otherwise
prove nothing about pipeshard's importer).

Tensors and their roles:
  * A float32 initializer that any node uses as an operand (a Gemm/MatMul weight or bias, a
    LayerNorm/BatchNorm scale or bias, the operand of an elementwise op), directly or through
    Identity nodes, is ONE trainable nn.Parameter, however often it is used. They are listed
    in `parameters_by_name` (initializer name -> Parameter) in the order of the file's
    initializers.
  * An initializer used as BatchNormalization running mean/var is a buffer (`buffers_by_name`);
    with training_mode=1 F.batch_norm updates it in place, with torch momentum = 1 - (ONNX
    momentum) and the unbiased batch variance, as torch.nn.BatchNorm does. An initializer used
    both ways (constant folding merges equal tensors) gets a parameter AND a separate buffer.
  * Other initializers (int64 shapes and axes) are plain constants.

Ops: Gemm (transA=0), MatMul, Add, Sub, Mul, Div, Pow, Sqrt, Erf, Tanh, Sigmoid, Relu,
LeakyRelu, Gelu, Softmax, LogSoftmax, ReduceMean (axes as attribute or input), LayerNormalization,
BatchNormalization, Dropout (identity), Flatten, Reshape, Identity, Constant, Transpose.

Run this file to check it against every models/reference/<name>.{input,output}.npy:
    /usr/bin/python3 tests/golden/onnx_torch.py
"""
import json
import os
import sys

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import helper, numpy_helper

BN_STAT_SLOTS = (3, 4)  # BatchNormalization inputs: X, scale, B, input_mean, input_var


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model):
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise ValueError("model has no default-domain opset")


def _constant_value(node):
    a = _attrs(node)
    if "value" in a:
        return torch.from_numpy(numpy_helper.to_array(a["value"]).copy())
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    raise ValueError("Constant node '%s': unsupported value attribute %s" % (node.name, sorted(a)))


class OnnxModule(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.graph = model.graph
        self.opset = _opset(model)
        inits = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}

        # Identity chains on initializers: value name -> the initializer it is.
        alias = {name: name for name in inits}
        for node in self.graph.node:
            if node.op_type == "Identity" and node.input[0] in alias:
                alias[node.output[0]] = alias[node.input[0]]
        self.alias = alias

        # Roles: which initializers are BN statistics, which are operands (weights).
        stat_use, weight_use = set(), set()
        for node in self.graph.node:
            if node.op_type == "Identity":
                continue
            for slot, name in enumerate(node.input):
                if name not in alias:
                    continue
                src = alias[name]
                if node.op_type == "BatchNormalization" and slot in BN_STAT_SLOTS:
                    stat_use.add(src)
                elif inits[src].dtype == np.float32 and not self._is_non_weight_slot(node, slot):
                    weight_use.add(src)

        self.param_names, self.buffer_names = [], []
        self.params = nn.ParameterList()
        self.constants = {}
        for t in self.graph.initializer:
            value = torch.from_numpy(inits[t.name].copy())
            if t.name in weight_use:
                self.param_names.append(t.name)
                self.params.append(nn.Parameter(value.clone()))
            if t.name in stat_use:
                self.register_buffer("stat%d" % len(self.buffer_names), value.clone())
                self.buffer_names.append(t.name)
            if t.name not in weight_use and t.name not in stat_use:
                self.constants[t.name] = value
        # The data input: the first graph input that is not an initializer (IR < 4 lists both).
        self.input_name = next(i.name for i in self.graph.input if i.name not in inits)
        # Ends in LogSoftmax: the output already is log-probabilities (the loss is nll_loss).
        self.ends_in_log_softmax = self.graph.node[-1].op_type == "LogSoftmax"

    @staticmethod
    def _is_non_weight_slot(node, slot):
        # Float operands that are hyper-parameters rather than weights.
        return ((node.op_type == "Pow" and slot == 1) or
                (node.op_type == "Dropout" and slot >= 1) or
                (node.op_type in ("Reshape", "ReduceMean") and slot >= 1))

    @property
    def parameters_by_name(self):
        return dict(zip(self.param_names, self.params))

    @property
    def buffers_by_name(self):
        return {n: getattr(self, "stat%d" % i) for i, n in enumerate(self.buffer_names)}

    def state_by_name(self):
        """Every trainable initializer and BN statistic, by initializer name, as numpy float32."""
        out = {n: p.detach().numpy().copy() for n, p in self.parameters_by_name.items()}
        for n, b in self.buffers_by_name.items():
            out[n] = b.detach().numpy().copy()
        return out

    def forward(self, x):
        params, buffers = self.parameters_by_name, self.buffers_by_name
        env = dict(self.constants)
        env.update(params)
        env[self.input_name] = x
        for node in self.graph.node:
            ins = []
            for slot, name in enumerate(node.input):
                if name == "":
                    ins.append(None)
                elif node.op_type == "BatchNormalization" and slot in BN_STAT_SLOTS:
                    ins.append(buffers[self.alias[name]])
                else:
                    ins.append(env[name])
            outs = self._run(node, ins)
            for name, value in zip(node.output, outs):
                if name:
                    env[name] = value
        return env[self.graph.output[0].name]

    # ------------------------------------------------------------------ ops
    def _run(self, node, ins):
        op, a = node.op_type, _attrs(node)
        x = ins[0] if ins else None
        if op == "Gemm":
            if a.get("transA", 0):
                raise ValueError("Gemm '%s': transA=1 is not supported" % node.name)
            alpha, beta, trans_b = a.get("alpha", 1.0), a.get("beta", 1.0), a.get("transB", 0)
            c = ins[2] if len(ins) > 2 else None
            if alpha == 1.0 and beta == 1.0 and trans_b:
                return [F.linear(x, ins[1], c)]  # exactly nn.Linear
            y = x @ (ins[1].t() if trans_b else ins[1])
            if alpha != 1.0:
                y = y * alpha
            if c is not None:
                y = y + (c * beta if beta != 1.0 else c)
            return [y]
        if op == "MatMul":
            return [torch.matmul(x, ins[1])]
        binary = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}
        if op in binary:
            return [binary[op](x, ins[1])]
        if op == "Pow":
            e = ins[1]
            if e.numel() == 1:
                return [torch.pow(x, e.item())]
            return [torch.pow(x, e)]
        unary = {"Sqrt": torch.sqrt, "Erf": torch.erf, "Tanh": torch.tanh,
                 "Sigmoid": torch.sigmoid, "Relu": torch.relu}
        if op in unary:
            return [unary[op](x)]
        if op == "LeakyRelu":
            return [F.leaky_relu(x, a.get("alpha", 0.01))]
        if op == "Gelu":
            approximate = a.get("approximate", b"none")
            if isinstance(approximate, bytes):
                approximate = approximate.decode()
            return [F.gelu(x, approximate=approximate)]
        if op in ("Softmax", "LogSoftmax"):
            fn = F.softmax if op == "Softmax" else F.log_softmax
            if self.opset >= 13:
                return [fn(x, dim=a.get("axis", -1))]
            axis = a.get("axis", 1) % x.dim()  # opset < 13: coerce to 2-D at axis
            flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
            return [fn(flat, dim=1).reshape(x.shape)]
        if op == "ReduceMean":
            axes = a.get("axes")
            if len(ins) > 1 and ins[1] is not None:
                axes = [int(v) for v in ins[1].reshape(-1).tolist()]
            keep = bool(a.get("keepdims", 1))
            if not axes:
                if a.get("noop_with_empty_axes", 0):
                    return [x]
                axes = list(range(x.dim()))
            return [torch.mean(x, dim=list(axes), keepdim=keep)]
        if op == "LayerNormalization":
            axis = a.get("axis", -1) % x.dim()
            shape = tuple(x.shape[axis:])
            bias = ins[2] if len(ins) > 2 else None
            return [F.layer_norm(x, shape, ins[1], bias, a.get("epsilon", 1e-5))]
        if op == "BatchNormalization":
            training = bool(a.get("training_mode", 0))
            mean, var = ins[3], ins[4]
            y = F.batch_norm(x, mean, var, ins[1], ins[2], training=training,
                             momentum=1.0 - a.get("momentum", 0.9), eps=a.get("epsilon", 1e-5))
            return [y, mean, var]
        if op == "Dropout":
            return [x, torch.ones_like(x, dtype=torch.bool)]
        if op == "Flatten":
            axis = a.get("axis", 1)
            axis = axis + x.dim() if axis < 0 else axis
            return [x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)]
        if op == "Reshape":
            shape = [int(v) for v in ins[1].tolist()]
            if not a.get("allowzero", 0):
                shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
            return [x.reshape(shape)]
        if op == "Identity":
            return [x]
        if op == "Constant":
            return [_constant_value(node)]
        if op == "Transpose":
            perm = a.get("perm", list(reversed(range(x.dim()))))
            return [x.permute(*perm)]
        raise ValueError("node '%s': op %s is not supported by the golden interpreter"
                         % (node.name, op))


def load(path):
    return OnnxModule(onnx.load(path))


def check_references(root):
    """Every model with a reference: the interpreter's output equals torch's recording."""
    meta = json.load(open(os.path.join(root, "models", "metadata.json")))
    worst = 0.0
    for name, m in sorted(meta.items()):
        ref = m.get("reference")
        if not ref:
            continue
        module = load(os.path.join(root, "models", name))
        x = torch.from_numpy(np.load(os.path.join(root, "models", ref["input"])))
        want = np.load(os.path.join(root, "models", ref["output"]))
        with torch.no_grad():
            got = module(x).numpy()  # BN follows the file's training_mode, as torch recorded it
        diff = float(np.max(np.abs(got - want)))
        worst = max(worst, diff)
        print("%-32s %-5s max |diff| %.3g" % (name, ref["mode"], diff))
        assert got.shape == want.shape and diff <= 1e-5, name
    print("worst %.3g over all references" % worst)
    return worst


if __name__ == "__main__":
    torch.set_num_threads(1)
    check_references(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
