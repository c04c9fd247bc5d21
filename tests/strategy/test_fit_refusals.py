"""Models Keras cannot train on several CPU replicas are refused before step 1, with the fix.

Both the user's own `model.fit` (the fit guards) and `Trainer.build` refuse, as
they do for `steps_per_execution > 1`. Real processes: 2 logical CPUs, and 2 real
MWMS workers on 127.0.0.1.
"""

from __future__ import annotations

import textwrap

import pytest

from procs import describe, free_ports, run_cluster, run_process, worker_tf_configs

pytestmark = pytest.mark.slow

CLEAN_ENV: dict[str, str | None] = {"STRATKIT_KERAS_COMPAT": None, "TF_USE_LEGACY_KERAS": None}

REFUSALS = textwrap.dedent("""
    import json, sys, stratkit
    from stratkit.errors import ConfigError
    case = sys.argv[1]
    if len(sys.argv) > 2:
        trainer = stratkit.Trainer()  # MWMS from TF_CONFIG
    else:
        trainer = stratkit.Trainer(strategy="mirrored", logical_cpus=2)
    import keras, numpy as np

    def build():
        if case == "stateful":
            inp = keras.Input(batch_shape=(8, 5, 3))
            out = keras.layers.Dense(1)(keras.layers.LSTM(4, stateful=True, name="my_lstm")(inp))
            x = np.ones((32, 5, 3), "float32")
        else:
            inp = keras.Input((3,))
            out = keras.layers.Dense(1)(inp)
            x = np.ones((32, 3), "float32")
        model = keras.Model(inp, out)
        model.compile(optimizer="sgd", loss="mse", jit_compile=True if case == "jit" else "auto")
        return model, x

    report = {"replicas": trainer.num_replicas}
    try:
        trainer.build(lambda: build()[0])
        report["trainer"] = None
    except ConfigError as exc:
        report["trainer"] = str(exc)
    with trainer.strategy.scope():
        model, x = build()
    report["jit_compile"] = model.jit_compile
    try:
        model.fit(x, np.ones((32, 1), "float32"), batch_size=8, epochs=1, verbose=2)
        report["fit"] = None
    except ConfigError as exc:
        report["fit"] = str(exc)
    print(json.dumps(report))
""")


def test_a_stateful_rnn_on_two_replicas_is_refused_by_fit_and_trainer_naming_the_layer():
    result = run_process(REFUSALS, args=["stateful"], env=CLEAN_ENV, timeout=120)
    assert result.ok, describe([result])
    report = result.last_json()
    assert report["replicas"] == 2
    for where in ("trainer", "fit"):
        assert report[where] is not None, f"{where} trained a stateful LSTM on 2 replicas"
        assert "my_lstm" in report[where] and "stateful=True" in report[where] and "Fix:" in report[where]
    assert "Epoch 1/" not in result.stdout  # refused before step 1


def test_jit_compile_on_two_cpu_replicas_is_refused_by_fit_and_trainer():
    result = run_process(REFUSALS, args=["jit"], env=CLEAN_ENV, timeout=120)
    assert result.ok, describe([result])
    report = result.last_json()
    assert report["replicas"] == 2 and report["jit_compile"] is True
    for where in ("trainer", "fit"):
        assert report[where] is not None, f"{where} ran jit_compile=True on 2 CPU replicas"
        assert "jit_compile=True" in report[where] and "jit_compile=False" in report[where]
    assert "Epoch 1/" not in result.stdout


def test_jit_compile_on_two_cpu_workers_is_refused_on_both_without_an_abort():
    results = run_cluster(REFUSALS, worker_tf_configs(free_ports(2)), args=["jit", "mwms"], env=CLEAN_ENV,
                          timeout=180, grace_after_failure=20)
    assert all(r.ok for r in results), describe(results)
    for result in results:
        report = result.last_json()
        assert report["replicas"] == 2
        assert report["trainer"] and report["fit"] and "jit_compile=True" in report["fit"]


def test_the_default_jit_compile_is_not_refused_on_cpu_replicas():
    # Keras's jit_compile="auto" resolves to False on CPU for the TensorFlow backend: nothing to refuse.
    result = run_process(REFUSALS, args=["auto"], env=CLEAN_ENV, timeout=120)
    assert result.ok, describe([result])
    assert result.last_json() == {"replicas": 2, "trainer": None, "jit_compile": False, "fit": None}
