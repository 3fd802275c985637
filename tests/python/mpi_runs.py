# Run by test_mpi.py as `mpiexec -n 2 python3 mpi_runs.py OUT`: pipeshard.train under
# mpirun, every golden fixture in two layouts (D=2 and P=2), plus what a job does with bad
# input, a callback that raises, and check_equivalence. Each rank writes what it got into
# OUT (rank<r>_*.npz, rank<r>.json); test_mpi.py compares the ranks with each other and
# with the train tool under mpirun.
import json
import pathlib
import sys

import numpy as np

import pipeshard
from conftest import GOLDEN_CASES, golden_case, keywords



def layouts(case):
    """The layouts a fixture trains in, by name: its keywords (and train's flags)."""
    # BatchNorm would normalise each micro-batch alone, which train refuses.
    p2 = {"stages": 2, "micro_batches": 1 if "batchnorm" in case else 4}
    return {"d2": ({}, []), "p2": (p2, ["--stages", "2", "--micro-batches", str(p2["micro_batches"])])}


class Enough(Exception):
    pass


def main(out):
    rank = pipeshard.rank()
    summary = {"rank": rank, "world_size": pipeshard.world_size()}
    for case in GOLDEN_CASES:
        fixture = golden_case(case)
        X, y = np.load(fixture["data"]), np.load(fixture["labels"])
        for name, (layout, _) in layouts(case).items():
            result = pipeshard.train(pipeshard.load(fixture["model"]), X, y, **keywords(fixture["args"]), **layout)
            weights = {"w:" + k: v for k, v in result.model.weights().items()}
            np.savez(out / f"rank{rank}_{case}_{name}.npz", step=[s.step for s in result.history],
                     loss=[s.loss for s in result.history], lr=[s.lr for s in result.history], **weights)
            if rank == 0:
                result.model.save(str(out / f"{case}_{name}.onnx"))

    fixture = golden_case("course_sgd")
    X, y = np.load(fixture["data"]), np.load(fixture["labels"])
    model = pipeshard.load(fixture["model"])
    try:  # bad input: every rank raises rank 0's message
        pipeshard.train(model, X, y, lr=-1.0, stages=2)
    except ValueError as e:
        summary["bad_lr"] = str(e)
    try:  # a layout the job cannot hold
        pipeshard.train(model, X, y, stages=3)
    except ValueError as e:
        summary["bad_layout"] = str(e)

    seen = []

    def stop_at_3(step):
        seen.append(step.step)
        if step.step == 3:
            raise Enough("enough at step 3")

    try:  # rank 0's callback raises at step 3: every rank stops after step 4
        pipeshard.train(model, X, y, steps=10, batch_size=64, stages=2, callback=stop_at_3,
                        checkpoint=out / "stopped")
    except Enough as e:
        summary["callback"] = f"Enough: {e}"
    except RuntimeError as e:
        summary["callback"] = f"RuntimeError: {e}"
    summary["callback_steps"] = seen
    summary["equivalent"] = pipeshard.check_equivalence(model, X, y, steps=4, stages=2, micro_batches=2,
                                                        optimizer="adamw")
    (out / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
