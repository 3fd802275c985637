"""pipeshard from Python: load an ONNX MLP, partition it, and train it on NumPy arrays.

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

from ._pipeshard import Evaluation, Model, Plan, Step, TrainResult, load

# -- PyTorch in and out (_load.py, _torch.py): load() also of an onnx.ModelProto,
# from_torch(module, example_input), and .to_torch(module) on a Model and a TrainResult.
from ._load import load  # noqa: F811  (wraps _pipeshard.load)
from ._torch import from_torch, model_to_torch, result_to_torch

Model.to_torch = model_to_torch
TrainResult.to_torch = result_to_torch
# -- end of PyTorch in and out

__all__ = ["load", "train", "from_torch", "Model", "Plan", "TrainResult", "Step", "Evaluation"]

# train's keywords: the flag each stands for, and the Python type it takes. None (the
# default of every keyword) leaves the flag out, so that train's own default applies.
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
    "on_nonfinite": ("--on-nonfinite", str),
    "keep_activations": ("--keep-activations", bool),
}


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
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [flag, repr(float(value))]
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return [flag, str(value)]
    if kind is str and isinstance(value, str):
        return [flag, value]
    raise TypeError(f"{name} must be {kind.__name__}, not {type(value).__name__}")


def train(model, X, y, *, eval=None, verbose=False, **options):
    """Trains `model` (a pipeshard.Model) on X (float32 [N, ...]) and y (int64/int32 class
    ids [N] for cross-entropy, float32 targets for loss="mse") in this process, as
    `train model --data X --labels y` would, bit for bit. Returns a TrainResult: .history
    (a Step per optimizer step: step, epoch, loss, lr, samples_per_s), .eval (an
    Evaluation per epoch when eval=(X_eval, y_eval) is given) and .model (the trained
    Model: .save(path), .weights()).

    Keywords (train's flags, with its defaults when left out): loss, optimizer, lr,
    momentum, nesterov, betas, eps, weight_decay, lr_schedule, warmup_steps,
    clip_grad_norm, batch_size, grad_accum, steps or epochs, shuffle, seed, on_nonfinite,
    keep_activations. verbose=True prints train's progress lines on stderr.

    The arrays are read in place: they must be C-contiguous (TypeError otherwise: pass
    np.ascontiguousarray(X)). ValueError: bad data or options, with train's message."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a pipeshard.Model (pipeshard.load), not {type(model).__name__}")
    flags = []
    for name, value in options.items():
        if name not in _TRAIN_FLAGS:
            raise TypeError(f"train() got an unexpected keyword argument '{name}'")
        if value is not None:
            flags += _flag_words(name, value)
    eval_X = eval_y = None
    if eval is not None:
        if not (isinstance(eval, (tuple, list)) and len(eval) == 2):
            raise TypeError("eval must be a pair (X_eval, y_eval)")
        eval_X, eval_y = eval
    return _pipeshard._train(model, X, y, eval_X, eval_y, flags, verbose)


from . import _pipeshard  # noqa: E402  (train's binding, after the public names)
