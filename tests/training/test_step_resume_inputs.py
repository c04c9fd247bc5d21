"""A run resumed mid-epoch reads exactly the batches an uninterrupted run reads, for every input kind; bad input
is refused and nothing is lost.

In-process runs on one device: an uninterrupted fit, the same fit crashed (an exception right before global
step 13 trains: the step backup of step 10 is the newest), then a fresh model resumed from the backup. The
resumed run must end with the uninterrupted run's weights and history. Signals are sent to child processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap

import numpy as np
import pytest

from procs import describe, run_process

import stratkit
from stratkit.errors import ConfigError
from stratkit.training.checkpoint import find_resume_point

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.slow

ROWS, BATCH, EVERY, CRASH_AT = 96, 12, 5, 13   # 8 steps per epoch; backups at 5, 10, 15...


@pytest.fixture(scope="module")
def trainer():
    return stratkit.Trainer(strategy="one_device")


class Crash(RuntimeError):
    pass


class Steps(keras.callbacks.Callback):
    """Crash before global step `crash_at` trains; record each step trained (global index)."""

    def __init__(self, crash_at: int | None = None, per_epoch: int = ROWS // BATCH) -> None:
        super().__init__()
        self.crash_at, self.per_epoch, self.trained = crash_at, per_epoch, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch * self.per_epoch + batch == self.crash_at:
            raise Crash(f"crash before step {self.crash_at}")

    def on_train_batch_end(self, batch, logs=None):
        self.trained.append(self.epoch * self.per_epoch + batch)


def _data(rows: int = ROWS):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")


def _model(width: int = 16, dropout: bool = False):
    def build():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((8,)), keras.layers.Dense(width, activation="tanh")]
        layers += [keras.layers.Dropout(0.3)] if dropout else []
        model = keras.Sequential(layers + [keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model
    return build


def _three_runs(trainer, tmp_path, make_data, *, epochs=4, per_epoch=ROWS // BATCH, build=None, **fit):
    """(uninterrupted, resumed) fit results: (weights, history, steps trained by the resumed run)."""
    build = build or _model()
    fit = {"global_batch_size": BATCH, "verbose": 0, **fit}
    reference = trainer.build(build)
    history = trainer.fit(reference, make_data(), epochs=epochs, **fit)
    backup = tmp_path / "backup"
    with pytest.raises(Crash):
        trainer.fit(trainer.build(build), make_data(), epochs=epochs, backup_dir=str(backup), backup_every=EVERY,
                    callbacks=[Steps(CRASH_AT, per_epoch)], **fit)
    assert find_resume_point(str(backup)).position.step == 10 - per_epoch  # global step 10
    steps = Steps(None, per_epoch)
    resumed = trainer.build(build)
    again = trainer.fit(resumed, make_data(), epochs=epochs, backup_dir=str(backup), backup_every=EVERY,
                        callbacks=[steps], **fit)
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert again.epoch == history.epoch
    for key in ("loss", "mae"):
        np.testing.assert_allclose(again.history[key], history.history[key], atol=1e-6, rtol=0)
    assert steps.trained[0] == 10 and len(steps.trained) == epochs * per_epoch - 10  # nothing trained twice
    assert not backup.exists()
    return steps


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        self.read.append(index)
        return self.x[index * BATCH:(index + 1) * BATCH], self.y[index * BATCH:(index + 1) * BATCH]


@pytest.mark.parametrize("kind", ["arrays", "arrays-steps", "arrays-unshuffled", "batched-dataset-steps",
                                  "dataset-one-pass", "dataset_fn"])
def test_a_mid_epoch_resume_reads_the_batches_an_uninterrupted_run_reads(trainer, tmp_path, kind):
    x, y = _data()
    fit: dict = {}
    if kind == "arrays":
        make = lambda: (x, y)  # noqa: E731 - shuffled by (seed, epoch): positioned by index, nothing re-read
    elif kind == "arrays-steps":
        make, fit = (lambda: (x, y)), {"steps_per_epoch": 6}  # batches run on across passes
    elif kind == "arrays-unshuffled":
        make, fit = (lambda: (x, y)), {"shuffle": False}
    elif kind == "batched-dataset-steps":
        make, fit = (lambda: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=3).batch(BATCH)), \
            {"steps_per_epoch": 6}
    elif kind == "dataset-one-pass":
        make = lambda: tf.data.Dataset.from_tensor_slices((x, y))  # noqa: E731 - the resumed pass replays 2 batches
    # (batched-dataset-steps and dataset_fn reshuffle every pass with a fixed seed: replayed through fit's
    # own iterator, they continue exactly)
    else:
        def make():
            def dataset_fn(context):
                batch = context.get_per_replica_batch_size(BATCH)
                return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=5).batch(batch)
            return dataset_fn
        fit = {"steps_per_epoch": 6, "global_batch_size": None}
    per_epoch = fit.get("steps_per_epoch", ROWS // BATCH)
    _three_runs(trainer, tmp_path, make, per_epoch=per_epoch, **fit)


def test_a_py_dataset_resumes_by_index_without_reading_the_batches_before(trainer, tmp_path):
    x, y = _data()
    datasets: list[Batches] = []

    def make():
        datasets.append(Batches(x, y))
        return datasets[-1]

    _three_runs(trainer, tmp_path, make, global_batch_size=None)
    uninterrupted, resumed = datasets[0].read, datasets[-1].read
    assert uninterrupted[-32:] == list(range(8)) * 4  # (before them: the batches Keras peeks at for shapes)
    # The resumed epoch (epoch 2, from its step 2) reads batches 2..7 only; the epochs after it every batch.
    assert resumed[-22:] == list(range(2, 8)) + list(range(8)) * 2


def test_the_random_state_carries_over_a_mid_epoch_resume(trainer, tmp_path):
    x, y = _data()
    _three_runs(trainer, tmp_path, lambda: (x, y), build=_model(dropout=True))


# -- bad input: a clear error, and nothing lost ----------------------------------------------------------

@pytest.mark.parametrize("value", [0, -3, 2.5, True, "soon", "10 parsecs", "0s", [5]])
def test_a_backup_every_that_is_no_step_count_or_duration_is_refused_naming_it(trainer, tmp_path, value):
    model = trainer.build(_model())
    with pytest.raises(ConfigError, match=r"backup_every=.*Fix: backup_every=") as error:
        trainer.fit(model, _data(), epochs=1, global_batch_size=BATCH, backup_dir=str(tmp_path), backup_every=value)
    assert repr(value) in str(error.value)


def test_backup_every_needs_a_backup_dir(trainer):
    with pytest.raises(ConfigError, match="backup_every=5 needs backup_dir"):
        trainer.fit(trainer.build(_model()), _data(), epochs=1, global_batch_size=BATCH, backup_every=5)


@pytest.mark.parametrize("every", ["30s", "1.5min", "1h", 7, "7"])
def test_backup_every_takes_steps_or_a_duration(every):
    from stratkit.training.checkpoint import parse_every

    parsed = parse_every(every)
    assert parsed.per_step and (parsed.steps == 7 or parsed.seconds in (30.0, 90.0, 3600.0))


def _crashed(trainer, backup, build=None, batch=BATCH):
    with pytest.raises(Crash):
        trainer.fit(trainer.build(build or _model()), _data(), epochs=4, global_batch_size=batch,
                    backup_dir=str(backup), backup_every=EVERY, callbacks=[Steps(CRASH_AT, ROWS // batch)],
                    verbose=0)
    return {name: (backup / name).read_bytes() for name in os.listdir(backup)}


def test_a_backup_of_another_model_is_refused_naming_the_first_difference_and_kept(trainer, tmp_path):
    backup = tmp_path / "backup"
    before = _crashed(trainer, backup)
    with pytest.raises(ConfigError, match=r"another model\. Variable 0: the backup has dense\w*/kernel \(8, 16\), "
                                          r"this model has dense\w*/kernel \(8, 32\)"):
        trainer.fit(trainer.build(_model(width=32)), _data(), epochs=4, global_batch_size=BATCH,
                    backup_dir=str(backup), backup_every=EVERY, verbose=0)
    assert {name: (backup / name).read_bytes() for name in os.listdir(backup)} == before


def test_another_global_batch_is_refused_mid_epoch_with_both_numbers(trainer, tmp_path):
    backup = tmp_path / "backup"
    before = _crashed(trainer, backup)
    with pytest.raises(ConfigError, match=r"global batch 12, but this run has global batch 24"):
        trainer.fit(trainer.build(_model()), _data(), epochs=4, global_batch_size=24, backup_dir=str(backup),
                    backup_every=EVERY, verbose=0)
    assert {name: (backup / name).read_bytes() for name in os.listdir(backup)} == before


def test_another_global_batch_at_an_epoch_boundary_is_accepted_and_said(trainer, tmp_path, capsys):
    backup = tmp_path / "backup"
    with pytest.raises(Crash):  # epoch backups (no backup_every): the crash after epoch 2's backup
        trainer.fit(trainer.build(_model()), _data(), epochs=4, global_batch_size=BATCH, backup_dir=str(backup),
                    callbacks=[Steps(2 * ROWS // BATCH + 1)], verbose=0)
    capsys.readouterr()
    history = trainer.fit(trainer.build(_model()), _data(), epochs=4, global_batch_size=24,
                          backup_dir=str(backup), verbose=0)
    assert history.epoch == [0, 1, 2, 3]
    assert "global batch 12 -> 24" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root")
def test_a_full_disk_keeps_the_previous_backup_and_names_the_directory(trainer, tmp_path):
    """A 1 MiB tmpfs, filled after the first step backup: the next one fails with ENOSPC (a real full disk)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("this machine refuses a tmpfs mount")
    backup = mount / "backup"
    try:
        class FillDisk(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 6 and not (mount / "filler").exists():  # after the backup of step 5
                    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
                    (mount / "filler").write_bytes(b"\0" * max(free - 8192, 0))

        with pytest.raises(ConfigError, match=r"could not write the backup at epoch 1 \+ 2 steps to backup_dir="
                                              rf"'{backup}': No space left on device; the previous backup \(epoch 0 "
                                              r"\+ 5 steps\) is intact") as error:
            trainer.fit(trainer.build(_model()), _data(), epochs=4, global_batch_size=BATCH, backup_dir=str(backup),
                        backup_every=EVERY, callbacks=[FillDisk()], verbose=0)
        assert type(error.value).__name__ == "BackupWriteError"
        assert find_resume_point(str(backup)).position.step == 5  # intact, and what a restart resumes from
        assert sorted(os.listdir(backup)) == ["checkpoint.json", "epoch-00000-step-0000005.state.json",
                                              "epoch-00000-step-0000005.weights.h5"]  # no half file left
        (mount / "filler").unlink()
        steps = Steps()
        trainer.fit(trainer.build(_model()), _data(), epochs=1, global_batch_size=BATCH, backup_dir=str(backup),
                    backup_every=EVERY, callbacks=[steps], verbose=0)
        assert steps.trained == [5, 6, 7]  # resumed from it
    finally:
        subprocess.run(["umount", "-l", str(mount)])


_SIGNALLED = textwrap.dedent("""
    import os, signal, sys, time
    import stratkit
    trainer = stratkit.Trainer(strategy="one_device")
    import keras, numpy as np
    SECOND = os.environ["SECOND"]

    class Notice(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch * 8 + batch == 13:
                os.environ["NOTICED"] = "1"
                os.kill(os.getpid(), signal.SIGTERM)   # the notice: the backup is written before step 14
        def get_state(self):                           # a user's callback takes part in the backup
            if os.environ.get("NOTICED") and SECOND == "TERM":
                os.kill(os.getpid(), signal.SIGTERM)   # a second notice while the backup is being written
            return {"epoch": self.epoch}
        def set_state(self, state):
            print("restored", state, flush=True)

    original = keras.layers.Dense.save_own_variables
    def save(self, store):                              # a SIGKILL in the middle of writing the weights file
        original(self, store)
        if SECOND == "KILL" and os.environ.get("NOTICED"):
            os.kill(os.getpid(), signal.SIGKILL)
    keras.layers.Dense.save_own_variables = save

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model
    x = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
    trainer.fit(trainer.build(build), (x, x[:, :1]), epochs=4, global_batch_size=12, backup_dir=sys.argv[1],
                backup_every=5, callbacks=[Notice()], verbose=0)
""")


@pytest.mark.parametrize("second", ["TERM", "KILL"])
def test_a_second_signal_during_the_save_finishes_it_or_leaves_the_previous_backup(tmp_path, second):
    backup = tmp_path / "backup"
    result = run_process(_SIGNALLED, args=[str(backup)], env={"SECOND": second}, timeout=120)
    point = find_resume_point(str(backup))  # whatever is there reads whole: never half a file
    if second == "TERM":  # the save finished; the second notice was counted
        assert result.returncode == 75, describe([result])
        assert "1 more notice(s) came during the save" in result.stderr
        assert point.position.epoch == 1 and point.position.step == 6  # global step 14
        assert point.state()["callbacks"]["Notice"] == {"epoch": 1}
    else:  # killed mid-write: the previous backup (step 10) stands, the new one never got named
        assert result.returncode == -signal.SIGKILL, describe([result])
        assert point.position.epoch == 1 and point.position.step == 2
        assert json.loads((backup / "checkpoint.json").read_text())["step"] == 2


def test_callbacks_counters_go_on_at_the_backups_step(trainer, tmp_path):
    """ModelCheckpoint(save_freq=3) saves at the same steps, LearningRateScheduler's multiplicative schedule is
    applied once per epoch, TensorBoard's step axis and CSVLogger's rows go on, across a mid-epoch resume."""
    x, y = _data()

    def callbacks(out):
        return [keras.callbacks.ModelCheckpoint(str(out / "ckpt-{epoch}-{batch}.weights.h5"), save_freq=3,
                                                save_weights_only=True),
                keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.8),
                keras.callbacks.TensorBoard(str(out / "tb"), update_freq=2),
                keras.callbacks.CSVLogger(str(out / "log.csv"))]

    def run(out, backup=None, crash=None):
        out.mkdir(exist_ok=True)
        extra = [Steps(crash)] if crash else []
        model = trainer.build(_model())
        given = callbacks(out)
        options = {"backup_dir": str(backup), "backup_every": EVERY} if backup else {}
        history = trainer.fit(model, (x, y), epochs=4, global_batch_size=BATCH, verbose=0,
                              callbacks=[*extra, *given], **options)
        return model, history, given

    model, history, given = run(tmp_path / "reference")
    backup = tmp_path / "backup"
    with pytest.raises(Crash):
        run(tmp_path / "resumed", backup, crash=CRASH_AT)
    again_model, again, again_given = run(tmp_path / "resumed", backup)
    np.testing.assert_allclose(again.history["learning_rate"], history.history["learning_rate"], rtol=1e-7)
    assert len(set(history.history["learning_rate"])) == 4  # 0.8x at every epoch's start, once
    for a, b in zip(again_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    saved = sorted(p.name for p in (tmp_path / "reference").glob("ckpt-*"))
    assert saved and sorted(p.name for p in (tmp_path / "resumed").glob("ckpt-*")) == saved
    assert again_given[2]._global_train_batch == given[2]._global_train_batch == 32  # TensorBoard's step axis
    import csv

    rows = [list(csv.DictReader((tmp_path / name / "log.csv").open())) for name in ("reference", "resumed")]
    assert [r["epoch"] for r in rows[1]] == [r["epoch"] for r in rows[0]] == ["0", "1", "2", "3"]  # none repeated
    np.testing.assert_allclose([float(r["loss"]) for r in rows[1]], [float(r["loss"]) for r in rows[0]], atol=1e-6)


def test_a_duration_backs_up_at_the_first_step_boundary_after_it(trainer, tmp_path):
    x, y = _data()

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            import time

            time.sleep(0.25)

    backup = tmp_path / "backup"
    with pytest.raises(Crash):
        trainer.fit(trainer.build(_model()), (x, y), epochs=4, global_batch_size=BATCH, backup_dir=str(backup),
                    backup_every="1s", callbacks=[Slow(), Steps(CRASH_AT)], verbose=0)
    point = find_resume_point(str(backup))
    state = point.state()
    assert state["reason"] == "every 1s (the chief's clock)" and state["phase"] == "batch"
    # steps of >= 0.25 s: a backup every 4-5 steps, the newest one at most 5 steps before the crash before step 13
    assert 8 <= state["position"]["global_step"] <= CRASH_AT
