# What the Python tests share: where the sources and the built tools are (ctest sets
# PIPESHARD_SOURCE and PIPESHARD_BIN; tests/CMakeLists.txt), and running a tool.
import json
import os
import pathlib
import subprocess

import pytest

SOURCE = pathlib.Path(os.environ.get("PIPESHARD_SOURCE", pathlib.Path(__file__).resolve().parents[2]))
BIN = pathlib.Path(os.environ.get("PIPESHARD_BIN", SOURCE / "build" / "bin"))


def run_tool(tool, *args, cwd=None):
    """Runs build/bin/<tool> with `args`; the CompletedProcess (text)."""
    return subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True, cwd=cwd)


def tool_error(completed):
    """The one line a tool says for bad input, without its "<tool>: error: " prefix."""
    assert completed.returncode == 2, completed.stderr
    line = completed.stderr.strip().splitlines()[-1]
    return line.split(": error: ", 1)[1]


@pytest.fixture
def source():
    return SOURCE


# The golden PyTorch fixtures (tests/golden/*/case.json), by name.
GOLDEN_CASES = sorted(p.parent.name for p in (SOURCE / "tests" / "golden").glob("*/case.json"))


def golden_case(name):
    """A fixture's case.json, with model, data and labels as absolute paths."""
    fixture = json.loads((SOURCE / "tests" / "golden" / name / "case.json").read_text())
    for key in ("model", "data", "labels"):
        fixture[key] = SOURCE / fixture[key]
    return fixture


def keywords(args):
    """train's flags (a fixture's "args") as pipeshard.train's keywords."""
    import pipeshard

    out, i = {}, 0
    while i < len(args):
        name = args[i][2:].replace("-", "_")
        if name == "no_shuffle":
            out["shuffle"] = False
        elif pipeshard._TRAIN_FLAGS[name][1] is bool:
            out[name] = True
        else:
            value = args[i + 1]
            i += 1
            kind = pipeshard._TRAIN_FLAGS[name][1]
            if kind is tuple:
                out[name] = tuple(float(b) for b in value.split(","))
            else:
                out[name] = value if kind in ("path", "scale") else kind(value)
        i += 1
    return out


def mpiexec(np_, *args, timeout=300, cwd=None):
    """Runs `mpiexec -n np_ args` (as ctest's MPI tests do, oversubscribed); the CompletedProcess."""
    launcher = os.environ.get("PIPESHARD_MPIEXEC", "mpiexec")
    return subprocess.run([launcher, "-n", str(np_), "--oversubscribe", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
