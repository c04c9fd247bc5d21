"""Seeded KerasTuner searches the engine tests run: as one process, and as N tuners on Spark, Ray, Slurm, launch.

`seeded_search(kind, ...)` is the search function the runners ship to their
tuners (the tests register this module to be pickled by value, so executors
and actors need no copy of the tests); `python -m engine_searches KIND STORE`
runs it as one process, the reference every engine's search must equal. It
returns each trial's hyperparameters, score and status, the best
hyperparameters, the search's wall time, this tuner's id, and how long each
trial this tuner ran spent inside `fit` (the rest of the search's time on
this tuner is what its trials cost beyond their own training: `overhead`).

Every epoch of a trial prints `TRIAL <id> RUN <run> EPOCH <epoch> TUNER <tuner> PID <pid> HOST <host>` (the tests kill
and stop tuners by these lines); with `slow`, each epoch sleeps that long (room to kill a tuner mid-trial).
Two more behaviours, from the environment (a script under `stratkit launch --tune` has no arguments per tuner):
`SEARCH_FAIL_TRIAL=<id>` fails that trial (KerasTuner's FailedTrialError at its first epoch), and
`SEARCH_KILL_<tuner>=<n>:<epoch>:<marker>` makes that tuner SIGKILL itself at that epoch of its n-th trial, once
(the marker file says it happened: the trial and run it killed).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

#: The searches the tests run: RandomSearch of 8 trials, and Hyperband (6 trials, 13 epochs).
KINDS = ("random", "hyperband")


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 1))
    x = rng.normal(size=(64, 8)).astype("float32")
    xv = rng.normal(size=(32, 8)).astype("float32")
    return x, (x @ w).astype("float32"), xv, (xv @ w).astype("float32")


def seeded_search(kind: str, store: str | None = None, *, trials: int = 8, epochs: int = 2, slow: float = 0.0,
                  directory: str = "kt", tune_options: dict | None = None) -> dict:
    """Run one seeded search (`kind` in KINDS) as a tuner of whatever search this process belongs to."""
    import keras
    import keras_tuner

    import stratkit

    tuner_box: list = []
    timings: dict[str, dict[str, float]] = {}
    order: dict[str, int] = {}  # trial id -> the how-manieth trial of this tuner it is

    def build(hp):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(hp.Int("units", 4, 32, step=4),
                                                                        activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-3, 1e-1, sampling="log")), loss="mse")
        return model

    class Trace(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.fit_started = time.monotonic()

        def on_epoch_begin(self, epoch, logs=None):
            state = tuner_box[0]._stratkit
            lease = state.current.lease
            print(f"TRIAL {lease.trial_id} RUN {lease.run} EPOCH {epoch} TUNER {state.session.tuner} "
                  f"PID {os.getpid()} HOST {socket.gethostname()}", flush=True)
            if slow:
                time.sleep(slow)
            if lease.trial_id == os.environ.get("SEARCH_FAIL_TRIAL"):
                raise keras_tuner.errors.FailedTrialError(f"trial {lease.trial_id} fails on purpose")
            kill = os.environ.get(f"SEARCH_KILL_{state.session.tuner}")  # "<nth trial>:<epoch>:<marker file>"
            if kill:
                nth, at, marker = kill.split(":", 2)
                order.setdefault(lease.trial_id, len(order) + 1)
                if order[lease.trial_id] == int(nth) and epoch == int(at) and not os.path.exists(marker):
                    with open(marker, "w") as handle:
                        handle.write(f"{lease.trial_id} {lease.run}")
                    os.kill(os.getpid(), 9)

        def on_train_end(self, logs=None):
            lease = tuner_box[0]._stratkit.current.lease
            timings.setdefault(lease.trial_id, {})["fit"] = time.monotonic() - self.fit_started

    directory = os.path.abspath(directory)
    options = dict(tune_options or {})
    strategy = None
    if os.environ.get("STRATKIT_TUNE_GROUP"):  # a multi-worker trial group: its strategy before KerasTuner's model
        strategy = stratkit.make_strategy()
    if store is not None:
        options["store"] = f"{store}/{kind}"
    if kind == "random":
        tuner = keras_tuner.RandomSearch(build, objective="val_loss", max_trials=trials, seed=1, directory=directory,
                                         project_name=kind, distribution_strategy=strategy)
        fit = {"epochs": epochs}
    else:
        tuner = keras_tuner.Hyperband(build, objective="val_loss", max_epochs=3, factor=3, seed=2,
                                      directory=directory, project_name=kind, distribution_strategy=strategy)
        fit = {}
    tuner_box.append(stratkit.tune(tuner, **options))

    x, y, xv, yv = data()
    started = time.monotonic()
    tuner.search(x, y, batch_size=32, validation_data=(xv, yv), callbacks=[Trace()], verbose=0, **fit)
    seconds = time.monotonic() - started
    found = {t.trial_id: [{k: v for k, v in t.hyperparameters.values.items()}, t.score, t.status]
             for t in tuner.oracle.trials.values()}
    return {"trials": found, "best": tuner.get_best_hyperparameters()[0].values, "seconds": seconds,
            "tuner": tuner._stratkit.session.tuner, "timings": timings}


def seeded_searches(store: str, kinds: tuple[str, ...] = KINDS, **options) -> dict:
    """Each search of `kinds` in turn, from `store` as the working directory (a run may search several times)."""
    os.chdir(store)
    return {kind: seeded_search(kind, store, **options) for kind in kinds}


def compare(result: dict, reference: dict, tolerance: float = 1e-5, partial: bool = False) -> list[str]:
    """What differs between two searches' trials (ids, hyperparameters, statuses, scores within `tolerance`).

    `partial`: `result` is a shorter RandomSearch of the same seed (its trial k is the reference's trial k):
    only its trials are compared, not the best.
    """
    problems = []
    wanted = {k: v for k, v in reference["trials"].items() if not partial or k in result["trials"]}
    if set(result["trials"]) != set(wanted):
        return [f"trial ids {sorted(result['trials'])} != {sorted(wanted)}"]
    for trial_id, (values, score, status) in sorted(wanted.items()):
        got_values, got_score, got_status = result["trials"][trial_id]
        if got_values != values or got_status != status:
            problems.append(f"trial {trial_id}: {got_values} {got_status} != {values} {status}")
        elif (score is None) != (got_score is None) or (score is not None and abs(got_score - score) > tolerance):
            problems.append(f"trial {trial_id}: score {got_score} != {score}")
    if not partial and result["best"] != reference["best"]:
        problems.append(f"best {result['best']} != {reference['best']}")
    return problems


def overhead(result: dict) -> float:
    """What a trial cost this tuner beyond its own `fit`, on average: the search's wall time on this tuner less
    its trials' `fit` times, per trial (the lease, the build, the store, the reports, the start gate's wait)."""
    fits = [t["fit"] for t in result["timings"].values() if "fit" in t]
    return (result["seconds"] - sum(fits)) / max(len(fits), 1)


def reference(store: str, kinds: tuple[str, ...] = KINDS) -> dict:
    """Each search of `kinds` as one process (in a child: this process may not import TensorFlow)."""
    from procs import describe, run_process

    result = run_process(os.path.abspath(__file__), args=[store, *kinds], timeout=900,
                         env={"STRATKIT_CLUSTER_ENV": "none"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, describe([result])
    return json.loads(lines[-1][len("RESULT "):])


def shared_reference(tmp_path_factory) -> dict:
    """`reference()` once per test session, shared by the modules that compare with it (the Spark, Slurm and
    launch searches), across pytest-xdist workers too: the first to ask runs it, the others wait for its file."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = base.parent if run else base
    path = root / f"engine-search-reference-{run or 'local'}.json"
    with open(root / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (here, or when this process dies)
        if not path.exists():
            store = root / f"engine-search-reference-{run or 'local'}"
            store.mkdir(exist_ok=True)
            result = reference(str(store))
            path.write_text(json.dumps(result))
        return json.loads(path.read_text())


if __name__ == "__main__":  # python engine_searches.py STORE KIND... [--tracking MODE] [--trials N]: a process
    argv = sys.argv[2:]
    options = {"tracking": argv[argv.index("--tracking") + 1]} if "--tracking" in argv else {}
    trials = int(argv[argv.index("--trials") + 1]) if "--trials" in argv else 8
    out = seeded_searches(sys.argv[1], tuple(arg for arg in argv if arg in KINDS), tune_options=options,
                          trials=trials)
    print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
