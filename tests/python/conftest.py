# What the Python tests share: where the sources and the built tools are (ctest sets
# PIPESHARD_SOURCE and PIPESHARD_BIN; tests/CMakeLists.txt), and running a tool.
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
