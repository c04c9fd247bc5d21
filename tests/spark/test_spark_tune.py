"""A hyperparameter search on a real 2-executor Spark (local-cluster[2,1,1024]): `SparkRunner(tune=True)`.

Issue 51's acceptance on Spark: a seeded KerasTuner RandomSearch of 8 trials and a Hyperband search on 2
executors try the same trials and get the same scores as the one-process search (within 1e-5); a tuner killed
mid-trial is a lease that expires (its trial runs again on the other tuner, the search ends the same); the
Optuna example's study (8 trials, optuna-integration's pruning callback) on 2 executors tries one process's
trials and prunes, and an Optuna tuner SIGKILLed mid-trial fails its trial, whose retry runs on the other tuner;
bad input (more tuners than slots, a store the tuners cannot write) is a ConfigError before any trial. The session is
tests/spark/test_spark_runner.py's (shared: the executors start once).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time

import cloudpickle
import engine_searches
import pytest
from spark_helpers import shared_session

from stratkit.errors import ConfigError
from stratkit.spark import SparkRunner


def _example(name: str):
    """An example script as a module (by path: putting examples/ on sys.path would shadow other modules)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tune_optuna = _example("tune_optuna")  # examples/tune_optuna.py, the study the docs show

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.spark]

cloudpickle.register_pickle_by_value(engine_searches)
cloudpickle.register_pickle_by_value(tune_optuna)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Both searches as one process."""
    return engine_searches.shared_reference(tmp_path_factory)


@pytest.mark.tune_acceptance
def test_a_seeded_random_search_and_hyperband_on_two_executors_equal_the_one_process_search(spark, reference,
                                                                                            tmp_path, capsys):
    runner = SparkRunner(num_workers=2, tune=True, timeout=900)
    started = time.monotonic()
    result = runner.run(engine_searches.seeded_searches, str(tmp_path))  # both searches, one after the other
    seconds = time.monotonic() - started
    out = capsys.readouterr().out
    for kind in engine_searches.KINDS:
        assert engine_searches.compare(result[kind], reference[kind]) == [], (kind, out[-6000:])
    tuners = {line.split(" TUNER ")[1].split()[0] for line in out.splitlines() if " TUNER " in line}
    assert len(tuners) == 2, out[-3000:]  # both executors ran trials
    assert runner.last_run.lost == [] and set(runner.last_run.exit_codes.values()) == {0}
    print(f"spark 2 tuners: {seconds:.1f} s for both searches (one process: "
          f"{sum(reference[k]['seconds'] for k in engine_searches.KINDS):.1f} s); a trial's cost beyond its fit on "
          f"tuner {result['random']['tuner']}: random {engine_searches.overhead(result['random']):.2f} s, hyperband "
          f"{engine_searches.overhead(result['hyperband']):.2f} s")


def kill_a_tuner_mid_trial(out_dir: str) -> dict:
    """Tuner 1 SIGKILLs its own training process mid-trial (its first trial's second epoch, once)."""
    import keras

    os.chdir(out_dir)
    tuner_id = int(os.environ["STRATKIT_TUNE_TUNER"])
    marker = os.path.join(out_dir, "killed")

    class KillOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if tuner_id == 1 and epoch == 1 and not os.path.exists(marker):
                with open(marker, "w") as handle:
                    handle.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)

    import stratkit.tuning.kt_tuner as kt

    original = kt.DistributedTuner._build_and_fit_model

    def with_kill(self, trial, *args, **kwargs):
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), KillOnce()]
        return original(self, trial, *args, **kwargs)

    kt.DistributedTuner._build_and_fit_model = with_kill
    return engine_searches.seeded_search("random", out_dir, slow=0.2)


def test_a_tuner_killed_mid_trial_loses_its_lease_and_the_search_ends_as_one_process(spark, reference, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("STRATKIT_TUNE_LEASE_SECONDS", "6")
    runner = SparkRunner(num_workers=2, tune=True, timeout=900)
    result = runner.run(kill_a_tuner_mid_trial, str(tmp_path))
    assert os.path.exists(tmp_path / "killed")
    assert runner.last_run.lost == ["tuner:1"], runner.last_run
    assert engine_searches.compare(result, reference["random"]) == []


@pytest.mark.tune_acceptance
def test_the_optuna_example_on_two_executors_tries_one_processs_trials_and_prunes(spark, tmp_path):
    """examples/tune_optuna.py's study (a seeded TPE, the median pruner, KerasPruningCallback) on 2 Spark tuners,
    the study held on the driver (this process), beside the same study in one process: the same 8 trials (numbers,
    parameters), every epoch both runs reported equal, the same value where both completed a trial, and pruned
    trials; which trials are pruned depends on which ended first (docs/tuning.md, "Optuna")."""
    runner = SparkRunner(num_workers=2, tune=True, timeout=900)
    started = time.monotonic()
    two = runner.run(tune_optuna.search, 8, 2, str(tmp_path / "study"))
    seconds = time.monotonic() - started
    started = time.monotonic()
    one = tune_optuna.search(8, 2)
    alone = time.monotonic() - started
    assert runner.last_run.lost == [] and set(runner.last_run.exit_codes.values()) == {0}
    assert [t[:3:2] for t in two["trials"]] == [t[:3:2] for t in one["trials"]] and len(one["trials"]) == 8
    assert "PRUNED" in {t[1] for t in two["trials"]}, two["trials"]
    for (number, state, _, value, reported), (_, state1, _, value1, reported1) in zip(two["trials"], one["trials"]):
        steps = reported.keys() & reported1.keys()
        assert steps and all(abs(reported[s] - reported1[s]) <= 1e-6 for s in steps), (number, reported, reported1)
        if state == state1 == "COMPLETE":
            assert abs(value - value1) <= 1e-6, number
    print(f"optuna on spark, 2 tuners: {seconds:.1f} s (one process {alone:.1f} s); pruned: 2 tuners "
          f"{[t[0] for t in two['trials'] if t[1] == 'PRUNED']}, one process "
          f"{[t[0] for t in one['trials'] if t[1] == 'PRUNED']}")


def optuna_with_a_worker_killed(out_dir: str) -> list[list]:
    """A seeded Optuna study (8 trials of 3 reported steps, the median pruner) whose tuner 1 SIGKILLs itself in
    its first trial, after its first report; the study's trials as every tuner holds them at the end."""
    import optuna

    import stratkit

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tuner = int(os.environ["STRATKIT_TUNE_TUNER"])
    marker = os.path.join(out_dir, "killed")

    def objective(trial):
        x, n = trial.suggest_float("x", -10, 10), trial.suggest_int("n", 1, 5)
        for step in range(3):
            time.sleep(0.2)
            if tuner == 1 and step == 1 and not os.path.exists(marker):
                with open(marker, "w") as handle:
                    handle.write(str(trial.number))
                os.kill(os.getpid(), signal.SIGKILL)
            trial.report((x - 2) ** 2 + n + 1.0 / (step + 1), step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return (x - 2) ** 2 + n

    study = stratkit.tune(optuna.create_study(study_name="killed", sampler=optuna.samplers.RandomSampler(seed=1),
                                              pruner=optuna.pruners.MedianPruner(n_startup_trials=2)),
                          store=os.path.join(out_dir, "study"))
    study.optimize(objective, n_trials=8)
    return [[t.number, t.state.name, t.params, t.system_attrs.get("failed_trial"),
             t.system_attrs.get("stratkit_lost")] for t in study.trials]


@pytest.mark.tune_acceptance
def test_an_optuna_worker_killed_mid_trial_fails_its_trial_a_retry_runs_and_the_study_ends(spark, tmp_path,
                                                                                          monkeypatch):
    """Issue 51's Optuna acceptance on Spark: the executor's tuner SIGKILLed mid-trial loses its lease; the trial is
    FAIL (lost), a retry with its parameters runs on the other tuner, and the study ends with its 8 trials
    counted, their parameters those of the same study uninterrupted."""
    import optuna

    monkeypatch.setenv("STRATKIT_TUNE_LEASE_SECONDS", "4")
    runner = SparkRunner(num_workers=2, tune=True, timeout=900)
    trials = runner.run(optuna_with_a_worker_killed, str(tmp_path))
    lost = int((tmp_path / "killed").read_text())
    assert runner.last_run.lost == ["tuner:1"], runner.last_run
    by_number = {t[0]: t for t in trials}
    assert by_number[lost][1] == "FAIL" and "its tuner was lost" in by_number[lost][4], by_number[lost]
    retries = [t for t in trials if t[3] == lost]
    assert len(retries) == 1 and retries[0][1] in ("COMPLETE", "PRUNED") and retries[0][2] == by_number[lost][2]
    counted = [t for t in trials if t[3] is None]
    assert len(counted) == 8 and "PRUNED" in {t[1] for t in trials}, trials
    uninterrupted = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    uninterrupted.optimize(lambda t: t.suggest_float("x", -10, 10) + t.suggest_int("n", 1, 5), n_trials=8)
    assert [t[2] for t in counted] == [t.params for t in uninterrupted.trials]


def test_the_spark_example_searches_on_two_executors_as_one_process(spark, tmp_path, monkeypatch):
    """examples/tune_spark.py (the docs' Spark sample): its search_on_spark on 2 executors (this module's
    session, not a Spark of its own), 3 trials of 1 epoch, beside the example's search in one process: the same
    trials, scores within 1e-5 and the same best hyperparameters."""
    tune_spark = _example("tune_spark")
    monkeypatch.chdir(tmp_path)  # the example's KerasTuner directory is relative
    two = tune_spark.search_on_spark(spark, 2, 3, 1, str(tmp_path / "store"))
    one = tune_spark.tune_keras_tuner.search(3, 1)
    assert two["trials"].keys() == one["trials"].keys() and len(one["trials"]) == 3, (two, one)
    assert all(abs(two["trials"][k] - one["trials"][k]) <= 1e-5 for k in one["trials"]), (two, one)
    assert two["best"] == one["best"]


def test_more_tuners_than_slots_are_refused_before_any_job(spark):
    with pytest.raises(ConfigError, match="a search of 3 tuners needs 3 concurrent task slots"):
        SparkRunner(num_workers=3, tune=True).run(engine_searches.seeded_search, "random", "/nonexistent")


def test_a_store_the_tuners_cannot_write_is_a_config_error_before_any_trial(spark, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot be written") as caught:
        SparkRunner(num_workers=2, tune=True, timeout=600).run(engine_searches.seeded_search, "random",
                                                               str(blocker))
    assert "TRIAL" not in str(caught.value)


def test_tune_refuses_the_arguments_that_mean_nothing_to_tuners():
    for kwargs, name in (({"num_ps": 1}, "num_ps"), ({"min_workers": 1}, "min_workers"),
                         ({"max_retries": 1}, "max_retries")):
        with pytest.raises(ConfigError, match=f"{name}=1 does not go with tune=True"):
            SparkRunner(num_workers=2, tune=True, **kwargs)




def change_directory_and_return(value):
    os.chdir("/")  # a search function does (tests/engine_searches.py), and so may any train_fn
    return value


def test_a_function_that_changes_its_working_directory_still_returns_its_value(spark):
    """The task's working directory (payload, result) is absolute: Spark's file root is "." on a cluster's
    executors, and a relative result path broke once the function left that directory (a search's did)."""
    assert SparkRunner(num_workers=2).run(change_directory_and_return, 7) == 7
