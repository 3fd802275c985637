# pipeshard.train takes every option train has, as train does: the keywords cover train
# --help's flags; outputs are train's files; a callback sees each step and may stop the
# run, which resumes from its checkpoint onto the uninterrupted trajectory; Ctrl-C stops
# it as it stops train; progress bars only when asked or interactive.
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import pipeshard
from conftest import SOURCE, run_tool

MODEL = SOURCE / "models" / "simple_digits.onnx"


def digits():
    return np.load(SOURCE / "data" / "digits_features.npy"), np.load(SOURCE / "data" / "digits_labels.npy")


def test_every_flag_has_a_keyword():
    flags = {flag for flag, _ in pipeshard._pipeshard._train_flags()}
    data = {"--data", "--labels", "--eval-data", "--eval-labels"}  # the arrays
    others = {"--help", "--check-equivalence"}  # the tool's; pipeshard.check_equivalence
    assert {flag for flag, _ in pipeshard._TRAIN_FLAGS.values()} == flags - data - others
    for name in pipeshard._TRAIN_FLAGS:
        assert f"    {name} (" in pipeshard.train.__doc__, name  # help(pipeshard.train) lists it


def test_outputs_are_trains(tmp_path):
    X, y = digits()
    options = ["--optimizer", "adamw", "--batch-size", "64", "--steps", "12", "--seed", "3"]
    cli = run_tool("train", MODEL, "--data", SOURCE / "data" / "digits_features.npy", "--labels",
                   SOURCE / "data" / "digits_labels.npy", *options, "--metrics", tmp_path / "cli.jsonl", "--save",
                   tmp_path / "cli.onnx")
    assert cli.returncode == 0, cli.stderr
    result = pipeshard.train(pipeshard.load(MODEL), X, y, optimizer="adamw", batch_size=64, steps=12, seed=3,
                             metrics=tmp_path / "py.jsonl", save=tmp_path / "py.onnx", trace=tmp_path / "trace.json",
                             tensorboard=tmp_path / "board")
    assert (tmp_path / "py.onnx").read_bytes() == (tmp_path / "cli.onnx").read_bytes()
    timing = ("samples_per_s", "elapsed_s")
    rows = [[{k: v for k, v in json.loads(line).items() if k not in timing} for line in f.read_text().splitlines()]
            for f in (tmp_path / "cli.jsonl", tmp_path / "py.jsonl")]
    assert rows[0] == rows[1] and len(rows[0]) == 12
    assert [r["loss"] for r in rows[1]] == [s.loss for s in result.history]
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any((tmp_path / "board").iterdir())


class Enough(Exception):
    pass


def test_callback_stops_and_the_run_resumes_onto_the_same_trajectory(tmp_path):
    X, y = digits()
    options = dict(optimizer="adam", batch_size=64, steps=10, seed=1)
    whole = pipeshard.train(pipeshard.load(MODEL), X, y, **options)
    seen = []

    def stop_at_4(step):
        seen.append((step.step, step.total_steps))
        if step.step == 4:
            raise Enough

    with pytest.raises(Enough):
        pipeshard.train(pipeshard.load(MODEL), X, y, **options, callback=stop_at_4, checkpoint=tmp_path / "ck")
    assert seen == [(s, 10) for s in range(1, 5)]  # alone, the run stops after the step whose callback raised
    rest = pipeshard.train(pipeshard.load(MODEL), X, y, **options, resume=tmp_path / "ck")
    assert [s.step for s in rest.history] == list(range(5, 11))
    assert [s.loss for s in rest.history] == [s.loss for s in whole.history[4:]]
    for name, w in whole.model.weights().items():
        assert np.array_equal(rest.model.weights()[name], w), name


def test_callback_must_be_callable():
    X, y = digits()
    with pytest.raises(TypeError, match="callback"):
        pipeshard.train(pipeshard.load(MODEL), X, y, steps=1, callback=3)


CTRL_C = """
import sys, numpy as np, pipeshard
X, y = np.load(sys.argv[1]), np.load(sys.argv[2])
def started(step):
    if step.step == 1:
        print("started", flush=True)
try:
    pipeshard.train(pipeshard.load(sys.argv[3]), X, y, steps=1000000, batch_size=8, callback=started,
                    checkpoint=sys.argv[4])
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", CTRL_C, SOURCE / "data" / "digits_features.npy",
                              SOURCE / "data" / "digits_labels.npy", MODEL, tmp_path / "ck"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline() == "started\n"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out == "KeyboardInterrupt\n"
    line = err.strip().splitlines()[-1]  # as train says it
    assert line.startswith("stopped by SIGINT after step ") and line.endswith(
        f"/1000000: checkpoint in {tmp_path / 'ck'} (continue with --resume {tmp_path / 'ck'})"), err
    assert any((tmp_path / "ck").iterdir())


def test_silent_unless_asked(capfd):
    X, y = digits()
    pipeshard.train(pipeshard.load(MODEL), X, y, steps=3)
    assert capfd.readouterr().err == ""  # a script's stderr is not a terminal: no bar
    pipeshard.train(pipeshard.load(MODEL), X, y, steps=3, verbose=True)
    err = capfd.readouterr().err
    assert "training " in err and "step 3/3" in err and "done: 3 steps" in err


def test_progress_bar(capfd, monkeypatch):
    pytest.importorskip("tqdm", reason="python3-tqdm is not installed: the bar falls back to train's line")
    X, y = digits()
    pipeshard.train(pipeshard.load(MODEL), X, y, steps=7, progress=True)
    err = capfd.readouterr().err
    assert "7/7" in err and "loss" in err and "training " not in err  # tqdm's bar, not train's lines
    monkeypatch.setitem(sys.modules, "tqdm", None)  # without tqdm: train's own progress line
    pipeshard.train(pipeshard.load(MODEL), X, y, steps=7, progress=True)
    assert "step 7/7" in capfd.readouterr().err


def test_memory_mapped_data_trains_as_the_array(tmp_path):  # (in place: test_zero_copy.py)
    X, y = digits()
    np.save(tmp_path / "x.npy", X)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    a = pipeshard.train(pipeshard.load(MODEL), X, y, steps=5)
    b = pipeshard.train(pipeshard.load(MODEL), mapped, y, steps=5)
    assert [s.loss for s in a.history] == [s.loss for s in b.history]


def test_keyword_types():
    X, y = digits()
    m = pipeshard.load(MODEL)
    with pytest.raises(TypeError, match="save must be a path"):
        pipeshard.train(m, X, y, save=3)
    with pytest.raises(TypeError, match="loss_scale"):
        pipeshard.train(m, X, y, loss_scale=1.5)
    with pytest.raises(ValueError, match="--loss-scale"):
        pipeshard.train(m, X, y, loss_scale=1000)
