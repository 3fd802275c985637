# Bad input to pipeshard.train: ValueError with train's own one-line message (the array's
# name where train names its file), TypeError for the wrong Python types and layouts.
import numpy as np
import pytest

import pipeshard
from conftest import SOURCE, run_tool, tool_error

MODEL = SOURCE / "models" / "simple_digits.onnx"  # 64 features, 10 classes


def digits():
    return np.load(SOURCE / "data" / "digits_features.npy"), np.load(SOURCE / "data" / "digits_labels.npy")


def cli_message(tmp_path, X, y, *flags):
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", y)
    line = tool_error(run_tool("train", MODEL, "--data", tmp_path / "x.npy", "--labels", tmp_path / "y.npy", *flags))
    return line.replace(str(tmp_path / "x.npy"), "X").replace(str(tmp_path / "y.npy"), "y")


def python_message(X, y, **options):
    with pytest.raises(ValueError) as raised:
        pipeshard.train(pipeshard.load(MODEL), X, y, **options)
    return str(raised.value)


def test_wrong_dtype(tmp_path):
    X, y = digits()
    Xi = X.astype(np.int64)
    assert python_message(Xi, y) == cli_message(tmp_path, Xi, y)
    yf = y.astype(np.float32)
    assert python_message(X, yf) == cli_message(tmp_path, X, yf)
    with pytest.raises(TypeError, match="float64"):
        pipeshard.train(pipeshard.load(MODEL), X.astype(np.float64), y)


def test_wrong_shape(tmp_path):
    X, y = digits()
    assert python_message(X[:, :63].copy(), y) == cli_message(tmp_path, X[:, :63], y)
    assert python_message(X, y[:-1].copy()) == cli_message(tmp_path, X, y[:-1])


def test_nan_and_bad_labels(tmp_path):
    X, y = digits()
    X = X.copy()
    X[12, 3] = np.nan
    assert python_message(X, y) == cli_message(tmp_path, X, y)
    X, y = digits()
    y = y.copy()
    y[5] = 10
    assert python_message(X, y) == cli_message(tmp_path, X, y)


@pytest.mark.parametrize(
    "options,flags",
    [
        ({"lr": -1.0}, ["--lr", "-1.0"]),
        ({"optimizer": "lamb"}, ["--optimizer", "lamb"]),
        ({"optimizer": "adam", "momentum": 0.9}, ["--optimizer", "adam", "--momentum", "0.9"]),
        ({"batch_size": 5000}, ["--batch-size", "5000"]),
        ({"steps": 1, "epochs": 1}, ["--steps", "1", "--epochs", "1"]),
    ],
)
def test_bad_options(tmp_path, options, flags):
    X, y = digits()
    assert python_message(X, y, **options) == cli_message(tmp_path, X, y, *flags)


def test_wrong_types():
    X, y = digits()
    m = pipeshard.load(MODEL)
    with pytest.raises(TypeError, match="ascontiguousarray"):
        pipeshard.train(m, np.asfortranarray(X), y)
    with pytest.raises(TypeError, match="numpy array"):
        pipeshard.train(m, X.tolist(), y)
    with pytest.raises(TypeError, match="lr"):
        pipeshard.train(m, X, y, lr="fast")
    with pytest.raises(TypeError, match="unexpected keyword"):
        pipeshard.train(m, X, y, learning_rate=0.1)
