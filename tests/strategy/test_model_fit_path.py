"""`stratkit.make_strategy()` + the user's own `model.fit`: what stratkit guards there.

A user who only takes the strategy from stratkit and keeps calling Keras's
`model.fit` / `evaluate` / `predict` gets the same protection as `Trainer`
users: files written by Keras callbacks land only where the chief writes them,
one progress bar, a clear error for parameter-server training and for
`steps_per_execution > 1`. Every test runs real TensorFlow in fresh processes
(TF fixes devices and collectives at startup); the multi-worker ones start
real workers on 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from procs import cluster_tf_configs, describe, free_ports, run_cluster, run_process, worker_tf_configs

pytestmark = pytest.mark.slow

CLEAN_ENV: dict[str, str | None] = {"STRATKIT_KERAS_COMPAT": None, "TF_USE_LEGACY_KERAS": None,
                                    "STRATKIT_VERBOSE_WORKERS": None}


# --------------------------------------------------------------------------
# Item 3 + 10: the user's own file-writing callbacks on 2 workers, one progress bar
# --------------------------------------------------------------------------

USER_FIT = textwrap.dedent('''
    import json, os, signal
    import stratkit

    strategy = stratkit.make_strategy()           # MWMS on 2 workers, nothing else from stratkit
    spec = stratkit.detect()
    import keras
    import numpy as np

    OUT, EPOCHS, KILL = os.environ["OUT"], int(os.environ["EPOCHS"]), os.environ.get("KILL_AT_EPOCH")
    rank = max(spec.worker_rank, 0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    class KillAfterEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if KILL and epoch + 1 == int(KILL) and rank == 1:
                print(f"killing rank {rank} after epoch {epoch + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    # Every one of these writes to the SAME path on every worker, as in Keras's tutorials.
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(OUT, "backup"),
                                                  delete_checkpoint=not os.environ.get("KEEP_BACKUP")),
                 keras.callbacks.ModelCheckpoint(os.path.join(OUT, "ckpt", "model.keras")),
                 keras.callbacks.ModelCheckpoint(os.path.join(OUT, "ckpt", "last.weights.h5"),
                                                 save_weights_only=True),
                 keras.callbacks.TensorBoard(os.path.join(OUT, "tensorboard")),
                 keras.callbacks.CSVLogger(os.path.join(OUT, "log.csv")),
                 KillAfterEpoch()]
    verbose = {"verbose": int(os.environ["VERBOSE"])} if os.environ.get("VERBOSE") else {}
    history = model.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, callbacks=callbacks, **verbose)
    print(json.dumps({"epochs": history.epoch, "loss": history.history["loss"], "rank": rank,
                      "weights": [w.tolist() for w in model.get_weights()],
                      "backup_dir_after": callbacks[0].backup_dir,
                      "checkpoint_after": callbacks[1].filepath}))
''')


def _stratkit_temp_dirs(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("stratkit-"))


@pytest.mark.multiworker
def test_users_own_backup_and_checkpoint_callbacks_survive_a_kill_and_resume_on_two_workers(tmp_path):
    script = tmp_path / "user_fit.py"
    script.write_text(USER_FIT)
    out = tmp_path / "out"
    tmpdirs = [tmp_path / "tmp-0", tmp_path / "tmp-1"]
    for d in tmpdirs:
        d.mkdir()
    per_process = [{"TMPDIR": str(d)} for d in tmpdirs]

    # The reference: the same script in one process (no cluster), 3 uninterrupted epochs.
    single = run_process(str(script), env={**CLEAN_ENV, "OUT": str(tmp_path / "single"), "EPOCHS": "3"},
                         timeout=120)
    assert single.ok, describe([single])
    ref = single.last_json()
    assert ref["epochs"] == [0, 1, 2]

    # Run 1: worker 1 is SIGKILLed after epoch 2; the chief then loses its peer.
    # Upstream, this run dies at the end of epoch 1 already (every worker writes the same files).
    ports = free_ports(2)
    env = {**CLEAN_ENV, "OUT": str(out), "EPOCHS": "3"}
    first = run_cluster(str(script), worker_tf_configs(ports), env={**env, "KILL_AT_EPOCH": "2", "VERBOSE": "2"},
                        per_process_env=per_process, timeout=150, grace_after_failure=10)
    assert "killing rank 1 after epoch 2" in first[1].stdout, describe(first)
    assert first[1].returncode == -9, describe(first)
    # An explicit verbose= wins on every worker: both printed their epoch lines.
    assert "Epoch 2/3" in first[0].stdout and "Epoch 2/3" in first[1].stdout, describe(first)
    assert json.loads((out / "backup" / "training_metadata.json").read_text())["epoch"] == 2
    # Worker 1 wrote into private directories of its own (routing: tests/training/test_callback_routing.py);
    # the chief used none, and the SIGKILL no longer leaves worker 1's behind (stratkit.strategy.scratch).
    assert _stratkit_temp_dirs(tmpdirs[0]) == [] and _stratkit_temp_dirs(tmpdirs[1]) == [], describe(first)
    for d in tmpdirs:  # run 2 must leave nothing
        shutil.rmtree(d)
        d.mkdir()

    # Run 2: relaunch both workers; they resume at epoch 2 from the chief's backup.
    second = run_cluster(str(script), worker_tf_configs(free_ports(2)), env=env, per_process_env=per_process,
                         timeout=150, grace_after_failure=15)
    assert all(r.ok for r in second), describe(second)
    reports = [r.last_json() for r in second]
    for report in reports:
        assert report["epochs"] == [2], report              # only the epoch that was missing
        # Exact maths: 2 workers x 16 rows = the single process's batch of 32, same SGD steps.
        assert report["loss"] == pytest.approx(ref["loss"][2:], rel=1e-5)
        for w, w_ref in zip(report["weights"], ref["weights"], strict=True):
            np.testing.assert_allclose(np.array(w), np.array(w_ref), atol=1e-5)
        # The user's callback objects are given back as they were made.
        assert report["backup_dir_after"] == str(out / "backup")
        assert report["checkpoint_after"] == str(out / "ckpt" / "model.keras")
    assert reports[0]["weights"] == reports[1]["weights"]

    # Only the chief wrote where the user asked; the backup served its purpose and is gone.
    assert (out / "ckpt" / "model.keras").is_file() and (out / "ckpt" / "last.weights.h5").is_file()
    assert (out / "log.csv").read_text().count("\n") == 2   # header + the resumed epoch (the chief's own file)
    assert any((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert not (out / "backup").exists()
    # Worker 1 wrote into private directories of its own, and removed them at the end.
    assert _stratkit_temp_dirs(tmpdirs[0]) == [] and _stratkit_temp_dirs(tmpdirs[1]) == []
    # One progress bar by default: the chief prints epoch lines, worker 1 prints none.
    assert "Epoch 3/3" in second[0].stdout, describe(second)
    assert "Epoch 3/3" not in second[1].stdout and "loss:" not in second[1].stdout, describe(second)


@pytest.mark.multiworker
def test_workers_that_would_resume_at_different_epochs_stop_with_a_clear_error(tmp_path):
    # The chief's backup holds epoch 1; worker 1 cannot see it (as on a host without shared storage).
    script = tmp_path / "user_fit.py"
    script.write_text(USER_FIT)
    chief_out, worker_out = tmp_path / "chief", tmp_path / "worker"
    made = run_process(str(script), env={**CLEAN_ENV, "OUT": str(chief_out), "EPOCHS": "1", "KEEP_BACKUP": "1"},
                       timeout=120)
    assert made.ok and (chief_out / "backup").is_dir(), describe([made])

    results = run_cluster(str(script), worker_tf_configs(free_ports(2)), env={**CLEAN_ENV, "EPOCHS": "3"},
                          per_process_env=[{"OUT": str(chief_out)}, {"OUT": str(worker_out)}],
                          timeout=150, grace_after_failure=20)
    assert [r.returncode for r in results] == [1, 1], describe(results)
    for r in results:
        assert "ConfigError" in r.stderr and "would resume at different epochs [1, 0]" in r.stderr, describe(results)
        assert "Fix: keep backup_dir on storage every worker can read" in r.stderr
        assert "Epoch 2/3" not in r.stdout   # stopped before any training step


# --------------------------------------------------------------------------
# Item 4: parameter-server strategy + the user's own fit or Keras metrics
# --------------------------------------------------------------------------

PS_USER = textwrap.dedent('''
    import json, os
    import stratkit

    strategy = stratkit.make_strategy()   # ps and worker tasks serve here, then exit 0
    import keras
    import numpy as np
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def outcome(call):
        try:
            call()
            return "ran"
        except stratkit.ConfigError as exc:
            return "ConfigError: " + str(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc)[:300]}"

    report = {
        "fit": outcome(lambda: model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)),
        "evaluate": outcome(lambda: model.evaluate(x, y, batch_size=16, verbose=0)),
        "predict": outcome(lambda: model.predict(x, batch_size=16, verbose=0)),
    }

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()   # a Keras metric, as in TF's PS tutorial

    @tf.function
    def keras_metric_step():
        def replica():
            accuracy.update_state(tf.constant([1]), tf.constant([[0.0, 1.0]]))
            return tf.constant(0)
        return strategy.run(replica)

    def schedule_keras_metric():
        for _ in range(8):
            coordinator.schedule(keras_metric_step)
        coordinator.join()
    report["keras_metric"] = outcome(schedule_keras_metric)

    # What the README tells a custom PS loop to do: raw tf.Variable counters, assign_add outside strategy.run.
    with strategy.scope():
        steps = tf.Variable(0, dtype=tf.int64)
        correct = tf.Variable(0.0)
        seen = tf.Variable(0.0)

    @tf.function
    def counted_step():
        def replica():
            return tf.constant(1.0), tf.constant(1.0)   # (correct, examples) of this step's batch
        per_replica = strategy.run(replica)
        c, n = (strategy.reduce("SUM", v, axis=None) for v in per_replica)
        correct.assign_add(c)
        seen.assign_add(n)
        return steps.assign_add(1)

    for _ in range(61):
        coordinator.schedule(counted_step)
    coordinator.join()
    report.update(steps=int(steps.numpy()), accuracy=float(correct.numpy() / seen.numpy()))
    print(json.dumps(report))
''')


@pytest.mark.multiworker
def test_parameter_server_with_users_own_fit_or_keras_metrics_says_use_the_trainer(tmp_path):
    ports = free_ports(3)
    configs = cluster_tf_configs({"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
                                  "ps": [f"127.0.0.1:{ports[2]}"]})
    results = run_cluster(PS_USER, configs, env={**CLEAN_ENV, "STRATKIT_CHIEF_GRACE_SECONDS": "60"},
                          timeout=180, grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    report = results[0].last_json()
    for call in ("fit", "evaluate", "predict", "keras_metric"):
        message = report[call]
        assert message.startswith("ConfigError: "), (call, message)
        assert "stratkit.Trainer(...).fit" in message and "coordinator API" in message, (call, message)
        assert "parameter-server" in message
    assert "model.fit" in report["fit"] and "model.predict" in report["predict"]
    assert "atomic" in report["keras_metric"] and "tf.Variable" in report["keras_metric"]
    # The recipe the message points to counts exactly.
    assert report["steps"] == 61
    assert report["accuracy"] == 1.0


# --------------------------------------------------------------------------
# Item 5: steps_per_execution > 1 in the user's own compile + fit
# --------------------------------------------------------------------------

def test_steps_per_execution_is_refused_in_users_own_fit_under_mirrored():
    result = run_process(textwrap.dedent('''
        import json
        import stratkit
        strategy = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
        import keras
        import numpy as np
        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        report = {"replicas": strategy.num_replicas_in_sync}
        for name, call in [("fit", lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0)),
                           ("evaluate", lambda: model.evaluate(x, y, batch_size=16, verbose=0))]:
            try:
                call()
                report[name] = "ran"
            except stratkit.ConfigError as exc:
                report[name] = "ConfigError: " + str(exc)
            except Exception as exc:
                report[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        with strategy.scope():
            ok = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            ok.compile(optimizer="sgd", loss="mse")
        report["spe1_loss"] = float(ok.fit(x, y, batch_size=16, epochs=1, verbose=0).history["loss"][0])
        print(json.dumps(report))
    '''), env=CLEAN_ENV, timeout=120)
    assert result.ok, describe([result])
    report = result.last_json()
    assert report["replicas"] == 2
    for name in ("fit", "evaluate"):
        assert report[name].startswith("ConfigError: steps_per_execution=2"), report[name]
        assert "steps_per_execution=1" in report[name]
    assert np.isfinite(report["spe1_loss"])


# --------------------------------------------------------------------------
# Item 8: a strategy made after a TensorFlow op, refused only where TF fails
# --------------------------------------------------------------------------

AFTER_AN_OP = textwrap.dedent('''
    import json, sys
    import stratkit
    import tensorflow as tf
    tf.constant(1.0) + 1.0                       # the runtime starts here
    kind, raw = sys.argv[1], sys.argv[2] == "raw"

    def tf_itself():
        if kind == "mirrored_logical":
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
            return tf.distribute.MirroredStrategy()
        if kind == "mirrored":
            return tf.distribute.MirroredStrategy()
        return tf.distribute.MultiWorkerMirroredStrategy()

    def ours():
        if kind == "mirrored_logical":
            return stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
        return stratkit.make_strategy(strategy=kind if kind == "mirrored" else "multi_worker_mirrored")

    try:
        s = tf_itself() if raw else ours()
        total = s.reduce("SUM", s.run(lambda: tf.constant(1.0)), axis=None)
        print(json.dumps({"ok": True, "type": type(s).__name__, "sum": float(total)}))
    except stratkit.ConfigError as exc:
        print(json.dumps({"ok": False, "config_error": True, "error": str(exc)}))
    except Exception as exc:
        print(json.dumps({"ok": False, "config_error": False, "error": f"{type(exc).__name__}: {exc}"}))
''')

ONE_WORKER_CLUSTER = {"cluster": {"worker": ["127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}


def _after_an_op(kind: str, raw: bool, cluster: bool) -> dict:
    tf_config = None
    if cluster:
        tf_config = json.loads(json.dumps(ONE_WORKER_CLUSTER).replace("{port}", str(free_ports(1)[0])))
    result = run_process(AFTER_AN_OP, env=CLEAN_ENV, args=[kind, "raw" if raw else "ours"], timeout=90,
                         tf_config=tf_config)
    assert result.ok, describe([result])
    return result.last_json()


@pytest.mark.parametrize(("kind", "cluster", "tf_allows"), [
    ("mirrored", False, True),
    ("multi_worker_mirrored", False, True),      # one process, no cluster: TF allows it
    ("multi_worker_mirrored", True, False),      # a cluster: 'Collective ops must be configured at program startup'
    ("mirrored_logical", False, False),          # logical devices cannot change once TF started
])
def test_strategy_after_a_tensorflow_op_is_refused_exactly_where_tensorflow_fails(kind, cluster, tf_allows):
    raw = _after_an_op(kind, raw=True, cluster=cluster)
    assert raw["ok"] is tf_allows, raw            # what TensorFlow itself does
    ours = _after_an_op(kind, raw=False, cluster=cluster)
    if tf_allows:
        assert ours["ok"], ours
        assert ours["sum"] == raw["sum"]
    else:
        assert ours["config_error"], ours
        assert "Fix: create the strategy before any other TensorFlow op" in ours["error"]


# --------------------------------------------------------------------------
# After fit returns on any worker, the chief's callbacks have finished (their files are complete)
# --------------------------------------------------------------------------

CHIEF_WRITES_LATE = textwrap.dedent('''
    import json, os, time
    import stratkit

    strategy = stratkit.make_strategy()
    import keras
    import numpy as np

    OUT = os.environ["OUT"]
    chief = bool(strategy.extended.should_checkpoint)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")

    class SlowChiefFile(keras.callbacks.Callback):
        """The chief writes a file at the end of training, slowly (a large checkpoint, a slow disk)."""
        def on_train_end(self, logs=None):
            if chief:
                time.sleep(1.5)
                with open(os.path.join(OUT, "chief-file"), "w") as handle:
                    handle.write("complete")

    x = np.ones((32, 4), "float32")
    model.fit(x, x[:, :1], epochs=1, batch_size=8, callbacks=[SlowChiefFile()], verbose=0)
    # As in TF's tutorials: every worker reads what the chief saved (e.g. model.load_weights of its checkpoint).
    print(json.dumps({"chief": chief, "sees_chief_file": os.path.exists(os.path.join(OUT, "chief-file"))}))
''')


def test_every_workers_fit_returns_after_the_chiefs_callbacks_finished(tmp_path):
    """A non-chief's fit used to return while the chief was still writing (h5py: 'unable to lock file')."""
    results = run_cluster(CHIEF_WRITES_LATE, worker_tf_configs(free_ports(2)), env={**CLEAN_ENV, "OUT": str(tmp_path)},
                          timeout=180)
    assert all(r.ok for r in results), describe(results)
    seen = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    assert [s["chief"] for s in seen] == [True, False]
    assert all(s["sees_chief_file"] for s in seen), seen


# --------------------------------------------------------------------------
# Issue 23 item 5, issue 39: a Python generator in the user's own model.fit on several workers
# --------------------------------------------------------------------------

GENERATOR_FIT = textwrap.dedent('''
    import json
    import stratkit

    strategy = stratkit.make_strategy()
    import keras, numpy as np, tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")

    def batches():                                   # 16 rows a batch (the global batch), forever
        i = 0
        while True:
            rows = slice(16 * (i % 40), 16 * (i % 40 + 1))
            yield x[rows], y[rows]
            i += 1

    def fit(data, **kwargs):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(data, epochs=2, verbose=0, **kwargs)
        return {"w": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"]}

    signature = (tf.TensorSpec((None, 8), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    report = {"generator": fit(batches(), steps_per_epoch=10),
              "from_generator": fit(tf.data.Dataset.from_generator(batches, output_signature=signature),
                                    steps_per_epoch=10)}
    print(json.dumps(report))
''')


def test_a_generator_in_model_fit_on_two_workers_trains_as_one_process_without_a_warning():
    """Before: the generator's batches a throwaway iterator prefetched were never trained (3 on one process, 4 per
    worker), so 2 workers trained other batches than one process, with a warning; and TensorFlow wrote into the
    generator's rows once the strategy split them. Now both are exact: nothing to warn about."""
    results = run_cluster(GENERATOR_FIT, worker_tf_configs(free_ports(2)), env=CLEAN_ENV, timeout=240,
                          grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    single = run_process(GENERATOR_FIT, env=CLEAN_ENV, timeout=240)
    assert single.ok, describe([single])
    reference = single.last_json()
    chief, worker = (r.last_json() for r in results)
    assert chief == worker
    for name in ("generator", "from_generator"):
        np.testing.assert_allclose(chief[name]["loss"], reference[name]["loss"], rtol=1e-5, err_msg=name)
        for got, want in zip(chief[name]["w"], reference[name]["w"], strict=True):
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, err_msg=name)
    for result in (*results, single):
        assert "Python generator" not in result.stderr + result.stdout, result.stderr[-3000:]
