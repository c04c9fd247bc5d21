"""Keras's file-writing callbacks with a store URL as their path (`route_side_effects`, `store_callbacks`), in
this process against moto's S3 server: which worker writes what where, what is refused before training, and
the paths the user gave kept on the callback objects. Training on 2 real workers with them:
test_store_paths_multiworker.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

keras = pytest.importorskip("keras")

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.strategy import store_callbacks
from stratkit.training.callbacks import remove_dirs, route_side_effects


@pytest.fixture
def s3(use_store):
    server = use_store("s3")
    return server, server.url(server.make_bucket(f"cbs-{os.getpid()}-{os.urandom(3).hex()}"), "run")


def _callbacks(url):
    return [keras.callbacks.ModelCheckpoint(url + "/ckpt/{epoch}/m.keras", save_freq=4),
            keras.callbacks.CSVLogger(url + "/log.csv", append=True),
            keras.callbacks.TensorBoard(url + "/tb"),
            keras.callbacks.BackupAndRestore(url + "/backup", double_checkpoint=True)]


def test_the_chief_writes_each_callbacks_files_to_a_staging_dir_synced_to_the_store(s3):
    _, url = s3
    storage.open_store(url).write_bytes("log.csv", b"epoch,loss\n0,1.0\n")
    storage.open_store(url + "/backup").write_bytes("training_metadata.json", b'{"epoch": 3, "batch": 0}')
    callbacks = _callbacks(url)
    routed, temps = route_side_effects(callbacks, is_chief=True)
    try:
        kinds = [type(c).__name__ for c in routed]
        assert kinds == ["ModelCheckpoint", "StoreSyncEveryBatch", "CSVLogger", "StoreSync", "TensorBoard",
                         "StoreSync", "BackupAndRestore", "StoreSync"]
        ckpt, csv, tb, backup = callbacks
        assert [routed[i] for i in (0, 2, 4, 6)] == callbacks        # the user's own objects train
        for path in (ckpt.filepath, csv.filename, tb.log_dir, backup.backup_dir):
            assert any(path.startswith(t) for t in temps), (path, temps)
        assert ckpt.filepath.endswith(os.sep + os.path.join("{epoch}", "m.keras"))  # the store root: .../ckpt
        with open(csv.filename) as handle:
            assert handle.read() == "epoch,loss\n0,1.0\n"          # append=True: read back first
        with open(os.path.join(backup.backup_dir, "training_metadata.json")) as handle:
            assert json.load(handle)["epoch"] == 3                    # the backup read back before training
        assert backup.double_checkpoint
        # A second routing (Trainer.fit, then the guard in model.fit) stages nothing again.
        again, more = route_side_effects(routed, is_chief=True)
        assert [a is b for a, b in zip(again, routed)] == [True] * len(routed) and more == []
    finally:
        remove_dirs(temps)
    assert [ckpt.filepath, csv.filename, tb.log_dir, backup.backup_dir] == [
        url + "/ckpt/{epoch}/m.keras", url + "/log.csv", url + "/tb", url + "/backup"]
    assert not any(os.path.exists(t) for t in temps)


def test_a_resume_continues_a_csv_log_in_the_store_on_a_machine_that_never_had_it(s3):
    """A CSVLogger(url) without append=True, as users write it: a resume from backup_dir makes it append at the
    backup's epoch (callbacks_state.continue_csv_logs). Its file is read back first, so the rows of the epochs before
    the resume are kept in the store, not replaced by the resumed epochs alone (seen on a fresh test host:
    tests/test_storage_hosts.py kept epochs 2-4 of 0-4 before this)."""
    from stratkit.training.checkpoint import callbacks_state

    _, url = s3
    store = storage.open_store(url)
    store.write_bytes("log.csv", b"epoch,loss,val_loss\r\n0,4.0,NA\r\n1,3.0,NA\r\n2,2.5,NA\r\n")  # (Keras's columns)
    logger = keras.callbacks.CSVLogger(url + "/log.csv")
    routed, temps = route_side_effects([logger], is_chief=True)
    try:
        appending = callbacks_state.continue_csv_logs([logger], 2)   # the resume, at epoch 2
        for callback in routed:
            callback.on_train_begin()
        for callback in routed:
            callback.on_epoch_end(2, {"loss": 2.0})
        for callback in routed:
            callback.on_train_end()
        callbacks_state.restore_csv_append(appending)
    finally:
        remove_dirs(temps)
    assert store.read_bytes("log.csv").decode().split() == ["epoch,loss,val_loss", "0,4.0,NA", "1,3.0,NA", "2,2.0,NA"]
    assert logger.filename == url + "/log.csv" and logger.append is False


def test_a_store_the_chief_cannot_write_is_refused_before_training(s3):
    server, _ = s3
    callbacks = [keras.callbacks.TensorBoard(server.url("no-such-bucket-cbs", "tb"))]
    with pytest.raises(ConfigError, match=r"TensorBoard\(log_dir=...\)='s3://no-such-bucket-cbs/tb'.*does not "
                                          r"exist.*Fix: create it"):
        route_side_effects(callbacks, is_chief=True)
    assert callbacks[0].log_dir == "s3://no-such-bucket-cbs/tb"


def test_other_workers_read_the_backup_back_and_write_nothing_to_the_store(s3):
    _, url = s3
    backup_url = url + "/backup"
    storage.open_store(backup_url).write_bytes("training_metadata.json", b'{"epoch": 2, "batch": 0}')
    callbacks = _callbacks(url)
    routed, temps = route_side_effects(callbacks, is_chief=False, multi_worker=True)
    try:
        assert "StoreSync" not in [type(c).__name__ for c in routed]
        # the user's own object trains, its files in a private directory for the length of fit (issue 46)
        private = next(c for c in routed if isinstance(c, keras.callbacks.BackupAndRestore))
        assert private is callbacks[3] and any(private.backup_dir.startswith(t) for t in temps)
        with open(os.path.join(private.backup_dir, "training_metadata.json")) as handle:
            assert json.load(handle)["epoch"] == 2
        agree = routed[routed.index(private) + 1]
        assert agree.backup_dir == backup_url                          # messages name the user's URL
    finally:
        remove_dirs(temps)
    assert callbacks[3].backup_dir == backup_url                       # and it names the URL again after fit
    assert storage.open_store(backup_url).list() == ["training_metadata.json"]


def test_paths_no_filesystem_can_open_are_refused_on_every_worker(monkeypatch):
    for is_chief in (True, False):
        with pytest.raises(ConfigError, match=r"would be a local directory named 's3:'"):
            route_side_effects([keras.callbacks.CSVLogger("s3:/bucket/log.csv")], is_chief=is_chief)
    monkeypatch.setitem(sys.modules, "adlfs", None)
    with pytest.raises(ConfigError, match=r'pip install "stratkit\[azure\]"'):
        route_side_effects([keras.callbacks.TensorBoard("az://container/tb")], is_chief=False)
    # gs:// without gcsfs: tf.io.gfile reaches it, so the chief leaves the callback to Keras, as plain Keras does.
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    callback = keras.callbacks.TensorBoard("gs://bucket/tb")
    routed, temps = route_side_effects([callback], is_chief=True)
    assert routed == [callback] and temps == [] and callback.log_dir == "gs://bucket/tb"


def test_uploads_that_fail_warn_during_training_and_raise_at_its_end(s3, tmp_path, monkeypatch, caplog):
    server, url = s3
    # s3fs's and botocore's own retries of a refused connection, cut short (fsspec's config, as a user can)
    monkeypatch.setenv("FSSPEC_S3", json.dumps({"config_kwargs": {"retries": {"max_attempts": 1}}}))
    from stores import refresh_clients

    refresh_clients()
    staging = str(tmp_path / "staging")
    os.makedirs(staging)
    sync = store_callbacks.StoreSync(storage.Mirror(staging, storage.open_store(url + "/logs")), staging)
    with open(os.path.join(staging, "log.csv"), "w") as handle:
        handle.write("epoch\n0\n")
    monkeypatch.setattr(store_callbacks, "FINAL_TRIES", (0.01,))
    server.down()
    try:
        sync.on_epoch_end(0)
        assert "could not upload to s3://" in caplog.text and "trying again at the next epoch's end" in caplog.text
        with pytest.raises(storage.StoreError, match="could not be uploaded at the end of training"):
            sync.on_train_end()
    finally:
        server.up()
    sync.on_train_end()
    assert storage.open_store(url + "/logs").read_bytes("log.csv") == b"epoch\n0\n"


def test_one_process_trainer_fit_and_save_to_gcs_and_keras_own_save_too(use_store, capsys):
    import numpy as np

    import stratkit

    server = use_store("gs")
    url = server.url(server.make_bucket(f"one-{os.getpid()}-{os.urandom(3).hex()}"), "run")
    trainer = stratkit.Trainer(strategy="one_device")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = trainer.build(build)
    x, y = np.ones((32, 3), "float32"), np.zeros((32, 1), "float32")
    checkpoint = keras.callbacks.ModelCheckpoint(url + "/ckpt/m-{epoch}.weights.h5", save_weights_only=True,
                                                 verbose=1)
    trainer.fit(model, (x, y), epochs=2, global_batch_size=8, callbacks=[checkpoint], verbose=0)
    said = capsys.readouterr().out
    assert f"saving model to {url}/ckpt/m-2.weights.h5" in said, said   # the URL, not the staging directory
    assert checkpoint.filepath == url + "/ckpt/m-{epoch}.weights.h5"
    assert trainer.save(model, url + "/model.keras") == url + "/model.keras"
    # One process: Keras's own model.save of a model under stratkit's strategy goes through the store layer too,
    # as on N workers (issue 49; before, tf.io.gfile's own GCS client)
    model.save(url + "/keras.keras")
    assert storage.open_store(url).list() == ["ckpt/m-1.weights.h5", "ckpt/m-2.weights.h5", "keras.keras",
                                              "model.keras"]
