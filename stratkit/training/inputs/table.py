"""A `stratkit.data.TableInput`: a table on a disk or a store, read per worker, exactly once, in one order.

Each worker's pipeline is its own (`strategy.distribute_datasets_from_function`): worker i of N reads its
lanes and hands its replicas their parts of each global batch (`stratkit.data.readahead`), so nothing is
auto-sharded and no worker reads another's rows. Its share of a batch may be a few rows more or fewer than
B/N, or none (stratkit's fit is exact on uneven replica batches).

Before the first step every worker agrees on the snapshot: a Delta table without a version reads the
chief's latest version; every worker's plan must then have the same fingerprint (a Parquet listing that
changed between two workers' listings is refused, naming the fix). A failure to plan on one worker is
raised on every worker after the agreement (no worker is left waiting in a collective).

Steps rule: without `steps_per_epoch` an epoch is one pass, ceil(rows / global batch) steps, the last batch
partial, on every worker; with it, epochs of that many steps run on across passes. A resume at (epoch, step)
starts every lane at its offset (`stratkit.data.cursor`): nothing is read twice, at any world size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from stratkit import status
from stratkit.data import TableInput
from stratkit.data.budget import check_budget
from stratkit.data.readahead import last_failure
from stratkit.data.table_input import lanes_note
from stratkit.errors import ConfigError
from stratkit.strategy.keras_compat.trainer_patches import _is_chief
from stratkit.training.inputs import rules
from stratkit.training.inputs.base import InputAdapter, PreparedData, WorkerContext

log = status.logger(__name__)


def agreed(data: TableInput, strategy: Any) -> TableInput:
    """`data` pinned to the snapshot every worker reads (the chief's Delta version), its plan checked alike. Every
    worker plans the table; what planning says (files left out, a partition named as a column) the chief says.

    Raises:
        ConfigError: this or another worker could not plan the table, or the workers' plans differ.
    """
    with status.hushed(strategy is not None and not _is_chief(strategy)):
        return _agreed(data, strategy)


def _agreed(data: TableInput, strategy: Any) -> TableInput:
    from stratkit.strategy import collectives, keras_compat

    multi = strategy is not None and keras_compat.is_multi_worker_collective(strategy)
    failed: BaseException | None = None
    if data.table.kind == "delta" and data.table.version is None:
        try:
            version = data.table.latest_version() or 0
        except Exception as exc:  # noqa: BLE001 - raised after the agreement every worker must reach
            failed, version = exc, -1
        if multi:
            chief = collectives.chief_ints(strategy, [version])[0]
            failed = failed if chief >= 0 else (failed or ConfigError(
                "the chief could not open the Delta table. Fix: the error in the chief's log"))
            version = chief
        if failed is None:
            data = data.at_version(version)
    mark = 0
    if failed is None:
        try:
            mark = int(data.record().fingerprint[:15], 16)
        except Exception as exc:  # noqa: BLE001 - as above
            failed = exc
    if multi:
        mine = -1 if failed is not None else mark
        low, high = collectives.min_over_workers(strategy, mine), -collectives.min_over_workers(strategy, -mine)
        if failed is None and low < 0:
            failed = ConfigError("another worker could not read the table's plan. Fix: the error in that worker's "
                                 "log")
        elif failed is None and low != high:
            failed = ConfigError(f"the workers planned different snapshots of {data.table!r} (the files changed "
                                 "while they listed them). Fix: stop writing to the table while a run starts, read a "
                                 "Delta table (a version pins its files), or list the files yourself")
    if failed is not None:
        raise failed
    return data


class TableAdapter(InputAdapter):
    kind = "table"

    def __init__(self, data: TableInput, model: Any = None) -> None:
        super().__init__(data)
        self.model = model

    def distribute(self, *, strategy: Any, num_replicas: int, global_batch_size: int | None,
                   steps_per_epoch: int | None, training: bool, shuffle: bool, seed: int, tpu: bool,
                   drop_remainder: bool, shard: bool, first_epoch: int = 0, first_step: int = 0) -> PreparedData:
        if global_batch_size is None:
            raise rules.no_batch_size(num_replicas)
        if tpu or drop_remainder:
            raise ConfigError("a TableInput's last batch of a pass is partial (every row once, none dropped), which "
                              "TPUs cannot take. Fix: train on GPUs or CPUs, or pass a tf.data.Dataset")
        data = agreed(self.data.with_order(seed, shuffle) if training else self.data, strategy)
        per_pass = data.steps_per_epoch(global_batch_size)
        layout = data.layout()
        world = _workers(strategy)
        check_budget(layout, data.plan(), world, data.read_ahead_bytes)   # before step 1, not in the pipeline
        data.feed(self.model)                                              # the columns against the model
        if training:
            note = lanes_note(layout, world)
            if note and _is_chief(strategy):                                    # said once, not per worker
                log.warning("%s", note)
        passes = None if training else 1
        epoch, step = (first_epoch, first_step) if training else (0, 0)
        fn = data.dataset_fn(global_batch_size, model=self.model, epoch=epoch, step=step,
                             steps_per_epoch=steps_per_epoch if training else None, passes=passes)
        dataset = strategy.distribute_datasets_from_function(fn)
        steps = steps_per_epoch if (training and steps_per_epoch) else per_pass
        return PreparedData(dataset, global_batch_size, steps, data.num_rows, self.kind, endless=training,
                            record=data.record().as_dict(), failure=last_failure)

    def local(self, global_batch_size: int | None, what: str) -> Any:
        raise ConfigError(f"a TableInput cannot be read here ({what}). Fix: pass it to Trainer.fit / "
                          "Trainer.evaluate on a synchronous strategy (parameter-server training cannot read it)")

    def predict_inputs(self, batch_size: int) -> Any:
        return self.local(batch_size, "predict")

    def batched_element_spec(self, num_workers: int, num_replicas: int) -> Any:
        return self.local(None, "parameter-server training")

    def worker_dataset_fn(self, global_batch_size: int | None, context: WorkerContext, seed: int) -> Callable:
        return self.local(None, "parameter-server training")


def _workers(strategy: Any) -> int:
    """Workers of the strategy's cluster: its replicas over this worker's devices."""
    local = len(getattr(strategy.extended, "worker_devices", ()) or ()) or 1
    return max(int(strategy.num_replicas_in_sync) // local, 1)




def refuse(data: Any, *, class_weight: Any = None, predicting: bool = False) -> None:
    """Refuse what a `TableInput` cannot take, before anything runs (no-op for other data).

    Raises:
        ConfigError: `class_weight` with a table (Keras would map the distributed dataset, which it cannot), or
            a table given to `Trainer.predict` (every row's prediction, in order, on every worker: the reader
            shards and shuffles).
    """
    if not isinstance(data, TableInput):
        return
    if predicting:
        raise ConfigError("Trainer.predict does not read a stratkit.data.TableInput (it returns every row's "
                          "prediction in order on every worker; the table reader shards and shuffles). Fix: "
                          "Trainer.evaluate(model, table_input, ...) for scores, or read the feature columns into "
                          "numpy (e.g. pyarrow.parquet.read_table(path, columns=[...])) and predict on them")
    if class_weight is not None:
        raise ConfigError("class_weight is not applied to a stratkit.data.TableInput (each worker makes its own "
                          "batches from the table). Fix: write each row's class weight as a column and pass "
                          "TableInput(..., sample_weight='that column') (in Spark: df.withColumn('w', "
                          "F.when(F.col('label') == 1, 3.0).otherwise(1.0)))")


@contextlib.contextmanager
def untraced(model: Any, active: bool = True) -> Iterator[None]:
    """The model's traced train/test/predict steps dropped before and after (when `active`: a `Trainer` call fed
    from a table).

    Keras (3.15.1, measured; plain Keras on numpy alike) reuses a model's traced step on the next call, and a
    step traced for labels of one rank fails on another ("Cannot take the length of shape with unknown rank").
    A table's label takes its output's shape ((B, 1) for a `Dense(1)`), where numpy labels are often (B,): so a
    model trained on a table and then scored on held-out arrays (or the reverse) failed. Keras traces anew on
    the next call (`make_train_function` makes one when there is none)."""
    def drop() -> None:
        for name in ("train_function", "test_function", "predict_function"):
            if active and getattr(model, name, None) is not None:
                setattr(model, name, None)

    drop()
    try:
        yield
    finally:
        drop()


__all__ = ["TableAdapter", "agreed", "refuse", "untraced"]
