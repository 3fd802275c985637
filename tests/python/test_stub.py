# The type hints (pipeshard/__init__.pyi) stay the package's: every public name, and
# train's keywords exactly, beside the package where type checkers look (PEP 561).
import ast
import inspect
import pathlib

import pipeshard


def stub():
    path = pathlib.Path(pipeshard.__file__).with_suffix(".pyi")
    assert path.exists() and (path.parent / "py.typed").exists()
    return {node.name: node for node in ast.parse(path.read_text()).body if hasattr(node, "name")}


def test_every_public_name_is_typed():
    assert set(pipeshard.__all__) <= set(stub())


def test_train_keywords_are_the_flags():
    train = stub()["train"]
    keywords = [a.arg for a in train.args.kwonlyargs]
    assert keywords[:4] == ["eval", "callback", "progress", "verbose"]
    assert keywords[4:] == list(pipeshard._TRAIN_FLAGS)


def test_model_partition_matches_the_binding():
    partition = next(f for f in stub()["Model"].body if getattr(f, "name", "") == "partition")
    typed = [a.arg for a in partition.args.args][1:]  # after self
    doc = pipeshard.Model.partition.__doc__.splitlines()[0]  # pybind11's signature line
    assert all(f"{name}:" in doc for name in typed), doc
    assert inspect.signature(pipeshard.check_equivalence).parameters.keys() >= {"model", "X", "y", "steps"}
