"""Backups and resume: lose seconds, not an epoch.

`Trainer.fit(backup_dir=D)` backs up after every epoch; with `backup_every=K`
(steps) or a duration ("30s", "10min"), at step boundaries instead. Either way
a preemption notice (SIGTERM, or STRATKIT_PREEMPTION_SIGNAL; USR1 in a Slurm job) makes every worker
stop at the same step, write a backup and exit with status 75
(`stratkit.status.EXIT_PREEMPTED`). A restarted run resumes at the newest
backup every worker has: at its epoch and step, reading the batches an
uninterrupted run reads from there, with the metrics, random state and
callbacks' state it had. With your own `model.fit`: `stratkit.callbacks.Backup`.

One job per module (the API other engines build on, see docs/architecture.md):

| module | job |
|---|---|
| `layout` | file names, `Position` (epoch, step), checkpoint.json |
| `store` | `write_backup` (the one function every backup is written through), `find_resume_point`, `load`, `copy_backup`, pruning, removal |
| `state` | the step state: `RunFacts` (global batch, steps, rows, world size) and their checks; metrics, random state, learning rate, the model manifest |
| `schedule` | `parse_every`: `backup_every` as steps or a duration; when one is due |
| `data` | where the data stands, per input kind; `ResumedPyDataset` |
| `callbacks_state` | callbacks' state (Keras's, stratkit's, `get_state`/`set_state`), CSVLogger's rows |
| `preemption` | the signals, `Preempted` and the exit |
| `agreement` | the step boundary every worker acts at on a notice or the chief's clock (out of band through TensorFlow's coordination service; a collective where none runs) |
| `callback` | `Backup`, the Keras callback that ties them |
"""

from __future__ import annotations

from stratkit.training.checkpoint.callback import Backup
from stratkit.training.checkpoint.data import DataPosition, ResumedPyDataset, data_position
from stratkit.training.checkpoint.data import resumable_input as resumable_input_for
from stratkit.training.checkpoint.layout import METADATA, Metadata, Position, read_metadata, worker_backup_dir
from stratkit.training.checkpoint.preemption import SIGNAL_VAR, Preempted, parse_signal, preemption_signals
from stratkit.training.checkpoint.schedule import Every, check_every, parse_every
from stratkit.training.checkpoint.state import RunFacts
from stratkit.training.checkpoint.store import (BackupWriteError, ResumePoint, copy_backup, find_resume_point,
                                                load, past_end, prepare_dir, readable_position, remove_backup,
                                                write_backup)

__all__ = ["METADATA", "SIGNAL_VAR", "Backup", "BackupWriteError", "DataPosition", "Every", "Metadata", "Position",
           "Preempted", "ResumePoint", "ResumedPyDataset", "RunFacts", "check_every", "copy_backup", "data_position", "find_resume_point", "load",
           "parse_every", "parse_signal", "past_end", "preemption_signals", "prepare_dir", "read_metadata",
           "readable_position", "remove_backup", "resumable_input_for", "worker_backup_dir", "write_backup"]
