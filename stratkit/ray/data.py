"""Ray Data inside Ray Train: a worker's `ray.train.get_dataset_shard(...)` as `Trainer.fit` input, exact.

Ray Train splits each dataset it is given among the workers itself
(`streaming_split(num_workers, equal=True)` in its default `DataConfig`), so a
worker's shard is its part of the data, not the whole: the opposite of arrays,
which every worker holds whole and `Trainer.fit` cuts. `dataset_shard_to_tf`
turns the shard into a `dataset_fn(input_context)` (an input kind `Trainer.fit`
already reads per worker) with the global-batch semantics of arrays:

* each step every worker takes the next `global_batch_size / num_workers` rows
  of its shard (split among its replicas), and the gradient is the mean over
  the global batch they make together: the step of one process on that global
  batch (equal within 1e-5, tests/ray/test_ray_train.py);
* every worker must run the same number of steps (MultiWorkerMirrored's
  collectives): the workers agree on their shard sizes before training, and
  shards of different sizes are refused with a `ConfigError` (they could only
  be trained by dropping or repeating rows on some workers); rows beyond the
  last full global batch are left out, and said so;
* the shard is read once, into this worker's memory, and every epoch sees it
  in that order: shuffle in Ray Data (`ds.random_shuffle(seed=...)`) before
  `TensorflowTrainer(datasets=...)`.

Imports Ray when called, TensorFlow inside the `dataset_fn` (`stratkit.strategy.collectives` for the agreement).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.ray.versions import import_ray
from stratkit.strategy.collectives import min_over_workers

log = status.logger(__name__)

API = "dataset_shard_to_tf"


def dataset_shard_to_tf(shard: Any, trainer: Any, global_batch_size: int, *, features: str | Sequence[str],
                        label: str) -> tuple[Callable[[Any], Any], int]:
    """This worker's Ray Data shard as `Trainer.fit` input: `(dataset_fn, steps_per_epoch)`.

    Call it in `train_loop_per_worker`, on every worker (it is a collective), after `stratkit.Trainer()`:

        shard = ray.train.get_dataset_shard("train")
        data, steps = dataset_shard_to_tf(shard, trainer, 64, features="x", label="y")
        trainer.fit(model, data, epochs=10, steps_per_epoch=steps)

    Args:
        shard: `ray.train.get_dataset_shard(name)` (a Ray `DataIterator`).
        trainer: this worker's `stratkit.Trainer` (its strategy runs the agreement).
        global_batch_size: examples per step across all workers, as for arrays; a multiple of the
            trainer's replicas.
        features: the column holding the model's input, or several columns (then `x` is a dict by name,
            for a model with named inputs).
        label: the column holding the target.

    Returns:
        `dataset_fn(input_context)` for `Trainer.fit`, and the `steps_per_epoch` to pass with it (the
        same on every worker: full global batches of the shards).

    Raises:
        ConfigError: a bad batch size or column, a trainer that is not this Ray Train cluster's, or
            shards of different sizes (naming the sizes and the fix).
    """
    ray = import_ray(API)
    import ray.train

    world = int(ray.train.get_context().get_world_size())
    replicas = int(trainer.num_replicas)
    if trainer.spec.strategy == "parameter_server" or max(int(trainer.spec.num_workers), 1) != world:
        raise ConfigError(f"{API} needs the Trainer of this Ray Train worker group ({world} worker(s)): the "
                          f"trainer's strategy is {trainer.spec.strategy} with {trainer.spec.num_workers} "
                          "worker(s). Fix: make stratkit.Trainer() inside train_loop_per_worker, where Ray "
                          "wrote TF_CONFIG")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1 \
            or global_batch_size % replicas:
        raise ConfigError(f"global_batch_size must be a positive multiple of the {replicas} replicas: got "
                          f"{global_batch_size!r}. Fix: e.g. global_batch_size={replicas * 32}")
    names = [features] if isinstance(features, str) else list(features)
    failed: BaseException | None = None
    try:
        columns, problem = _read(shard, [*names, label])
    except Exception as exc:  # noqa: BLE001 - raised again after the agreement, which every worker must reach
        columns, problem, failed = {}, "", exc
    rows = -1 if problem or failed is not None else len(columns[label])
    # Every worker reaches the agreement, even one that could not read its shard (else the others would hang).
    fewest = min_over_workers(trainer.strategy, rows) if world > 1 else rows
    most = -min_over_workers(trainer.strategy, -rows) if world > 1 else rows
    if failed is not None:
        raise failed
    if problem:
        raise ConfigError(problem)
    if fewest < 0:
        raise ConfigError(f"{API}: another Ray Train worker could not read its Ray Data shard. Fix: the one in "
                          "that worker's error (in its log)")
    if fewest != most:
        raise ConfigError(f"the Ray Data shards of the {world} workers differ in size ({fewest} to {most} rows; "
                          f"this worker: {rows}): MultiWorkerMirrored runs the same steps on every worker, so "
                          "they cannot be trained as one process's global batches. Fix: let Ray Train split the "
                          "dataset (its default DataConfig splits with equal=True), not a dataset you split "
                          "yourself, or give every worker the same number of rows")
    per_worker = global_batch_size // world
    steps = rows // per_worker
    if steps == 0:
        raise ConfigError(f"each worker's Ray Data shard has {rows} rows, fewer than one step's "
                          f"{per_worker} (global_batch_size={global_batch_size} over {world} workers). Fix: a "
                          "smaller global_batch_size, or more data")
    if rows % per_worker:
        log.info("%s: %d row(s) of each worker's shard beyond the last full global batch are left out "
                 "(%d steps of %d)", API, rows % per_worker, steps, global_batch_size)
    x = columns[names[0]] if isinstance(features, str) else {name: columns[name] for name in names}
    y = columns[label]
    used = steps * per_worker

    def dataset_fn(input_context: Any) -> Any:
        import tensorflow as tf

        if input_context.num_input_pipelines != world:
            raise ConfigError(f"{API}'s dataset_fn got {input_context.num_input_pipelines} input pipelines for "
                              f"{world} Ray Train workers. Fix: pass it to the Trainer it was made with")
        per_replica = input_context.get_per_replica_batch_size(global_batch_size)
        cut = {k: v[:used] for k, v in x.items()} if isinstance(x, dict) else x[:used]
        return tf.data.Dataset.from_tensor_slices((cut, y[:used])).batch(per_replica, drop_remainder=True)

    return dataset_fn, steps


def _read(shard: Any, names: Sequence[str]) -> tuple[dict[str, np.ndarray], str]:
    """Every row of the shard as numpy columns (one pass), and what is wrong with it ("": nothing)."""
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for batch in shard.iter_batches(batch_size=4096, batch_format="numpy"):
        missing = [name for name in names if name not in batch]
        if missing:
            return {}, (f"{API}: the Ray dataset has no column {missing[0]!r} (its columns: "
                        f"{', '.join(map(repr, batch))}). Fix: features=/label= name its columns")
        for name in names:
            parts[name].append(np.asarray(batch[name]))
    if not parts[names[0]]:
        return {name: np.zeros((0,)) for name in names}, ""
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}, ""
