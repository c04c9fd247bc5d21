"""How do I start on Ray? The same training function on a Ray cluster, two ways.

* Inside Ray Train: `ray.train.tensorflow.TensorflowTrainer` writes each
  worker's TF_CONFIG, and a `stratkit.Trainer` in `train_loop_per_worker`
  trains as one process; `RayReportCallback` reports metrics and the chief's
  checkpoint every epoch and resumes from Ray's checkpoint after a restart.
* `RayRunner(num_workers=N, num_ps=M).run(train_fn, ...)`: one fresh actor per
  TF task in a placement group, train_fn in a fresh process per task, every
  output line on the driver as `[worker:1] ...`, the chief's return value back,
  `RayTrainingError` with the failing task's root cause, retries, a timeout,
  and parameter servers.
* Ray Data inside Ray Train: `dataset_shard_to_tf(ray.train.get_dataset_shard(...), trainer, global_batch_size,
  features=..., label=...)` feeds `Trainer.fit` with the global batches of one process.

Importing this package imports neither Ray nor TensorFlow; Ray is imported when
a runner runs (`stratkit.ray.versions`), Keras when `RayReportCallback` is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stratkit.ray.failures import RayTrainingError
from stratkit.ray.runner import RayRunner, RayRunReport

if TYPE_CHECKING:
    from stratkit.ray.data import dataset_shard_to_tf
    from stratkit.ray.train import RayReportCallback

__all__ = ["RayReportCallback", "RayRunReport", "RayRunner", "RayTrainingError", "dataset_shard_to_tf"]


def __getattr__(name: str) -> Any:
    # The callback is a Keras class: imported on first use, so the driver of a RayRunner never imports Keras.
    if name == "RayReportCallback":
        return importlib.import_module("stratkit.ray.train").RayReportCallback
    if name == "dataset_shard_to_tf":  # used inside Ray Train's workers only
        return importlib.import_module("stratkit.ray.data").dataset_shard_to_tf
    raise AttributeError(f"module 'stratkit.ray' has no attribute {name!r}")
