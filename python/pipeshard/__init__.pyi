# Type hints for pipeshard (the package is pipeshard/__init__.py over the extension
# _pipeshard). test_stub.py checks that train's keywords here are _TRAIN_FLAGS's.
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
import numpy.typing as npt

_Path = str | os.PathLike[str]

class Step:
    step: int
    epoch: int
    total_steps: int
    loss: float
    lr: float
    samples_per_s: float
    skipped: bool

class Evaluation:
    epoch: int
    step: int
    train_loss: float
    loss: float
    accuracy: float

class Plan:
    stages: list[dict[str, Any]]
    total_parameters: int
    balance: float
    crossing_bytes: int
    def memory_per_stage(self) -> list[int]: ...
    def table(self, folder: Optional[str] = None) -> str: ...
    def to_json(self) -> str: ...
    def write(self, folder: str) -> None: ...

class Model:
    path: str
    layers: int
    parameter_count: int
    nodes: int
    def save(self, path: str) -> None: ...
    def weights(self) -> dict[str, npt.NDArray[np.float32]]: ...
    def partition(
        self,
        stages: int = 1,
        tensor_parallel: int = 1,
        balance: str = "params",
        batch_size: int = 32,
        micro_batches: Optional[int] = None,
        schedule: str = "1f1b",
        virtual_stages: int = 0,
        optimizer: str = "adam",
        keep_activations: bool = False,
        replicas: int = 1,
        zero: int = 0,
        bucket_mb: float = 25.0,
    ) -> Plan: ...
    def plan_layouts(
        self,
        ranks: int,
        batch_size: int = 32,
        optimizer: str = "adam",
        balance: str = "params",
        bucket_mb: float = 25.0,
        memory_per_rank: int | str | None = None,
        profile: _Path | None = None,
        max_micro_batches: int = 16,
    ) -> dict[str, Any]: ...
    def to_torch(self, module: Any) -> Any: ...

class TrainResult:
    model: Model
    history: list[Step]
    eval: list[Evaluation]
    layout: Optional[str]
    predicted_step_ms: Optional[float]
    def to_torch(self, module: Any) -> Any: ...

def load(source: _Path | bytes | Any) -> Model: ...
def from_torch(module: Any, example_input: Any, **export_options: Any) -> Model: ...
def rank() -> int: ...
def world_size() -> int: ...
def train(
    model: Model,
    X: npt.NDArray[Any],
    y: npt.NDArray[Any],
    *,
    eval: Optional[tuple[npt.NDArray[Any], npt.NDArray[Any]]] = None,
    callback: Optional[Callable[[Step], Any]] = None,
    progress: Optional[bool] = None,
    verbose: bool = False,
    loss: str | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    momentum: float | None = None,
    nesterov: bool | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    lr_schedule: str | None = None,
    warmup_steps: int | None = None,
    clip_grad_norm: float | None = None,
    batch_size: int | None = None,
    grad_accum: int | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    shuffle: bool | None = None,
    seed: int | None = None,
    metrics: _Path | None = None,
    save: _Path | None = None,
    checkpoint: _Path | None = None,
    checkpoint_every: int | None = None,
    resume: _Path | None = None,
    device: str | None = None,
    precision: str | None = None,
    gpu_comm: str | None = None,
    stages: int | None = None,
    tensor_parallel: int | None = None,
    micro_batches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    balance: str | None = None,
    trace: _Path | None = None,
    tensorboard: _Path | None = None,
    plot: _Path | None = None,
    bucket_mb: float | None = None,
    zero: int | None = None,
    comm_timeout: float | None = None,
    loss_scale: str | int | None = None,
    on_nonfinite: str | None = None,
    cuda_graph: bool | None = None,
    keep_activations: bool | None = None,
    sync_batchnorm: bool | None = None,
    layout: str | None = None,
    profile: _Path | None = None,
) -> TrainResult: ...
def check_equivalence(model: Model, X: npt.NDArray[Any], y: npt.NDArray[Any], steps: int = 10, **options: Any) -> bool: ...
