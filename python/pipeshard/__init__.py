"""pipeshard from Python: load an ONNX MLP, partition it, and train it on NumPy arrays,
in one process or across the processes of `mpirun -np N /usr/bin/python3 script.py`.

    import numpy as np, pipeshard
    m = pipeshard.load("models/simple_digits.onnx")
    print(m.partition(stages=2).table())
    result = pipeshard.train(m, X, y, optimizer="adamw", epochs=3)
    result.model.save("trained.onnx")

The work is the C++ libraries' that the `partition` and `train` tools run (the module
_pipeshard binds them), so a run here is the tool's, bit for bit. Arrays are read where
they lie, never copied: C-contiguous float32 features, int64/int32 labels or float32
targets. Bad input raises ValueError with the tool's one-line message; arguments of the
wrong type raise TypeError.
"""

import os
import sys
import textwrap

from ._pipeshard import Evaluation, Model, Plan, Step, TrainResult
from . import _pipeshard
from ._load import load  # _pipeshard.load, and of an onnx.ModelProto too
from ._torch import from_torch, model_to_torch, result_to_torch

# PyTorch in and out (_torch.py): .to_torch(module) on a Model and a TrainResult.
Model.to_torch = model_to_torch
TrainResult.to_torch = result_to_torch

__all__ = [
    "load",
    "train",
    "check_equivalence",
    "from_torch",
    "rank",
    "world_size",
    "Model",
    "Plan",
    "TrainResult",
    "Step",
    "Evaluation",
]

# train's keywords: the flag each stands for, and the Python type it takes ("path": str or
# os.PathLike; "scale": a power of two or "dynamic"/"none"). None (the default of every
# keyword) leaves the flag out, so that train's own default applies. Every flag of
# `train --help` but the data's, --check-equivalence (pipeshard.check_equivalence) and
# --help has one (tests/python/test_train_options.py).
_TRAIN_FLAGS = {
    "loss": ("--loss", str),
    "optimizer": ("--optimizer", str),
    "lr": ("--lr", float),
    "momentum": ("--momentum", float),
    "nesterov": ("--nesterov", bool),
    "betas": ("--betas", tuple),
    "eps": ("--eps", float),
    "weight_decay": ("--weight-decay", float),
    "lr_schedule": ("--lr-schedule", str),
    "warmup_steps": ("--warmup-steps", int),
    "clip_grad_norm": ("--clip-grad-norm", float),
    "batch_size": ("--batch-size", int),
    "grad_accum": ("--grad-accum", int),
    "steps": ("--steps", int),
    "epochs": ("--epochs", int),
    "shuffle": ("--no-shuffle", bool),  # shuffle=False is --no-shuffle
    "seed": ("--seed", int),
    "metrics": ("--metrics", "path"),
    "save": ("--save", "path"),
    "checkpoint": ("--checkpoint", "path"),
    "checkpoint_every": ("--checkpoint-every", int),
    "resume": ("--resume", "path"),
    "device": ("--device", str),
    "precision": ("--precision", str),
    "gpu_comm": ("--gpu-comm", str),
    "stages": ("--stages", int),
    "tensor_parallel": ("--tensor-parallel", int),
    "micro_batches": ("--micro-batches", int),
    "schedule": ("--schedule", str),
    "virtual_stages": ("--virtual-stages", int),
    "balance": ("--balance", str),
    "trace": ("--trace", "path"),
    "tensorboard": ("--tensorboard", "path"),
    "plot": ("--plot", "path"),
    "bucket_mb": ("--bucket-mb", float),
    "zero": ("--zero", int),
    "comm_timeout": ("--comm-timeout", float),
    "loss_scale": ("--loss-scale", "scale"),
    "on_nonfinite": ("--on-nonfinite", str),
    "cuda_graph": ("--cuda-graph", bool),
    "keep_activations": ("--keep-activations", bool),
    "sync_batchnorm": ("--sync-batchnorm", bool),
    "layout": ("--layout", str),
    "profile": ("--profile", "path"),
}

_KIND_NAMES = {"path": "a path (str or os.PathLike)", "scale": "'dynamic', 'none' or a power of two like 1024"}


def _flag_words(name, value):
    flag, kind = _TRAIN_FLAGS[name]
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, not {type(value).__name__}")
        wanted = not value if name == "shuffle" else value
        return [flag] if wanted else []
    if kind is tuple:  # betas=(b1, b2)
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise TypeError(f"{name} must be a pair of numbers like (0.9, 0.999)")
        return [flag, ",".join(repr(float(v)) for v in value)]
    if kind == "path" and isinstance(value, (str, os.PathLike)):
        return [flag, os.fspath(value)]
    if kind == "scale" and (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
        return [flag, str(value)]
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [flag, repr(float(value))]
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return [flag, str(value)]
    if kind is str and isinstance(value, str):
        return [flag, value]
    wanted = _KIND_NAMES.get(kind) or kind.__name__
    raise TypeError(f"{name} must be {wanted}, not {type(value).__name__}")


def _flags(options):
    flags = []
    for name, value in options.items():
        if name not in _TRAIN_FLAGS:
            raise TypeError(f"got an unexpected keyword argument '{name}'")
        if value is not None:
            flags += _flag_words(name, value)
    return flags


def _check_model(model):
    if not isinstance(model, Model):
        raise TypeError(f"model must be a pipeshard.Model (pipeshard.load), not {type(model).__name__}")


def _progress_bar(callback):
    """A callback drawing tqdm's bar on stderr (rank 0 calls it), then calling `callback`;
    and the function that closes the bar. None when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = None

    def on_step(step):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=step.total_steps, initial=step.step - 1, unit="step", file=sys.stderr, leave=True)
        bar.update(1)
        bar.set_postfix_str(f"epoch {step.epoch}, loss {step.loss:.4f}", refresh=False)
        if callback is not None:
            callback(step)

    def close():
        if bar is not None:
            bar.close()

    return on_step, close


def train(model, X, y, *, eval=None, callback=None, progress=None, verbose=False, **options):
    _check_model(model)
    flags = _flags(options)
    eval_X = eval_y = None
    if eval is not None:
        if not (isinstance(eval, (tuple, list)) and len(eval) == 2):
            raise TypeError("eval must be a pair (X_eval, y_eval)")
        eval_X, eval_y = eval
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable, not {type(callback).__name__}")
    if progress is None:  # interactive: a terminal on stderr, rank 0 of the job
        progress = sys.stderr.isatty() and not verbose
    close = None
    if progress and not verbose:
        bar = _progress_bar(callback)
        if bar is None:
            verbose = True  # no tqdm: train's own progress line
        else:
            callback, close = bar
    try:
        return _pipeshard._train(model, X, y, eval_X, eval_y, flags, verbose, callback)
    finally:
        if close is not None:
            close()


def check_equivalence(model, X, y, steps=10, **options):
    """Trains `steps` steps in the layout the keywords give (stages, tensor_parallel,
    micro_batches, ...; under mpirun, the job's processes) and in one process on the same
    data, prints the largest loss and weight difference and the tensor furthest from the
    reference on stderr, as `train --check-equivalence steps` does, and returns True when
    they agree to float rounding, False when they do not. Keywords: pipeshard.train's,
    without outputs (save, metrics, trace, checkpoint, tensorboard, resume, plot) and
    eval. ValueError: bad data or options, with train's message."""
    _check_model(model)
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise TypeError(f"steps must be int, not {type(steps).__name__}")
    return _pipeshard._check_equivalence(model, X, y, _flags(options) + ["--check-equivalence", str(steps)])


def rank():
    """This process's rank in the mpirun job (0 without mpirun)."""
    return _pipeshard._place_in_job()[0]


def world_size():
    """The number of processes in the mpirun job (1 without mpirun)."""
    return _pipeshard._place_in_job()[1]


def _keyword_lines():
    """One line per keyword: its name, its type, and train --help's text for its flag."""
    described = dict(_pipeshard._train_flags())
    lines = []
    for name, (flag, kind) in _TRAIN_FLAGS.items():
        text = described[flag]
        if name == "shuffle":
            text = "False: take batches in the arrays' order (--no-shuffle; default True)"
        kind_name = {"path": "path", "scale": "str|int"}.get(kind) or kind.__name__
        lines.append(textwrap.fill(f"{name} ({kind_name}): {text}", 100, initial_indent="    ",
                                   subsequent_indent="        "))
    return "\n".join(lines)


_TRAIN_DOC = """Trains `model` (a pipeshard.Model) on X and y as `train model --data X --labels y`
would, bit for bit, and returns a TrainResult, the same on every rank:
  .history  a Step per optimizer step (step, epoch, total_steps, loss, lr, samples_per_s, skipped)
  .eval     an Evaluation per epoch when eval=(X_eval, y_eval) is given (loss, accuracy)
  .model    the trained Model (.save(path), .weights())
  .layout, .predicted_step_ms  with layout="auto": the planner's choice and its predicted
            ms per step (None otherwise); model.plan_layouts(N) lists every layout it weighed

Under `mpirun -np N /usr/bin/python3 script.py`, every rank makes the same call with the
same arrays (or the same memory-mapped file, np.load(path, mmap_mode="r")), and the run is
train's in that layout: N = stages x tensor_parallel x data-parallel replicas.

Arguments:
    X: float32 features [N, ...], C-contiguous, read in place (TypeError otherwise: pass
       np.ascontiguousarray(X)).
    y: int64/int32 class ids [N] (loss="cross-entropy", the default) or float32 targets
       (loss="mse"), read in place.
    eval: (X_eval, y_eval), evaluated after each epoch.
    callback: called on rank 0 with each Step. If it raises, the run stops (in one process
       after that step, under mpirun after the next, as Ctrl-C would: a checkpoint when
       checkpoint= is given) and train raises what it raised; the other ranks raise
       RuntimeError. Under mpirun the other ranks wait for it in the next step: one slower
       than comm_timeout (default 60 s) ends the job, so keep it quick (or comm_timeout=0).
    progress: a progress bar on stderr (tqdm's, or train's own line without tqdm). Default:
       when stderr is a terminal, i.e. interactive use; scripts stay silent.
    verbose: True prints train's lines on stderr (what it trains, progress, the summary).

Keywords (train's flags by the same names, with its defaults when left out or None):
{keywords}

Ctrl-C stops the run after the step in progress, writes a checkpoint when checkpoint= is
given, and raises KeyboardInterrupt (under mpirun, SIGTERM: SystemExit(143)).
ValueError: bad data or options, with train's one-line message; nothing is written.
TypeError: an argument of the wrong type."""

train.__doc__ = _TRAIN_DOC.format(keywords=_keyword_lines())  # the keywords as train --help says them
