# The two ways README.md's "Python" section gives to `import pipeshard`, each with no PYTHONPATH:
# Debian's /usr/bin/python3 after the build (its pipeshard.pth pointer, python/site_pointer.py),
# and `pip install .` into a venv, offline (setup.py, reusing this build's folder).
import os
import pathlib
import site
import subprocess
import sys

import pytest

import pipeshard
from conftest import SOURCE

BUILD_PYTHON = pathlib.Path(pipeshard.__file__).resolve().parents[1]  # the build's python/, on PYTHONPATH
BUILD = BUILD_PYTHON.parent


def clean_environment(**extra):
    """This environment without PYTHONPATH, nor pip's settings (PIP_*, config files)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def run(args, cwd, **extra):
    completed = subprocess.run(list(map(str, args)), cwd=cwd, env=clean_environment(**extra), capture_output=True,
                               text=True)
    assert completed.returncode == 0, f"{args}:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def test_system_python_imports_this_build_without_pythonpath(tmp_path):
    if os.environ.get("PIPESHARD_PYTHON_SITE_POINTER", "ON") != "ON":
        pytest.skip("this build writes no pointer (-DPIPESHARD_PYTHON_SITE_POINTER=OFF)")
    pointer = pathlib.Path(site.getsitepackages()[0]) / "pipeshard.pth"
    if not os.access(pointer.parent if pointer.parent.exists() else pointer.parent.parent, os.W_OK):
        pytest.skip(f"the build could not write {pointer} (not root): PYTHONPATH={BUILD_PYTHON} is the way here")
    assert pointer.exists(), f"the build did not write {pointer} (python/site_pointer.py)"
    named = [line for line in pointer.read_text().splitlines() if line and not line.startswith("#")]
    if [pathlib.Path(p).resolve() for p in named] != [BUILD_PYTHON]:
        pytest.skip(f"{pointer} names {named}, another checkout's build (the last build wins)")
    # From another folder, so that neither the sources nor the build are on the path by accident.
    printed = run(["/usr/bin/python3", "-c", "import pipeshard; print(pipeshard.__file__)"], tmp_path)
    assert pathlib.Path(printed.strip()) == BUILD_PYTHON / "pipeshard" / "__init__.py"


TRAIN_TWO_STEPS = """
import sys, numpy as np, pipeshard
source = sys.argv[1]
m = pipeshard.load(source + "/models/simple_digits.onnx")
X = np.load(source + "/data/digits_train_features.npy")
y = np.load(source + "/data/digits_train_labels.npy")
result = pipeshard.train(m, X, y, steps=2, batch_size=32)
print(pipeshard.__file__)
print(len(result.history), result.history[-1].loss)
"""


def test_pip_installs_the_package_offline_into_a_venv(tmp_path):
    # README.md's venv, made --without-pip to save the seconds of ensurepip: `python -m pip` is
    # then Debian's pip (python3-pip), the very version ensurepip would have put in the venv.
    venv = tmp_path / "venv"
    run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    # --no-index: any attempt to download (build dependencies, numpy) fails the install.
    run([python, "-m", "pip", "install", "--no-index", "--no-cache-dir", SOURCE], tmp_path,
        PIPESHARD_BUILD_DIR=str(BUILD), PIPESHARD_SETUP_NO_BUILD="1")  # the build under test, untouched
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    printed = run([python, "-c", TRAIN_TWO_STEPS, SOURCE], elsewhere).splitlines()
    installed = pathlib.Path(printed[0])
    assert installed.is_relative_to(venv), f"imported {installed}, not the venv's package"
    package_files = {p.name for p in (SOURCE / "python" / "pipeshard").iterdir() if p.is_file()}
    missing = package_files - {p.name for p in installed.parent.iterdir()}
    assert not missing, f"the venv's package lacks {sorted(missing)}"
    assert (installed.parent / "libpipeshard_watchdog.so").exists()
    steps, loss = printed[1].split()
    assert int(steps) == 2 and 0 < float(loss) < 10
