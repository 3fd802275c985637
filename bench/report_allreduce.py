"""All-reduce rate for bench/report.py: ours (bench_allreduce) against PyTorch's gloo, 2 processes.

Ours: `mpirun -np 2 bench_allreduce MIN MAX REPS` (bench/allreduce_rate.cc) times the communicator's
blocking all_reduce, all_reduce_async + wait, and raw MPI_Allreduce, float32 sums in place, and
ZeRO's split of the same traffic: reduce_scatter + all_gather (blocking and async), raw
MPI_Reduce_scatter_block + MPI_Allgather, and each half alone. The peer:
torch.distributed.all_reduce on gloo (what DDP uses on CPUs), 2 Python processes rendezvousing
through a file, not pinned: gloo moves data on a thread of its own, which pinning would squeeze
onto the caller's core. Both sides time alike: per size and repetition, one untimed call, a
barrier, then `iters` back-to-back calls, the slowest rank's time / iters; the median over
repetitions; the whole sweep runs `rounds` times, ours and gloo alternating which goes first, and
the figure is the median over rounds. gloo makes 1/8 of our calls per repetition (at least 2):
its small messages take 2 to 3 orders of magnitude longer than ours.
  algbw = bytes / time;  busbw = algbw * 2(n-1)/n for an all-reduce or a reduce-scatter + all-gather,
  algbw * (n-1)/n for a reduce-scatter or an all-gather alone  (nccl-tests' convention)

Run as `report_allreduce.py --gloo-worker JSON`, it is one gloo rank (report.py starts them).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RANKS = 2
# bench_allreduce's ways that move half an all-reduce's traffic (bus factor (n-1)/n, not 2(n-1)/n).
HALF_WAYS = ("reduce_scatter", "MPI_Reduce_scatter_block", "all_gather", "MPI_Allgather")


def iterations_for(size_bytes):
    """bench_allreduce's iteration count (allreduce_rate.cc: iterations_for)."""
    return max(2, min(200, (128 << 20) // size_bytes))


def gloo_iterations_for(size_bytes):
    return max(2, iterations_for(size_bytes) // 8)


def sizes_between(min_bytes, max_bytes):
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


# --------------------------------------------------------------------------- gloo child
def gloo_worker(job):
    """One gloo rank: prints, on rank 0, one JSON line {size: {"time_s", "ok"}}."""
    import torch
    import torch.distributed as dist
    rank = job["rank"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + job["rendezvous"], rank=rank, world_size=job["world"])
    out = {}
    for size in job["sizes"]:
        n = size // 4
        pattern = (torch.arange(n) % 8 + 1).float()
        data = pattern * (rank + 1)
        dist.all_reduce(data)
        world = job["world"]
        ok = torch.tensor([0.0 if torch.equal(data, pattern * (world * (world + 1) / 2)) else 1.0])
        dist.all_reduce(ok)
        data.zero_()
        dist.all_reduce(data)  # warm-up
        iters, times = gloo_iterations_for(size), []
        for _ in range(job["repetitions"]):
            dist.all_reduce(data)  # untimed, as bench_allreduce does before each repetition
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(data)
            slowest = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(slowest.item())
        out[size] = {"time_s": statistics.median(times), "ok": ok.item() == 0.0, "iters": iters}
    if rank == 0:
        print(json.dumps({"sizes": out, "torch": torch.__version__}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent
def run_ours(bench, mpirun, min_bytes, max_bytes, repetitions, env, log_path):
    """{way: {size: {"time_s", "ok", "iters"}}} from one bench_allreduce run."""
    argv = [mpirun, "--oversubscribe", "--bind-to", "core", "-np", str(RANKS), bench, str(min_bytes), str(max_bytes),
            str(repetitions)]
    with open(log_path, "w") as log:
        status = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    text = open(log_path).read()
    if status not in (0, 1):  # 1: a check failed, which the table shows
        raise SystemExit(f"report: bench_allreduce failed (status {status}):\n{text[-2000:]}")
    ways = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) == 8 and cols[0].isdigit():
            ways.setdefault(cols[3], {})[int(cols[0])] = {"time_s": float(cols[4]) / 1e6, "ok": cols[7] == "ok",
                                                          "iters": int(cols[2])}
    banner = "\n".join(line for line in text.splitlines()[:2])
    return ways, banner


def run_gloo(sizes, repetitions, env, folder, tag):
    rendezvous = os.path.join(folder, f"{tag}.rendezvous")
    procs, logs = [], []
    for rank in range(RANKS):
        job = {"rank": rank, "world": RANKS, "sizes": sizes, "repetitions": repetitions, "rendezvous": rendezvous}
        logs.append(os.path.join(folder, f"{tag}.rank{rank}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--gloo-worker", json.dumps(job)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=600)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("report: the gloo all-reduce failed:\n" + "\n".join(open(log).read()[-1500:] for log in logs))
    out = json.loads(open(logs[0]).read().strip().splitlines()[-1])
    return {int(size): entry for size, entry in out["sizes"].items()}, out["torch"]


def measure(bench, mpirun, min_bytes, max_bytes, repetitions, rounds, env_ours, env_peer, progress):
    """Alternating rounds of ours and gloo; returns {way: {size: {"time_s", "times", "ok"}}}, the banner,
    torch's version. Ways: bench_allreduce's (all_reduce, async+wait, MPI_Allreduce, rs+ag, rs+ag_async,
    MPI_RSB+Allgather, reduce_scatter, MPI_Reduce_scatter_block, all_gather, MPI_Allgather) and gloo."""
    sizes = sizes_between(min_bytes, max_bytes)
    per_round = {}
    banner, torch_version = "", ""
    with tempfile.TemporaryDirectory(prefix="pipeshard-allreduce-") as folder:
        for r in range(rounds):
            for side in (("ours", "gloo") if r % 2 == 0 else ("gloo", "ours")):
                if side == "ours":
                    ways, banner = run_ours(bench, mpirun, min_bytes, max_bytes, repetitions, env_ours,
                                            os.path.join(folder, f"ours_{r}.log"))
                else:
                    gloo, torch_version = run_gloo(sizes, repetitions, env_peer, folder, f"gloo_{r}")
                    ways = {"gloo": gloo}
                for way, by_size in ways.items():
                    for size, entry in by_size.items():
                        slot = per_round.setdefault(way, {}).setdefault(size, {"times": [], "ok": True,
                                                                               "iters": entry.get("iters")})
                        slot["times"].append(entry["time_s"])
                        slot["ok"] = slot["ok"] and entry["ok"]
            progress(f"all-reduce round {r + 1}/{rounds} done")
    for by_size in per_round.values():
        for slot in by_size.values():
            slot["time_s"] = statistics.median(slot["times"])
            slot["spread"] = max(slot["times"]) / min(slot["times"]) - 1
    return per_round, banner, torch_version


def bus_factor(way="all_reduce", ranks=RANKS):
    """nccl-tests' busbw / algbw for one of bench_allreduce's ways (or gloo, an all-reduce)."""
    half = (ranks - 1) / ranks
    return half if way in HALF_WAYS else 2 * half


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--gloo-worker":
        gloo_worker(json.loads(sys.argv[2]))
    else:
        sys.exit("report_allreduce.py is a module of bench/report.py; run that")
