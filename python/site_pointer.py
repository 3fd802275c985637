"""Points this interpreter at a build's package: writes pipeshard.pth, naming DIR (the
build's python/ folder), into the first site directory (site.getsitepackages()[0]:
/usr/local/lib/python3.11/dist-packages for Debian 12's /usr/bin/python3), whose .pth
files site.py reads at every start. Run by the build after the module (python/CMakeLists.txt).

    site_pointer.py DIR

Quiet when the pointer already names DIR. One pointer per interpreter, so with two
checkouts the last build wins, and this says so. Never fails the build: where the site
directory is not writable (not root) it says that `import pipeshard` needs PYTHONPATH=DIR.
"""
import os
import pathlib
import site
import sys

HEADER = "# written by pipeshard's build (python/site_pointer.py) at each build: the last build wins\n"


def main(target):
    pointer = pathlib.Path(site.getsitepackages()[0]) / "pipeshard.pth"
    wanted = HEADER + target + "\n"
    try:
        before = pointer.read_text()
    except OSError:
        before = None
    if before == wanted:
        return
    try:
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.write_text(wanted)
    except OSError as e:
        print(f"pipeshard: could not write {pointer} ({e.strerror}); without it "
              f"`import pipeshard` needs PYTHONPATH={target}")
        return
    previous = [line for line in (before or "").splitlines() if line and not line.startswith("#")]
    if previous:
        print(f"pipeshard: {sys.executable} now imports pipeshard from {target}, "
              f"no longer from {previous[0]} (the last build wins; {pointer})")
    else:
        print(f"pipeshard: {sys.executable} imports pipeshard from {target} ({pointer})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: site_pointer.py DIR")
    main(os.path.abspath(sys.argv[1]))
