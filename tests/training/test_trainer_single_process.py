"""Trainer behaviour that one process can show: input checks, learning-rate scaling,
throughput, saving, and checkpoints that survive a kill mid-write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from procs import child_env

import stratkit
from stratkit.errors import ConfigError
from stratkit.training import backup
from stratkit.training.data import prepare, resolve_global_batch_size

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainer():
    return stratkit.Trainer(strategy="one_device")


def _mlp(lr=0.1):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


# -- batch sizes --------------------------------------------------------------------
def test_global_batch_is_per_replica_times_replicas():
    assert resolve_global_batch_size(None, 16, 4, required=True) == 64
    assert resolve_global_batch_size(64, None, 4, required=True) == 64
    assert resolve_global_batch_size(64, 16, 4, required=True) == 64  # consistent: accepted


@pytest.mark.parametrize("args, message", [
    ((64, 32, 4), r"global_batch_size=64 and per_replica_batch_size=32 disagree with 4 replica"),
    ((None, None, 2), r"neither global_batch_size nor per_replica_batch_size.*Fix: give exactly one"),
    ((0, None, 1), r"global_batch_size must be a positive integer: got 0"),
    ((None, 2.5, 1), r"per_replica_batch_size must be a positive integer: got 2.5"),
    ((True, None, 1), r"global_batch_size must be a positive integer: got True"),
])
def test_bad_batch_sizes_name_the_argument_and_the_fix(args, message):
    with pytest.raises(ConfigError, match=message):
        resolve_global_batch_size(*args, required=True)


def test_batch_that_does_not_split_over_replicas_suggests_sizes(trainer):
    with pytest.raises(ConfigError, match=r"global_batch_size=30 does not split evenly over 4 replicas.*28 or 32"):
        prepare(_data(), strategy=trainer.strategy, num_replicas=4, global_batch_size=30)


def test_batch_larger_than_the_data_is_refused(trainer):
    with pytest.raises(ConfigError, match=r"global_batch_size=128 is larger than the 64 examples"):
        trainer.fit(trainer.build(_mlp), _data(64), global_batch_size=128)


def test_already_batched_dataset_is_refused_with_the_fix(trainer):
    ds = tf.data.Dataset.from_tensor_slices(_data()).batch(8)
    with pytest.raises(ConfigError, match=r"already batched \(batch size 8\).*pass it unbatched"):
        trainer.fit(trainer.build(_mlp), ds, global_batch_size=16)


def test_dataset_fn_needs_steps_per_epoch(trainer):
    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices(_data()).batch(ctx.get_per_replica_batch_size(16)).repeat()

    with pytest.raises(ConfigError, match=r"steps_per_epoch is required with a dataset_fn"):
        trainer.fit(trainer.build(_mlp), dataset_fn)
    history = trainer.fit(trainer.build(_mlp), dataset_fn, epochs=2, steps_per_epoch=3, verbose=0)
    assert len(history.history["loss"]) == 2


def test_mismatched_array_lengths_are_refused(trainer):
    x, y = _data()
    with pytest.raises(ConfigError, match=r"different numbers of rows: \[10, 64\]"):
        trainer.fit(trainer.build(_mlp), (x, y[:10]), global_batch_size=8)


# -- TPU requirements are enforced by the trainer (checked here; no TPU on this machine) ---------
def test_tpu_needs_static_shapes_and_divisible_batches(trainer):
    ragged = tf.data.Dataset.from_generator(lambda: iter([np.zeros(3, "float32")]),
                                            output_signature=tf.TensorSpec([None], tf.float32))
    with pytest.raises(ConfigError, match=r"TPU needs static shapes.*\(None,\)"):
        prepare(ragged, strategy=trainer.strategy, num_replicas=8, global_batch_size=64, tpu=True)
    with pytest.raises(ConfigError, match=r"global_batch_size=60 does not split evenly over 8 replicas.*TPU"):
        prepare(_data(), strategy=trainer.strategy, num_replicas=8, global_batch_size=60, tpu=True)
    prepared = prepare(_data(70), strategy=trainer.strategy, num_replicas=8, global_batch_size=32, tpu=True)
    assert prepared.steps_per_epoch == 2  # drop_remainder: the partial batch of 6 is not fed to a TPU
    assert prepared.dataset.element_spec[0].shape.as_list() == [32, 4]


# -- learning rate scaling, throughput ------------------------------------------------------------
def test_linear_scaling_with_gradual_warmup_reaches_n_times_the_rate():
    from stratkit.callbacks import LinearScalingWarmup

    model = _mlp(lr=0.1)
    rates = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            rates.append(float(self.model.optimizer.learning_rate.numpy()))

    x, y = _data(40)
    model.fit(x, y, batch_size=10, epochs=4, verbose=0,
              callbacks=[LinearScalingWarmup(4, warmup_epochs=2, steps_per_epoch=4), Record()])
    assert rates[0] == pytest.approx(0.1)                       # starts at the compiled rate
    assert rates[4] == pytest.approx(0.1 * (1 + 3 * 4 / 8))     # halfway through warmup
    assert rates[8:] == pytest.approx([0.4] * 8)                # then lr x 4
    assert all(b >= a for a, b in zip(rates, rates[1:]))        # monotonic ramp


def test_scale_learning_rate_without_warmup_and_schedule_refusal(trainer):
    model = trainer.build(_mlp)
    history = trainer.fit(model, _data(), global_batch_size=16, scale_learning_rate=True, verbose=0)
    assert history.history["learning_rate"][-1] == pytest.approx(0.1 * trainer.num_replicas)

    def with_schedule():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
                      loss="mse")
        return model

    with pytest.raises(ConfigError, match=r"needs a constant learning rate.*ExponentialDecay"):
        trainer.fit(trainer.build(with_schedule), _data(), global_batch_size=16, scale_learning_rate=True)
    with pytest.raises(ConfigError, match=r"warmup_epochs=2 only applies with scale_learning_rate=True"):
        trainer.fit(trainer.build(_mlp), _data(), global_batch_size=16, warmup_epochs=2)


def test_throughput_is_reported_per_epoch(trainer, capsys):
    history = trainer.fit(trainer.build(_mlp), _data(), global_batch_size=16, epochs=2, verbose=0)
    rates = history.history["examples_per_sec"]
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert "examples/sec" in capsys.readouterr().out


def test_throughput_counts_a_partial_last_batch_as_the_rows_it_holds(trainer, capsys, tmp_path):
    """40 rows in global batches of 16 are 3 steps and 40 examples, not 48 (on arrays and on a table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratkit.data import Table, TableInput

    x, y = _data(40)
    trainer.fit(trainer.build(_mlp), (x, y), global_batch_size=16, epochs=1, verbose=0)
    assert "40 examples in 3 steps of global batch 16" in capsys.readouterr().out
    columns = {"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
               "y": pa.FixedSizeListArray.from_arrays(pa.array(y.ravel()), 3)}
    pq.write_table(pa.table(columns), tmp_path / "part-0.parquet")
    table = TableInput(Table.parquet(str(tmp_path)), features=["x"], label="y", seed=1)
    trainer.fit(trainer.build(_mlp), table, global_batch_size=16, epochs=1, verbose=0)
    assert "40 examples in 3 steps of global batch 16" in capsys.readouterr().out
    trainer.fit(trainer.build(_mlp), _data(40), global_batch_size=16, epochs=1, steps_per_epoch=3, verbose=0)
    assert "48 examples in 3 steps of global batch 16" in capsys.readouterr().out   # the steps rule: all full


# -- build / save ---------------------------------------------------------------------------------
def test_build_refuses_an_uncompiled_model_or_a_non_model(trainer):
    with pytest.raises(ConfigError, match=r"not compiled"):
        trainer.build(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    with pytest.raises(ConfigError, match=r"returned int, not a keras.Model"):
        trainer.build(lambda: 3)


def test_save_creates_parents_atomically_and_reloads(trainer, tmp_path):
    model = trainer.build(_mlp)
    trainer.fit(model, _data(), global_batch_size=16, verbose=0)
    target = tmp_path / "a" / "b" / "model.keras"
    assert trainer.save(model, target) == str(target)
    assert sorted(os.listdir(target.parent)) == ["model.keras"]  # no temp file left behind
    x, _ = _data()
    np.testing.assert_allclose(keras.models.load_model(target).predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    with pytest.raises(ConfigError, match=r"must end in .keras"):
        trainer.save(model, tmp_path / "model.h5")


# -- checkpoints survive a kill at any moment -----------------------------------------------------
_SAVER = """
import sys, keras
from stratkit.training.backup import save_epoch
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(512)])
model.compile(optimizer="adam", loss="mse")
model.optimizer.build(model.trainable_variables)
save_epoch(model, sys.argv[1], 1)
print("ready", flush=True)
epoch = 1
while True:
    epoch += 1
    save_epoch(model, sys.argv[1], epoch)
"""


def test_a_kill_mid_write_never_breaks_the_resume(tmp_path):
    directory = tmp_path / "backup"
    rng = np.random.default_rng(1)
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(directory)], stdout=subprocess.PIPE,
                                env=child_env(), start_new_session=True)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            # saves run back to back, so a kill at a random moment usually lands mid-write
            time.sleep(float(rng.uniform(0.2, 1.5)))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        epoch = backup.latest_epoch(str(directory))
        assert epoch >= 1
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(512)])
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
        model.load_weights(backup.weights_path(str(directory), epoch))  # a complete file, every time
        assert len(backup.available_epochs(str(directory))) <= 3


def test_checkpoint_metadata_naming_a_missing_file_means_start_over(tmp_path):
    (tmp_path / backup.METADATA).write_text('{"epoch": 7, "file": "epoch-00007.weights.h5"}')
    assert backup.latest_epoch(str(tmp_path)) == 0
    (tmp_path / backup.METADATA).write_text('{"epo')  # truncated by hand: still no crash
    assert backup.latest_epoch(str(tmp_path)) == 0


# -- a resumed run reads each epoch's data as an uninterrupted one ------------------------------------
def _adam_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.mark.parametrize("steps", [None, 3])  # one pass per epoch (a partial last batch) | steps across passes
def test_epochs_split_over_two_fits_train_as_one_fit_with_shuffled_arrays(trainer, steps):
    """fit(epochs=2) then fit(epochs=5, initial_epoch=2) == fit(epochs=5): each epoch's order depends on the epoch.

    Before: every fit (every resumed process) restarted the sequence of shuffles at epoch 1's order.
    """
    data = _data(45)  # 45 rows, global batch 8: 6 batches per pass, the last of 5 rows
    whole = trainer.build(_adam_mlp)
    trainer.fit(whole, data, epochs=5, global_batch_size=8, steps_per_epoch=steps, verbose=0)
    split = trainer.build(_adam_mlp)
    trainer.fit(split, data, epochs=2, global_batch_size=8, steps_per_epoch=steps, verbose=0)
    trainer.fit(split, data, epochs=5, initial_epoch=2, global_batch_size=8, steps_per_epoch=steps, verbose=0)
    for a, b in zip(whole.get_weights(), split.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # and the epochs really read different orders (shuffled): training twice on one order differs
    fixed = trainer.build(_adam_mlp)
    trainer.fit(fixed, data, epochs=2, global_batch_size=8, steps_per_epoch=steps, verbose=0)
    trainer.fit(fixed, data, epochs=3, global_batch_size=8, steps_per_epoch=steps, verbose=0)
    assert max(np.abs(a - b).max() for a, b in zip(whole.get_weights(), fixed.get_weights())) > 1e-4


def test_each_epoch_reads_every_row_once_in_a_new_order():
    from stratkit.training.inputs import prepare as prepare_inputs

    x = np.arange(10, dtype="float32")[:, None]
    prepared = prepare_inputs((x, x), strategy=None, num_replicas=1, global_batch_size=4, training=True)
    assert prepared.endless and prepared.steps_per_epoch == 3
    batches = [b[0].numpy()[:, 0] for b in prepared.dataset.take(6)]
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    first, second = np.concatenate(batches[:3]), np.concatenate(batches[3:])
    assert sorted(first) == sorted(second) == list(range(10))
    assert list(first) != list(second)
    later = prepare_inputs((x, x), strategy=None, num_replicas=1, global_batch_size=4, training=True, first_epoch=1)
    assert list(np.concatenate([b[0].numpy()[:, 0] for b in later.dataset.take(3)])) == list(second)
