"""The input rules, the same for every input kind and every strategy.

* `steps_per_epoch=N` runs exactly N steps every epoch. Finite data is read as
  one stream, repeated as often as needed (numpy arrays reshuffled on each
  pass); the next epoch continues where the last one stopped. Without
  `steps_per_epoch` an epoch is one pass over the data.
* A `tf.data.Dataset` already batched with the global batch is used as it is
  (its batch size is the global batch when none is given); a different batch
  size is a `ConfigError` that says how to fix it.

Steps are counted two ways (Keras' own per-batch hook and
`optimizer.iterations`, or the parameter-server step counter), and on the
synchronous strategies every example id the replicas trained on is counted:
in the cluster runs 30 steps x 64 = 5 passes over 384 rows, so every id
exactly 5 times.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections import Counter

import numpy as np
import pytest

from procs import cluster_tf_configs, describe, free_ports, run_cluster, run_process, worker_tf_configs

import stratkit
from stratkit.errors import ConfigError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.slow

ROWS, BATCH, STEPS, EPOCHS = 384, 64, 35, 6  # 6 batches of data per pass, 35 steps asked per epoch
CLUSTER_STEPS, CLUSTER_EPOCHS = 10, 3  # the same in SCRIPT, shorter for the multi-process runs
KINDS = ("numpy", "dataset", "batched", "dataset_fn")


@pytest.fixture(scope="module")
def trainer():
    return stratkit.Trainer(strategy="one_device")


def _arrays():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 4)).astype("float32"), rng.normal(size=(ROWS, 3)).astype("float32")


def _data(kind: str, x, y):
    if kind == "numpy":
        return (x, y)
    if kind == "dataset":
        return tf.data.Dataset.from_tensor_slices((x, y))
    if kind == "batched":  # as Keras users write it: batched with the global batch, then prefetched
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).prefetch(tf.data.AUTOTUNE)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.batch(context.get_per_replica_batch_size(BATCH))

    return dataset_fn


def _mlp():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


# -- one process ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_steps_per_epoch_beyond_the_data_runs_every_step(trainer, capsys, kind):
    model = trainer.build(_mlp)
    counter = CountBatches()
    trainer.fit(model, _data(kind, *_arrays()), epochs=EPOCHS, steps_per_epoch=STEPS, global_batch_size=BATCH,
                callbacks=[counter], verbose=0)
    assert counter.per_epoch == [STEPS] * EPOCHS
    assert int(model.optimizer.iterations.numpy()) == STEPS * EPOCHS
    lines = re.findall(r"\[stratkit\] epoch \d+: .*\(\d+ examples in (\d+) steps of global batch (\d+)",
                       capsys.readouterr().out)
    assert lines == [(str(STEPS), str(BATCH))] * EPOCHS


def test_without_steps_per_epoch_an_epoch_is_one_pass(trainer):
    model = trainer.build(_mlp)
    counter = CountBatches()
    trainer.fit(model, _data("dataset", *_arrays()), epochs=2, global_batch_size=BATCH, callbacks=[counter],
                verbose=0)
    assert counter.per_epoch == [ROWS // BATCH] * 2


def test_the_throughput_line_reports_the_steps_that_ran(trainer, capsys):
    class StopAfterTenSteps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 9:
                self.model.stop_training = True

    model = trainer.build(_mlp)
    trainer.fit(model, _arrays(), epochs=3, steps_per_epoch=STEPS, global_batch_size=BATCH,
                callbacks=[StopAfterTenSteps()], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert "in 10 steps of global batch 64," in capsys.readouterr().out


def test_a_batched_dataset_gives_the_global_batch_for_fit_evaluate_and_predict(trainer):
    x, y = _arrays()
    model = trainer.build(_mlp)
    counter = CountBatches()
    trainer.fit(model, _data("batched", x, y), epochs=2, callbacks=[counter], verbose=0)  # no batch size given
    assert counter.per_epoch == [ROWS // BATCH] * 2
    assert trainer.evaluate(model, _data("batched", x, y)) == pytest.approx(
        trainer.evaluate(model, (x, y), global_batch_size=BATCH), rel=1e-6)
    np.testing.assert_allclose(trainer.predict(model, tf.data.Dataset.from_tensor_slices(x).batch(BATCH)),
                               trainer.predict(model, x, global_batch_size=BATCH), rtol=1e-6)


def test_a_batched_dataset_with_another_batch_size_says_how_to_fix_it(trainer):
    x, y = _arrays()
    with pytest.raises(ConfigError, match=r"already batched \(batch size 32\).*global_batch_size=64.*"
                                          r"Fix: batch it with 64.*or pass it unbatched"):
        trainer.fit(trainer.build(_mlp), tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
                    global_batch_size=64)


# -- several replicas, several workers, parameter servers -------------------------------------
SCRIPT = textwrap.dedent('''
    import json, os
    from collections import Counter
    import stratkit

    options = {"logical_cpus": 2} if os.environ.get("STRATEGY") == "mirrored" else {}
    trainer = stratkit.Trainer(strategy=os.environ.get("STRATEGY"), **options)   # PS: ps/worker tasks serve here
    import keras
    import numpy as np
    import tensorflow as tf

    ROWS, BATCH, STEPS, EPOCHS = 384, 64, 10, 3   # 10 steps asked, 6 batches of data
    ids = np.arange(ROWS, dtype="float32")
    x = np.stack([ids, np.ones(ROWS, "float32")], axis=1)
    y = np.zeros((ROWS, 1), "float32")
    ps = trainer.spec.strategy == "parameter_server"
    seen = []


    class Record(keras.layers.Layer):
        """Drops the id column; on synchronous strategies it records the ids a replica trains on."""

        def call(self, inputs, training=None):
            if training and not ps:
                def log(batch_ids):
                    seen.extend(int(i) for i in batch_ids.numpy())
                    return np.int32(0)
                token = tf.py_function(log, [tf.cast(inputs[:, 0], tf.int64)], tf.int32)
                with tf.control_dependencies([token]):
                    return tf.identity(inputs[:, 1:])
            return inputs[:, 1:]


    def build():
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(Record()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return model


    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines,
                                                              context.input_pipeline_id)
        return ds.batch(context.get_per_replica_batch_size(BATCH))


    class CountBatches(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            counts.append(0)

        def on_train_batch_end(self, batch, logs=None):
            counts[-1] += 1


    kinds = {"numpy": lambda: (x, y),
             "dataset": lambda: tf.data.Dataset.from_tensor_slices((x, y)),
             "batched": lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).prefetch(2),
             "dataset_fn": lambda: dataset_fn}
    report = {}
    for kind, data in kinds.items():
        counts, seen[:] = [], []
        model = trainer.build(build)
        history = trainer.fit(model, data(), epochs=EPOCHS, steps_per_epoch=STEPS, global_batch_size=BATCH,
                              callbacks=[CountBatches()])
        report[kind] = {"steps": history.steps if ps else int(model.optimizer.iterations.numpy()),
                        "batches_per_epoch": counts, "id_counts": [Counter(seen)[i] for i in range(ROWS)]}
    batched_x = tf.data.Dataset.from_tensor_slices(x).batch(BATCH)
    report["evaluate_batched"] = trainer.evaluate(model, kinds["batched"]())
    report["evaluate_numpy"] = trainer.evaluate(model, (x, y), global_batch_size=BATCH)
    report["predict_diff"] = float(np.abs(trainer.predict(model, batched_x)
                                          - trainer.predict(model, x, global_batch_size=BATCH)).max())
    with open(os.environ["OUT"] + f"-{trainer.spec.task_type or 'local'}-{trainer.spec.task_index or 0}.json",
              "w") as handle:
        json.dump(report, handle)
''')


def _run(tmp_path, configs, **env):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {"OUT": str(tmp_path / "report"), "STRATKIT_CHIEF_GRACE_SECONDS": "60", **env}
    if configs is None:
        results = [run_process(str(script), env=env, timeout=240)]
    else:
        results = run_cluster(str(script), configs, env=env, timeout=300, grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    return results


def _assert_every_step_ran(reports, sync=True):
    chief = reports[0]
    for kind in KINDS:
        for report in reports:
            assert report[kind]["steps"] == CLUSTER_STEPS * CLUSTER_EPOCHS, kind
            if sync:
                assert report[kind]["batches_per_epoch"] == [CLUSTER_STEPS] * CLUSTER_EPOCHS, kind
        if sync:  # 30 steps x 64 = 1920 examples = 5 passes: every id exactly 5 times, over all workers
            totals = np.sum([r[kind]["id_counts"] for r in reports], axis=0)
            assert Counter(totals.tolist()) == {CLUSTER_STEPS * CLUSTER_EPOCHS * BATCH // ROWS: ROWS}, kind
    assert chief["evaluate_batched"] == pytest.approx(chief["evaluate_numpy"], rel=1e-6)
    assert chief["predict_diff"] < 1e-6


def test_mirrored_two_replicas_runs_every_step_of_every_input_kind(tmp_path):
    results = _run(tmp_path, None, STRATEGY="mirrored")
    report = json.loads((tmp_path / "report-local-0.json").read_text())
    _assert_every_step_ran([report])
    assert results[0].stdout.count(f"in {CLUSTER_STEPS} steps of global batch {BATCH},") == CLUSTER_EPOCHS * len(KINDS)


@pytest.mark.multiworker
def test_two_workers_run_every_step_of_every_input_kind(tmp_path):
    _run(tmp_path, worker_tf_configs(free_ports(2)))
    _assert_every_step_ran([json.loads((tmp_path / f"report-worker-{i}.json").read_text()) for i in (0, 1)])


@pytest.mark.multiworker
def test_parameter_servers_run_every_step_of_every_input_kind(tmp_path):
    ports = iter(free_ports(4))
    results = _run(tmp_path, cluster_tf_configs({
        "chief": [f"127.0.0.1:{next(ports)}"], "worker": [f"127.0.0.1:{next(ports)}", f"127.0.0.1:{next(ports)}"],
        "ps": [f"127.0.0.1:{next(ports)}"]}))
    _assert_every_step_ran([json.loads((tmp_path / "report-chief-0.json").read_text())], sync=False)
    assert results[0].stdout.count(f": {CLUSTER_STEPS} steps in ") == CLUSTER_EPOCHS * len(KINDS)


# -- parameter servers: every worker needs a step's worth of its shard -------------------------
def test_parameter_server_data_too_small_for_each_worker_to_fill_a_step_is_refused():
    from stratkit.training.ps import _check_shards

    x, y = _arrays()  # 384 rows: 3 workers read 128 each
    _check_shards((x, y), 128, num_workers=3, num_replicas=1)
    with pytest.raises(ConfigError, match=r"384 examples: each of the 3 workers reads 128, fewer than one step's "
                                          r"batch of 129.*Fix: use global_batch_size <= 128"):
        _check_shards((x, y), 129, num_workers=3, num_replicas=1)
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)  # 6 batches
    _check_shards(batched, BATCH, num_workers=6, num_replicas=1)
    with pytest.raises(ConfigError, match=r"6 batch\(es\), fewer than the 7 workers.*Fix:"):
        _check_shards(batched, BATCH, num_workers=7, num_replicas=1)
