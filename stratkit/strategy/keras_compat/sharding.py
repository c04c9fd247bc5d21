"""Which auto-shard policy a `tf.data` input trains with on several workers: exact, unless the user chose FILE.

Measured (TF 2.21, Keras 3.15.1, 2 MultiWorkerMirrored workers, TFRecord files):

* ``AutoShardPolicy.AUTO`` (every dataset's default) tries FILE first. With
  fewer files than workers TensorFlow fails at step 1 (``Could not apply FILE
  based sharding``); with enough files each worker reads whole files of its
  own, so a step's global batch is a different set of rows from one
  process's (every row still once per epoch): 2.5e-2 off one process's
  weights with 4 files (``tests/strategy/input_cases.py``).
* ``DATA`` has every worker read every file and keep its part of each global
  batch: the global batches are one process's, at N times the reading.

So stratkit gives an ``AUTO`` dataset ``DATA`` (:func:`settle`) and says so
once at fit start when the data reads files (where AUTO would have meant
FILE). A policy the user set is kept: FILE (for the I/O) is said to be inexact
and why, and refused before step 1 when there are fewer files than workers
(counted from the pipeline's reader, :func:`.dataset_graph.file_names`).
``Trainer.fit`` (``training/inputs``) and every dataset a stratkit strategy
distributes (:mod:`.distributed_input`, the user's own ``model.fit``) go
through :func:`settle`.
"""

from __future__ import annotations

import threading
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.strategy.keras_compat import dataset_graph
from stratkit.strategy.keras_compat.trainer_patches import _is_multi_worker_collective

log = status.logger(__name__)

_said: set[str] = set()
_said_lock = threading.Lock()


def workers_of(strategy: Any) -> int:
    """The workers that shard the input between them: a multi-worker MWMS cluster's chief and workers, else 1."""
    if strategy is None or not _is_multi_worker_collective(strategy):
        return 1
    cluster = strategy.cluster_resolver.cluster_spec().as_dict()
    return max(sum(len(cluster.get(role, ())) for role in ("chief", "worker")), 1)


def _policy(name: str) -> Any:
    import tensorflow as tf

    return getattr(tf.data.experimental.AutoShardPolicy, name)


def with_policy(dataset: Any, name: str) -> Any:
    """`dataset` with auto-shard policy `name` ("DATA", "OFF", ...)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = _policy(name)
    return dataset.with_options(options)


def file_count(dataset: Any) -> int | None:
    """How many files FILE sharding would split among the workers; None when unknown (no reader found, or
    names whose number tf.data cannot tell without reading them)."""
    names = dataset_graph.file_names(dataset)
    if names is None:
        return None
    count = int(names.cardinality())
    return count if count >= 0 else None


def settle(dataset: Any, num_workers: int) -> Any:
    """`dataset` with the auto-shard policy it trains with on `num_workers` workers (see the module's text).

    Raises:
        ConfigError: FILE was chosen, and the data has fewer files than there are workers.
    """
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == _policy("AUTO"):
        dataset = with_policy(dataset, "DATA")
        if num_workers > 1 and dataset_graph.file_names(dataset) is not None:
            files = file_count(dataset)
            few = files is not None and files < num_workers
            too_few = f", and with {files} file(s) for {num_workers} workers a failure at step 1" if few else ""
            _say_once(log.info, f"data reads {_files(files)} on {num_workers} workers: auto-shard policy DATA "
                      "(stratkit's choice for the dataset's AUTO): every worker reads every file and trains its part "
                      "of each global batch, so training equals one process's, at the cost of each worker reading "
                      "all the data. AUTO would have given each worker whole files of its own (FILE): other global "
                      f"batches than one process's{too_few}. To read 1/N of the files per worker instead, set the "
                      "policy FILE yourself (docs/trainer.md, Sharding).")
        return dataset
    if policy == _policy("FILE") and num_workers > 1:
        files = file_count(dataset)
        if files is not None and files < num_workers:
            raise ConfigError(
                f"data reads {_files(files)} with auto-shard policy FILE (set on the dataset), but there are "
                f"{num_workers} workers: FILE gives each worker whole files, so {num_workers - files} worker(s) would "
                "get none and TensorFlow would fail at step 1 ('Could not apply FILE based sharding'). Fix: write "
                f"the data as at least {num_workers} files (a multiple of {num_workers} gives every worker as many), "
                "or set AutoShardPolicy.DATA (exact: every worker reads all the files and trains its part of each "
                "global batch), or leave the policy at AUTO (stratkit then uses DATA)")
        _say_once(log.warning, f"data reads {_files(files)} with auto-shard policy FILE on {num_workers} workers: each "
                  "worker reads whole files of its own (1/N of the reading), so a step's global batch holds other rows "
                  "than one process's (every row is still trained once an epoch; workers with more rows than others "
                  "end their epoch later): not one process's training. For exact training set AutoShardPolicy.DATA, "
                  "or leave AUTO (docs/trainer.md, Sharding).")
    return dataset


def _files(count: int | None) -> str:
    return "files" if count is None else f"{count} file(s)"


def _say_once(say: Any, message: str) -> None:
    """One line per situation and process (fit after fit, or its validation data, says nothing new)."""
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    say(message)
