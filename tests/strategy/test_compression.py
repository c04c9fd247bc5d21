"""gradient_compression on one process: validation, the gate, the traced collective, fp16 overflow.

The strategy tests run MirroredStrategy over 2 logical CPUs in a child process
(logical devices must be set before TensorFlow starts). On TF 2.21 that
strategy all-reduces with the same CollectiveReduceV2 as MultiWorkerMirrored,
one op per replica device per pack, so the traced graph shows what goes on the
wire. The 2-worker behaviour is in tests/training/test_compression_multiworker.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from procs import describe, run_process

import stratkit
from stratkit.errors import ConfigError, KerasCompatError
from stratkit.strategy import compression

CHILD = textwrap.dedent("""
    import json, os, sys
    import stratkit
    from stratkit.strategy import compression
    mode = os.environ["MODE"]
    kind = os.environ.get("KIND", "mirrored")
    options = {"logical_cpus": 2} if kind == "mirrored" else {}
    trainer = stratkit.Trainer(strategy=kind, gradient_compression=None if mode.startswith("none") else mode,
                               **options)
    strategy = trainer.strategy  # made by stratkit.make_strategy; the model below trains with plain model.fit
    if mode == "none+hook":
        compression.install()  # the wrapper in place, the strategy without a mode: must change nothing
    import collections, keras, numpy as np, tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    scale = float(os.environ.get("TARGET_SCALE", "1"))
    y = (x @ rng.normal(size=(8, 1)) * scale).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    # The collectives of one traced Keras train step (Keras' own train_step under strategy.run).
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    step = tf.function(lambda it: strategy.run(model.train_step, args=(next(it),)))
    graph = step.get_concrete_function(iterator).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    collectives = collections.Counter(f"{n.op}:{tf.as_dtype(n.attr['T'].type).name}" for n in nodes
                                      if n.op.startswith(("Collective", "Nccl")))
    before = [w.copy() for w in model.get_weights()]
    error = None
    try:
        model.fit(dataset, epochs=int(os.environ.get("EPOCHS", "2")), verbose=0, shuffle=False)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    trainer_error = None
    if os.environ.get("TRAINER"):
        try:
            trainer.fit(model, (x, y), epochs=1, global_batch_size=32, verbose=0)
        except Exception as exc:
            trainer_error = {"type": type(exc).__name__, "message": str(exc),
                             "mro": [c.__name__ for c in type(exc).__mro__]}
    print(json.dumps({"collectives": collectives, "installed": compression.installed(),
                      "attr": compression.mode_of(strategy), "error": error, "trainer_error": trainer_error,
                      "before": [w.tolist() for w in before], "weights": [w.tolist() for w in model.get_weights()],
                      "replicas": strategy.num_replicas_in_sync}))
""")


def _child(mode: str, **env: str) -> dict:
    result = run_process(CHILD, env={"MODE": mode, **env}, timeout=180)
    assert result.ok, describe([result])
    return result.last_json()


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """One training of the same model per mode (each in its own process)."""
    return {mode: _child(mode) for mode in ("none", "none+hook", "bf16", "fp16")}


# -- the argument -------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["BF16", "int8", "float16", 16, True, ""])
def test_a_bad_value_names_the_argument_the_value_and_the_fix(bad):
    with pytest.raises(ConfigError) as info:
        compression.validate(bad)
    message = str(info.value)
    assert f"gradient_compression={bad!r}" in message and "Fix:" in message and "'bf16'" in message


@pytest.mark.parametrize("good", [None, "bf16", "fp16"])
def test_the_three_documented_values_are_accepted(good):
    assert compression.validate(good) == good


def test_make_strategy_and_trainer_refuse_a_bad_value_before_building_anything():
    code = textwrap.dedent("""
        import sys, stratkit
        for build in (stratkit.make_strategy, stratkit.Trainer):
            try:
                build(strategy="one_device", gradient_compression="int8")
            except stratkit.ConfigError as exc:
                print("refused:", exc)
        print("tensorflow imported:", "tensorflow" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.count("refused: gradient_compression='int8'") == 2, out.stdout + out.stderr
    assert "tensorflow imported: False" in out.stdout


def test_importing_compression_does_not_import_tensorflow():
    code = "import sys, stratkit.strategy.compression; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# -- where it applies -----------------------------------------------------------------


def test_parameter_server_ignores_it_with_a_note(caplog):
    class Strategy:  # configure() only sets an attribute on the strategy it is given
        pass

    strategy = Strategy()
    with caplog.at_level(logging.WARNING, logger="stratkit.strategy.compression"):
        compression.configure(strategy, "parameter_server", "bf16")
    assert compression.mode_of(strategy) is None
    assert "ignored with ParameterServerStrategy" in caplog.text and "no all-reduce" in caplog.text


@pytest.mark.slow
def test_one_device_does_nothing_and_installs_nothing():
    run = _child("bf16", KIND="one_device", EPOCHS="1")
    assert run["attr"] is None and not run["installed"] and run["error"] is None
    assert run["collectives"] == {}


# -- the gate -------------------------------------------------------------------------


@pytest.fixture
def fresh():
    """keras_compat's gate re-evaluated, and Keras' optimizer restored, around the test."""
    from stratkit.strategy import keras_compat

    keras_compat.revert()
    compression.revert()
    yield
    compression.revert()
    keras_compat.revert()


class _Strategy:
    pass


@pytest.mark.slow
def test_keras_compat_off_refuses_compression(fresh, monkeypatch):
    monkeypatch.setenv("STRATKIT_KERAS_COMPAT", "off")
    with pytest.raises(ConfigError, match=r"gradient_compression='bf16' needs .*STRATKIT_KERAS_COMPAT=off.*Fix:"):
        compression.configure(_Strategy(), "mirrored", "bf16")
    assert not compression.installed()


@pytest.mark.slow
def test_tested_keras_installs_the_wrapper_and_marks_the_strategy(fresh):
    strategy = _Strategy()
    compression.configure(strategy, "multi_worker_mirrored", "fp16")
    assert compression.installed() and compression.mode_of(strategy) == "fp16"
    compression.revert()
    assert not compression.installed()


@pytest.mark.slow
def test_untested_keras_is_checked_and_refused_when_the_optimizer_changed(fresh, monkeypatch):
    from stratkit.strategy import keras_compat

    assert compression.self_check() == []  # the installed Keras has the method where the wrapper expects it
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.99.0")
    monkeypatch.setenv("STRATKIT_KERAS_COMPAT", "force")  # the bug fixes are forced; the wrapper is still checked
    from stratkit.strategy.keras_compat import all_reduce  # the gate module that wraps the private method

    monkeypatch.setattr(all_reduce, "_METHOD", "_no_such_method")
    assert "does not exist" in compression.self_check()[0]
    keras_compat.revert()
    monkeypatch.delenv("STRATKIT_KERAS_COMPAT")
    monkeypatch.setattr(keras_compat, "upstream_bugs_present", lambda: [])  # an untested Keras with the bugs fixed
    with pytest.raises(KerasCompatError, match=r"3\.99\.0 .*does not exist.*Fix:"):
        compression.configure(_Strategy(), "mirrored", "bf16")


# -- what the wrapper does to a real step ----------------------------------------------


@pytest.mark.slow
def test_one_packed_collective_per_step_in_the_wire_dtype(runs):
    # Per replica device (2 here): one pack holding all 4 gradients, in the wire dtype with compression, and
    # one float32 all-reduce of the loss's (count, rows) that makes the loss a share of the global count
    # (keras_compat/global_gradient.py); no float32 gradient all-reduce is left under compression.
    assert runs["none"]["collectives"] == {"CollectiveReduceV2:float32": 4}
    assert runs["none+hook"]["collectives"] == {"CollectiveReduceV2:float32": 4}
    assert runs["bf16"]["collectives"] == {"CollectiveReduceV2:bfloat16": 2, "CollectiveReduceV2:float32": 2}
    assert runs["fp16"]["collectives"] == {"CollectiveReduceV2:float16": 2, "CollectiveReduceV2:float32": 2}


@pytest.mark.slow
def test_without_compression_the_weights_are_bit_for_bit_upstreams(runs):
    assert not runs["none"]["installed"] and runs["none+hook"]["installed"]
    assert runs["none"]["weights"] == runs["none+hook"]["weights"]  # exact equality, not approx


@pytest.mark.slow
@pytest.mark.parametrize("mode, tolerance", [("bf16", 2e-2), ("fp16", 2e-3)])
def test_compressed_training_stays_close_to_float32(runs, mode, tolerance):
    run, reference = runs[mode], runs["none"]
    assert run["attr"] == mode and run["installed"] and run["error"] is None
    for got, want, start in zip(run["weights"], reference["weights"], reference["before"]):
        got, want, start = np.array(got), np.array(want), np.array(start)
        assert np.all(np.isfinite(got))
        assert not np.array_equal(got, want)  # it really went through the cast
        # Tolerance relative to how far float32 training moved the weights.
        assert np.abs(got - want).max() <= tolerance * max(np.abs(want - start).max(), 1e-3)


@pytest.mark.slow
def test_fp16_overflow_is_refused_before_any_weight_changes():
    # Targets of order 1e6: squared-error gradients far beyond float16's 65504.
    run = _child("fp16", TARGET_SCALE="1e6", EPOCHS="1", TRAINER="1")
    assert run["error"] is not None and compression.OVERFLOW_MESSAGE in run["error"]
    assert "Fix: use gradient_compression=bf16" in run["error"]
    assert run["weights"] == run["before"]  # the refused step updated nothing
    # Through Trainer.fit the same refusal is a ConfigError without TensorFlow's traceback.
    refused = run["trainer_error"]
    assert refused["type"] == "ConfigError" and "StratkitError" in refused["mro"]
    assert refused["message"].startswith("training stopped before the update: gradient_compression='fp16'")
    assert "before the cast were all finite" in refused["message"]
    assert "Fix: use gradient_compression='bf16'" in refused["message"]


@pytest.mark.slow
def test_bf16_keeps_float32_range_where_fp16_refuses():
    run = _child("bf16", TARGET_SCALE="1e6", EPOCHS="1")
    assert run["error"] is None
    assert all(np.all(np.isfinite(np.array(w))) for w in run["weights"])
    assert run["weights"] != run["before"]

