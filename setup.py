"""`pip install .`: the Python package pipeshard (python/), built by the project's CMake.

build_ext builds only the module's target, _pipeshard, in ./build (PIPESHARD_BUILD_DIR to
choose another folder): in a checkout already built that takes seconds, and in a fresh one it
configures build/ first (a full Release configure, then the module's libraries: minutes).
`cmake --install --component python` then copies the package (python/CMakeLists.txt lists it:
python/pipeshard/'s files, the module, the watchdog library beside it) into the wheel.

No pyproject.toml on purpose: with one, pip 23 (Debian 12) would fetch setuptools and wheel from
PyPI into an isolated build environment. Without one, it builds with the setuptools and wheel it
sees, which in a venv made with --system-site-packages are Debian's (python3-setuptools,
python3-wheel; scripts/install-deps.sh installs them), so nothing is downloaded. The module is
built for Debian's /usr/bin/python3, so that venv must be made by it (README.md, "Python").
"""
import os
import pathlib
import subprocess
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
BUILD = pathlib.Path(os.environ.get("PIPESHARD_BUILD_DIR", ROOT / "build")).resolve()


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        def cmake(*args):
            subprocess.run(["cmake", *map(str, args)], check=True)

        if not (BUILD / "CMakeCache.txt").exists():
            cmake("-S", ROOT, "-B", BUILD, "-DCMAKE_BUILD_TYPE=Release")
        # PIPESHARD_SETUP_NO_BUILD=1 (the tests): install what the build holds, without touching it.
        if os.environ.get("PIPESHARD_SETUP_NO_BUILD") != "1":
            cmake("--build", BUILD, "-j", os.cpu_count() or 1, "--target", "_pipeshard")
        module = pathlib.Path(self.get_ext_fullpath(ext.name))  # <build_lib>/pipeshard/_pipeshard<EXT_SUFFIX>
        cmake("--install", BUILD, "--component", "python", "--prefix", module.parent.parent)
        if not module.exists():
            built = sorted(p.name for p in module.parent.glob("_pipeshard*"))
            raise RuntimeError(f"{BUILD} built {built or 'no module'} (python/CMakeLists.txt: for /usr/bin/python3), "
                               f"but this interpreter loads {module.name} "
                               f"(EXT_SUFFIX {sysconfig.get_config_var('EXT_SUFFIX')}): "
                               f"pip install from a venv made by /usr/bin/python3")


# setuptools' own working folders (build/, *.egg-info) inside the CMake build, not beside the sources.
SETUPTOOLS_DIR = BUILD / "setuptools"
SETUPTOOLS_DIR.mkdir(parents=True, exist_ok=True)  # egg_info wants its folder to exist

setup(
    name="pipeshard",
    version="0.1.0",  # no releases yet
    description="Partition an ONNX MLP into pipeline and tensor-parallel stages and train it, "
    "equal to one process step for step",
    packages=["pipeshard"],
    package_dir={"pipeshard": "python/pipeshard"},
    ext_modules=[Extension("pipeshard._pipeshard", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["numpy"],
    zip_safe=False,
    options={"build": {"build_base": str(SETUPTOOLS_DIR)}, "egg_info": {"egg_base": str(SETUPTOOLS_DIR)}},
)
