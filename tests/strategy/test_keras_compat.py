"""stratkit.strategy.keras_compat: the Keras 3 fixes, proved on real processes.

The multi-worker tests start two real Python processes on 127.0.0.1, each an
MWMS worker with its own TF_CONFIG, and train a small Dense model. The patched
run must train, evaluate and predict identically on both workers and match a
single-process run; the same script without the patch must fail with the
known upstream error (so the test shows the patch is what makes it work).

The version-gate tests run in-process: they never create a strategy, and the
self-check runs no eager TensorFlow op.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator

import pytest
from procs import child_env, describe, free_ports, run_cluster, run_process, worker_tf_configs

from stratkit.errors import ConfigError, KerasCompatError
from stratkit.strategy import keras_compat

# Every child starts without the variables that change the gate's decision.
CLEAN_ENV: dict[str, str | None] = {keras_compat.ENV_VAR: None, "TF_USE_LEGACY_KERAS": None}

# One MWMS worker. argv[1] is the mode:
#   patched     create MWMS, then keras_compat.apply(strategy)
#   none        no patch at all (upstream Keras)
#   build_only  only the _maybe_symbolic_build fix (shows bug 2 on its own)
#   apply_first pretend Keras is untested (3.99.0) and call apply() BEFORE
#               creating MWMS (needs STRATKIT_KERAS_COMPAT=force)
WORKER = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.time()
    mode = sys.argv[1]
    import numpy as np
    status = mode
    if mode == "apply_first":
        from stratkit.strategy import keras_compat
        keras_compat.installed_keras_version = lambda: "3.99.0"
        status = keras_compat.apply()
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any TF op
    import keras
    from stratkit.strategy import keras_compat
    if mode == "patched":
        status = keras_compat.apply(strategy)
    elif mode == "build_only":
        from keras.src.backend.tensorflow import trainer
        trainer.TensorFlowTrainer._maybe_symbolic_build = keras_compat._maybe_symbolic_build

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    w = np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")
    y = (x @ w + 0.1).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    pred = model.predict(x, batch_size=16, verbose=0)
    w1, b1, w2, b2 = model.get_weights()
    ref = np.maximum(x @ w1 + b1, 0.0) @ w2 + b2  # numpy forward pass, final weights
    print(json.dumps({
        "status": status,
        "replicas": strategy.num_replicas_in_sync,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate": {k: float(v) for k, v in evaluation.items()},
        "pred_shape": list(pred.shape),
        "pred_max_err": float(np.max(np.abs(pred - ref))),
        "ref_mse": float(np.mean((ref - y) ** 2)),
        "seconds": round(time.time() - t0, 1),
    }))
    """
)


def _two_workers(mode: str, env: dict[str, str | None] | None = None, timeout: float = 90.0,
                 grace: float | None = None):
    return run_cluster(
        WORKER,
        worker_tf_configs(free_ports(2)),
        env={**CLEAN_ENV, **(env or {})},
        args=[mode],
        timeout=timeout,
        grace_after_failure=grace,
    )


def _assert_trained(results, expected_status: str) -> list[dict]:
    assert [r.returncode for r in results] == [0, 0], describe(results)
    reports = [r.last_json() for r in results]
    for rep in reports:
        assert rep["status"] == expected_status
        assert rep["replicas"] == 2
        losses = rep["history"]["loss"]
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses), rep
        assert losses[1] < losses[0], rep  # it learns
        # evaluate's loss is the GLOBAL mean over all 64 rows, not one worker's share
        assert rep["evaluate"]["loss"] == pytest.approx(rep["ref_mse"], rel=1e-5)
        # predict gathers all rows from both workers, in order
        assert rep["pred_shape"] == [64, 1]
        assert rep["pred_max_err"] < 1e-5
    # both workers hold the same model and saw the same numbers
    assert reports[0]["history"] == reports[1]["history"]
    assert reports[0]["evaluate"] == reports[1]["evaluate"]
    return reports


@pytest.mark.multiworker
def test_two_worker_mwms_trains_with_patch_and_matches_one_process():
    results = _two_workers("patched")
    reports = _assert_trained(results, "patched")

    # A one-process MWMS (no TF_CONFIG: needs no patch) on the same global batches
    # is the reference: the 2-worker gradient all-reduce must give the same training.
    single = run_process(WORKER, env=CLEAN_ENV, args=["none"], timeout=90)
    assert single.ok, describe([single])
    ref = single.last_json()
    assert reports[0]["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-5)
    assert reports[0]["evaluate"]["loss"] == pytest.approx(ref["evaluate"]["loss"], rel=1e-5)


@pytest.mark.multiworker
@pytest.mark.parametrize(
    ("mode", "error"),
    [
        # keras-team/keras#20585: upstream _maybe_symbolic_build
        ("none", "Attempt to convert a value (PerReplica"),
        # tensorflow/tensorflow#72388: upstream reduce_per_replica, once bug 1 is fixed
        ("build_only", "Invalid reduction dimension 0 for input with 0 dimensions"),
    ],
)
def test_two_worker_mwms_fails_without_the_patch(mode: str, error: str):
    # If a worker hangs in a collective instead, the timeout kills it: the
    # assertion below still holds (no worker may succeed).
    results = _two_workers(mode, timeout=60, grace=20)
    assert not any(r.ok for r in results), describe(results)
    assert any(error in r.stderr for r in results), describe(results)


@pytest.mark.multiworker
def test_forced_apply_before_the_strategy_exists_keeps_mwms_working():
    """The untested-version path (self-check + force) runs before MWMS is created.

    Proves the self-check runs no eager op (MWMS would then refuse to start with
    'Collective ops must be configured at program startup').
    """
    results = _two_workers("apply_first", env={keras_compat.ENV_VAR: "force"})
    _assert_trained(results, "forced")
    assert all("at your own risk" in r.stderr for r in results), describe(results)


# --------------------------------------------------------------------------
# MirroredStrategy guards (one process, two logical CPUs)
# --------------------------------------------------------------------------

MIRRORED = textwrap.dedent(
    """
    import json
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    import keras
    from stratkit.errors import ConfigError
    from stratkit.strategy import keras_compat
    from stratkit.training.inputs import check_divisible  # the one divisibility check, as Trainer uses it

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def make_model(steps_per_execution=1):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
        return model

    def outcome(model, batch_size):
        try:
            h = model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
            return {"ok": True, "loss": float(h.history["loss"][0])}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}

    def guard(fn, *args):
        try:
            fn(*args)
            return None
        except ConfigError as e:
            return str(e)

    out = {"replicas": strategy.num_replicas_in_sync}
    m = make_model(steps_per_execution=2)
    out["spe_guard"] = guard(keras_compat.check_steps_per_execution, m, strategy)
    out["spe_upstream"] = outcome(m, 16)
    m = make_model()
    out["spe1_guard"] = guard(keras_compat.check_steps_per_execution, m, strategy)
    out["first_batch_guard"] = guard(check_divisible, 15, strategy.num_replicas_in_sync)
    out["uneven_upstream"] = outcome(make_model(), 15)
    out["status"] = keras_compat.apply(strategy)
    out["uneven_patched"] = outcome(make_model(), 15)
    out["even_patched"] = outcome(make_model(), 16)
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_mirrored_guards_match_what_keras_really_does():
    result = run_process(MIRRORED, env=CLEAN_ENV, timeout=120)
    assert result.ok, describe([result])
    rep = result.last_json()
    assert rep["replicas"] == 2

    # steps_per_execution > 1: the guard refuses, and Keras itself really fails.
    assert "steps_per_execution=2" in rep["spe_guard"]
    assert "steps_per_execution=1" in rep["spe_guard"]
    assert not rep["spe_upstream"]["ok"]
    assert "placeholder" in rep["spe_upstream"]["error"].lower(), rep["spe_upstream"]
    assert rep["spe1_guard"] is None

    # Uneven first batch: the guard names it; upstream Keras fails with AddN.
    assert "global_batch_size=15" in rep["first_batch_guard"] and "14 or 16" in rep["first_batch_guard"]
    assert not rep["uneven_upstream"]["ok"]
    assert "AddN must have the same size and shape" in rep["uneven_upstream"]["error"]

    # Measured: that AddN came from _maybe_symbolic_build's cross-replica MEAN of
    # the first batch, so the patch removes it too.
    assert rep["status"] == "patched"
    assert rep["uneven_patched"]["ok"], rep["uneven_patched"]
    assert rep["even_patched"]["ok"] and math.isfinite(rep["even_patched"]["loss"])


# --------------------------------------------------------------------------
# The version gate (in-process)
# --------------------------------------------------------------------------


def _trainer():
    from keras.src.backend.tensorflow import trainer

    return trainer


def _is_patched() -> bool:
    t = _trainer()
    return (
        t.TensorFlowTrainer.__dict__["_maybe_symbolic_build"] is keras_compat._maybe_symbolic_build
        and t.reduce_per_replica is keras_compat._reduce_per_replica
    )


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Unpatched Keras, no cached apply() result, no override variables; restored after."""
    pytest.importorskip("keras")
    for name in CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)
    keras_compat.revert()
    t = _trainer()
    original_build = t.TensorFlowTrainer.__dict__["_maybe_symbolic_build"]
    original_reduce = t.reduce_per_replica
    yield
    keras_compat.revert()
    assert t.TensorFlowTrainer.__dict__["_maybe_symbolic_build"] is original_build
    assert t.reduce_per_replica is original_reduce


def test_installed_version_is_a_tested_one_in_this_environment(fresh):
    # If this fails, the environment moved: re-run the multiworker tests on the
    # new version and add it to TESTED_KERAS_VERSIONS only if they pass.
    assert keras_compat.installed_keras_version() in keras_compat.TESTED_KERAS_VERSIONS


def test_tested_version_is_patched_once(fresh):
    assert keras_compat.apply() == "patched"
    assert _is_patched()
    original = keras_compat._originals["reduce_per_replica"]
    assert keras_compat.apply() == "patched"
    assert _is_patched()
    assert keras_compat._originals["reduce_per_replica"] is original  # not wrapped twice


def test_self_check_sees_both_bugs_in_real_keras_and_none_once_fixed(fresh):
    assert keras_compat.upstream_bugs_present() == [
        keras_compat.BUG_SYMBOLIC_BUILD,
        keras_compat.BUG_SCALAR_REDUCE,
    ]
    keras_compat._install()
    assert keras_compat.upstream_bugs_present() == []


def test_untested_version_with_the_bugs_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.99.0")
    with pytest.raises(KerasCompatError) as info:
        keras_compat.apply()
    msg = str(info.value)
    assert "3.99.0" in msg
    assert "3.15.1" in msg
    assert "pip install keras==3.15.1" in msg
    assert "STRATKIT_KERAS_COMPAT=force" in msg
    assert "STRATKIT_KERAS_COMPAT=off" in msg
    assert not _is_patched()
    # A refusal is not cached: the next call decides again.
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.15.1")
    assert keras_compat.apply() == "patched"


def test_untested_version_that_fixed_the_bugs_is_left_alone(fresh, monkeypatch):
    # Stand-in for a future Keras whose own functions behave like the fixed ones:
    # put the fixed functions in place first, then ask the gate about "3.99.0".
    keras_compat._install()
    keras_compat._status = None
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.99.0")
    assert keras_compat.apply() == "not_needed"


def test_force_patches_an_untested_version(fresh, monkeypatch, caplog):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "3.99.0")
    monkeypatch.setenv(keras_compat.ENV_VAR, "force")
    assert keras_compat.apply() == "forced"
    assert _is_patched()
    assert "3.99.0" in caplog.text and "own risk" in caplog.text


def test_off_never_patches(fresh, monkeypatch):
    monkeypatch.setenv(keras_compat.ENV_VAR, "off")
    assert keras_compat.apply() == "disabled"
    assert not _is_patched()


def test_unknown_override_value_is_a_config_error(fresh, monkeypatch):
    monkeypatch.setenv(keras_compat.ENV_VAR, "yes-please")
    with pytest.raises(ConfigError, match="STRATKIT_KERAS_COMPAT='yes-please'"):
        keras_compat.apply()


def test_keras_2_needs_nothing(fresh, monkeypatch):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: "2.15.0")
    assert keras_compat.apply() == "not_needed"
    assert not _is_patched()


def test_legacy_keras_env_still_patches_the_keras_3_that_import_keras_gives(fresh, monkeypatch):
    # Ray Train sets TF_USE_LEGACY_KERAS=1 in every worker. That routes only `tf.keras` to tf_keras:
    # `import keras` (what a Keras 3 model and stratkit.Trainer use) is still Keras 3, which needs the fixes.
    # Before this was fixed, an installed tf_keras made the gate skip them, and a Keras 3 model in
    # Ray Train failed with "Attempt to convert a value (PerReplica...".
    import keras

    fake_tf_keras = types.ModuleType("tf_keras")
    fake_tf_keras.__version__ = "2.21.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tf_keras", fake_tf_keras)
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert keras_compat.installed_keras_version() == keras.__version__
    assert keras_compat.apply() == "patched"
    assert _is_patched()


def test_one_device_gets_the_trainer_fixes_on_a_tested_version(fresh, monkeypatch):
    # a model without call() (Keras's DCGAN example) needs the build fix on one device too (test_global_gradient)
    assert keras_compat.apply_one_device() is True
    assert _is_patched()
    assert keras_compat.apply_one_device() is True and _is_patched()   # idempotent


@pytest.mark.parametrize("version, mode, fixed", [("3.99.0", None, False), ("3.99.0", "force", False),
                                                  ("3.15.1", "off", False), ("2.15.0", None, False)])
def test_one_device_is_never_refused_and_follows_the_gate(fresh, monkeypatch, version, mode, fixed):
    monkeypatch.setattr(keras_compat, "installed_keras_version", lambda: version)
    if mode:
        monkeypatch.setenv(keras_compat.ENV_VAR, mode)
    assert keras_compat.apply_one_device() is fixed
    assert _is_patched() is fixed


def test_the_trainer_fixes_make_the_step_wait_for_its_batch_and_revert_gives_keras_its_own(fresh):
    from stratkit.strategy.keras_compat import step_gate

    original = _trainer().TensorFlowTrainer.__dict__["_make_function"]
    assert step_gate.self_check() == []       # the installed Keras has the shape the gate reaches into
    assert keras_compat.apply_one_device() is True
    assert _trainer().TensorFlowTrainer.__dict__["_make_function"] is step_gate._make_function
    keras_compat.revert()
    assert _trainer().TensorFlowTrainer.__dict__["_make_function"] is original


def test_the_step_gate_leaves_a_keras_whose_step_it_cannot_reach_alone_and_says_so(fresh, monkeypatch, caplog):
    from stratkit.strategy.keras_compat import step_gate

    class Trainer:       # a Keras whose _make_function calls its step some other way
        def _make_function(self, step_function):
            def function(iterator):
                return step_function(next(iterator))

            return function

    assert step_gate.self_check(Trainer.__dict__["_make_function"])
    with monkeypatch.context() as patch:
        patch.setattr(_trainer(), "TensorFlowTrainer", Trainer)
        assert step_gate.install() is False
    assert Trainer.__dict__["_make_function"] is not step_gate._make_function
    assert "cannot make Keras's step wait for its batch" in caplog.text


def test_apply_wraps_the_seed_generator_once_and_revert_gives_it_back(fresh):
    import keras

    original = keras.random.SeedGenerator.__dict__["next"]
    assert keras_compat.apply() == "patched"
    wrapped = keras.random.SeedGenerator.__dict__["next"]
    assert wrapped is not original
    keras_compat._status = None
    keras_compat.apply()
    assert keras.random.SeedGenerator.__dict__["next"] is wrapped       # not wrapped twice
    keras_compat.revert()
    assert keras.random.SeedGenerator.__dict__["next"] is original


# --------------------------------------------------------------------------
# Cheap guards and import hygiene
# --------------------------------------------------------------------------


def test_steps_per_execution_with_one_replica_is_fine(fresh):
    tf = pytest.importorskip("tensorflow")
    model = types.SimpleNamespace(steps_per_execution=4)
    keras_compat.check_steps_per_execution(model, tf.distribute.OneDeviceStrategy("/cpu:0"))
    keras_compat.check_steps_per_execution(model, tf.distribute.MirroredStrategy(["/cpu:0"]))


def test_importing_keras_compat_does_not_import_tensorflow():
    code = (
        "import sys, stratkit.strategy.keras_compat\n"
        "bad = [m for m in ('tensorflow', 'keras', 'tf_keras') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, env=child_env(None, CLEAN_ENV), capture_output=True,
        text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_batchnorm_notice_names_the_layers_that_train_not_the_frozen_ones(monkeypatch):
    """The fit-start notice's list (stratkit/strategy/keras_compat/batchnorm.py training_layer_names): a
    base called with training=False but trainable trains its BatchNormalization (keras-team/keras#20285)."""
    keras = pytest.importorskip("keras")
    from stratkit.strategy.keras_compat import batchnorm

    monkeypatch.delenv(batchnorm.ENV_VAR, raising=False)
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(name="trains"),
                             keras.layers.BatchNormalization(name="frozen"),
                             keras.layers.BatchNormalization(name="synced", synchronized=True)], name="base")
    base.get_layer("frozen").trainable = False
    inputs = keras.Input((3,))
    head = keras.layers.BatchNormalization(name="head")
    model = keras.Model(inputs, head(base(inputs, training=False)))
    assert batchnorm.training_layer_names(model) == ["base/trains", "head"]
    monkeypatch.setenv(batchnorm.ENV_VAR, "1")            # the global batch's moments: nothing per replica
    assert batchnorm.training_layer_names(model) == []
