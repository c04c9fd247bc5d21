"""`float(var)` / `int(var)` of a Keras variable read in a callback under Mirrored and MWMS.

Keras 3's `Variable.__float__`/`__int__` call `float(self.value)`; under a
Mirrored/MWMS scope that value is a tf.distribute `MirroredVariable`, which has
neither, so `float(model.optimizer.learning_rate)` raised `TypeError ... not
'MirroredVariable'` where one process gives the number. Real processes: 2 logical
CPUs in one process, and 2 real MWMS workers on 127.0.0.1.
"""

from __future__ import annotations

import textwrap

import pytest

from procs import describe, free_ports, run_cluster, run_process, worker_tf_configs

from stratkit.strategy import keras_compat

CLEAN_ENV: dict[str, str | None] = {"STRATKIT_KERAS_COMPAT": None, "TF_USE_LEGACY_KERAS": None}

READ_IN_A_CALLBACK = textwrap.dedent("""
    import json, os, sys, stratkit
    if sys.argv[1] == "mirrored":
        strategy = stratkit.make_strategy(strategy="mirrored", logical_cpus=2)
    else:
        strategy = stratkit.make_strategy()  # MWMS from TF_CONFIG
    import keras, numpy as np

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.125)), loss="mse")

    seen = {}

    class Read(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            opt = self.model.optimizer
            seen.update(lr=float(opt.learning_rate), iterations=int(opt.iterations),
                        scale=float(opt.dynamic_scale), iterations_float=float(opt.iterations),
                        kernel_is_matrix=None)
            try:
                float(self.model.layers[0].kernel)
            except TypeError as exc:
                seen["kernel_is_matrix"] = "Only scalar arrays" in str(exc)  # Keras's own error, unchanged

    x = np.ones((64, 4), "float32")
    model.fit(x, x[:, :1], batch_size=16, epochs=2, verbose=0, callbacks=[Read()])
    seen["numpy"] = [float(model.optimizer.learning_rate.numpy()), int(model.optimizer.iterations.numpy()),
                     float(model.optimizer.dynamic_scale.numpy())]
    seen["replicas"] = strategy.num_replicas_in_sync
    print(json.dumps(seen))
""")


def _check(report: dict, steps: int) -> None:
    assert report["lr"] == 0.125
    assert report["iterations"] == steps and report["iterations_float"] == float(steps)
    assert report["scale"] == 32768.0  # LossScaleOptimizer's initial scale: no overflow in 8 steps
    assert report["numpy"] == [0.125, steps, 32768.0]
    assert report["kernel_is_matrix"] is True


def test_float_and_int_of_variables_in_a_callback_on_two_logical_cpus():
    result = run_process(READ_IN_A_CALLBACK, args=["mirrored"], env=CLEAN_ENV, timeout=120)
    assert result.ok, describe([result])
    report = result.last_json()
    assert report["replicas"] == 2
    _check(report, steps=8)  # 64 rows / global batch 16 x 2 epochs


def test_float_and_int_of_variables_in_a_callback_on_two_workers():
    results = run_cluster(READ_IN_A_CALLBACK, worker_tf_configs(free_ports(2)), args=["mwms"], env=CLEAN_ENV,
                          timeout=180, grace_after_failure=20)
    assert all(r.ok for r in results), describe(results)
    for result in results:
        report = result.last_json()
        assert report["replicas"] == 2
        _check(report, steps=8)  # the global batch 16 is split over the workers: same steps


@pytest.fixture
def fresh():
    keras_compat.revert()
    yield
    keras_compat.revert()


def test_self_check_sees_the_bug_in_installed_keras_and_not_once_patched(fresh):
    from stratkit.strategy.keras_compat import variable_scalars

    assert variable_scalars.bug_present()
    assert keras_compat.apply() == "patched"
    assert not variable_scalars.bug_present()
    keras_compat.revert()
    assert variable_scalars.bug_present()  # revert put Keras's own methods back
