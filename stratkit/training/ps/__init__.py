"""Parameter-server training for Keras 3: the coordinator loop behind `Trainer.fit`.

Keras 3 has no ParameterServerStrategy path: `model.fit` refuses the
strategy's datasets and `DatasetCreator` is gone. On a PS cluster the same
user script runs on every task; `Trainer()` turns ps and worker tasks into
servers, and `trainer.fit` on the chief runs the coordinator loop, on the
evaluator the sidecar evaluation. One module per job:

  fit.py          which task does what (`fit_parameter_server`, `evaluate_locally`)
  coordinator.py  the chief's loop: schedule one closure per step, join per epoch
  variables.py    building every variable up front; the atomic counters on the ps
  metrics.py      the model's metrics as exact per-step deltas
  checkpoints.py  the chief's epoch checkpoints and end-of-training marker
  evaluator.py    the sidecar evaluator watching those checkpoints

Inputs go through `stratkit.training.inputs` (each worker its own shard,
repeated); the private Keras/TensorFlow pieces the loop runs on are in
`stratkit.strategy.keras_ps`, behind the version gate.
"""

from __future__ import annotations

from typing import Any

from stratkit.training import inputs
from stratkit.training.ps.checkpoints import DONE_FILE, ChiefCheckpoints, read_done_marker
from stratkit.training.ps.evaluator import run_sidecar_evaluation, summary_dir
from stratkit.training.ps.fit import check_steps_per_epoch, evaluate_locally, fit_parameter_server

# The names the tests import from before the split.
_ChiefCheckpoints = ChiefCheckpoints


def _check_shards(data: Any, global_batch_size: int | None, num_workers: int, num_replicas: int) -> None:
    """Every worker's shard must hold a step (`InputAdapter.check_worker_shards`, under its old name)."""
    inputs.adapter_for(data).check_worker_shards(global_batch_size, num_workers, num_replicas)


__all__ = ["DONE_FILE", "ChiefCheckpoints", "check_steps_per_epoch", "evaluate_locally", "fit_parameter_server",
           "read_done_marker", "run_sidecar_evaluation", "summary_dir"]
