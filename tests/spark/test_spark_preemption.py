"""`SparkRunner` and a preemption notice: a worker's training process gets SIGTERM mid-epoch, every worker stops
at one step, saves and exits 75, and the retry (not counted against max_retries) resumes at that step; a
SIGKILL instead is a failure, retried from the last step backup. Both end equal to one uninterrupted process.

A real 2-executor Spark (local-cluster[2,1,1024], the session tests/spark/test_spark_runner.py uses), the
training of tests/training/checkpoint_script.py (tests/engine_preemption.py says how it is driven).
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
from spark_helpers import shared_session

import engine_preemption as ep
from stratkit.spark import SparkRunner, SparkTrainingError

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.multiworker]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(ep)


@pytest.fixture(scope="module")
def spark():
    return shared_session("local-cluster[2,1,1024]", {"spark.stratkit.stage": "arrow"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return ep.reference(tmp_path_factory.mktemp("reference"))


def _run(tmp_path, how, max_retries, ancestor=None):
    out = tmp_path / "out"
    out.mkdir()
    signaller = ep.Signaller(out, ep.SIGNALS[how], ancestor=ancestor)
    runner = SparkRunner(num_workers=2, max_retries=max_retries, timeout=600)
    started = time.monotonic()
    result = runner.run(ep.train_script, ep.SCRIPT, str(out), ep.script_env(out))
    seconds = time.monotonic() - started
    signaller.join()
    report = ep.resume_report(out, signaller.sent_at)
    print(f"SparkRunner {how}: {report}, run {seconds:.1f} s, attempts {runner.last_run.attempts}")
    return out, result, runner, report


def test_a_preempted_worker_saves_at_one_step_and_the_uncounted_retry_resumes_there(spark, tmp_path, reference,
                                                                                     capsys):
    # max_retries=0: a preemption is not a failure, so the retry happens anyway.
    out, result, runner, report = _run(tmp_path, "TERM", max_retries=0)
    log = "".join(capsys.readouterr())
    with capsys.disabled():
        print(f"\n{runner.last_run.attempts} attempts: {report}")
    assert runner.last_run.attempts == 2 and runner.last_run.preempted == 1, log[-4000:]
    assert "attempt 1 was preempted (task worker:" in log, log[-4000:]
    assert "was preempted: it stopped on a preemption notice" in log
    assert "not counted against max_retries" in log
    # Both workers stopped at one step after the signal, each with its backup; the retry resumed right there.
    assert "[worker:1] [stratkit] warning: preempted: preemption notice: SIGTERM" in log, log[-4000:]
    assert "[worker:0] [stratkit] warning: preempted: a preemption notice reached another worker" in log
    stopped = f"global step {report['resumed_at']})"
    assert log.count(stopped) == 2 and report["resumed_at"] > ep.KILL_AT, (report, log[-4000:])
    for rank in (0, 1):
        assert ep.retrained(out, rank) == [], (rank, ep.retrained(out, rank))
    assert report["resumed_at"] == report["last_step_before"] + 1, report
    ep.assert_equals_reference(result, out, reference)


def test_a_sigkilled_worker_is_a_failure_retried_from_the_last_step_backup(spark, tmp_path, reference, capsys):
    out, result, runner, report = _run(tmp_path, "KILL", max_retries=1)
    log = "".join(capsys.readouterr())
    with capsys.disabled():
        print(f"\n{runner.last_run.attempts} attempts: {report}")
    assert runner.last_run.attempts == 2 and runner.last_run.preempted == 0, log[-4000:]
    assert "attempt 1 of 2 failed (task worker:1 (rank 1) failed with exit code -9" in log, log[-4000:]
    # Resumed at the step backup of step 21: steps 21 and 22 trained again (at most backup_every).
    assert report["resumed_at"] == 21 and ep.retrained(out, 1) == [21, 22], report
    ep.assert_equals_reference(result, out, reference)



def test_sigterm_to_an_executor_reaches_its_training_process_which_saves_and_the_retry_resumes_there(
        spark, tmp_path, reference, capsys):
    # A node drained, a pod deleted: the executor's JVM gets SIGTERM; its shutdown stops Spark's Python daemon,
    # which sends its workers SIGHUP; the task passes it on. Spark relaunches the executor for the retry.
    out, result, runner, report = _run(tmp_path, "TERM", max_retries=0, ancestor="java")
    log = "".join(capsys.readouterr())
    with capsys.disabled():
        print(f"\nexecutor SIGTERM, {runner.last_run.attempts} attempts: {report}")
    assert runner.last_run.attempts == 2 and runner.last_run.preempted == 1, log[-4000:]
    assert "[worker:1] [stratkit] worker:1: this task's Python worker got SIGHUP: passed on to its training process" \
        in log, log[-4000:]
    assert log.count(f"global step {report['resumed_at']})") == 2, (report, log[-4000:])
    for rank in (0, 1):
        assert ep.retrained(out, rank) == [], (rank, ep.retrained(out, rank))
    assert report["resumed_at"] == report["last_step_before"] + 1, report
    ep.assert_equals_reference(result, out, reference)
