# The layout planner from Python: Model.plan_layouts is partition --plan --json, and
# pipeshard.train(layout="auto") runs its first choice and says which, as train --layout
# auto does. No timing is asserted.
import json

import numpy as np
import pytest

import pipeshard
from conftest import SOURCE, run_tool

MODEL = SOURCE / "models" / "simple_digits.onnx"
PAPER = SOURCE / "bench" / "profiles" / "h100_8x8_handwritten.json"


def test_plan_layouts_is_partition_plan_json():
    cli = run_tool("partition", MODEL, "--plan", "--ranks", "4", "--batch-size", "64", "--optimizer", "sgd",
                   "--memory-per-rank", "1MiB", "--max-micro-batches", "4", "--profile", PAPER, "--json")
    assert cli.returncode == 0, cli.stderr
    plan = pipeshard.load(MODEL).plan_layouts(4, batch_size=64, optimizer="sgd", memory_per_rank="1MiB",
                                              max_micro_batches=4, profile=PAPER)
    expected = json.loads(cli.stdout)
    assert plan["layouts"] and plan["rejected"], "1 MiB a rank refuses some layouts and accepts others"
    for key in ("ranks", "batch_size", "memory_per_rank", "optimizer_slots", "profile_machine", "layouts", "rejected"):
        assert plan[key] == expected[key], key
    assert plan["memory_per_rank"] == 1 << 20
    assert pipeshard.load(MODEL).plan_layouts(4, memory_per_rank=1 << 20)["memory_per_rank"] == 1 << 20


def test_plan_layouts_refuses_bad_options():
    m = pipeshard.load(MODEL)
    for options, match in [(dict(ranks=0), "ranks"), (dict(ranks=2, batch_size=0), "batch_size"),
                           (dict(ranks=2, memory_per_rank="12 parsecs"), "memory_per_rank: '12 parsecs'"),
                           (dict(ranks=2, memory_per_rank=True), "memory_per_rank"),
                           (dict(ranks=2, optimizer="lion"), "optimizer"),
                           (dict(ranks=2, max_micro_batches=0), "max_micro_batches"),
                           (dict(ranks=2, profile=SOURCE / "missing.json"), "profile: .*cannot be read")]:
        with pytest.raises(ValueError, match=match):
            m.plan_layouts(**options)


def test_train_layout_auto_runs_the_first_choice(tmp_path):
    X = np.load(SOURCE / "data" / "digits_features.npy")
    y = np.load(SOURCE / "data" / "digits_labels.npy")
    m = pipeshard.load(MODEL)
    first = m.plan_layouts(1, batch_size=64, optimizer="adam", profile=PAPER)["layouts"][0]
    result = pipeshard.train(m, X, y, batch_size=64, steps=3, optimizer="adam", seed=2, layout="auto", profile=PAPER)
    assert result.layout == first["text"]
    assert result.predicted_step_ms == pytest.approx(first["predicted"]["step_ms"], rel=1e-9)
    # The same run as its flags given by hand: the planner only chose them.
    flags = {"micro_batches": first["micro_batches"], "keep_activations": first["keep_activations"]}
    by_hand = pipeshard.train(m, X, y, batch_size=64, steps=3, optimizer="adam", seed=2, **flags)
    assert [s.loss for s in result.history] == [s.loss for s in by_hand.history]
    assert by_hand.layout is None and by_hand.predicted_step_ms is None
    with pytest.raises(ValueError, match="--layout auto chooses --stages itself"):
        pipeshard.train(m, X, y, steps=1, layout="auto", stages=1)
    with pytest.raises(ValueError, match="--profile is for --layout auto"):
        pipeshard.train(m, X, y, steps=1, profile=PAPER)
