# pipeshard.train is train's run, bit for bit: the golden fixtures (tests/golden/) trained
# by both give the same loss and learning rate at every step and the same weights.
import json

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

import pipeshard
from conftest import GOLDEN_CASES as CASES, SOURCE, keywords, run_tool


@pytest.mark.parametrize("case", CASES)
def test_same_as_train_bit_for_bit(case, tmp_path):
    fixture = json.loads((SOURCE / "tests" / "golden" / case / "case.json").read_text())
    model, data, labels = (SOURCE / fixture[k] for k in ("model", "data", "labels"))
    metrics, saved = tmp_path / "metrics.jsonl", tmp_path / "trained.onnx"
    cli = run_tool("train", model, "--data", data, "--labels", labels, *fixture["args"], "--metrics", metrics,
                   "--save", saved)
    assert cli.returncode == 0, cli.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    result = pipeshard.train(pipeshard.load(model), np.load(data), np.load(labels), **keywords(fixture["args"]))
    assert [s.step for s in result.history] == [r["step"] for r in rows]
    assert [s.loss for s in result.history] == [r["loss"] for r in rows]
    assert [s.lr for s in result.history] == [r["lr"] for r in rows]
    assert [s.epoch for s in result.history] == [r["epoch"] for r in rows]
    want = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(saved)).graph.initializer}
    got = result.model.weights()
    assert got.keys() <= want.keys()
    for name, w in got.items():
        assert w.dtype == np.float32 and np.array_equal(w, want[name].reshape(w.shape)), name
    ours = tmp_path / "ours.onnx"
    result.model.save(str(ours))
    assert ours.read_bytes() == saved.read_bytes()


def test_eval_per_epoch_and_training_on():
    X = np.load(SOURCE / "data" / "digits_train_features.npy")
    y = np.load(SOURCE / "data" / "digits_train_labels.npy")
    Xe = np.load(SOURCE / "data" / "digits_test_features.npy")
    ye = np.load(SOURCE / "data" / "digits_test_labels.npy")
    m = pipeshard.load(SOURCE / "models" / "simple_digits.onnx")
    result = pipeshard.train(m, X, y, optimizer="adamw", batch_size=64, epochs=2, seed=3, eval=(Xe, ye))
    assert [e.epoch for e in result.eval] == [1, 2]
    assert all(0 <= e.accuracy <= 1 for e in result.eval)
    assert result.history[-1].epoch == 2 and all(s.samples_per_s > 0 for s in result.history)
    again = pipeshard.train(result.model, X, y, optimizer="adamw", batch_size=64, steps=3)
    assert len(again.history) == 3
    assert m.weights().keys() == again.model.weights().keys()
