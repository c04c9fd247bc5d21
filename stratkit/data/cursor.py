"""Where a table input stands: (snapshot, pass, global batch), what a backup records, and where a resume reads.

`Trainer.fit` counts epochs and steps; the table counts *passes* (one read of every row, ceil(R/B) global
batches, the last one partial) and global batches within a pass. Without `steps_per_epoch` an epoch is a
pass; with it, epochs of `steps_per_epoch` steps run on across passes, and global step n = epoch x steps +
step is batch n mod ceil(R/B) of pass n div ceil(R/B) (`Cursor.at`).

From a cursor every lane's offset follows in closed form (`shards.Layout.offsets` of the global position
kB): a resume at any world size starts each of its lanes at the window holding that offset and drops only
the rows of that window that come before it, nothing read and dropped beyond one window per lane.

What the backup records (`OrderRecord`, in the backup's state under "data"): the snapshot (the plan's
fingerprint and its source's own record: a Delta version, the files with their sizes), the seed, the lanes,
the window and whether it shuffles. A resume pins the same snapshot, and refuses a mid-pass resume whose
order would differ (a ConfigError naming the setting and the fix).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stratkit.data.shards import steps_for
from stratkit.errors import ConfigError


@dataclass(frozen=True, order=True)
class Cursor:
    """Global batch `batch` of pass `pass_` (the next batch to train on)."""

    pass_: int = 0
    batch: int = 0

    @classmethod
    def at(cls, epoch: int, step: int, *, rows: int, batch_size: int, steps_per_epoch: int | None = None) -> Cursor:
        """The cursor of `Trainer.fit`'s (epoch, step)."""
        per_pass = steps_for(rows, batch_size)
        done = int(epoch) * (steps_per_epoch or per_pass) + int(step)
        return cls(*divmod(done, per_pass))

    def global_position(self, batch_size: int) -> int:
        """The first global position of this batch."""
        return self.batch * int(batch_size)


@dataclass(frozen=True)
class OrderRecord:
    """What fixes the order of a run's rows: recorded in each backup, pinned by a resume."""

    source: dict[str, Any]
    fingerprint: str
    rows: int
    seed: int
    lanes: int
    window: int
    shuffle: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> OrderRecord | None:
        if not value or "fingerprint" not in value:
            return None
        fields = cls.__dataclass_fields__
        return cls(**{k: value[k] for k in fields if k in value})


def check_resume(saved: OrderRecord, now: OrderRecord, *, mid_pass: bool, backup: str) -> str | None:
    """Refuse a resume that would not continue the backup's order; a note for a change it accepts.

    The snapshot must be the same (the caller pins it from `saved`, so a difference means the table's files
    changed under the run). Mid-pass, the seed, lanes, window and shuffle must be the same too; at a pass
    boundary a change is accepted (the next pass is a new order anyway) and said.

    Raises:
        ConfigError: naming the setting, both values and the fix.
    """
    if saved.fingerprint != now.fingerprint or saved.rows != now.rows:
        raise ConfigError(f"backup_dir={backup!r} was written reading the table snapshot {saved.fingerprint[:12]} "
                          f"({saved.rows} rows), but this run reads {now.fingerprint[:12]} ({now.rows} rows): the "
                          "table's files changed under the run (a file rewritten or removed). Nothing was "
                          "changed. Fix: restore the table's files, read a Delta table (its versions are kept), or "
                          "move the backup away to start over")
    changes = [(name, getattr(saved, name), getattr(now, name)) for name in ("seed", "lanes", "window", "shuffle")
               if getattr(saved, name) != getattr(now, name)]
    if not changes:
        return None
    if mid_pass:
        name, old, new = changes[0]
        shown = {"window": "shuffle_window"}.get(name, name)
        raise ConfigError(f"backup_dir={backup!r} holds a backup in the middle of a pass over the table read with "
                          f"{shown}={old!r}, but this run has {shown}={new!r}: the rows after the backup would not "
                          f"be the uninterrupted run's. Nothing was changed. Fix: pass {shown}={old!r} to continue "
                          "it, or move the backup away to start over")
    return "; ".join(f"{name} {old!r} -> {new!r}" for name, old, new in changes)


__all__ = ["Cursor", "OrderRecord", "check_resume"]
