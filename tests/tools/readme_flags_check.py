#!/usr/bin/env python3
"""README.md's synopses against the tools' --help: for each TOOL given, the README section
headed "## `TOOL`" opens with a synopsis (its first ``` block), which must name every long
flag `TOOL --help` lists and no flag that --help does not; each short form (-s) must appear
somewhere in the section. Exit 0 when all hold; prints what differs otherwise.
    readme_flags_check.py README.md TOOL_BINARY...
"""
import os
import re
import subprocess
import sys

FLAG = r"(?<![\w-])(--?[a-z][a-z0-9-]*)(?![\w-])"


def help_flags(binary):
    """The flags of --help's option lines (`  -s,--stages INT  ...`), --help itself left out."""
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, check=True).stdout
    flags = set()
    for line in text.splitlines():
        m = re.match(r"\s+(-[^\s]+)", line)
        if m:
            flags.update(f for f in m.group(1).split(",") if f not in ("-h", "--help"))
    return flags


def section(readme, tool):
    m = re.search(r"^## `" + re.escape(tool) + r"`\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if not m:
        return None, None
    body = m.group(1)
    synopsis = re.search(r"```\n(.*?)```", body, re.S)
    return body, synopsis.group(1) if synopsis else None


def main():
    readme_path, binaries = sys.argv[1], sys.argv[2:]
    readme = open(readme_path, encoding="utf-8").read()
    problems, counts = [], []
    for binary in binaries:
        tool = os.path.basename(binary)
        body, synopsis = section(readme, tool)
        if synopsis is None:
            problems.append(f"{tool}: README.md has no section '## `{tool}`' opening with a synopsis")
            continue
        flags = help_flags(binary)
        named = set(re.findall(FLAG, synopsis))
        in_section = set(re.findall(FLAG, body))
        for f in sorted(flags):
            if f.startswith("--") and f not in named:
                problems.append(f"{tool}: --help lists {f}, the README's synopsis does not")
            if not f.startswith("--") and f not in in_section:
                problems.append(f"{tool}: --help lists {f}, the README's section never mentions it")
        for f in sorted(named - flags):
            problems.append(f"{tool}: the README's synopsis names {f}, which --help does not list")
        counts.append(f"{tool} {len(flags)}")
    for p in problems:
        print(f"readme_flags_check: {p}")
    if problems:
        return 1
    print(f"readme_flags_check: every flag of --help is in README.md's synopses ({', '.join(counts)} flags)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
