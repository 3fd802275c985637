# README.md's "Python" section as shown there: its first ```python block, run from the repository
# root with the built module, prints exactly the block that follows the word "prints" after it.
import re
import subprocess
import sys

from conftest import SOURCE


def section(text, heading):
    """The lines of README.md's `## heading` section, up to the next `## ` heading."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def fenced_blocks(lines):
    """(language, text, index of the line after the closing fence) for each ``` block, in order."""
    blocks, i = [], 0
    while i < len(lines):
        opening = re.fullmatch(r"```(\w*)\s*", lines[i])
        if opening:
            close = lines.index("```", i + 1)
            blocks.append((opening.group(1), "\n".join(lines[i + 1:close]) + "\n", i, close + 1))
            i = close + 1
        else:
            i += 1
    return blocks


def example_and_output():
    lines = section((SOURCE / "README.md").read_text(), "Python")
    blocks = fenced_blocks(lines)
    code_index = next(n for n, (language, *_) in enumerate(blocks) if language == "python")
    _, code, _, code_end = blocks[code_index]
    for _, text, start, end in blocks[code_index + 1:]:
        if re.search(r"\bprints\b", "\n".join(lines[code_end:start])):  # the prose before this block
            return code, text
        code_end = end
    raise AssertionError("README.md, Python: no ``` block after the word 'prints' that follows the example")


def test_readme_python_example_prints_what_the_readme_shows():
    code, expected = example_and_output()
    # The module this test runs against is the one on PYTHONPATH (ctest: build/python).
    completed = subprocess.run([sys.executable, "-c", code], cwd=SOURCE, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == expected
