"""The search service's planner never draws from the process's global random generators.

Under `stratkit launch --tune` the service runs in the chief tuner's process, in a thread of its own, and answers
the other tuners while the chief trains. The chief seeds each trial (`keras.utils.set_random_seed`) and then builds
its model; Keras draws a Dropout's default seed from Python's global `random`. A draw in the service's thread in
between gave that trial other weights: a Hyperband trial scored 5.16 on 2 tuners against 4.90 in one process, once,
under load. KerasTuner's `Trial.from_state` was that draw (it generates a throwaway id with `random.randint`).

Here a real Hyperband oracle runs a whole search through `KerasTunerPlanner`, as the service drives it for a
tuner (propose, per-epoch reports, ends, a lost trial given up, every query, the stored state and its restore), and
each call must leave Python's and NumPy's global generators as they were.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

keras_tuner = pytest.importorskip("keras_tuner")

from stratkit.tuning.kt_oracle import KerasTunerPlanner, trial_from_state  # noqa: E402
from stratkit.tuning.planner import DONE, WAIT, Proposal  # noqa: E402


def _generators() -> tuple:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return random.getstate(), kind, keys.tobytes(), pos, has_gauss, gauss


class Untouched:
    """Calls a planner method and checks that it drew nothing from the global generators."""

    def __init__(self, planner: KerasTunerPlanner) -> None:
        self.planner = planner
        self.calls = 0

    def __getattr__(self, name: str):
        method = getattr(self.planner, name)

        def call(*args, **kwargs):
            random.seed(12345)
            np.random.seed(6789)
            before = _generators()
            result = method(*args, **kwargs)
            assert _generators() == before, f"KerasTunerPlanner.{name} drew from the global random generators"
            self.calls += 1
            return result

        return call


def _hyperband(directory) -> KerasTunerPlanner:
    hp = keras_tuner.HyperParameters()
    hp.Float("lr", 1e-3, 1e-1, sampling="log")
    hp.Int("units", 4, 32)
    hp.Float("drop", 0.0, 0.5)
    oracle = keras_tuner.oracles.HyperbandOracle(objective="val_loss", max_epochs=3, factor=3, seed=1,
                                                 hyperparameters=hp)
    oracle._set_project_dir(str(directory), "search")
    return KerasTunerPlanner(oracle)


def _ended(payload: dict, score: float) -> dict:
    trial = trial_from_state(payload["trial"])
    trial.status = "COMPLETED"
    trial.score, trial.best_step = score, 0
    trial.metrics.update("val_loss", score, step=0)
    return {"trial": trial.get_state()}


def test_a_whole_hyperband_search_draws_nothing_from_the_global_generators(tmp_path):
    planner = Untouched(_hyperband(tmp_path))
    running: list[Proposal] = []
    ended, given_up = [], []
    while True:
        proposal = planner.propose()
        if proposal is DONE:
            break
        if proposal is WAIT:  # a round waits for the last one's results: end the oldest trial running
            assert running, "the planner waits while nothing runs"
        else:
            running.append(proposal)
            if len(running) < 2:
                continue
        trial = running.pop(0)
        planner.report(trial.trial_id, {"metrics": {"val_loss": 1.0 / (1 + len(ended))}, "step": 0})
        if len(ended) == 1 and not given_up:  # its tuner was lost: the service gives the trial up
            planner.give_up(trial.trial_id, "its tuner was lost")
            given_up.append(trial.trial_id)
        else:
            planner.finish(trial.trial_id, _ended(trial.payload, 1.0 / (1 + len(ended))))
            ended.append(trial.trial_id)
        for name, args in (("trial", {"trial_id": trial.trial_id}), ("best", {"num_trials": 2}), ("trials", {}),
                           ("space", {}), ("remaining", {})):
            planner.query(name, args)
    assert len(ended) >= 4 and given_up
    stored = planner.state()
    again = Untouched(_hyperband(tmp_path / "restarted"))
    again.restore(stored)
    assert again.planner.oracle.trials.keys() == planner.planner.oracle.trials.keys()
    assert again.query("best", {"num_trials": 1})[0]["trial_id"] == planner.query("best", {"num_trials": 1})[0][
        "trial_id"]


def test_a_trial_from_its_state_is_the_same_trial():
    hp = keras_tuner.HyperParameters()
    hp.Float("lr", 1e-3, 1e-1)
    original = keras_tuner.engine.trial.Trial(hp, trial_id="0007", status="COMPLETED")
    original.score, original.best_step = 0.25, 3
    state = original.get_state()
    random.seed(1)
    before = random.getstate()
    copy = trial_from_state(state)
    assert random.getstate() == before
    assert copy.get_state() == state
