#!/usr/bin/python3
"""Bring your own PyTorch model (README.md, "Bring your own PyTorch model"), in two halves
around one `train` run:

    /usr/bin/python3 docs/examples/own_model.py export DIR [--opset N] [--eval-mode]
    build/bin/train DIR/model.onnx --data DIR/features.npy --labels DIR/labels.npy \\
        --eval-data DIR/eval_features.npy --eval-labels DIR/eval_labels.npy --save DIR/trained.onnx ...
    /usr/bin/python3 docs/examples/own_model.py load DIR

export: defines an MLP with LayerNorm and Dropout (OwnMLP below), exports it with
torch.onnx.export in training mode (Dropout kept; --eval-mode exports in eval mode, torch's
default, and Dropout is gone) at batch 1, and writes synthetic data: features float32 [N, 20],
labels int64 [N] (cross-entropy) and targets float32 [N, 4] (--loss mse), and an eval set.
The module's initial weights go to DIR/initial.pt.

load: reads DIR/trained.onnx back into a fresh OwnMLP by initializer name (onnx's
numpy_helper), checks that every parameter was found with its shape and that training
changed it, and prints the eval set's loss and accuracy in eval mode, which are the numbers
`train` printed for its last epoch.

Needs torch, numpy and onnx: Debian's python3-torch and python3-onnx (torch 1.13, onnx 1.12).
"""
import argparse
import os
import sys

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper

FEATURES, HIDDEN, CLASSES = 20, 64, 4
TRAIN_SAMPLES, EVAL_SAMPLES = 512, 256


class OwnMLP(nn.Module):
    """Linear(20, 64), LayerNorm, ReLU, Dropout(0.1), Linear(64, 4): logits for 4 classes."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)  # weight [64, 20], bias [64]
        self.norm = nn.LayerNorm(HIDDEN)        # weight [64], bias [64]
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)   # weight [4, 64], bias [4]

    def forward(self, x):  # x [batch, 20] -> logits [batch, 4]
        return self.fc2(self.drop(F.relu(self.norm(self.fc1(x)))))


def synthetic_data(samples, generator, teacher):
    """features float32 [samples, 20]; labels int64 [samples], the argmax of a fixed linear map
    of the features; targets float32 [samples, 4], that map's values (for --loss mse)."""
    x = torch.randn(samples, FEATURES, generator=generator)
    y = x @ teacher  # [samples, 4]
    return x.numpy().astype(np.float32), y.argmax(dim=1).numpy().astype(np.int64), y.numpy().astype(np.float32)


def export(args):
    os.makedirs(args.dir, exist_ok=True)
    torch.manual_seed(0)
    model = OwnMLP()
    torch.save(model.state_dict(), os.path.join(args.dir, "initial.pt"))
    path = os.path.join(args.dir, "model.onnx")
    mode = torch.onnx.TrainingMode.EVAL if args.eval_mode else torch.onnx.TrainingMode.TRAINING
    model.train(not args.eval_mode)
    # The batch size of the example input does not matter: train reads the batch from --batch-size.
    torch.onnx.export(model, torch.zeros(1, FEATURES), path, opset_version=args.opset, training=mode,
                      do_constant_folding=args.eval_mode, input_names=["x"], output_names=["logits"])
    ops = " ".join(n.op_type for n in onnx.load(path).graph.node)
    print(f"wrote {path}: opset {args.opset}, {'eval' if args.eval_mode else 'training'}-mode export, nodes: {ops}")

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    for prefix, samples in (("", TRAIN_SAMPLES), ("eval_", EVAL_SAMPLES)):
        x, labels, targets = synthetic_data(samples, g, teacher)
        np.save(os.path.join(args.dir, prefix + "features.npy"), x)       # float32 [N, 20]
        np.save(os.path.join(args.dir, prefix + "labels.npy"), labels)    # int64 [N], class ids 0..3
        np.save(os.path.join(args.dir, prefix + "targets.npy"), targets)  # float32 [N, 4], for --loss mse
    print(f"wrote {TRAIN_SAMPLES} training and {EVAL_SAMPLES} eval samples to {args.dir}/: "
          "features.npy float32 [N, 20], labels.npy int64 [N], targets.npy float32 [N, 4]")


def load(args):
    trained = onnx.load(os.path.join(args.dir, args.model))  # external data beside it is read too
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in trained.graph.initializer}
    model = OwnMLP()
    # Parameters and buffers by name, as state_dict() names them. A buffer the export leaves
    # out (BatchNorm's num_batches_tracked) keeps its value; every parameter must be there.
    state = {name: weights[name] for name in model.state_dict() if name in weights}
    missing = [name for name, _ in model.named_parameters() if name not in state]
    if missing:
        sys.exit(f"own_model.py: {args.model} has no initializer {', '.join(missing)}")
    model.load_state_dict(state, strict=False)  # checks the shapes

    initial = torch.load(os.path.join(args.dir, "initial.pt"))
    unchanged = [name for name in state if torch.equal(state[name], initial[name])]
    if unchanged:
        sys.exit(f"own_model.py: training changed no value of {', '.join(unchanged)}")
    print(f"loaded {len(state)} tensors by name from {args.model}: {' '.join(state)} (each changed by training)")

    model.eval()  # Dropout off, as train evaluates
    x = torch.from_numpy(np.load(os.path.join(args.dir, "eval_features.npy")))
    labels = torch.from_numpy(np.load(os.path.join(args.dir, "eval_labels.npy")))
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits, labels).item()
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    print(f"PyTorch on the eval set: loss {loss:.4f}  accuracy {100 * accuracy:.1f}%")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export OwnMLP to DIR/model.onnx and write the data")
    e.add_argument("dir")
    e.add_argument("--opset", type=int, default=17, help="ONNX opset to export (default 17, torch 1.13's newest)")
    e.add_argument("--eval-mode", action="store_true", help="export in eval mode: Dropout is left out")
    ld = sub.add_parser("load", help="read DIR/trained.onnx back into OwnMLP and evaluate it")
    ld.add_argument("dir")
    ld.add_argument("--model", default="trained.onnx", help="file in DIR that train --save wrote")
    args = parser.parse_args()
    if args.command == "export":
        export(args)
    else:
        load(args)


if __name__ == "__main__":
    main()
