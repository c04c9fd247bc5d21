"""Optuna studies on stratkit's search service, for real: one process is Optuna's own optimize, N workers
try one process's trials, a killed worker's trial fails and runs again, a killed chief resumes from S3.

The fast tests run the study in this process (plain Python objectives, no TensorFlow): `stratkit.tune(study)`
against the same study optimized by Optuna alone, and the refusals. The slow ones start real processes:
2 workers under `LocalRunner(tune=True)` (a Hyperband-pruned study equal to Optuna's one-process trials),
`stratkit launch --tune` with a worker SIGKILLed mid-trial and then the chief SIGKILLed mid-retry (the study on
moto's S3 resumes and ends with the trials of an uninterrupted study), and an objective failing on the first
trial (a ConfigError on every worker). The Keras study with optuna-integration's pruning callback is the
example's test (tests/examples/test_examples.py: examples/tune_optuna.py on 2 workers and in one process).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import optuna
import pytest
from test_keras_tuner import Run

import stratkit
from stratkit import ConfigError

SCRIPT = str(Path(__file__).with_name("optuna_script.py"))
TRIAL = re.compile(r"TRIAL (\d+) TUNER (\d+) PID (\d+) ATTEMPT (\d+) RETRY_OF (\S+)")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in list(os.environ):
        if name.startswith("STRATKIT_TUNE_"):
            monkeypatch.delenv(name)


def objective(trial: optuna.Trial) -> float:
    """Plain Python, with a conditional parameter and pruning on 3 reported steps."""
    x = trial.suggest_float("x", -10, 10)
    kind = trial.suggest_categorical("kind", ["int", "float"])
    n = trial.suggest_int("n", 1, 8, log=True) if kind == "int" else trial.suggest_float("f", 0.0, 1.0)
    trial.set_user_attr("kind", kind)
    for step in range(3):
        trial.report((x - 2) ** 2 + n + 1.0 / (step + 1), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return (x - 2) ** 2 + n


def static(trial: optuna.Trial) -> float:
    """The same space in every trial (what N workers draw as one process), pruned on 3 reported steps."""
    x = trial.suggest_float("x", -10, 10)
    n = trial.suggest_int("n", 1, 8, log=True)
    for step in range(3):
        trial.report((x - 2) ** 2 + n + 1.0 / (step + 1), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return (x - 2) ** 2 + n


def _trials(study: optuna.Study) -> list[tuple]:
    return [(t.number, t.state.name, t.params, t.values, t.intermediate_values, t.user_attrs) for t in study.trials]


#: Named: Hyperband puts a trial in a bracket by a hash of the study's name (Optuna's own name is random).
STUDIES = {
    "tpe+median": lambda: optuna.create_study(study_name="s", sampler=optuna.samplers.TPESampler(seed=3),
                                              pruner=optuna.pruners.MedianPruner(n_startup_trials=2)),
    "random+hyperband": lambda: optuna.create_study(study_name="s", sampler=optuna.samplers.RandomSampler(seed=3),
                                                    pruner=optuna.pruners.HyperbandPruner(1, 3, 2)),
    "grid": lambda: optuna.create_study(study_name="s", sampler=optuna.samplers.GridSampler(
        {"x": [0.0, 2.0], "kind": ["int", "float"], "n": [1, 2], "f": [0.5]}, seed=0)),
}


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_one_process_is_optunas_own_optimize(name):
    """One process: the same trials (numbers, states, parameters, values, reports), TPE past its random start
    included, as Optuna optimizing alone; then the study holds them in memory, the search's store is gone."""
    alone = STUDIES[name]()
    alone.optimize(objective, n_trials=14)
    study = stratkit.tune(STUDIES[name]())
    study.optimize(objective, n_trials=14)
    assert _trials(study) == _trials(alone)
    assert study.best_params == alone.best_params and len(study.trials) == len(alone.trials) >= 8
    study.enqueue_trial({"x": 1.0})  # after the search: a plain in-memory study again
    assert study.trials[-1].state == optuna.trial.TrialState.WAITING


def test_bad_input_is_a_config_error_before_any_trial(tmp_path):
    calls = []

    def failing(trial):
        calls.append(trial.number)
        x = trial.suggest_float("x", -1, 1)
        raise ValueError(f"no model for x={x}")

    with pytest.raises(ConfigError, match=r"the objective fails on the study's first trial: Trial 0 failed with "
                       r"parameters: \{'x': .*\} because of the following error: ValueError\('no model for x="):
        stratkit.tune(optuna.create_study()).optimize(failing, n_trials=4)
    assert calls == [0]
    # catch= lets a trial fail, as in Optuna
    study = stratkit.tune(optuna.create_study())
    study.optimize(failing, n_trials=2, catch=(ValueError,))
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    with pytest.raises(ConfigError, match=r"optimize\(\) ran already"):
        study.optimize(objective, n_trials=2)
    with pytest.raises(ConfigError, match=r"n_jobs=2.*run more workers"):
        stratkit.tune(optuna.create_study()).optimize(objective, n_trials=2, n_jobs=2)
    with pytest.raises(ConfigError, match=r"n_trials=0"):
        stratkit.tune(optuna.create_study()).optimize(objective, n_trials=0)
    with pytest.raises(ConfigError, match=r"keeps its trials in its own storage.*without storage="):
        stratkit.tune(optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}"))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match=r"store=.*a-file.*cannot be written"):
        stratkit.tune(optuna.create_study(), store=str(blocked / "study")).optimize(objective, n_trials=2)
    from stratkit.tuning import environment

    with pytest.MonkeyPatch.context() as patch:  # a worker of `launch --tune --workers-per-trial 2`
        for key, value in environment.task_env(("127.0.0.1", 9), "t" * 32, 0, 1, group=(1, 2)).items():
            patch.setenv(key, value)
        with pytest.raises(ConfigError, match=r"worker 1 of a multi-worker trial group of 2.*Fix: drop "
                           r"--workers-per-trial"):
            stratkit.tune(optuna.create_study()).optimize(objective, n_trials=2)


@pytest.mark.slow
def test_an_unreachable_store_is_a_config_error_before_any_trial(store_server):
    """The study's store is S3 (moto) and down: every worker's store check refuses it before any trial ran."""
    import stores

    s3 = store_server("s3")
    bucket = s3.make_bucket(f"optuna-down-{os.getpid()}")
    calls = []
    with stores.client_settings(s3):
        s3.down()
        try:
            with pytest.raises(ConfigError, match=rf"store='s3://{bucket}/study'.*Fix"):
                stratkit.tune(optuna.create_study(), store=s3.url(bucket, "study")).optimize(calls.append, n_trials=2)
        finally:
            s3.up()
    assert calls == []


def study_on_local_runner():
    """A LocalRunner task: the study's 8 trials on 2 workers; every worker's view of the study afterwards."""
    import optuna

    import stratkit

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = stratkit.tune(STUDIES["random+hyperband"]())
    study.optimize(static, n_trials=8)
    return {"trials": _trials(study), "tuner": os.environ["STRATKIT_TUNE_TUNER"]}


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_workers_under_local_runner_try_one_processs_trials():
    """LocalRunner(tune=True): the driver (this process) holds the study; 2 workers run its 8 trials. A seeded
    RandomSampler draws as in one process, whatever the order the trials end in; Hyperband prunes (which
    trials depends on that order, so the pruned ones are compared on what both runs reported)."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    alone = STUDIES["random+hyperband"]()
    alone.optimize(static, n_trials=8)
    result = stratkit.LocalRunner(num_workers=2, tune=True).run(study_on_local_runner)
    trials = result["trials"]
    assert [t[:3:2] for t in trials] == [t[:3:2] for t in _trials(alone)]  # numbers, parameters
    assert "PRUNED" in {t[1] for t in trials}
    for got, expected in zip(trials, _trials(alone)):
        steps = set(got[4]) & set(expected[4])
        assert steps and all(got[4][s] == expected[4][s] for s in steps), (got, expected)
        if got[1] == expected[1] == "COMPLETE":
            assert got[3] == expected[3]


def _held(run: Run, tuner: int) -> tuple[int, int]:
    _, hold = run.wait_for(rf"HOLD (\d+) TUNER {tuner} PID (\d+)", timeout=300)
    return int(hold[1]), int(hold[2])


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_killed_worker_fails_its_trial_a_retry_runs_and_a_killed_chief_resumes_from_s3(tmp_path, store_server):
    """2 workers under `stratkit launch --tune --max-restarts 1`, the study on S3 (moto). Worker 1 is SIGKILLed
    in its first trial: the trial is marked FAIL and a retry with its parameters runs on worker 0 within 30 s.
    Worker 0, the chief, is SIGKILLed in that retry: the restarted chief resumes the study from S3 (its trials
    finished so far never run again, the retry fails and runs again), and the study ends with n_trials trials
    counted, pruned ones among them, whose parameters are those of the same study uninterrupted."""
    s3 = store_server("s3")
    bucket = s3.make_bucket(f"optuna-{os.getpid()}-{int(time.time())}")
    env = {**s3.client_env({}), "STRATKIT_TUNE_LEASE_SECONDS": "3"}
    run = Run([sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--max-restarts", "1",
               "--", sys.executable, SCRIPT, "--store", s3.url(bucket, "study"), "--hold", "1:0", "--hold-retry", "0"],
              tmp_path, env)
    lost, worker = _held(run, 1)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    retry, chief = _held(run, 0)
    delay = time.monotonic() - killed
    assert delay < 30
    print(f"the killed worker's trial {lost} ran again as trial {retry} {delay:.1f} s after the kill")
    finished = {t["number"] for t in json.loads(s3.fs().cat_file(f"{bucket}/study/search.json"))["planner"]["trials"]
                if t["state"] in ("COMPLETE", "PRUNED")}
    os.kill(chief, signal.SIGKILL)
    restarted, _ = run.wait_for(r"attempt 2 of 2: worker:0 started", timeout=120)
    assert run.finish(timeout=600) == 0, run.text[-8000:]
    assert "resumed the search from s3://" in run.text
    again = {int(m[0]) for _, line in run.lines[restarted:] for m in TRIAL.findall(line)}
    assert again and not again & finished, (sorted(finished), sorted(again))
    results = run.results()
    trials = {t["number"]: t for t in results["0"]["trials"]}
    assert results["0"]["trials"] == results["1"]["trials"]
    assert trials[lost]["state"] == "FAIL" and "its tuner was lost" in trials[lost]["lost"]
    assert trials[retry]["retry_of"] == lost and trials[retry]["state"] == "FAIL"
    assert "restarted" in trials[retry]["lost"] and trials[retry]["params"] == trials[lost]["params"]
    reruns = [t for t in trials.values() if t["retry_of"] == lost and t["number"] != retry]
    assert len(reruns) == 1 and reruns[0]["state"] in ("COMPLETE", "PRUNED")
    assert reruns[0]["params"] == trials[lost]["params"]
    counted = [t for t in trials.values() if t["retry_of"] is None]
    assert len(counted) == 8 and "PRUNED" in {t["state"] for t in trials.values()}
    uninterrupted = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    uninterrupted.optimize(lambda t: t.suggest_float("x", -10, 10) + t.suggest_int("n", 1, 5), n_trials=8)
    assert sorted(json.dumps(t["params"], sort_keys=True) for t in counted) == \
        sorted(json.dumps(t.params, sort_keys=True) for t in uninterrupted.trials)


@pytest.mark.slow
@pytest.mark.multiworker
def test_an_objective_failing_on_the_first_trial_stops_every_worker_before_another_trial(tmp_path):
    run = Run([sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", "2", "--", sys.executable,
               SCRIPT, "--fail-first"], tmp_path)
    assert run.finish(timeout=300) != 0
    message = r"ConfigError: the objective fails on the study's first trial: Trial 0 failed with parameters"
    assert re.search(rf"\[worker:0\].*{message}", run.text) and re.search(rf"\[worker:1\].*{message}", run.text), \
        run.text[-8000:]
    started = [TRIAL.search(line)[1] for _, line in run.lines if re.match(r"\[worker:\d\] TRIAL", line)]
    assert started == ["0"]  # no other trial started (the launcher's report quotes the line again: not counted)
