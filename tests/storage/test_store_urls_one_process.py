"""Store URLs at any world size (issue 49): the script that works on 2 workers works as one process.

`one_process_urls_script.py` is the issue's script: a plain `model.fit` under `stratkit.make_strategy()` with
`ModelCheckpoint`, `CSVLogger(append=True)`, `TensorBoard` and `BackupAndRestore` on S3. Before, as one process
it stopped at once ("File system scheme 's3' not implemented"): stratkit routed URLs only on several workers or in
`Trainer.fit`. Here, against real servers (moto's S3, the GCS emulator), it runs as one process (one device, and
Mirrored over one device killed in its third epoch and relaunched with a fresh disk) and on 2 workers: the same
files in every bucket, the weights of the uninterrupted one-process run. A model without a stratkit strategy keeps
Keras's own behaviour in the same process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from procs import child_env, describe, free_ports, run_cluster, worker_tf_configs

from stratkit.process.children import kill_group, start_child

keras = pytest.importorskip("keras")

from stratkit import storage
from stratkit.errors import ConfigError

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("one_process_urls_script.py")
TOLERANCE = 1e-5


def _unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{os.urandom(3).hex()}"


def _data():
    x = np.linspace(-1.0, 1.0, 32 * 3, dtype="float32").reshape(32, 3)
    return x, x.sum(axis=1, keepdims=True)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


# -- in this process ----------------------------------------------------------------------------------------

def test_one_process_under_make_strategy_fits_and_saves_to_store_urls(use_store):
    """Failed before with UnimplementedError: on one device neither the callbacks nor Keras's saves were routed."""
    import stratkit

    s3, gs = use_store("s3"), use_store("gs")
    s3_url, gs_url = s3.url(s3.make_bucket(_unique("one")), "run"), gs.url(gs.make_bucket(_unique("one")), "run")
    strategy = stratkit.make_strategy("one_device")
    with strategy.scope():
        model = _model()
    x, y = _data()
    callbacks = [keras.callbacks.ModelCheckpoint(s3_url + "/ckpt/m-{epoch:02d}.weights.h5", save_weights_only=True),
                 keras.callbacks.CSVLogger(s3_url + "/log.csv", append=True)]
    model.fit(x, y, batch_size=8, epochs=2, callbacks=callbacks, verbose=0)
    model.save(s3_url + "/model.keras")
    model.save_weights(gs_url + "/model.weights.h5")
    assert storage.open_store(s3_url).list() == ["ckpt/m-01.weights.h5", "ckpt/m-02.weights.h5", "log.csv",
                                                 "model.keras"]
    assert storage.open_store(gs_url).list() == ["model.weights.h5"]
    assert [callbacks[0].filepath, callbacks[1].filename] == [s3_url + "/ckpt/m-{epoch:02d}.weights.h5",
                                                              s3_url + "/log.csv"]
    with storage.local_copy(gs_url + "/model.weights.h5") as path:
        like = _model()
        like.load_weights(path)
    assert all(np.array_equal(a, b) for a, b in zip(like.get_weights(), model.get_weights()))


def test_plain_keras_in_the_same_process_keeps_keras_own_behaviour(use_store, tmp_path, monkeypatch):
    """The guards wrap Keras's classes for the whole process: a model without a strategy stratkit made gets Keras's
    own fit and save (a local path written as Keras writes it, a URL left to tf.io.gfile)."""
    import tensorflow as tf

    import stratkit

    server = use_store("s3")
    url = server.url(server.make_bucket(_unique("plain")), "run")
    strategy = stratkit.make_strategy("one_device")     # the guards are installed in this process
    monkeypatch.chdir(tmp_path)
    x, y = _data()
    plain = _model()                                     # no strategy
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        own = _model()                                   # the user's own strategy, not stratkit's
    with strategy.scope():
        routed = _model()
    # "s3:/bkt/log.csv" is a local path to Keras: a file under a directory named "s3:"
    os.makedirs("s3:/bkt")
    for model in (plain, own):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[keras.callbacks.CSVLogger("s3:/bkt/log.csv")])
        assert (tmp_path / "s3:" / "bkt" / "log.csv").read_text().startswith("epoch")
        with pytest.raises(FileNotFoundError):          # Keras creates no directory for model.save
            model.save("missing/model.keras")
        with pytest.raises(tf.errors.UnimplementedError, match="File system scheme 's3' not implemented"):
            model.save(url + "/model.keras")
        with pytest.raises(tf.errors.UnimplementedError, match="File system scheme 's3' not implemented"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.CSVLogger(url + "/log.csv")])
    assert storage.open_store(url).list() == []
    # the same calls on the model under stratkit's strategy are routed
    with pytest.raises(ConfigError, match="named 's3:'"):
        routed.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.CSVLogger("s3:/bkt/log.csv")])
    routed.save("missing/model.keras")
    routed.save(url + "/model.keras")
    assert (tmp_path / "missing" / "model.keras").is_file() and storage.open_store(url).list() == ["model.keras"]


# -- the script: one process, killed and relaunched, and 2 workers --------------------------------------

def _bucket_names(server, bucket: str) -> list[str]:
    """The keys under `bucket`, each TensorBoard event file's host/pid/time part left out (one per writer)."""
    names = {re.sub(r"events\.out\.tfevents\..*", "events.out.tfevents.*", key[len(bucket) + 1:])
             for key in server.fs().find(bucket)}
    return sorted(names)


def _killed_and_relaunched(env: dict[str, str], root: Path) -> tuple[dict, str]:
    """The script as one process on Mirrored: SIGKILLed in its third epoch, then relaunched on a fresh disk."""
    first, temp = root / "first", root / "first-tmp"
    first.mkdir()
    temp.mkdir()
    with open(root / "first.out", "wb") as out:
        proc = start_child([sys.executable, str(SCRIPT)],
                           child_env(None, {**env, "STOP_IN_EPOCH": "3", "TMPDIR": str(temp)}),
                           stdout=out, stderr=subprocess.STDOUT, cwd=str(first))
        try:
            deadline = time.monotonic() + 400
            while not (first / "STOPPED").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (first / "STOPPED").exists(), (root / "first.out").read_text(errors="replace")[-3000:]
        finally:
            kill_group(proc.pid)           # SIGKILL, the whole process group
            proc.wait()
    said = (root / "first.out").read_text(errors="replace")
    second, temp = root / "second", root / "second-tmp"    # a fresh working directory and staging area
    second.mkdir()
    temp.mkdir()
    [result] = run_cluster(SCRIPT, [None], env=env, per_process_env=[{"TMPDIR": str(temp)}], timeout=400,
                           cwd=second)
    assert result.ok, describe([result])
    return result.last_json(), said


@pytest.fixture(scope="module")
def runs(store_server, tmp_path_factory):
    """Three runs side by side, each in its own bucket: one process (one device, with model.save/save_weights/
    export), one process on Mirrored killed and relaunched, and 2 workers (worker 1 may only read S3)."""
    s3, gs = store_server("s3"), store_server("gs")
    root = tmp_path_factory.mktemp("one-process-urls")
    base = {**s3.client_env({}), **gs.env}
    buckets = {name: s3.make_bucket(_unique(name)) for name in ("one", "resumed", "workers")}
    saves_bucket = gs.make_bucket(_unique("saves"))
    saves = {"keras": f"s3://{buckets['one']}/saved/model.keras",
             "weights": gs.url(saves_bucket, "model.weights.h5"), "export": f"s3://{buckets['one']}/saved/export"}

    def one_process():
        work, temp = root / "one", root / "one-tmp"
        work.mkdir()
        temp.mkdir()
        env = {**base, "BUCKET": f"s3://{buckets['one']}", "SAVES": json.dumps(saves), "TMPDIR": str(temp)}
        [result] = run_cluster(SCRIPT, [None], env=env, timeout=400, cwd=work)
        assert result.ok, describe([result])
        return result.last_json()

    def workers():
        work, temps = root / "workers", [root / "worker0-tmp", root / "worker1-tmp"]
        for directory in (work, *temps):
            directory.mkdir()
        # worker 1 may only read S3: nothing of its reaches the store
        each = [{"TMPDIR": str(temps[0])}, {"TMPDIR": str(temps[1]), **s3.read_only_env()}]
        env = {**base, "BUCKET": f"s3://{buckets['workers']}"}
        results = run_cluster(SCRIPT, worker_tf_configs(free_ports(2)), env=env, per_process_env=each, timeout=400,
                              grace_after_failure=30, cwd=work)
        assert all(r.ok for r in results), describe(results)
        return [r.last_json() for r in results]

    with ThreadPoolExecutor(2) as pool:
        one, two = pool.submit(one_process), pool.submit(workers)
        resumed, said = _killed_and_relaunched(
            {**base, "BUCKET": f"s3://{buckets['resumed']}", "STRATKIT_STRATEGY": "mirrored"}, root)
        one, two = one.result(), two.result()
    return {"one": one, "resumed": resumed, "workers": two, "first_attempt": said, "s3": s3, "buckets": buckets,
            "root": root}


def _largest_difference(a: list, b: list) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.multiworker
def test_the_script_as_one_process_killed_and_relaunched_and_on_2_workers_leaves_the_same_files(runs):
    one, resumed, (chief, other) = runs["one"], runs["resumed"], runs["workers"]
    assert [(r["strategy"], r["replicas"]) for r in (one, resumed, chief)] == [
        ("one_device", 1), ("mirrored", 1), ("multi_worker_mirrored", 2)]
    assert "Epoch 3/5" in runs["first_attempt"] and "Epoch 4/5" not in runs["first_attempt"]
    assert resumed["epochs"] == [2, 3, 4]                    # BackupAndRestore resumed it from the store
    s3, buckets = runs["s3"], runs["buckets"]
    expected = ["ckpt/m-01.keras", "ckpt/m-02.keras", "ckpt/m-03.keras", "ckpt/m-04.keras", "ckpt/m-05.keras",
                "log.csv", "tb/train/events.out.tfevents.*"]
    assert _bucket_names(s3, buckets["resumed"]) == expected
    assert _bucket_names(s3, buckets["workers"]) == expected
    export = ["fingerprint.pb", "saved_model.pb", "variables/variables.data-00000-of-00001",
              "variables/variables.index"]
    assert _bucket_names(s3, buckets["one"]) == sorted(expected + [f"saved/export/{name}" for name in export] +
                                                       ["saved/model.keras"])
    for name, reports in (("one", [one]), ("resumed", [resumed]), ("workers", [chief, other])):
        url = f"s3://{buckets[name]}"
        for report in reports:             # every callback names the user's URL again after fit
            assert report["paths_after_fit"] == [url + "/ckpt/m-{epoch:02d}.keras", url + "/log.csv", url + "/tb",
                                                 url + "/bar"]
    # no directory named after a scheme, nothing left in any staging area
    assert not [p for p in runs["root"].rglob("*") if p.name.endswith(":")]
    for temp in runs["root"].glob("*-tmp"):
        if temp.name != "first-tmp":        # (SIGKILL left no chance to clean up; the relaunch had a fresh one)
            assert [p.name for p in temp.iterdir()] == [], temp


@pytest.mark.multiworker
def test_the_weights_equal_the_uninterrupted_one_process_run(runs):
    one, resumed, (chief, other) = runs["one"], runs["resumed"], runs["workers"]
    assert _largest_difference(resumed["weights"], one["weights"]) <= TOLERANCE
    assert _largest_difference(chief["weights"], one["weights"]) <= TOLERANCE
    assert chief["weights"] == other["weights"]              # the workers bit-identical


@pytest.mark.multiworker
def test_csv_logger_append_gives_each_epoch_once_after_the_resume(runs):
    s3, buckets = runs["s3"], runs["buckets"]
    for name in ("one", "resumed", "workers"):
        lines = s3.fs().cat(f"{buckets[name]}/log.csv").decode().splitlines()
        epochs = [line.split(",")[0] for line in lines[1:]]
        assert lines[0].startswith("epoch") and epochs == ["0", "1", "2", "3", "4"], (name, lines)


@pytest.mark.multiworker
def test_model_save_save_weights_and_export_on_one_process_read_back_equal(runs):
    one = runs["one"]
    assert one["keras"] <= 1e-6 and one["weights_file"] <= 1e-6 and one["export"] <= 1e-6, one
