"""Parameter-server training of a Keras 3 model through `trainer.fit`, as real processes on 127.0.0.1.

One user script (`SCRIPT`) runs unchanged on every task: `stratkit.Trainer()`
makes the ps and worker tasks serve until the chief is done, `trainer.fit`
trains on the chief and evaluates checkpoints on the evaluator.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from procs import REPO_ROOT, Result, cluster_tf_configs, describe, free_ports, run_cluster, run_process

from stratkit.cluster import ClusterSpec
from stratkit.errors import ConfigError

EPOCHS, STEPS = 5, 40  # 40 steps x global batch 32 = 1280 examples, about one pass over 1400 per epoch

SCRIPT = textwrap.dedent('''
    import json, os, signal, subprocess, sys, threading
    import stratkit

    OUT = os.environ["OUT"]
    MODE = os.environ.get("MODE", "mlp")
    DATA_KIND = os.environ.get("DATA_KIND", "numpy")
    spec = stratkit.detect()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"pid-{spec.task_type}-{spec.task_index}"), "w") as handle:
        handle.write(str(os.getpid()))

    if os.environ.get("RESTART_CHIEF") and spec.task_type == "chief" and not os.environ.get("CHIEF_CHILD"):
        # Play the job supervisor: run the chief, which dies after an epoch, then run it again.
        codes = []
        for kill in (os.environ["RESTART_CHIEF"], ""):
            env = dict(os.environ, CHIEF_CHILD="1", KILL_SELF_AT_EPOCH=kill)
            codes.append(subprocess.run([sys.executable, __file__], env=env).returncode)
        print(json.dumps({"chief_runs": codes}), flush=True)
        sys.exit(0 if codes[-1] == 0 else 1)

    options = {}
    if os.environ.get("PARTITION"):
        import tensorflow as tf
        options["variable_partitioner"] = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=32 * 1024, max_shards=2)
    trainer = stratkit.Trainer(**options)   # ps and worker tasks serve here, then exit
    chief_port_bound = None
    if spec.task_type == "chief":  # the servers watch this port to notice a chief that died
        import socket
        host, port = spec.address().rsplit(":", 1)
        with socket.socket() as probe:
            chief_port_bound = probe.connect_ex((host, int(port))) == 0

    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    if MODE == "embedding":  # a bag of (pixel, intensity) tokens: 64 pixels x 17 levels
        x = (np.arange(64) * 17 + digits.data.astype("int64")).astype("int32")
    else:
        x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    if DATA_KIND == "dataset":
        data = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1400, seed=1)
    elif DATA_KIND == "dataset_fn":
        def data(input_context):
            batch = input_context.get_per_replica_batch_size(32)
            ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            return ds.shuffle(1400).repeat().batch(batch)
    else:
        data = (x_train, y_train)


    def build():
        if MODE == "embedding":
            model = keras.Sequential([keras.Input((64,), dtype="int32"), keras.layers.Embedding(64 * 17, 16),
                                      keras.layers.Flatten(), keras.layers.Dense(10)])
        else:
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model


    class Chaos(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if os.environ.get("KILL_WORKER_AT_EPOCH") == str(epoch + 1):
                with open(os.path.join(OUT, "pid-worker-1")) as handle:
                    pid = int(handle.read())
                print(f"killing worker 1 during epoch {epoch + 1}", flush=True)
                threading.Timer(0.1, os.kill, (pid, signal.SIGKILL)).start()

        def on_epoch_end(self, epoch, logs=None):
            if os.environ.get("KILL_SELF_AT_EPOCH") == str(epoch + 1):
                print(f"chief dies after epoch {epoch + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ.get("RAISE_AT_EPOCH") == str(epoch + 1):
                raise RuntimeError("the user's code failed on the chief")


    class Record(keras.callbacks.Callback):
        calls = []

        def on_train_begin(self, logs=None):
            self.calls.append(["train_begin", self.model is model])

        def on_epoch_end(self, epoch, logs=None):
            self.calls.append(["epoch_end", epoch, sorted(logs)])

        def on_train_end(self, logs=None):
            self.calls.append(["train_end", sorted(logs or {})])


    model = trainer.build(build)
    first_fit_steps = None
    if os.environ.get("FIT_TWICE"):
        first_fit_steps = trainer.fit(model, data, epochs=1, steps_per_epoch=int(os.environ["STEPS"]),
                                      global_batch_size=32, verbose=0).steps
    history = trainer.fit(model, data, epochs=int(os.environ["EPOCHS"]), steps_per_epoch=int(os.environ["STEPS"]),
                          global_batch_size=32, validation_data=(x_test, y_test),
                          backup_dir=os.environ.get("BACKUP_DIR"), callbacks=[Chaos(), Record()] + (
                              [keras.callbacks.TensorBoard(os.environ["TB_DIR"])] if "TB_DIR" in os.environ else []))
    if spec.task_type == "evaluator":
        report = {"history": history.history, "epochs": history.epoch}
    else:
        evaluation = trainer.evaluate(model, (x_test, y_test), global_batch_size=64)
        predictions = trainer.predict(model, x_test, global_batch_size=64)
        trainer.save(model, os.path.join(OUT, "model.keras"))   # after fit: the ps tasks still serve
        np.save(os.path.join(OUT, "predictions.npy"), predictions)
        report = {"history": history.history, "steps": history.steps, "steps_scheduled": history.steps_scheduled,
                  "initial_epoch": history.initial_epoch, "evaluate": evaluation,
                  "iterations": int(model.optimizer.iterations.numpy()), "first_fit_steps": first_fit_steps,
                  "callback_calls": Record.calls,
                  "chief_port_bound": chief_port_bound,
                  "predict_accuracy": float((predictions.argmax(axis=1) == y_test).mean())}
        if MODE == "embedding":
            value = model.layers[0].embeddings.value
            report["embedding_shards"] = [str(v.device) for v in getattr(value, "variables", [value])]
    with open(os.path.join(OUT, f"report-{spec.task_type}.json"), "w") as handle:
        json.dump(report, handle)
''')

RELOAD = textwrap.dedent('''
    import json, sys
    import keras, numpy as np
    from sklearn.datasets import load_digits

    out, mode = sys.argv[1], sys.argv[2]
    digits = load_digits()
    if mode == "embedding":
        x = (np.arange(64) * 17 + digits.data.astype("int64")).astype("int32")[1400:]
    else:
        x = (digits.data / 16.0).astype("float32")[1400:]
    model = keras.models.load_model(f"{out}/model.keras")      # no strategy, no cluster
    diff = np.abs(model.predict(x, verbose=0) - np.load(f"{out}/predictions.npy")).max()
    print(json.dumps({"max_diff": float(diff)}))
''')


def _cluster(workers: int, ps: int, evaluator: bool = False) -> list[dict]:
    ports = iter(free_ports(1 + workers + ps + int(evaluator)))
    cluster = {"chief": [f"127.0.0.1:{next(ports)}"],
               "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
               "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)]}
    if evaluator:
        cluster["evaluator"] = [f"127.0.0.1:{next(ports)}"]
    return cluster_tf_configs(cluster)  # chief, workers, ps, evaluator: the order of the results


def _train(tmp_path: Path, configs: list[dict], timeout: float = 150, **env: str) -> tuple[list[Result], Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    results = run_cluster(str(script), configs, timeout=timeout, grace_after_failure=30, env={
        "OUT": str(out), "EPOCHS": str(EPOCHS), "STEPS": str(STEPS), "STRATKIT_CHIEF_GRACE_SECONDS": "60", **env})
    return results, out


def _report(out: Path, role: str = "chief") -> dict:
    return json.loads((out / f"report-{role}.json").read_text())


def _assert_reloads_identically(tmp_path: Path, out: Path, mode: str) -> None:
    (tmp_path / "reload.py").write_text(RELOAD)
    result = run_process(str(tmp_path / "reload.py"), args=[str(out), mode], timeout=90)
    assert result.ok, describe([result])
    assert result.last_json()["max_diff"] < 1e-5


def _assert_trained(report: dict, epochs_run: int = EPOCHS) -> None:
    history = report["history"]
    assert sorted(history) == ["accuracy", "examples_per_sec", "loss", "val_accuracy", "val_loss"]
    assert all(len(values) == epochs_run for values in history.values())
    assert history["loss"][-1] < history["loss"][0]
    assert report["evaluate"]["accuracy"] >= 0.85
    assert report["evaluate"]["accuracy"] == pytest.approx(history["val_accuracy"][-1], abs=1e-6)
    assert report["predict_accuracy"] == pytest.approx(report["evaluate"]["accuracy"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.multiworker
def test_chief_two_workers_one_ps_train_digits_with_exact_step_count(tmp_path):
    # fit twice, then evaluate, predict and save: the ps tasks serve until the chief's script ends.
    results, out = _train(tmp_path, _cluster(workers=2, ps=1), FIT_TWICE="1")
    assert all(r.ok for r in results), describe(results)
    chief, *servers = results
    for server in servers:
        assert "the chief finished training" in server.stdout, describe(results)
    report = _report(out)
    assert report["chief_port_bound"] is True
    _assert_trained(report)
    # Asynchronous workers, yet every scheduled step is counted exactly once, across both fits, and
    # Keras' own (non-atomic) counter is set to the exact count.
    assert report["first_fit_steps"] == STEPS
    assert report["steps"] == report["steps_scheduled"] == (1 + EPOCHS) * STEPS
    assert report["iterations"] == (1 + EPOCHS) * STEPS
    # Keras callbacks see the model and each epoch's logs, as with model.fit.
    keys = ["accuracy", "examples_per_sec", "loss", "val_accuracy", "val_loss"]
    assert report["callback_calls"] == ([["train_begin", True]] + [["epoch_end", e, keys] for e in range(EPOCHS)]
                                        + [["train_end", keys]])
    _assert_reloads_identically(tmp_path, out, "mlp")


@pytest.mark.slow
@pytest.mark.multiworker
def test_evaluator_follows_the_chief_and_a_partitioned_embedding_spans_two_ps(tmp_path, store_server):
    # TensorBoard's log_dir is a bucket on moto's S3 server: the chief's callback and the evaluator's summaries
    # are written locally and uploaded (stratkit.strategy.store_callbacks, the evaluator's mirror).
    s3 = store_server("s3")
    tensorboard = s3.url(s3.make_bucket(f"ps-tb-{os.getpid()}-{os.urandom(3).hex()}"), "tb")
    backup = tmp_path / "backup"
    results, out = _train(tmp_path, _cluster(workers=2, ps=2, evaluator=True), MODE="embedding", PARTITION="1",
                          DATA_KIND="dataset", BACKUP_DIR=str(backup), TB_DIR=tensorboard, **s3.env)
    assert all(r.ok for r in results), describe(results)
    report = _report(out)
    _assert_trained(report)
    assert report["steps"] == report["steps_scheduled"] == EPOCHS * STEPS
    # MinSizePartitioner split the 1088 x 16 embedding (70 KB) into one shard per ps.
    assert sorted(report["embedding_shards"]) == ["/job:ps/replica:0/task:0/device:CPU:0",
                                                  "/job:ps/replica:0/task:1/device:CPU:0"]
    evaluator = _report(out, "evaluator")
    assert evaluator["epochs"][-1] == EPOCHS  # it evaluated the final checkpoint, then stopped
    assert evaluator["history"]["val_accuracy"][-1] == pytest.approx(report["history"]["val_accuracy"][-1],
                                                                     abs=1e-6)
    assert "[stratkit] evaluator: epoch 5" in results[-1].stdout
    # TensorBoard: the chief's callback wrote train and validation curves, the evaluator its own run.
    names = s3.fs().find(tensorboard.split("://", 1)[1])
    for run in ("train", "validation", "eval"):
        assert any(f"/tb/{run}/events.out.tfevents" in name for name in names), (run, names)
    assert not (REPO_ROOT / "s3:").exists()       # the tasks' working directory holds no directory "s3:"
    assert json.loads((backup / "training-done.json").read_text())["epoch"] == EPOCHS
    _assert_reloads_identically(tmp_path, out, "embedding")


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_worker_sigkilled_mid_training_does_not_stop_the_chief(tmp_path):
    results, out = _train(tmp_path, _cluster(workers=2, ps=1), KILL_WORKER_AT_EPOCH="2")
    chief, worker0, worker1, ps = results
    assert worker1.returncode == -9, describe(results)  # the injected failure
    assert chief.ok and worker0.ok and ps.ok, describe(results)
    report = _report(out)
    assert len(report["history"]["loss"]) == EPOCHS
    assert report["steps_scheduled"] == EPOCHS * STEPS
    # A step in flight on the dead worker may have reached the ps before TensorFlow re-ran it.
    assert EPOCHS * STEPS <= report["steps"] <= EPOCHS * STEPS + 1
    assert report["evaluate"]["accuracy"] >= 0.8


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_restarted_chief_resumes_from_backup_dir_at_the_saved_epoch(tmp_path):
    backup = tmp_path / "backup"
    results, out = _train(tmp_path, _cluster(workers=1, ps=1), RESTART_CHIEF="2", DATA_KIND="dataset_fn",
                          BACKUP_DIR=str(backup))
    assert all(r.ok for r in results), describe(results)
    chief = results[0]
    assert chief.last_json() == {"chief_runs": [-9, 0]}
    assert "chief dies after epoch 2" in chief.stdout
    assert f"resumed from {backup / 'epoch-00002.weights.h5'} at epoch 2" in chief.stdout
    report = _report(out)
    assert report["initial_epoch"] == 2
    _assert_trained(report, epochs_run=EPOCHS - 2)  # epochs 3 to 5 only
    assert report["steps"] == report["steps_scheduled"] == EPOCHS * STEPS
    assert not backup.exists()  # a finished run without an evaluator leaves no backup behind


@pytest.mark.slow
@pytest.mark.multiworker
def test_when_the_chief_fails_the_servers_exit_1_at_once(tmp_path):
    results, _ = _train(tmp_path, _cluster(workers=1, ps=1), timeout=90, RAISE_AT_EPOCH="1",
                        STRATKIT_CHIEF_GRACE_SECONDS="600")
    chief, worker, ps = results
    assert chief.returncode == 1 and "the user's code failed on the chief" in chief.stderr, describe(results)
    for server in (worker, ps):  # not killed by the timeout: the chief told them
        assert server.returncode == 1 and not server.killed, describe(results)
        assert "the chief failed" in server.stderr


@pytest.mark.slow
@pytest.mark.multiworker
def test_when_the_chief_is_killed_the_servers_exit_1_after_the_grace_period(tmp_path):
    results, _ = _train(tmp_path, _cluster(workers=1, ps=1), timeout=90, KILL_SELF_AT_EPOCH="1",
                        STRATKIT_CHIEF_GRACE_SECONDS="3")
    chief, worker, ps = results
    assert chief.returncode == -9, describe(results)  # no exit hook runs: only its vanished port tells
    for server in (worker, ps):
        assert server.returncode == 1 and not server.killed, describe(results)
        assert "gone for 3s without ending training" in server.stderr


def _chief_without_cluster(cluster: dict) -> object:
    """A Trainer on a PS chief, without connecting: only the argument checks run."""
    from stratkit.training.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.spec = ClusterSpec(strategy="parameter_server", task_type="chief", task_index=0, cluster=cluster,
                               is_chief=True, num_workers=3)
    trainer.strategy = SimpleNamespace(num_replicas_in_sync=1)
    trainer.seed = 0
    return trainer


CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}
DATA = (np.zeros((64, 4), "float32"), np.zeros(64, "int32"))


def test_steps_per_epoch_is_required_and_the_error_says_how_to_fix_it():
    with pytest.raises(ConfigError, match=r"steps_per_epoch=None.*Fix: pass steps_per_epoch=N"):
        _chief_without_cluster(CLUSTER).fit(None, DATA, epochs=2, global_batch_size=32)


def test_a_cluster_with_an_evaluator_needs_backup_dir_on_the_chief():
    trainer = _chief_without_cluster({**CLUSTER, "evaluator": ["h:5"]})
    with pytest.raises(ConfigError, match=r"backup_dir=None.*evaluator.*Fix: pass backup_dir="):
        trainer.fit(None, DATA, epochs=2, steps_per_epoch=4, global_batch_size=32)
