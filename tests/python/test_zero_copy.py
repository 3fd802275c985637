# pipeshard.train reads the arrays where they lie: training on a 1 GB array raises the
# process's peak resident memory (VmHWM) by a few MB, not by the array.
import numpy as np

import pipeshard
from conftest import SOURCE


def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_training_does_not_copy_the_data():
    m = pipeshard.load(SOURCE / "models" / "simple_digits.onnx")  # 64 features
    small = np.ones((256, 64), np.float32), np.zeros(256, np.int64)
    pipeshard.train(m, *small, steps=2)  # the first run's one-off allocations (BLAS buffers) come here
    rows = (1 << 30) // (64 * 4)
    X = np.full((rows, 64), 0.5, np.float32)  # 1 GB, resident
    y = np.arange(rows, dtype=np.int64) % 10  # 32 MB
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from what is resident now
    before = status_kb("VmHWM")
    # In file order: shuffled, up to 2^20 samples, the order is a permutation held in memory (8 MB here).
    result = pipeshard.train(m, X, y, steps=4, batch_size=64, shuffle=False)
    grown_mb = (status_kb("VmHWM") - before) / 1024
    assert len(result.history) == 4
    print(f"peak resident memory grew by {grown_mb:.2f} MB while training on a 1 GB array")
    assert grown_mb < 8, f"peak memory grew by {grown_mb:.1f} MB while training on a 1 GB array"
