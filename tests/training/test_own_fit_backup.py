"""`stratkit.callbacks.Backup` gives a plain `model.fit` under `make_strategy()` step backups and an exact resume.

One process runs three fits of the same model: uninterrupted; crashed before global step 13 (every=5: the
backup of step 10 is the newest); resumed from it with a fresh model. The input is what a plain `fit` can
replay exactly in a new process (arrays with shuffle=False); EarlyStopping and ReduceLROnPlateau run too.
"""

from __future__ import annotations

import pytest

from procs import describe, run_process

pytestmark = pytest.mark.slow

_SCRIPT = """
import json, os, sys
import stratkit
strategy = stratkit.make_strategy(os.environ["STRATEGY"], **({"logical_cpus": 2} if os.environ["STRATEGY"] == "mirrored" else {}))
import keras, numpy as np

class Crash(RuntimeError):
    pass

class CrashAt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch * 8 + batch == 13:
            raise Crash()

def build():
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return model

rng = np.random.default_rng(1)
x = rng.normal(size=(96, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

def callbacks(*extra):
    return [keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=0.3),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=2.0), *extra]

def fit(model, extra):
    return model.fit(x, y, batch_size=12, epochs=8, shuffle=False, verbose=0, callbacks=callbacks(*extra))

reference = build()
want = fit(reference, [])
backup = sys.argv[1]
try:
    fit(build(), [CrashAt(), stratkit.callbacks.Backup(backup, every=5)])
except Crash:
    pass
print("backup", sorted(os.listdir(backup)), flush=True)
resumed = build()
got = fit(resumed, [stratkit.callbacks.Backup(backup, every=5)])
print(json.dumps({
    "weights": max(float(np.abs(a - b).max()) for a, b in zip(resumed.get_weights(), reference.get_weights())),
    "epochs": [got.epoch, want.epoch],
    "history": max(float(np.abs(np.array(got.history[k]) - np.array(want.history[k])).max()) for k in want.history),
    "lr": want.history["learning_rate"], "loss": want.history["loss"], "backup_left": os.path.exists(backup)}))
"""


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_a_plain_model_fit_resumes_mid_epoch_with_its_callbacks_state(tmp_path, strategy):
    result = run_process(_SCRIPT, args=[str(tmp_path / "backup")], env={"STRATEGY": strategy}, timeout=300)
    assert result.ok, describe([result])
    assert "epoch-00001-step-0000002.weights.h5" in result.stdout  # global step 10
    assert "resumed from" in result.stdout and "at epoch 1 + 2 steps" in result.stdout
    report = result.last_json()
    assert report["weights"] < 1e-6 and report["history"] < 1e-6, report
    assert report["epochs"][0] == report["epochs"][1] and len(report["epochs"][0]) < 8, report  # stopped early alike
    assert len(set(report["lr"])) > 1 and not report["backup_left"], report
