"""Ray and a preemption notice: a worker's training process gets SIGTERM mid-epoch, every worker stops at one
step, saves and exits 75, and the retry resumes at that step: `RayRunner` (a retry not counted against
max_retries) and Ray Train (`RayReportCallback` reports the preemption backup as Ray's checkpoint; Ray's
restart resumes from it). A SIGKILL instead is a failure, retried from the last step backup. Every run ends
equal to one uninterrupted process.

One local Ray for the module (`ray_helpers.local_ray`), the training of tests/training/checkpoint_script.py
(tests/engine_preemption.py says how it is driven).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

import engine_preemption as ep
from engine_preemption import train_script
from ray_helpers import local_ray, needs_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.multiworker, needs_ray]


@pytest.fixture(scope="module")
def ray_session():
    import cloudpickle

    with local_ray() as ray:
        import ray.cloudpickle

        for pickler in (cloudpickle, ray.cloudpickle):
            for module in (sys.modules[__name__], ep):
                pickler.register_pickle_by_value(module)
        yield ray
        for pickler in (cloudpickle, ray.cloudpickle):
            for module in (sys.modules[__name__], ep):
                pickler.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return ep.reference(tmp_path_factory.mktemp("reference"))


def _runner(tmp_path, how, max_retries):
    from stratkit.ray.runner import RayRunner

    out = tmp_path / "out"
    out.mkdir()
    signaller = ep.Signaller(out, ep.SIGNALS[how])
    runner = RayRunner(num_workers=2, max_retries=max_retries, timeout=600)
    started = time.monotonic()
    result = runner.run(ep.train_script, ep.SCRIPT, str(out), ep.script_env(out))
    seconds = time.monotonic() - started
    signaller.join()
    report = ep.resume_report(out, signaller.sent_at)
    print(f"RayRunner {how}: {report}, run {seconds:.1f} s, attempts {runner.last_run.attempts}")
    return out, result, runner, report


def test_ray_runner_a_preempted_worker_saves_at_one_step_and_the_uncounted_retry_resumes_there(
        ray_session, tmp_path, reference, capsys):
    out, result, runner, report = _runner(tmp_path, "TERM", max_retries=0)
    log = "".join(capsys.readouterr())
    with capsys.disabled():
        print(f"\n{runner.last_run.attempts} attempts: {report}")
    assert runner.last_run.attempts == 2 and runner.last_run.preempted == 1, log[-4000:]
    assert "attempt 1 was preempted (task worker:" in log and "it stopped on a preemption notice" in log, log[-4000:]
    assert "not counted against max_retries" in log
    assert "[worker:1] [stratkit] warning: preempted: preemption notice: SIGTERM" in log, log[-4000:]
    assert "[worker:0] [stratkit] warning: preempted: a preemption notice reached another worker" in log
    assert log.count(f"global step {report['resumed_at']})") == 2 and report["resumed_at"] > ep.KILL_AT, report
    for rank in (0, 1):
        assert ep.retrained(out, rank) == [], (rank, ep.retrained(out, rank))
    assert report["resumed_at"] == report["last_step_before"] + 1, report
    ep.assert_equals_reference(result, out, reference)


def test_ray_runner_a_sigkilled_worker_is_a_failure_retried_from_the_last_step_backup(ray_session, tmp_path,
                                                                                      reference, capsys):
    out, result, runner, report = _runner(tmp_path, "KILL", max_retries=1)
    log = "".join(capsys.readouterr())
    with capsys.disabled():
        print(f"\n{runner.last_run.attempts} attempts: {report}")
    assert runner.last_run.attempts == 2 and runner.last_run.preempted == 0, log[-4000:]
    assert "attempt 1 of 2 failed (task worker:1 (rank 1) failed with exit code -9" in log, log[-4000:]
    assert report["resumed_at"] == 21 and ep.retrained(out, 1) == [21, 22], report
    ep.assert_equals_reference(result, out, reference)


def ray_train_loop(config):
    from stratkit.ray import RayReportCallback

    report = RayReportCallback()
    env = dict(config["env"], BACKUP_DIR=report.backup_dir)
    train_script(config["script"], config["out"], env, extra_callbacks=[report])


def test_ray_train_a_preempted_worker_reports_its_backup_and_ray_resumes_at_that_step(ray_session, tmp_path,
                                                                                      reference):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    out = tmp_path / "out"
    out.mkdir()
    signaller = ep.Signaller(out, ep.SIGNALS["TERM"])
    trainer = TensorflowTrainer(ray_train_loop,
                                train_loop_config={"script": ep.SCRIPT, "out": str(out), "env": ep.script_env(out)},
                                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                                run_config=RunConfig(name="preempted", storage_path=str(tmp_path / "ray-results"),
                                                     failure_config=FailureConfig(max_failures=1)))
    started = time.monotonic()
    result = trainer.fit()
    seconds = time.monotonic() - started
    signaller.join()
    assert result.error is None, result.error
    report = ep.resume_report(out, signaller.sent_at)
    print(f"Ray Train TERM: {report}, run {seconds:.1f} s")
    # Ray's restart resumed at the step of the preemption backup: nothing trained twice.
    assert report["resumed_at"] > ep.KILL_AT and report["resumed_at"] == report["last_step_before"] + 1, report
    for rank in (0, 1):
        assert ep.retrained(out, rank) == [], (rank, ep.retrained(out, rank))
    ep.assert_equals_reference(json.loads((out / "result-0.json").read_text()), out, reference)
