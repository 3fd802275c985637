# Model.partition is partition's: the same plan.json for every model in models/, the same
# table, the same stage files.
import pytest

import pipeshard
from conftest import SOURCE, run_tool

MODELS = sorted(p.name for p in (SOURCE / "models").glob("*.onnx"))


@pytest.mark.parametrize("name", MODELS)
def test_plan_json_equals_partition_json(name, tmp_path, monkeypatch):
    monkeypatch.chdir(SOURCE)
    path = f"models/{name}"  # as given: plan.json names the model by it
    cli = run_tool("partition", path, "--stages", 2, "--json", "--out", tmp_path, cwd=SOURCE)
    m = pipeshard.load(path)
    if cli.returncode != 0:  # a model too small for two stages: the same refusal
        with pytest.raises(ValueError) as refused:
            m.partition(stages=2)
        assert str(refused.value).replace("stages: ", "--stages: ") in cli.stderr
        return
    assert m.partition(stages=2).to_json() + "\n" == cli.stdout


def test_table_and_files_equal_partition(tmp_path, monkeypatch):
    monkeypatch.chdir(SOURCE)
    out_cli, out_py = tmp_path / "cli", tmp_path / "py"
    args = ["--stages", "2", "--tensor-parallel", "2", "--batch-size", "64", "--micro-batches", "4"]
    cli = run_tool("partition", "models/simple_digits.onnx", *args, "--out", out_cli, cwd=SOURCE)
    assert cli.returncode == 0, cli.stderr
    m = pipeshard.load("models/simple_digits.onnx")
    plan = m.partition(stages=2, tensor_parallel=2, batch_size=64, micro_batches=4)
    assert plan.table(str(out_cli)) == cli.stdout
    assert plan.table() == cli.stdout[: cli.stdout.rindex("wrote ")]  # nothing written, nothing said
    plan.write(str(out_py))
    cli_files = sorted(p.name for p in out_cli.iterdir())
    assert sorted(p.name for p in out_py.iterdir()) == cli_files
    for f in cli_files:
        assert (out_py / f).read_bytes() == (out_cli / f).read_bytes(), f
    assert [s["parameters"] for s in plan.stages] and sum(s["parameters"] for s in plan.stages[::2]) > 0
    assert plan.total_parameters == m.parameter_count
    assert all(s["memory_bytes"] > 0 and s["nodes"] for s in plan.stages)


def test_zero_memory_estimate_equals_partition(tmp_path, monkeypatch):
    monkeypatch.chdir(SOURCE)
    args = ["--replicas", "4", "--zero", "2", "--bucket-mb", "0.01", "--optimizer", "adamw"]
    cli = run_tool("partition", "models/simple_digits.onnx", *args, "--out", tmp_path, cwd=SOURCE)
    assert cli.returncode == 0, cli.stderr
    m = pipeshard.load("models/simple_digits.onnx")
    plan = m.partition(replicas=4, zero=2, bucket_mb=0.01, optimizer="adamw")
    assert plan.table(str(tmp_path)) == cli.stdout
    assert "under ZeRO stage 2 over 4 replicas" in cli.stdout
    plain = m.partition(optimizer="adamw").stages[0]["memory_bytes"]
    assert plan.stages[0]["memory_bytes"] < plain
    with pytest.raises(ValueError, match="zero"):
        m.partition(replicas=2, zero=3)
    with pytest.raises(ValueError, match="replicas"):
        m.partition(replicas=0, zero=1)
    with pytest.raises(ValueError, match="bucket_mb"):
        m.partition(replicas=2, zero=2, bucket_mb=float("nan"))


def test_model_facts():
    m = pipeshard.load(SOURCE / "models" / "simple_digits.onnx")
    assert m.layers >= 2
    assert m.parameter_count == sum(w.size for w in m.weights().values())
    same = pipeshard.load((SOURCE / "models" / "simple_digits.onnx").read_bytes())
    assert same.parameter_count == m.parameter_count


def test_bad_partition_options_raise_value_error():
    m = pipeshard.load(SOURCE / "models" / "simple.onnx")
    with pytest.raises(ValueError, match="stages"):
        m.partition(stages=0)
    with pytest.raises(ValueError, match="balance"):
        m.partition(balance="speed")
    with pytest.raises(ValueError, match="not a valid ONNX file"):
        pipeshard.load(b"not onnx")
    with pytest.raises(TypeError):
        pipeshard.load(3)


def test_a_trained_models_stage_files_hold_the_trained_weights(tmp_path):
    import numpy as np
    import onnx
    import onnx.numpy_helper

    m = pipeshard.load(SOURCE / "models" / "simple_digits.onnx")
    X, y = np.load(SOURCE / "data" / "digits_features.npy"), np.load(SOURCE / "data" / "digits_labels.npy")
    trained = pipeshard.train(m, X, y, steps=5).model
    trained.partition(stages=2).write(str(tmp_path))
    stage_weights = {}
    for f in sorted(tmp_path.glob("*.onnx")):
        stage_weights.update({t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(f)).graph.initializer})
    weights, initial = trained.weights(), m.weights()
    assert weights.keys() <= stage_weights.keys()
    for name, w in weights.items():
        assert np.array_equal(stage_weights[name].reshape(w.shape), w), name
        assert not np.array_equal(initial[name], w), name  # trained, not the file's
