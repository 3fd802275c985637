#!/usr/bin/env python3
"""The report of tools/device_check.sh: device_check.md (for people) and device_check.json
(everything, for programs), from the facts the script collects as it goes. The script runs it
after every phase, so a run cut short still leaves a report; DC_FINAL=1 marks the last one.

Environment (set by device_check.sh): DC_STATE, the KEY=value facts file; DC_WORK, the
scratch folder with tests/*.json and *.out, multirank/results.md and bench/bench.{json,md};
DC_OUT, where the report goes; DC_MANIFEST, the build's device_manifest.json.
"""
import glob, json, os
state = {}
for line in open(os.environ["DC_STATE"]):
    k, _, v = line.rstrip("\n").partition("=")
    state[k] = v
work, out = os.environ["DC_WORK"], os.environ["DC_OUT"]
final = os.environ["DC_FINAL"] == "1"
manifest = {}
try:
    manifest = json.load(open(os.environ["DC_MANIFEST"]))
except (OSError, ValueError):
    pass

def skip_messages(exe):
    """GTEST_SKIP() messages from the executable's output (gtest's JSON leaves them out): the lines
    between "<file>:<line>: Skipped" and "[  SKIPPED ] <test>"."""
    found, current, lines = {}, None, None
    try:
        text = open(os.path.join(work, "tests", exe + ".out"), errors="replace").read()
    except OSError:
        return found
    for line in text.splitlines():
        if line.startswith("[ RUN      ] "):
            current, lines = line[13:].strip(), None
        elif line.endswith(": Skipped") and current:
            lines = []
        elif line.startswith("[  SKIPPED ] ") and current and lines is not None:
            found[current] = " ".join(l.strip() for l in lines if l.strip())
            lines = None
        elif lines is not None:
            lines.append(line)
    return found

# GPU tests: one gtest JSON per executable; an executable without one crashed or timed out.
tests = {"passed": [], "failed": [], "skipped": [], "crashed": []}
for exe in json.loads(state.get("TEST_EXES", "[]") or "[]"):
    path = os.path.join(work, "tests", exe + ".json")
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        status = state.get(f"TEST_RC_{exe}", "?")
        tests["crashed"].append({"executable": exe, "status": status,
                                 "tests": manifest.get("gpu_tests", {}).get(exe, [])})
        continue
    for suite in doc.get("testsuites", []):
        for case in suite.get("testsuite", []):
            name = f"{suite['name']}.{case['name']}"
            entry = {"name": name, "executable": exe, "ms": case.get("time")}
            if case.get("failures"):
                entry["message"] = case["failures"][0].get("failure", "").strip().splitlines()[:8]
                tests["failed"].append(entry)
            elif case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                entry["message"] = skip_messages(exe).get(name, "")
                tests["skipped"].append(entry)
            else:
                tests["passed"].append(entry)
bench, bench_md = {}, ""
multirank_md = ""
try:
    multirank_md = open(os.path.join(work, "multirank", "results.md")).read()
except OSError:
    pass
try:
    bench = json.load(open(os.path.join(work, "bench", "bench.json")))
    bench_md = open(os.path.join(work, "bench", "bench.md")).read()
except (OSError, ValueError):
    pass

gpu_ok = state.get("GPU_OK") == "1"
result = {"final": final, "gpu_ok": gpu_ok, "state": state, "manifest": manifest, "tests": tests,
          "bench": bench, "verdict": state.get("VERDICT", "incomplete")}
json.dump(result, open(os.path.join(out, "device_check.json"), "w"), indent=1, default=str)

L = []
L.append("# pipeshard device check")
L.append("")
if not final:
    L.append("**Incomplete: the check was cut short or is still running; this is what it had when it stopped.**")
    L.append("")
L.append(f"Verdict: **{state.get('VERDICT', 'incomplete')}**")
L.append("")
L.append("| | |")
L.append("|---|---|")
rows = [("GPU", f"{state.get('GPU_NAME')} ({state.get('GPU_MEMORY')}), {state.get('GPU_COUNT')} visible" if gpu_ok
         else f"**no usable GPU**: {state.get('GPU_WHY')}; GPU tests skip and the benchmarks ran as a CPU plumbing smoke"),
        ("driver / CUDA", f"driver {state.get('GPU_DRIVER')}, {state.get('GPU_CUDA_DRIVER')} (driver API); nvcc: {state.get('NVCC') or 'none'}"
         if gpu_ok else f"nvcc: {state.get('NVCC') or 'none'}"),
        ("machine", f"{state.get('HOST')}; {state.get('OS')}; {state.get('GLIBC')}"),
        ("PyTorch", f"{state.get('TORCH')} ({state.get('PY_TORCH') or 'no python with torch'})"),
        ("build", state.get("BUILD_NOTE", "not ready")),
        ("binaries from", f"commit {manifest.get('commit', '?')[:12]}"
         + (f" with {manifest.get('modified_tracked_files')} modified tracked files" if manifest.get("modified_tracked_files") else "")
         + f", built on host {manifest.get('uname', '?').split(' ')[1] if manifest.get('uname') else '?'} with {manifest.get('cxx', '?')} and nvcc {manifest.get('nvcc', '?')}"
         if manifest else "no manifest"),
        ("loader", state.get("LOADER_NOTE", "not checked")),
        ("mpirun", state.get("MPIRUN", "?"))]
for k, v in rows:
    L.append(f"| {k} | {str(v).replace('|', '/')} |")
if manifest.get("failed"):
    L.append("")
    L.append("Targets not built with the bundle (their tests and benchmarks cannot run):")
    for t, why in manifest["failed"].items():
        L.append(f"- `{t}`: {why}")
L.append("")
L.append("## GPU tests")
L.append("")
n = {k: len(v) for k, v in tests.items()}
if state.get("TESTS_NOTE"):
    L.append(state["TESTS_NOTE"])
    L.append("")
L.append(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped, {n['crashed']} executables without results "
         f"(executables: {', '.join(json.loads(state.get('TEST_EXES', '[]') or '[]')) or 'none'}; log: tests.log)")
for t in tests["failed"]:
    L.append(f"- FAILED `{t['name']}` ({t['executable']}): " + " / ".join(x.strip() for x in t.get("message", []))[:400])
for t in tests["crashed"]:
    how = t["status"] if str(t["status"]).startswith("not run") else f"exit status {t['status']}: crashed or timed out"
    L.append(f"- NO RESULT from `{t['executable']}` ({how}); its tests: "
             f"{', '.join(t['tests']) or '?'}")
if tests["skipped"]:
    reasons = sorted({(t.get("message") or "").strip().splitlines()[0] if (t.get("message") or "").strip() else "" for t in tests["skipped"]})
    L.append(f"- skipped: {', '.join(t['name'] for t in tests['skipped'])}"
             + (f" — {'; '.join(r for r in reasons if r)[:400]}" if any(reasons) else ""))
L.append("")
L.append("## Several processes on the GPU")
L.append("")
if state.get("MULTIRANK_NOTE"):
    L.append(state["MULTIRANK_NOTE"])
    L.append("")
L.append(multirank_md or "(not run)")
L.append("")
L.append("## Benchmarks")
L.append("")
if state.get("BENCH_NOTE"):
    L.append(state["BENCH_NOTE"])
    L.append("")
L.append(bench_md or "(no benchmark results)")
L.append("")
L.append("## Phases")
L.append("")
L.append("| phase | seconds |")
L.append("|---|---|")
for k, v in state.items():
    if k.startswith("PHASE_"):
        L.append(f"| {k[6:]} | {v} |")
L.append(f"| total | {state.get('TOTAL_S', '?')} |")
L.append("")
L.append("Files: device_check.md (this), device_check.json (everything, machine-readable), device_check.log (progress), "
         "env.txt (what the machine has), build.log, tests.log, bench.log, logs.tar.gz (gtest JSON, metrics).")
open(os.path.join(out, "device_check.md"), "w").write("\n".join(L) + "\n")
