"""`route_side_effects`: where each Keras callback writes on a non-chief worker.

In-process and fast: routing is decided before training, from the callback
objects alone. The end-to-end behaviour (2 real workers, a kill and a resume)
is in tests/strategy/test_model_fit_path.py.
"""

from __future__ import annotations

import os

import pytest

keras = pytest.importorskip("keras")

from stratkit.errors import ConfigError  # noqa: E402
from stratkit.training.callbacks import AgreeOnResume, remove_dirs, route_side_effects  # noqa: E402


def _user_callbacks(root) -> list:
    return [keras.callbacks.TensorBoard(str(root / "tb")),
            keras.callbacks.ModelCheckpoint(str(root / "ckpt" / "model.keras")),
            keras.callbacks.CSVLogger(str(root / "log.csv")),
            keras.callbacks.BackupAndRestore(str(root / "backup"), double_checkpoint=True,
                                             delete_checkpoint=False),
            keras.callbacks.RemoteMonitor(),
            keras.callbacks.EarlyStopping()]


def test_the_chief_keeps_the_users_callbacks_as_they_are(tmp_path):
    callbacks = _user_callbacks(tmp_path)
    routed, temps = route_side_effects(callbacks, is_chief=True)
    assert routed == callbacks and all(a is b for a, b in zip(routed, callbacks)) and temps == []


def test_other_workers_write_every_file_into_private_dirs_and_leave_the_users_objects_alone(tmp_path):
    callbacks = _user_callbacks(tmp_path)
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "training_metadata.json").write_text('{"epoch": 2, "batch": 0}')
    routed, temps = route_side_effects(callbacks, is_chief=False)
    try:
        tb, ckpt, csv, backup, early = routed                      # RemoteMonitor: the chief's job
        assert early is callbacks[5]                              # writes nothing: the same object
        assert [type(c) for c in (tb, ckpt, csv, backup)] == [type(c) for c in callbacks[:4]]
        private = [tb.log_dir, ckpt.filepath, csv.filename, backup.backup_dir]
        assert all(any(p.startswith(t) for t in temps) for p in private), (private, temps)
        assert os.path.basename(ckpt.filepath) == "model.keras" and os.path.basename(csv.filename) == "log.csv"
        # BackupAndRestore keeps its options and starts from the chief's backup.
        assert (backup.double_checkpoint, backup.delete_checkpoint) == (True, False)
        assert open(os.path.join(backup.backup_dir, "training_metadata.json")).read() == '{"epoch": 2, "batch": 0}'
        # The user's objects still point where the user asked.
        assert callbacks[0].log_dir == str(tmp_path / "tb")
        assert callbacks[1].filepath == str(tmp_path / "ckpt" / "model.keras")
        assert callbacks[3].backup_dir == str(tmp_path / "backup")
        # Routing twice (Trainer.fit, then the guard in model.fit) moves nothing again.
        again, more = route_side_effects(routed, is_chief=False)
        assert all(a is b for a, b in zip(again, routed)) and more == []
    finally:
        remove_dirs(temps)
    assert not any(os.path.exists(t) for t in temps)


def test_on_a_multi_worker_run_every_worker_checks_the_resume_epoch_after_a_backup(tmp_path):
    callbacks = _user_callbacks(tmp_path)
    for is_chief in (True, False):
        routed, temps = route_side_effects(callbacks, is_chief=is_chief, multi_worker=True)
        remove_dirs(temps)
        kinds = [type(c).__name__ for c in routed]
        assert kinds.index("AgreeOnResume") == kinds.index("BackupAndRestore") + 1
        assert isinstance(routed[kinds.index("AgreeOnResume")], AgreeOnResume)


def test_a_callback_whose_files_cannot_be_moved_is_refused_on_every_worker():
    class Harmless(keras.callbacks.Callback):
        pass

    orbax = getattr(keras.callbacks, "OrbaxCheckpoint", None)
    if orbax is None:
        pytest.skip("this Keras has no OrbaxCheckpoint")
    # OrbaxCheckpoint needs the orbax package to be constructed; the check is by type.
    callback = orbax.__new__(orbax)
    for is_chief in (True, False):
        with pytest.raises(ConfigError, match=r"OrbaxCheckpoint.*Fix: use keras.callbacks.ModelCheckpoint"):
            route_side_effects([Harmless(), callback], is_chief=is_chief)
