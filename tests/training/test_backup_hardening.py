"""Backups that nobody else can redirect and that always resume from what is good on disk.

Each test damages the files a real training run wrote (a crash after an
epoch, then a truncated file, garbage bytes, a broken checkpoint.json, a
`kill -9` in the middle of a save, someone else's symlink) and resumes for real.
The "crash" of an in-process run is an exception raised right after an epoch's
backup was written: like a kill, it skips the end-of-training cleanup.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap

import numpy as np
import pytest

from procs import describe, free_ports, run_cluster, run_process, worker_tf_configs

import stratkit
from stratkit.errors import ConfigError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.slow

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file owned by another user needs root")


@pytest.fixture(scope="module")
def trainer():
    return stratkit.Trainer(strategy="one_device")


class Crash(RuntimeError):
    pass


class CrashAfterEpoch(keras.callbacks.Callback):
    """Raise right after epoch `epoch`'s backup was written (the Backup callback runs first)."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epoch:
            raise Crash(f"crash after epoch {self.epoch}")


def _mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def _fit(trainer, backup, epochs, callbacks=()):
    model = trainer.build(_mlp)
    history = trainer.fit(model, _data(), epochs=epochs, global_batch_size=32, backup_dir=str(backup),
                          callbacks=list(callbacks), verbose=0)
    return model, history


def _crashed_run(trainer, backup, at_epoch=3):
    """Train until `at_epoch` is backed up, then crash: the backup dir keeps that epoch and the one before."""
    with pytest.raises(Crash):
        _fit(trainer, backup, epochs=6, callbacks=[CrashAfterEpoch(at_epoch)])
    names = sorted(os.listdir(backup))
    assert f"epoch-{at_epoch:05d}.weights.h5" in names and "checkpoint.json" in names, names
    return names


def _weights_of_epoch(backup, epoch):
    model = _mlp()
    model.optimizer.build(model.trainable_variables)
    model.load_weights(str(backup / f"epoch-{epoch:05d}.weights.h5"))
    return model.get_weights()


class SeesBackupDir(keras.callbacks.Callback):
    """Record what is in the backup dir when training starts (after the Backup callback resumed)."""

    def __init__(self, backup) -> None:
        super().__init__()
        self.backup = backup
        self.at_start: list[str] | None = None

    def on_train_begin(self, logs=None):
        self.at_start = sorted(os.listdir(self.backup))


# -- 4. a corrupt latest checkpoint: fall back to the previous good epoch --------------------------------

@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_epoch(trainer, tmp_path, damage, capsys):
    backup = tmp_path / "backup"
    _crashed_run(trainer, backup, at_epoch=3)
    epoch2 = _weights_of_epoch(backup, 2)
    latest = backup / "epoch-00003.weights.h5"
    data = latest.read_bytes()
    if damage == "truncate":
        latest.write_bytes(data[: len(data) // 2])
    else:  # garbage in the middle of the file: HDF5 itself may not notice
        middle = len(data) // 2
        latest.write_bytes(data[:middle] + os.urandom(256) + data[middle + 256:])
    capsys.readouterr()

    class FirstEpochStart(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if not hasattr(self, "weights"):
                self.weights = self.model.get_weights()
                self.first_epoch = epoch

    start = FirstEpochStart()
    _, history = _fit(trainer, backup, epochs=5, callbacks=[start])
    # epochs 3 to 5 ran: resumed after epoch 2, whose backup holds History's epochs 1 and 2 (the whole run's)
    assert start.first_epoch == 2 and history.epoch == [0, 1, 2, 3, 4]
    for got, want in zip(start.weights, epoch2):
        np.testing.assert_array_equal(got, want)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "epoch-00003.weights.h5" in line]
    assert len(warnings) == 1, warnings
    assert "corrupt" in warnings[0] and "epoch 2" in warnings[0], warnings[0]


# -- 5. a corrupt checkpoint.json: rebuild from the files that validate, never delete them ---------------

@pytest.mark.parametrize("damage", [b'{"epo', b"\x00\xff garbage \x13"])
def test_a_corrupt_checkpoint_json_is_rebuilt_from_the_weights_files(trainer, tmp_path, damage, capsys):
    backup = tmp_path / "backup"
    _crashed_run(trainer, backup, at_epoch=3)
    (backup / "checkpoint.json").write_bytes(damage)
    capsys.readouterr()
    _, history = _fit(trainer, backup, epochs=5)
    assert history.epoch == [3, 4]  # resumed at epoch 3, the newest file that validates
    err = capsys.readouterr().err
    assert "checkpoint.json" in err and "epoch 3" in err, err


def test_a_corrupt_checkpoint_json_and_no_readable_file_stops_and_deletes_nothing(trainer, tmp_path):
    backup = tmp_path / "backup"
    names = _crashed_run(trainer, backup, at_epoch=3)
    (backup / "checkpoint.json").write_bytes(b"\x00garbage")
    for name in names:
        if name.endswith(".weights.h5"):
            (backup / name).write_bytes((backup / name).read_bytes()[:100])
    before = {name: (backup / name).read_bytes() for name in names}
    with pytest.raises(ConfigError, match=r"checkpoint\.json.*(?s:.*)Fix:") as error:
        _fit(trainer, backup, epochs=5)
    assert str(backup) in str(error.value)
    assert {name: (backup / name).read_bytes() for name in os.listdir(backup)} == before


# -- 7. a backup already past the requested epochs: say so, train nothing, keep it --------------------

def test_a_backup_past_the_requested_epochs_is_kept_and_reported(trainer, tmp_path, capsys):
    backup = tmp_path / "backup"
    names = _crashed_run(trainer, backup, at_epoch=3)
    capsys.readouterr()
    model, history = _fit(trainer, backup, epochs=2)
    assert history.epoch == [] and history.history == {}  # zero epochs run
    assert sorted(os.listdir(backup)) == names  # nothing deleted
    err = capsys.readouterr().err
    assert "epoch 3" in err and "epochs=2" in err and "Fix:" in err, err
    for got, want in zip(model.get_weights(), _weights_of_epoch(backup, 3)):
        np.testing.assert_array_equal(got, want)
    # Asking for more epochs continues it, and a completed run cleans up.
    _, history = _fit(trainer, backup, epochs=4)
    assert history.epoch == [3]
    assert not backup.exists()


# -- 6. kill -9 in the middle of a save: the temporary goes at the next start ----------------------------

_KILLED_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import stratkit
    trainer = stratkit.Trainer(strategy="one_device")
    import keras

    calls = []
    original = keras.layers.Dense.save_own_variables

    def save_then_die(self, store):
        original(self, store)
        calls.append(self.name)
        if len(calls) == 3:  # epoch 2's save: the first layer is written, the file is not complete
            print("killing myself in the middle of a save", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    keras.layers.Dense.save_own_variables = save_then_die

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    trainer.fit(trainer.build(build), (x, y), epochs=6, global_batch_size=32, backup_dir=sys.argv[1], verbose=0)
""")


def test_a_kill_in_the_middle_of_a_save_leaves_no_temporary_after_the_next_start(trainer, tmp_path):
    backup = tmp_path / "backup"
    killed = run_process(_KILLED_IN_SAVE, args=[str(backup)], timeout=60)
    assert killed.returncode == -signal.SIGKILL and "in the middle of a save" in killed.stdout, describe([killed])
    finals = {"epoch-00001.weights.h5", "epoch-00001.state.json", "checkpoint.json"}
    left = set(os.listdir(backup))
    assert finals <= left and left - finals, left  # the kill landed mid-save: a temporary is there
    seen = SeesBackupDir(backup)
    _, history = _fit(trainer, backup, epochs=3, callbacks=[seen])
    # resumed after epoch 1, the last complete save (History's epoch 1 comes from it: the whole run's history)
    assert history.epoch == [0, 1, 2] and len(history.history["loss"]) == 3
    assert set(seen.at_start) == finals, seen.at_start  # the dead writer's temporary is gone
    assert not backup.exists()  # and a completed run leaves nothing behind


# -- 3. someone else's directory or symlink is refused; files are created exclusively ----------------

@needs_root
def test_a_backup_dir_symlink_made_by_another_user_is_refused(trainer, tmp_path):
    target = tmp_path / "victim"
    target.mkdir()
    link = tmp_path / "backup"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=r"backup_dir=.*backup.*symlink.*Fix:"):
        _fit(trainer, link, epochs=1)
    assert os.listdir(target) == []


def test_a_backup_dir_symlink_of_ones_own_is_followed(trainer, tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "backup"
    link.symlink_to(target)
    _, history = _fit(trainer, link, epochs=2)
    assert history.epoch == [0, 1]


@needs_root
def test_a_backup_dir_owned_by_another_user_is_refused(trainer, tmp_path):
    backup = tmp_path / "backup"
    backup.mkdir()
    os.chown(backup, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=r"backup_dir=.*owned by .*65534.*Fix:"):
        _fit(trainer, backup, epochs=1)
    assert os.listdir(backup) == []


@needs_root
def test_a_planted_checkpoint_json_symlink_is_refused_and_not_followed(trainer, tmp_path):
    backup = tmp_path / "backup"
    backup.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (backup / "checkpoint.json").symlink_to(victim)
    os.lchown(backup / "checkpoint.json", NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=r"checkpoint\.json.*symlink.*Fix:"):
        _fit(trainer, backup, epochs=1)
    assert victim.read_text() == "the user's file"


def test_files_are_never_written_through_a_planted_temporary_name(trainer, tmp_path):
    # Every temporary name the writer could pick from what another user can know (the pid, the epoch)
    # is planted as a symlink to the user's file: the save must create its own files, not open those.
    backup = tmp_path / "backup"
    backup.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    pid = os.getpid()
    for epoch in (1, 2):
        (backup / f".tmp-{pid}-epoch-{epoch:05d}.weights.h5").symlink_to(victim)
    (backup / f"checkpoint.json.tmp-{pid}").symlink_to(victim)
    with pytest.raises(Crash):
        _fit(trainer, backup, epochs=3, callbacks=[CrashAfterEpoch(2)])
    assert victim.read_text() == "the user's file"
    assert json.loads((backup / "checkpoint.json").read_text())["epoch"] == 2
    assert not os.path.islink(backup / "epoch-00002.weights.h5")


# -- issue 11 item 10: no per-epoch warning from the backup's collectives on 2 workers -----------------

_TWO_WORKERS = textwrap.dedent("""
    import sys
    import numpy as np
    import stratkit
    trainer = stratkit.Trainer()
    import keras

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    history = trainer.fit(trainer.build(build), (x, x[:, :1]), epochs=3, global_batch_size=16,
                          backup_dir=sys.argv[1], verbose=0)
    print("epochs", history.epoch, flush=True)
""")


@pytest.mark.multiworker
def test_two_worker_backups_print_no_eager_collective_warning(tmp_path):
    backup = tmp_path / "backup"
    results = run_cluster(_TWO_WORKERS, worker_tf_configs(free_ports(2)), args=[str(backup)], timeout=90,
                          grace_after_failure=20)
    assert all(r.ok for r in results), describe(results)
    for result in results:
        assert "epochs [0, 1, 2]" in result.stdout
        assert "eagerly has significant overhead" not in result.stderr, describe(results)
    assert not backup.exists()


# -- the parameter-server chief's checkpoints follow the same rules -----------------------------------

def _saved_epochs(backup, epochs=(1, 2, 3)):
    from stratkit.training import backup as backup_lib

    model = _mlp()
    model.fit(*_data(), epochs=1, verbose=0)
    for epoch in epochs:
        backup_lib.save_epoch(model, str(backup), epoch)
    return model


def test_the_ps_chief_falls_back_from_a_corrupt_latest_epoch_and_keeps_a_backup_past_epochs(tmp_path, capsys):
    from stratkit.training.ps import DONE_FILE, _ChiefCheckpoints

    backup = tmp_path / "backup"
    _saved_epochs(backup)
    latest = backup / "epoch-00003.weights.h5"
    latest.write_bytes(latest.read_bytes()[:-64])
    checkpoints = _ChiefCheckpoints(str(backup), has_evaluator=True, epochs=1)
    model = _mlp()
    model.optimizer.build(model.trainable_variables)  # the saved files hold the optimizer's state too
    assert checkpoints.resume(model) == 2
    err = capsys.readouterr().err
    assert "epoch-00003.weights.h5 is corrupt" in err and "resuming from epoch 2" in err, err
    assert "past epochs=1" in err
    checkpoints.finish(2)  # nothing trained: everything stays, and the evaluator is told which file is final
    assert {"epoch-00002.weights.h5", "epoch-00003.weights.h5", "checkpoint.json"} <= set(os.listdir(backup))
    assert json.loads((backup / DONE_FILE).read_text())["file"] == "epoch-00002.weights.h5"


def test_a_done_marker_naming_a_path_outside_the_backup_never_deletes_it(tmp_path):
    from stratkit.training.ps import DONE_FILE, _ChiefCheckpoints

    backup = tmp_path / "backup"
    backup.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (backup / DONE_FILE).write_text(json.dumps({"epoch": 9, "file": "../victim.txt"}))
    assert _ChiefCheckpoints(str(backup), has_evaluator=False).resume(_mlp()) == 0
    assert victim.read_text() == "the user's file"


# -- what a resume continues, and what it says it does not -----------------------------------------------

def test_a_resume_of_a_shuffled_dataset_says_its_order_is_not_continued_and_arrays_say_nothing(
        trainer, tmp_path, capsys):
    def fit(backup, data, callbacks=()):
        model = trainer.build(_mlp)
        trainer.fit(model, data, epochs=4, global_batch_size=32, backup_dir=str(backup), callbacks=list(callbacks),
                    verbose=0)
        return model

    def dataset():
        return tf.data.Dataset.from_tensor_slices(_data())

    with pytest.raises(Crash):
        fit(tmp_path / "dataset", dataset(), [CrashAfterEpoch(2)])
    fit(tmp_path / "dataset", dataset())
    assert "shuffle=True on a tf.data.Dataset: the epochs after this resume" in capsys.readouterr().err
    with pytest.raises(Crash):
        fit(tmp_path / "arrays", _data(), [CrashAfterEpoch(2)])
    resumed = fit(tmp_path / "arrays", _data()).get_weights()
    assert "shuffle=True" not in capsys.readouterr().err  # arrays: each epoch's order is a function of the epoch
    uninterrupted = fit(tmp_path / "whole", _data()).get_weights()
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(resumed, uninterrupted)) <= 1e-6
