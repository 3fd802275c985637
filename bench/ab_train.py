#!/usr/bin/env python3
"""Race two builds of `train` against each other on one model: did a change make a step slower?

    /usr/bin/python3 bench/cpu_vs_pytorch.py --models B --rounds 1 --keep   # prints the kept folder
    /usr/bin/python3 bench/ab_train.py OLD/bin/train NEW/bin/train FOLDER --model B --runs 8

Runs alternate (old, new / new, old) so that slow spells of the machine hit both; each run's
figure is the median step time after the first 5 steps (from --metrics); the verdict is the
median of the per-pair ratios new/old, as in cpu_vs_pytorch.py. Same flags as that benchmark's
own runs (SGD, lr 0.01, momentum 0.9, no shuffle, 2 threads).
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile


def step_ms(train, folder, model, batch, steps, env):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as metrics:
        subprocess.run([train, os.path.join(folder, f"{model}.onnx"), "--data", os.path.join(folder, f"{model}_x.npy"),
                        "--labels", os.path.join(folder, f"{model}_y.npy"), "--batch-size", str(batch),
                        "--steps", str(steps), "--lr", "0.01", "--momentum", "0.9", "--no-shuffle",
                        "--metrics", metrics.name], env=env, check=True, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(metrics.name)][5:]
    return statistics.median(batch / r["samples_per_s"] * 1000 for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("folder", help="a folder kept by cpu_vs_pytorch.py --keep")
    ap.add_argument("--model", default="B")
    ap.add_argument("--batch", type=int, default=256, help="the model's batch in cpu_vs_pytorch.py (A 128, B 256)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", type=int, default=8)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE")
    times = {"old": [], "new": []}
    for r in range(args.runs):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            times[side].append(step_ms(getattr(args, side), args.folder, args.model, args.batch, args.steps, env))
    for side, v in times.items():
        print(f"{side}: per-run median ms {' '.join(f'{x:.2f}' for x in v)}; median {statistics.median(v):.2f}")
    ratio = statistics.median(n / o for n, o in zip(times["new"], times["old"]))
    print(f"paired ratio new/old: {ratio:.4f}")


if __name__ == "__main__":
    main()
