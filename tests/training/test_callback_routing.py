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


def test_other_workers_train_the_users_own_objects_with_their_files_in_private_dirs_until_fit_ends(tmp_path):
    """The user's objects themselves train (so after fit they hold what one process's hold); only their files
    move, for the duration of fit. Before: private copies trained, and the user's `ckpt.best` stayed None."""
    callbacks = _user_callbacks(tmp_path)
    user_paths = [callbacks[0].log_dir, callbacks[1].filepath, callbacks[2].filename, callbacks[3].backup_dir,
                  callbacks[3]._weights_path, callbacks[3]._prev_training_metadata_path]
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "training_metadata.json").write_text('{"epoch": 2, "batch": 0}')
    routed, temps = route_side_effects(callbacks, is_chief=False)
    try:
        assert [id(c) for c in routed] == [id(c) for c in callbacks[:4] + callbacks[5:]]   # RemoteMonitor: the chief's
        tb, ckpt, csv, backup, _ = routed
        private = [tb.log_dir, ckpt.filepath, csv.filename, backup.backup_dir, backup._weights_path,
                   backup._prev_training_metadata_path]                  # the paths Keras derived move too
        assert all(any(p.startswith(t + os.sep) or p == t for t in temps) for p in private), (private, temps)
        assert os.path.basename(ckpt.filepath) == "model.keras" and os.path.basename(csv.filename) == "log.csv"
        # BackupAndRestore keeps its options and starts from the chief's backup.
        assert (backup.double_checkpoint, backup.delete_checkpoint) == (True, False)
        with open(os.path.join(backup.backup_dir, "training_metadata.json")) as handle:
            assert handle.read() == '{"epoch": 2, "batch": 0}'
        # Routing twice (Trainer.fit, then the guard in model.fit) moves nothing again.
        again, more = route_side_effects(routed, is_chief=False)
        assert all(a is b for a, b in zip(again, routed)) and more == []
        # What a callback notes during fit under its private dir (TensorBoard's run dirs, a subclass's saves)
        tb.set_model(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]))
        ckpt.saved = [os.path.join(os.path.dirname(ckpt.filepath), "model-01.keras")]
        ckpt.best = 0.5
    finally:
        remove_dirs(temps)
    assert not any(os.path.exists(t) for t in temps)
    # After fit the user's objects name the user's files again, and keep what they learned.
    assert [callbacks[0].log_dir, callbacks[1].filepath, callbacks[2].filename, callbacks[3].backup_dir,
            callbacks[3]._weights_path, callbacks[3]._prev_training_metadata_path] == user_paths
    assert callbacks[0]._train_dir == os.path.join(str(tmp_path / "tb"), "train")
    assert callbacks[1].saved == [str(tmp_path / "ckpt" / "model-01.keras")] and callbacks[1].best == 0.5
    # The next fit moves them again.
    routed, temps = route_side_effects(callbacks, is_chief=False)
    remove_dirs(temps)
    assert len(temps) == 4 and callbacks[1].filepath == str(tmp_path / "ckpt" / "model.keras")


def test_a_subclass_moves_the_paths_it_derived_from_the_users_path(tmp_path):
    class BestAndLast(keras.callbacks.ModelCheckpoint):
        def __init__(self, filepath, **kwargs):
            super().__init__(filepath, **kwargs)
            self.last_path = os.path.join(os.path.dirname(self.filepath), "last.keras")

    callback = BestAndLast(str(tmp_path / "ckpt" / "best.keras"), save_best_only=True)
    routed, temps = route_side_effects([callback], is_chief=False)
    try:
        assert routed == [callback] and callback.last_path == os.path.join(temps[0], "last.keras")
    finally:
        remove_dirs(temps)
    assert callback.last_path == str(tmp_path / "ckpt" / "last.keras")


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
