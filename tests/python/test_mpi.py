# pipeshard.train under mpirun is train's run under mpirun, bit for bit: every golden
# fixture trained by `mpiexec -n 2 python3 mpi_runs.py` with D=2 and with P=2 gives the
# same loss and learning rate at every step, and the same weights and saved file, as
# `mpiexec -n 2 train` with the same flags, on both ranks. One launch trains them all.
import json

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from conftest import BIN, GOLDEN_CASES, SOURCE, golden_case, mpiexec
from mpi_runs import layouts


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The folder mpi_runs.py filled, one launch for the whole module."""
    out = tmp_path_factory.mktemp("mpi_runs")
    done = mpiexec(2, "/usr/bin/python3", SOURCE / "tests" / "python" / "mpi_runs.py", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.parametrize("layout", ["d2", "p2"])
@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_same_as_train_under_mpirun(job, case, layout, tmp_path):
    fixture = golden_case(case)
    metrics, saved = tmp_path / "metrics.jsonl", tmp_path / "trained.onnx"
    _, flags = layouts(case)[layout]
    cli = mpiexec(2, BIN / "train", fixture["model"], "--data", fixture["data"], "--labels", fixture["labels"],
                  *fixture["args"], *flags, "--metrics", metrics, "--save", saved)
    assert cli.returncode == 0, cli.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    want = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(saved)).graph.initializer}
    for rank in (0, 1):  # every rank returns the whole result
        got = np.load(job / f"rank{rank}_{case}_{layout}.npz")
        assert list(got["step"]) == [r["step"] for r in rows]
        assert list(got["loss"]) == [r["loss"] for r in rows]
        assert list(got["lr"]) == [r["lr"] for r in rows]
        names = [k for k in got.files if k.startswith("w:")]
        assert names
        for name in names:
            assert np.array_equal(got[name], want[name[2:]].reshape(got[name].shape)), (rank, name)
    assert (job / f"{case}_{layout}.onnx").read_bytes() == saved.read_bytes()


def test_the_job_agrees(job):
    ranks = [json.loads((job / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(s["rank"], s["world_size"]) for s in ranks] == [(0, 2), (1, 2)]
    for s in ranks:  # bad input: rank 0's message on every rank, as train says it
        assert s["bad_lr"] == "--lr must be positive"
        assert "do not divide into 3 pipeline stages" in s["bad_layout"]
        assert s["equivalent"] is True
    # Rank 0's callback raised at step 3; the others learnt it in step 4's all-reduce.
    assert ranks[0]["callback"] == "Enough: enough at step 3" and ranks[0]["callback_steps"] == [1, 2, 3]
    assert ranks[1]["callback"] == "RuntimeError: training stopped after step 4: rank 0's callback raised an exception"
    assert ranks[1]["callback_steps"] == []
    assert (job / "stopped").is_dir() and any((job / "stopped").iterdir())  # the checkpoint after step 4


def test_readme_mpirun_example_prints_what_the_readme_says():
    done = mpiexec(2, "/usr/bin/python3", SOURCE / "docs" / "examples" / "python_mpirun.py", cwd=SOURCE)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines(keepends=True)  # check_equivalence's two lines, then the script's
    assert lines[1] == "equivalent: the layout computes the one-process training\n"
    mine = "".join(lines[2:])
    assert mine == "rank 0 of 2: equivalent to one process: True\nepoch 3: eval accuracy 91.3%\n"
    assert "```\n" + mine + "```" in (SOURCE / "README.md").read_text()
