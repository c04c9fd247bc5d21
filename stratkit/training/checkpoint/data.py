"""Where the data stands at a backup, per input kind, and how a resumed run's input starts there.

The position is global: epoch e, step s of the global batch, so it holds
whatever the world size (an elastic run that shrank or grew reads the same
global batches). Each input kind continues from it its own way:

| input | how the resumed run starts at epoch e, step s |
|---|---|
| numpy arrays (`Trainer.fit`) | each epoch's order is a function of (seed, epoch): the index stream starts at batch s of epoch e; nothing is read twice (`inputs.arrays`) |
| `keras.utils.PyDataset` | by index: the resumed epoch's pass starts at batch s (`ResumedPyDataset`); the batches before it are not read |
| `tf.data.Dataset` with `steps_per_epoch` (one stream for the run) | the iterator `fit` trains from reads and drops the e x steps + s batches read before (a replay, said once) |
| `tf.data.Dataset`, one pass per epoch | the resumed epoch's pass reads and drops its first s batches (a replay, said once) |
| `dataset_fn(input_context)` | each worker's iterator reads and drops its e x steps + s batches (exact at the same world size; said when it changed) |
| `stratkit.data.TableInput` (a table) | the backup records the snapshot (a Delta version, the files) and the order's settings; the resumed run reads that snapshot, and every lane starts at its offset for (epoch, step): nothing read twice, at any world size (`stratkit.data.cursor`) |
| your own `model.fit` (`stratkit.callbacks.Backup`) | Keras's iterator reads and drops what it read before the backup (a replay, said once) |

TensorFlow's own iterator checkpointing (`tf.train.Checkpoint(iterator=...)`)
would carry a pipeline's buffers instead, but the iterator Keras's `fit`
reads under a strategy (`tf.distribute`'s `DistributedIterator`) is not
trackable in TensorFlow 2.16-2.21 (measured: `Checkpoint was expecting iterator
to be a trackable object ... DistributedIterator`), so a tf.data position is
reached by a replay through the very iterator `fit` trains from: the same
iterators are made as in the uninterrupted run, so a pipeline that gives the
same batches in a new process, a reshuffle with a fixed seed included, is
continued exactly (a `Dataset.skip` in the pipeline was measured not to be: the
reshuffle seeds are drawn by every iterator of a dataset, and Keras's peek at
the first batch then read through the skip). A pipeline that reshuffles without
a fixed seed draws other orders in a new process: nothing makes that exact
(the resume says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import keras

from stratkit.data import TableInput
from stratkit.training.checkpoint.layout import Position


@dataclass
class DataPosition:
    """What the resumed epoch needs from its data.

    Attributes:
        skip: batches the first resumed epoch reads and drops (None: derived from Keras's iterator, for a
            plain `model.fit`); 0 when the input already starts at the position.
        before: run before the resumed epoch's data starts (a PyDataset's index offset).
        note: said once when a run resumes mid-epoch (what the resume reads again, or cannot continue).
    """

    skip: int | None = 0
    before: Callable[[], None] | None = None
    note: str | None = None


class ResumedPyDataset(keras.utils.PyDataset):
    """The user's PyDataset, whose next pass starts at batch `start` once `start_at(start)` was called.

    Keras reads a finite PyDataset's pass as indices 0 .. num_batches-1; during
    the resumed pass this one has num_batches - start batches, index i being the
    user's batch start + i, so the batches before the backup are never read. The
    pass after it (Keras calls `on_epoch_end`) is the user's whole dataset again.
    Everything else (workers, multiprocessing, `on_epoch_end`) is the user's.
    """

    def __init__(self, data: Any) -> None:
        super().__init__(workers=getattr(data, "workers", 1),
                         use_multiprocessing=getattr(data, "use_multiprocessing", False),
                         max_queue_size=getattr(data, "max_queue_size", 10))
        self.data = data
        self.offset = 0

    def start_at(self, start: int) -> None:
        self.offset = int(start)

    def __getitem__(self, index: int) -> Any:
        return self.data[index + self.offset]

    @property
    def num_batches(self) -> int | None:
        total = self.data.num_batches
        return None if total is None else total - self.offset

    def __len__(self) -> int:
        total = self.num_batches
        if total is None:
            raise TypeError("an infinite PyDataset has no len()")
        return total

    def on_epoch_begin(self) -> None:
        self.data.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.offset = 0
        self.data.on_epoch_end()


def resumable_input(data: Any, position: Position, record: dict | None = None, *, backup_dir: str = "") -> Any:
    """`data` as `Trainer.fit` should hand it to the input layer for a resume at `position`.

    A PyDataset resumed mid-epoch is wrapped (`ResumedPyDataset`); a `stratkit.data.TableInput` reads the
    snapshot and order the backup recorded (`record`: its Delta version, its files), checked
    (`stratkit.data.cursor.check_resume`); every other input is positioned by
    `stratkit.training.inputs.prepare(first_epoch, first_step)`.
    """
    if position.step > 0 and isinstance(data, keras.utils.PyDataset):
        return ResumedPyDataset(data)
    if isinstance(data, TableInput) and record is not None and position != Position():
        return data.pinned(record, mid_pass=position.step > 0, backup=backup_dir)
    return data


def data_position(data: Any, kind: str, replay: int, position: Position, *, world_changed: bool) -> DataPosition:
    """How the resumed epoch's data starts, for `Trainer.fit`'s prepared input of `kind`.

    Args:
        data: what `resumable_input` returned (a `ResumedPyDataset` is started by index).
        kind: the prepared input's kind (`PreparedData.kind`).
        replay: batches the prepared input could not skip itself (`PreparedData.replay`).
        position: where the backup stands.
        world_changed: the world size differs from the backup's.
    """
    if position.step == 0 and not replay:
        return DataPosition()
    if isinstance(data, ResumedPyDataset):
        step = position.step
        return DataPosition(before=lambda: data.start_at(step))
    note = None
    if kind == "dataset_fn" and world_changed:
        note = (f"the input is a dataset_fn and the world size changed since the backup: each worker read and "
                f"dropped {replay} batches to reach epoch {position.epoch + 1} step {position.step}, but its shard is "
                "not the one it read before, so the examples after the resume are not the uninterrupted run's")
    elif replay:
        note = (f"the input is a tf.data pipeline: to continue at epoch {position.epoch + 1} step {position.step} the "
                f"resumed run read and dropped {replay} batches (TensorFlow cannot save the position of the iterator "
                "fit reads). Exact when the pipeline gives the same batches in a new process (no reshuffle without "
                "a fixed seed)")
    return DataPosition(skip=replay, note=note)


def model_fit_position(position: Position) -> DataPosition:
    """For a plain `model.fit` (`stratkit.callbacks.Backup`): Keras's own iterator is replayed to the position."""
    if position.step == 0:
        return DataPosition()
    return DataPosition(skip=None, note=(
        f"model.fit's input is read again up to epoch {position.epoch + 1} step {position.step} (its batches are "
        "dropped, not trained). Exact when the input gives the same batches in a new process: a PyDataset, "
        "arrays with shuffle=False, a tf.data pipeline without unseeded reshuffling; stratkit.Trainer.fit "
        "continues shuffled arrays without reading them again"))
