"""The Trainer on 2 real worker processes on 127.0.0.1 (TF_CONFIG), Keras 3.

Every test here starts real TensorFlow processes; none mocks the strategy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from procs import describe, free_ports, run_cluster, run_process, worker_tf_configs

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = str(Path(__file__).with_name("worker_script.py"))


def _two_workers(env: dict, timeout: float = 240, grace: float = 30):
    return run_cluster(SCRIPT, worker_tf_configs(free_ports(2)), env=env, timeout=timeout,
                       grace_after_failure=grace)


def _reports(out: Path, ranks=(0, 1)) -> list[dict]:
    return [json.loads((out / f"report-{r}.json").read_text()) for r in ranks]


def test_fit_evaluate_predict_save_on_two_workers(tmp_path):
    results = _two_workers({"MODE": "digits", "OUT": str(tmp_path), "EPOCHS": "6"})
    assert all(r.ok for r in results), describe(results)
    chief, worker = _reports(tmp_path)
    # Synchronous data parallelism: both workers hold the same model, so they report the same numbers.
    assert chief["history"]["loss"] == pytest.approx(worker["history"]["loss"], rel=1e-6)
    assert chief["evaluate"] == pytest.approx(worker["evaluate"], rel=1e-6)
    assert chief["num_replicas"] == 2
    assert chief["history"]["loss"][-1] < chief["history"]["loss"][0]
    assert chief["evaluate"]["accuracy"] >= 0.9
    # predict returns every row, in order, on every worker.
    assert chief["predict_shape"] == worker["predict_shape"] == [397, 10]
    assert chief["predict_accuracy"] == pytest.approx(chief["evaluate"]["accuracy"], abs=1e-6)
    # Only the chief wrote the model, and it reloads without any strategy with identical predictions.
    assert chief["is_chief"] and chief["saved"] and not worker["is_chief"] and worker["saved"] is None
    assert sorted(os.listdir(tmp_path / "model")) == ["digits.keras"]
    # TensorBoard logs and ModelCheckpoint files come from the chief only.
    event_files = [f for _, _, files in os.walk(tmp_path / "tensorboard") for f in files]
    assert event_files and all(f".{chief['pid']}." in f for f in event_files), event_files
    assert os.listdir(tmp_path / "checkpoints") == ["last.keras"]
    reload = run_process(f"""
import json, numpy as np, keras
from sklearn.datasets import load_digits
data = load_digits()
x = (data.data[np.random.default_rng(0).permutation(len(data.target))] / 16.0).astype("float32")[1400:]
model = keras.models.load_model({str(tmp_path / 'model' / 'digits.keras')!r})
print(json.dumps({{"max_diff": float(np.abs(model.predict(x, verbose=0) - np.load({str(tmp_path / 'predictions.npy')!r})).max())}}))
""")
    assert reload.ok, describe([reload])
    assert reload.last_json()["max_diff"] < 1e-5


def test_sigkilled_worker_resumes_from_backup_at_the_epoch_reached(tmp_path):
    backup = tmp_path / "backup"
    env = {"MODE": "digits", "OUT": str(tmp_path / "run1"), "EPOCHS": "6", "BACKUP_DIR": str(backup),
           "KILL_AT_EPOCH": "3", "KILL_RANK": "1"}
    first = _two_workers(env, grace=20)
    assert first[1].returncode == -9, describe(first)  # the injected crash
    assert not first[0].ok                              # its peer cannot finish without it
    assert (backup / "checkpoint.json").exists()
    assert json.loads((backup / "checkpoint.json").read_text())["epoch"] >= 3

    env.update({"OUT": str(tmp_path / "run2"), "KILL_AT_EPOCH": ""})
    second = _two_workers(env)
    assert all(r.ok for r in second), describe(second)
    for result in second:
        assert "at epoch 3" in result.stdout, describe(second)
    chief, worker = _reports(tmp_path / "run2")
    assert chief["epochs_run"] == worker["epochs_run"] == 3  # epochs 4 to 6 only, not from zero
    # the restored weights and optimizer state carry on: a fresh first epoch ends near loss 1.3
    assert chief["history"]["loss"][0] < 0.5
    assert chief["evaluate"]["accuracy"] >= 0.85
    assert not backup.exists() or not any(backup.iterdir())  # the chief cleaned up after success


B, EPOCHS = 16, 3   # 256 examples: 8 steps per epoch of global batch 32 -> 24 SGD steps


@pytest.fixture(scope="module")
def single_process_weights(tmp_path_factory) -> list[np.ndarray]:
    """One process at the global batch 2 * B: the reference of the 2-worker and the 2-CPU Mirrored runs (one
    deterministic run, trained once for both)."""
    out = tmp_path_factory.mktemp("single")
    single = run_process(SCRIPT, env={"MODE": "equivalence", "OUT": str(out), "EPOCHS": str(EPOCHS),
                                      "BATCH": str(2 * B)})
    assert single.ok, describe([single])
    return [np.array(w) for w in _reports(out, ranks=(0,))[0]["weights"]]


def test_two_worker_sgd_equals_single_process_with_double_batch(tmp_path, single_process_weights):
    results = _two_workers({"MODE": "equivalence", "OUT": str(tmp_path / "mw"), "EPOCHS": str(EPOCHS),
                            "BATCH": str(B)})
    assert all(r.ok for r in results), describe(results)
    chief, worker = _reports(tmp_path / "mw")
    assert chief["num_replicas"] == 2
    reference = single_process_weights
    for got in (chief, worker):
        for w, ref in zip(got["weights"], reference):
            np.testing.assert_allclose(np.array(w), ref, rtol=1e-4, atol=1e-5)
    # and training really moved the weights (the comparison is not vacuous)
    initial = run_process(SCRIPT, env={"MODE": "equivalence", "OUT": str(tmp_path / "zero"), "EPOCHS": "1",
                                       "BATCH": "256"})
    assert initial.ok
    moved = [np.array(w) for w in _reports(tmp_path / "zero", ranks=(0,))[0]["weights"]]
    assert max(np.abs(m - r).max() for m, r in zip(moved, reference)) > 1e-3


def test_mirrored_over_two_logical_cpus_equals_single_device(tmp_path, single_process_weights):
    mirrored = run_process(SCRIPT, env={"MODE": "equivalence", "OUT": str(tmp_path / "mirrored"),
                                        "EPOCHS": str(EPOCHS), "BATCH": str(B), "STRATEGY": "mirrored",
                                        "LOGICAL_CPUS": "2"})
    assert mirrored.ok, describe([mirrored])
    report = _reports(tmp_path / "mirrored", ranks=(0,))[0]
    assert report["num_replicas"] == 2
    for w, ref in zip(report["weights"], single_process_weights):
        np.testing.assert_allclose(np.array(w), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["numpy", "dataset"])
def test_each_example_is_seen_once_per_epoch_across_workers(tmp_path, kind):
    n = 200  # 200 = 6 global batches of 32 + a partial batch of 8
    results = _two_workers({"MODE": "shards", "OUT": str(tmp_path), "EPOCHS": "2", "BATCH": "16",
                            "EXAMPLES": str(n), "DATA_KIND": kind})
    assert all(r.ok for r in results), describe(results)
    chief, worker = _reports(tmp_path)
    for epoch in range(2):
        a, b = chief["per_epoch"][epoch], worker["per_epoch"][epoch]
        assert len(a) == len(set(a)) and len(b) == len(set(b)), "an example was repeated within a worker"
        assert not set(a) & set(b), "two workers trained on the same example"
        assert sorted(a + b) == list(range(n)), "an example was dropped"
        assert abs(len(a) - len(b)) <= 8, "the shards are unbalanced"


def test_plain_model_fit_in_make_strategy_scope_gets_the_keras3_fixes(tmp_path):
    results = _two_workers({"MODE": "plain_fit", "OUT": str(tmp_path), "EPOCHS": "3"})
    assert all(r.ok for r in results), describe(results)
    chief, worker = _reports(tmp_path)
    assert chief["num_replicas"] == 2
    assert chief["history"]["loss"] == pytest.approx(worker["history"]["loss"], rel=1e-6)
    assert chief["evaluate"]["accuracy"] > 0.8


FIT_ARGS_SCRIPT = """
import json, sys
import stratkit
trainer = stratkit.Trainer()
import keras, numpy as np
rng = np.random.default_rng(0)
x = rng.normal(size=(320, 8)).astype("float32")
y = (x[:, :3].argmax(axis=1) + (x[:, 3] > 1.0)).clip(0, 2).astype("int32")

def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model

model = trainer.build(build)
history = trainer.fit(model, x, y=y, epochs=3, global_batch_size=16, validation_split=0.25,
                      class_weight={0: 1.0, 1: 4.0, 2: 0.5}, verbose=0)
print(json.dumps({"weights": [w.tolist() for w in model.get_weights()], "replicas": trainer.num_replicas,
                  "val_loss": history.history["val_loss"]}))
"""


def test_class_weight_and_validation_split_on_two_workers_equal_one_process():
    results = run_cluster(FIT_ARGS_SCRIPT, worker_tf_configs(free_ports(2)), timeout=240, grace_after_failure=30)
    assert all(r.ok for r in results), describe(results)
    single = run_process(FIT_ARGS_SCRIPT, timeout=240)
    assert single.ok, describe([single])
    reference = single.last_json()
    assert reference["replicas"] == 1
    for result in results:
        got = result.last_json()
        assert got["replicas"] == 2
        for w, ref in zip(got["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(np.array(w), np.array(ref), atol=1e-5)
        assert got["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
