"""A hyperparameter search on a real local Ray with 2 workers: `RayRunner(tune=True)`.

Issue 51's acceptance on Ray: a seeded KerasTuner RandomSearch of 8 trials and a Hyperband search on 2 Ray
workers try the same trials and get the same scores as the one-process search (within 1e-5); a tuner's actor
killed mid-trial is a lease that expires (its trial runs again on the other tuner, the search ends as one
process); more tuners than the cluster has room for is a ConfigError before anything is placed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import engine_searches
import pytest

from ray_helpers import local_ray, needs_ray
from stratkit.errors import ConfigError
from stratkit.ray.runner import RayRunner

pytestmark = [pytest.mark.slow, pytest.mark.tune_acceptance, pytest.mark.timeout(1800), pytest.mark.ray, needs_ray]


@pytest.fixture(scope="module")
def ray_session():
    import cloudpickle

    with local_ray(num_cpus=2) as ray:
        import ray.cloudpickle

        for pickler in (cloudpickle, ray.cloudpickle):
            for module in (sys.modules[__name__], engine_searches):
                pickler.register_pickle_by_value(module)
        yield ray
        for pickler in (cloudpickle, ray.cloudpickle):
            for module in (sys.modules[__name__], engine_searches):
                pickler.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return engine_searches.shared_reference(tmp_path_factory)


def test_a_seeded_random_search_and_hyperband_on_two_ray_workers_equal_the_one_process_search(ray_session, reference,
                                                                                             tmp_path, capsys):
    runner = RayRunner(num_workers=2, tune=True, timeout=900)
    started = time.monotonic()
    result = runner.run(engine_searches.seeded_searches, str(tmp_path))  # both searches, one after the other
    seconds = time.monotonic() - started
    out = capsys.readouterr().out
    for kind in engine_searches.KINDS:
        assert engine_searches.compare(result[kind], reference[kind]) == [], (kind, out[-6000:])
    assert {line.split(" TUNER ")[1].split()[0] for line in out.splitlines() if " TUNER " in line} == {"0", "1"}
    assert runner.last_run.lost == [] and set(runner.last_run.exit_codes.values()) == {0}
    with capsys.disabled():
        print(f"\nray 2 tuners: {seconds:.1f} s for both searches (one process: "
              f"{sum(reference[k]['seconds'] for k in engine_searches.KINDS):.1f} s); a trial's cost beyond its fit "
              f"on tuner 0: random {engine_searches.overhead(result['random']):.2f} s, hyperband "
              f"{engine_searches.overhead(result['hyperband']):.2f} s")


def test_a_tuner_whose_actor_dies_mid_trial_is_a_lost_lease_and_the_search_ends_as_one_process(
        ray_session, reference, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("STRATKIT_TUNE_LEASE_SECONDS", "6")
    runner = RayRunner(num_workers=2, tune=True, timeout=900)
    killed: list[str] = []

    def kill_tuner_1_at_its_second_epoch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            report = runner.last_run
            text = capfd.readouterr().out
            for line in text.splitlines():
                if " EPOCH 1 TUNER 1 " in line and report is not None and "tuner:1" in report.actor_pids:
                    os.kill(report.actor_pids["tuner:1"], signal.SIGKILL)  # the actor, and its process with it
                    killed.append(line)
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_tuner_1_at_its_second_epoch, daemon=True)
    killer.start()
    result = runner.run(engine_searches.seeded_search, "random", str(tmp_path), slow=0.5)
    killer.join(timeout=5)
    assert killed, "tuner 1 never reached a second epoch"
    assert runner.last_run.lost == ["tuner:1"], runner.last_run
    assert engine_searches.compare(result, reference["random"]) == []


def test_more_tuners_than_the_ray_cluster_has_cpus_for_are_refused_before_anything_is_placed(ray_session):
    with pytest.raises(ConfigError, match="a search of 3 tuners with cpus_per_worker=1 needs 3 CPU"):
        RayRunner(num_workers=3, tune=True).run(engine_searches.seeded_search, "random", "/nonexistent")
