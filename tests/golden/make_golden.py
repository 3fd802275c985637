#!/usr/bin/python3
"""Golden training fixtures: what PyTorch does, step by step, for pipeshard's `train` to match.

For every case in CASES below this script trains models/<model>.onnx with PyTorch, through
tests/golden/onnx_torch.py (an ONNX interpreter built from torch ops, sharing no code with
pipeshard) and torch.optim, in float32 on one thread, and writes

  tests/golden/<case>/case.json      {"model", "data", "labels": repo-relative paths,
                                      "args": the train flags (without --metrics/--save),
                                      "losses": per optimizer step, from its forward pass,
                                      "lrs": the learning rate each step used,
                                      "weights": {initializer name: repo-relative .npy},
                                      "resume_from_step": N (resume cases only),
                                      "float64_drift": how far float32 rounding alone moves
                                      this case (see drift_float64), "description"}
  tests/golden/<case>/weights/*.npy  the trained value of every trainable initializer and
                                      BatchNorm running statistic, in the file's layout; the
                                      file name is the initializer name with characters outside
                                      [A-Za-z0-9._-] replaced by '_' (case.json keeps the name)
  tests/golden/<case>/{x,y}.npy      synthetic data, for the cases that are not on digits

tests/golden/golden_test.cc runs build/bin/train with each case's flags and compares its metrics
(losses, learning rates) and saved model (weights) with these files.

What the reference does per optimizer step t = 1..S (the train contract):
  * takes K = --grad-accum consecutive batches of B = --batch-size samples in file order
    (--no-shuffle): batch g covers samples [b*B, (b+1)*B) with b = g mod floor(N/B), an
    incomplete last batch is dropped and each epoch restarts at sample 0; the K batches form
    ONE batch of K*B samples (loss = mean over them);
  * loss = F.cross_entropy on the logits, F.nll_loss when the model ends in LogSoftmax, or
    F.mse_loss; backward; torch.nn.utils.clip_grad_norm_ when --clip-grad-norm is given;
  * sets param_group['lr'] = lr * f(t) (constant / linear warmup / warmup + cosine) and calls
    optimizer.step() (torch.optim.SGD/Adam/AdamW, single-tensor implementation).

How to regenerate (from the repo root):
    /usr/bin/python3 tests/golden/make_golden.py            # writes every case (seconds)
    /usr/bin/python3 tests/golden/make_golden.py --check    # first checks the interpreter
                                                            # against models/reference
PyTorch (1.13), onnx and numpy are needed only to regenerate; building and running the test
needs none of them: the fixtures are checked in.
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import onnx
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True  # keep tests/golden free of __pycache__
sys.path.insert(0, HERE)
import onnx_torch  # noqa: E402

DIGITS_X, DIGITS_Y = "data/digits_features.npy", "data/digits_labels.npy"


# ----------------------------------------------------------------------------- synthetic data
def classification_data(seed, samples, features, classes, scale=1.0, shift=0.0):
    """x ~ N(shift, scale^2), y = argmax of a fixed random linear map of x."""
    rng = np.random.RandomState(seed)
    x = (rng.randn(samples, features) * scale + shift).astype(np.float32)
    w = rng.randn(features, classes)
    y = np.argmax((x - shift) @ w, axis=1).astype(np.int64)
    return x, y


def regression_data(seed, samples, features, outputs):
    """x ~ N(0, 1), targets = a fixed random nonlinear function of x."""
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, features).astype(np.float32)
    a = rng.randn(features, 32) / math.sqrt(features)
    b = rng.randn(32, outputs) / math.sqrt(32)
    y = (np.tanh(x @ a) @ b + 0.1 * np.sin(x[:, :outputs])).astype(np.float32)
    return x, y


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    description: str
    model: str                      # repo-relative .onnx
    optimizer: str                  # sgd | adam | adamw
    lr: float
    batch_size: int
    steps: int                      # optimizer steps in all
    loss: str = "cross-entropy"     # cross-entropy | mse
    momentum: Optional[float] = None
    nesterov: bool = False
    weight_decay: Optional[float] = None   # None: the optimizer's default (not passed)
    betas: Optional[tuple] = None   # None: (0.9, 0.999) (not passed)
    eps: Optional[float] = None     # None: 1e-8 (not passed)
    epochs: Optional[int] = None    # given: pass --epochs (= steps / batches per epoch)
    grad_accum: int = 1
    schedule: Optional[str] = None  # None: constant (not passed)
    warmup_steps: int = 0
    clip_grad_norm: Optional[float] = None
    resume_from_step: Optional[int] = None
    data: str = DIGITS_X            # repo-relative, or "x.npy"/"y.npy" in the case folder
    labels: str = DIGITS_Y
    synthetic: Optional[Callable] = None   # () -> (x, y), written to the case folder

    def args(self):
        """The train flags, in one canonical order."""
        a = ["--loss", self.loss, "--optimizer", self.optimizer, "--lr", repr(self.lr)]
        if self.momentum is not None:
            a += ["--momentum", repr(self.momentum)]
        if self.nesterov:
            a += ["--nesterov"]
        if self.betas is not None:
            a += ["--betas", "%r,%r" % self.betas]
        if self.eps is not None:
            a += ["--eps", repr(self.eps)]
        if self.weight_decay is not None:
            a += ["--weight-decay", repr(self.weight_decay)]
        a += ["--batch-size", str(self.batch_size)]
        if self.epochs is not None:
            a += ["--epochs", str(self.epochs)]
        else:
            a += ["--steps", str(self.steps)]
        a += ["--no-shuffle"]
        if self.grad_accum != 1:
            a += ["--grad-accum", str(self.grad_accum)]
        if self.schedule is not None:
            a += ["--lr-schedule", self.schedule]
        if self.warmup_steps:
            a += ["--warmup-steps", str(self.warmup_steps)]
        if self.clip_grad_norm is not None:
            a += ["--clip-grad-norm", repr(self.clip_grad_norm)]
        return a


DIGITS_MODEL = "models/simple_digits.onnx"
CASES = [
    Case("course_sgd", "SGD with momentum on digits; 30 steps of 64 cross the epoch boundary "
         "(1797 samples = 28 full batches, the last 5 samples dropped)",
         DIGITS_MODEL, "sgd", 0.05, 64, 30, momentum=0.9),
    Case("course_adamw", "AdamW on digits, explicit weight decay, across the epoch boundary",
         DIGITS_MODEL, "adamw", 0.002, 64, 30, weight_decay=0.01),
    Case("course_grad_accum", "course_sgd as 2 accumulated batches of 32 per step: the same "
         "samples as one batch of 64, so the same losses and weights as course_sgd",
         DIGITS_MODEL, "sgd", 0.05, 32, 30, momentum=0.9, grad_accum=2),
    Case("gelu_layernorm", "Adam through decomposed LayerNorm (ReduceMean/Pow/Sqrt/Div) and "
         "erf GELU, opset 18; synthetic data, 12 batches per epoch",
         "models/layernorm_opset18.onnx", "adam", 0.01, 32, 20,
         data="x.npy", labels="y.npy",
         synthetic=lambda: classification_data(1001, 384, 16, 10)),
    Case("residual", "Nesterov SGD with weight decay through a residual Add, on digits",
         "models/residual.onnx", "sgd", 0.05, 64, 20, momentum=0.9, nesterov=True,
         weight_decay=1e-4),
    Case("mse_regression", "Adam on mean squared error, float32 targets [512, 10]",
         "models/simple.onnx", "adam", 0.001, 64, 20, loss="mse",
         data="x.npy", labels="y.npy", synthetic=lambda: regression_data(1002, 512, 100, 10)),
    Case("batchnorm_train", "BatchNorm with training_mode=1: batch statistics, running "
         "statistics updated with momentum 1 - 0.9 and the unbiased variance; 256 samples = 8 "
         "batches per epoch",
         "models/batchnorm_train.onnx", "sgd", 0.1, 32, 15, momentum=0.9,
         data="x.npy", labels="y.npy",
         synthetic=lambda: classification_data(1003, 256, 16, 10, scale=2.0, shift=0.5)),
    Case("logsoftmax_nll", "the model ends in LogSoftmax, so the loss is nll_loss of its "
         "output; 300 samples = 4 batches of 64 per epoch, 44 dropped",
         "models/logsoftmax.onnx", "sgd", 0.1, 64, 15,
         data="x.npy", labels="y.npy", synthetic=lambda: classification_data(1004, 300, 32, 10)),
    Case("schedule_clip", "5 warmup steps then cosine decay to 0 at step 20, gradients clipped "
         "to total norm 0.3 (torch's norms here are 0.24-0.37: some steps clip, some do not)",
         DIGITS_MODEL, "sgd", 0.1, 64, 20, momentum=0.9, schedule="cosine", warmup_steps=5,
         clip_grad_norm=0.3),
    Case("adam_options", "Adam with every option given: --betas, --eps, (L2) --weight-decay, "
         "--lr-schedule warmup (linear for 4 steps, then constant), --epochs 2 (260 samples = 8 "
         "batches of 32 per epoch, 4 dropped); LeakyRelu, Sigmoid and Tanh",
         "models/activations.onnx", "adam", 0.005, 32, 16, betas=(0.8, 0.99), eps=1e-6,
         weight_decay=1e-3, schedule="warmup", warmup_steps=4, epochs=2,
         data="x.npy", labels="y.npy", synthetic=lambda: classification_data(1005, 260, 32, 10)),
    Case("resume_sgd", "10 uninterrupted steps; the test runs 5 with a checkpoint, then resumes "
         "to 10", DIGITS_MODEL, "sgd", 0.05, 64, 10, momentum=0.9, resume_from_step=5),
    Case("resume_adamw", "as resume_sgd with AdamW (default weight decay 0.01): the moments and "
         "step count must survive the checkpoint",
         DIGITS_MODEL, "adamw", 0.002, 64, 10, resume_from_step=5),
]


# ----------------------------------------------------------------------------- training
def lr_factor(case, t):
    """f(t) of the contract, for optimizer step t (1-based)."""
    w = case.warmup_steps
    if w > 0 and t <= w:
        return t / w
    if case.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (t - w) / (case.steps - w)))
    return 1.0


def make_optimizer(case, params):
    betas, eps = case.betas or (0.9, 0.999), 1e-8 if case.eps is None else case.eps
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=case.momentum or 0.0, dampening=0.0,
                               nesterov=case.nesterov, weight_decay=case.weight_decay or 0.0,
                               foreach=False)
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=case.lr, betas=betas, eps=eps,
                                weight_decay=case.weight_decay or 0.0, foreach=False)
    if case.optimizer == "adamw":
        wd = 0.01 if case.weight_decay is None else case.weight_decay
        return torch.optim.AdamW(params, lr=case.lr, betas=betas, eps=eps,
                                 weight_decay=wd, foreach=False)
    raise ValueError(case.optimizer)


def step_indices(case, samples, t):
    """Sample indices of optimizer step t: K consecutive batches of B in file order."""
    b, k = case.batch_size, case.grad_accum
    per_epoch = samples // b
    idx = []
    for g in range((t - 1) * k, t * k):
        start = (g % per_epoch) * b
        idx.extend(range(start, start + b))
    return idx


def train(case, x, y, dtype=torch.float32):
    """Runs the case; returns (losses, lrs, {initializer name: trained numpy array})."""
    module = onnx_torch.OnnxModule(onnx.load(os.path.join(ROOT, case.model))).to(dtype)
    params = list(module.params)
    opt = make_optimizer(case, params)
    x = torch.from_numpy(x).to(dtype)
    y = torch.from_numpy(y)
    if case.loss == "mse":
        y = y.to(dtype)
    losses, lrs = [], []
    for t in range(1, case.steps + 1):
        idx = torch.tensor(step_indices(case, x.shape[0], t))
        xb, yb = x[idx], y[idx]
        opt.zero_grad(set_to_none=True)
        out = module(xb)
        if case.loss == "mse":
            loss = F.mse_loss(out, yb)
        elif module.ends_in_log_softmax:
            loss = F.nll_loss(out, yb)
        else:
            loss = F.cross_entropy(out, yb)
        loss.backward()
        if case.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, case.clip_grad_norm)
        lr = case.lr * lr_factor(case, t)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(float(loss.item()))
        lrs.append(lr)
    return losses, lrs, module.state_by_name()


# ----------------------------------------------------------------------------- writing
def safe_file_name(name):
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".npy"


def load_data(case):
    if case.synthetic is None:
        return np.load(os.path.join(ROOT, case.data)), np.load(os.path.join(ROOT, case.labels))
    return case.synthetic()


def write_case(case):
    folder = os.path.join(HERE, case.name)
    rel = os.path.relpath(folder, ROOT)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(os.path.join(folder, "weights"))
    x, y = load_data(case)
    if case.epochs is not None:  # --epochs E means E passes of floor(N/B) batches
        assert case.grad_accum == 1 and case.steps == case.epochs * (len(x) // case.batch_size)
    data, labels = case.data, case.labels
    if case.synthetic is not None:
        np.save(os.path.join(folder, case.data), x)
        np.save(os.path.join(folder, case.labels), y)
        data, labels = rel + "/" + case.data, rel + "/" + case.labels
    losses, lrs, state = train(case, x, y)
    loss_drift, weight_drift = drift_float64(case, x, y, losses, state)
    weights, used = {}, set()
    for name, value in state.items():
        file_name = safe_file_name(name)
        if file_name in used:
            raise ValueError("%s: two initializers map to %s" % (case.name, file_name))
        used.add(file_name)
        assert value.dtype == np.float32
        np.save(os.path.join(folder, "weights", file_name), value)
        weights[name] = rel + "/weights/" + file_name
    doc = {"description": case.description, "model": case.model, "data": data, "labels": labels,
           "args": case.args(), "losses": losses, "lrs": lrs, "weights": weights}
    if case.resume_from_step is not None:
        doc["resume_from_step"] = case.resume_from_step
    doc["float64_drift"] = {"loss_rel": loss_drift, "weights": weight_drift}
    with open(os.path.join(folder, "case.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return losses, loss_drift, weight_drift


def drift_float64(case, x, y, l32, w32):
    """How far float32 rounding alone moves this case: the float32 run (l32, w32) against a
    float64 run of the same case, as (the worst relative loss difference, the worst over all
    tensors of max|w32 - w64| / max(1, max|w64|)) -- the measures golden_test.cc applies. An
    independent, faithful float32 implementation lands about this far from torch."""
    l64, _, w64 = train(case, x, y, torch.float64)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(l32, l64))
    weight = max(float(np.max(np.abs(w32[n] - w64[n]))) / max(1.0, float(np.max(np.abs(w64[n]))))
                 for n in w32)
    return loss_rel, weight


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="first check the interpreter against models/reference")
    parser.add_argument("cases", nargs="*", help="only these cases (default: all)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if opts.check:
        onnx_torch.check_references(ROOT)
    chosen = [c for c in CASES if not opts.cases or c.name in opts.cases]
    for case in chosen:
        losses, loss_drift, weight_drift = write_case(case)
        print("%-18s %2d steps  loss %.6f -> %.6f   float64 drift: loss %.2g rel, weights %.2g"
              % (case.name, case.steps, losses[0], losses[-1], loss_drift, weight_drift))
    total = sum(os.path.getsize(os.path.join(d, f)) for c in CASES
                for d, _, files in os.walk(os.path.join(HERE, c.name)) for f in files)
    print("fixtures: %.2f MB" % (total / 1e6))


if __name__ == "__main__":
    main()
