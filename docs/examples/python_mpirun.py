# pipeshard.train across processes: run from the repository root as
#   mpirun -np 2 /usr/bin/python3 docs/examples/python_mpirun.py
# (as root: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; more ranks than
# cores: --oversubscribe). Every rank runs this same script on the same arrays.
import numpy as np

import pipeshard

m = pipeshard.load("models/simple_digits.onnx")
X = np.load("data/digits_train_features.npy", mmap_mode="r")  # every rank maps the same pages
y = np.load("data/digits_train_labels.npy")
Xe, ye = np.load("data/digits_test_features.npy"), np.load("data/digits_test_labels.npy")

# Two pipeline stages of four micro-batches each: the job's 2 processes.
same = pipeshard.check_equivalence(m, X, y, steps=10, optimizer="adamw", batch_size=64, stages=2, micro_batches=4)
result = pipeshard.train(m, X, y, optimizer="adamw", batch_size=64, epochs=3, eval=(Xe, ye), stages=2,
                         micro_batches=4)
if pipeshard.rank() == 0:  # every rank holds the same result; one prints it
    print(f"rank {pipeshard.rank()} of {pipeshard.world_size()}: equivalent to one process: {same}")
    print(f"epoch 3: eval accuracy {100 * result.eval[-1].accuracy:.1f}%")
    result.model.save("/tmp/trained.onnx")
