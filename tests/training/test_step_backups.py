"""Lose seconds, not an epoch (issue #40's acceptance): step backups, preemption notices and exact resume.

Every run is a real process (`checkpoint_script.py`): 160 rows, global batch 16 (epochs of 10 steps),
`backup_every=7`, EarlyStopping + ReduceLROnPlateau + ModelCheckpoint(save_best_only) + CSVLogger. One
uninterrupted process is the reference every interrupted run must equal: weights and the whole history
within 1e-5, the same stopping epoch and learning rates, the same best file. Re-trained steps are counted
from the steps the runs logged after training them (`steps-<rank>.log`), not assumed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from procs import child_env, describe, free_ports, run_cluster, run_process, worker_tf_configs

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("checkpoint_script.py"))
TOLERANCE = 1e-5


def _run(out: Path, env: dict, strategy: str = "one_device", attempt: int = 0):
    out.mkdir(parents=True, exist_ok=True)
    extra = {"LOGICAL_CPUS": "2"} if strategy == "mirrored" else {}
    return run_process(SCRIPT, env={"OUT": str(out), "BACKUP_DIR": str(out / "backup"), "STRATEGY": strategy,
                                    "ATTEMPT": str(attempt), **extra, **env}, timeout=300)


def _launch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratkit.cli", "launch", *args, "--", sys.executable, SCRIPT]


def _launch_env(out: Path, env: dict) -> dict:
    clean = {k: None for k in os.environ if k.startswith(("STRATKIT_", "SLURM_")) or k == "TF_CONFIG"}
    return child_env(None, {**clean, "OUT": str(out), "BACKUP_DIR": str(out / "backup"), **env})


def _result(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"result-{rank}.json").read_text())


def _best(path: Path) -> list[np.ndarray]:
    import h5py

    with h5py.File(path, "r") as handle:
        found: list[tuple[str, np.ndarray]] = []
        handle.visititems(lambda name, obj: found.append((name, obj[()])) if isinstance(obj, h5py.Dataset) else None)
    return [value for _, value in sorted(found)]


def _retrained(out: Path, rank: int = 0) -> list[int]:
    """Steps trained by the first attempt and trained again by a later one (from the run's own log)."""
    lines = [tuple(map(int, line.split())) for line in (out / f"steps-{rank}.log").read_text().splitlines()]
    first = {step for attempt, step in lines if attempt == 0}
    return sorted(step for attempt, step in lines if attempt > 0 and step in first)


def _assert_equals_reference(out: Path, reference: Path, ranks=(0,)) -> None:
    want = _result(reference)
    for rank in ranks:
        got = _result(out, rank)
        for a, b in zip(got["weights"], want["weights"]):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=TOLERANCE, rtol=0)
        assert got["epochs"] == want["epochs"], (got["epochs"], want["epochs"])  # the whole history, every epoch
        assert got["stopped_epoch"] == want["stopped_epoch"] > 0  # EarlyStopping stopped, at the same epoch
        assert set(got["history"]) == set(want["history"])
        for key, values in want["history"].items():
            np.testing.assert_allclose(got["history"][key], values, atol=TOLERANCE, rtol=0, err_msg=key)
    assert len(set(want["history"]["learning_rate"])) > 1  # ReduceLROnPlateau acted (the test is not vacuous)
    for a, b in zip(_best(out / "best.weights.h5"), _best(reference / "best.weights.h5")):
        np.testing.assert_allclose(a, b, atol=TOLERANCE, rtol=0)
    rows = (out / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(e) for e in want["epochs"]]  # no row repeated


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted process: what every interrupted run below must equal."""
    out = tmp_path_factory.mktemp("reference")
    result = _run(out, {})
    assert result.ok, describe([result])
    assert not (out / "backup").exists()  # a finished run removes its backups
    return out


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.parametrize("how", ["KILL", "TERM"])
def test_one_process_stopped_at_step_23_resumes_as_if_never_stopped(tmp_path, reference, strategy, how):
    first = _run(tmp_path, {"KILL_AT": "23", "KILL_SIGNAL": how}, strategy)
    if how == "KILL":
        assert first.returncode == -signal.SIGKILL, describe([first])
        assert json.loads((tmp_path / "backup" / "checkpoint.json").read_text())["step"] == 1  # step 21
    else:  # a preemption notice: the backup at the next step boundary, then exit status 75
        assert first.returncode == 75, describe([first])
        assert "preempted: preemption notice: SIGTERM" in first.stderr and "global step 24" in first.stderr
    second = _run(tmp_path, {}, strategy, attempt=1)
    assert second.ok, describe([second])
    assert len(_retrained(tmp_path)) <= (2 if how == "KILL" else 1), _retrained(tmp_path)
    _assert_equals_reference(tmp_path, reference)


@pytest.mark.multiworker
def test_two_launched_workers_one_sigkilled_at_step_23_retrain_at_most_2_steps(tmp_path, reference):
    launch = subprocess.run(_launch_argv("--workers", "2", "--max-restarts", "1", "--stop-grace", "5"),
                            env=_launch_env(tmp_path, {"KILL_AT": "23", "KILL_RANK": "1", "KILL_SIGNAL": "KILL"}),
                            capture_output=True, text=True, timeout=600)
    assert launch.returncode == 0, launch.stderr[-5000:]
    assert "worker:1 killed by SIGKILL" in launch.stderr
    assert "resumed from" in launch.stdout and "at epoch 2 + 1 steps" in launch.stdout  # step 21 = 7 x 3
    for rank in (0, 1):
        assert _retrained(tmp_path, rank) == [21, 22]
    _assert_equals_reference(tmp_path, reference, ranks=(0, 1))


@pytest.mark.multiworker
def test_two_launched_workers_one_sigtermed_all_save_exit_75_and_resume(tmp_path, reference):
    # --max-restarts 0: the restart after a preemption is not counted; the SIGKILL 5 s after the SIGTERM (the
    # platform's deadline) must find no process of the first attempt alive.
    logs = tmp_path / "logs"
    launch = subprocess.run(_launch_argv("--workers", "2", "--max-restarts", "0", "--log-dir", str(logs)),
                            env=_launch_env(tmp_path, {"KILL_AT": "23", "KILL_RANK": "1", "KILL_SIGNAL": "TERM"}),
                            capture_output=True, text=True, timeout=600)
    assert launch.returncode == 0, launch.stderr[-5000:]
    assert "not counted against --max-restarts" in launch.stderr
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    first = [e for e in events if e["event"] in ("exit", "stopped") and e["attempt"] == 0]
    assert sorted(e["returncode"] for e in first) == [75, 75], first  # both saved and exited, none was killed
    sent = json.loads((tmp_path / "signal-1.json").read_text())["time"]
    assert max(e["time"] for e in first) - sent < 5.0, (first, sent)  # inside the grace period
    for rank, noticed in ((1, "preemption notice: SIGTERM"), (0, "reached another worker")):
        assert noticed in launch.stdout + launch.stderr
    for rank in (0, 1):
        assert _retrained(tmp_path, rank) == []  # stopped after step 23, resumed at 24: nothing trained twice
    _assert_equals_reference(tmp_path, reference, ranks=(0, 1))


@pytest.mark.multiworker
def test_sigterm_to_the_launcher_saves_every_worker_and_exits_75(tmp_path, reference):
    """A pod's SIGTERM (Kubernetes) reaches the launcher: the tasks save at one step, the launcher exits 75."""
    env = _launch_env(tmp_path, {})
    launcher = subprocess.Popen(_launch_argv("--workers", "2", "--max-restarts", "3"), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = tmp_path / "steps-0.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and launcher.poll() is None:
        if steps.exists() and len(steps.read_text().splitlines()) >= 15:
            break
        time.sleep(0.05)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    gone = time.monotonic() - sent
    assert launcher.returncode == 75, err[-5000:]
    assert "every task stopped at the same step, wrote its backup and exited 75" in err
    assert gone < 10, gone  # well inside Kubernetes' default 30 s grace period
    assert err.count("attempt 1 of 4: worker:") == 2 and "attempt 2" not in err  # no restart
    resumed = subprocess.run(_launch_argv("--workers", "2"), env={**env, "ATTEMPT": "1"}, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert len(_retrained(tmp_path)) <= 1
    _assert_equals_reference(tmp_path, reference, ranks=(0, 1))


@pytest.mark.multiworker
def test_a_two_worker_step_backup_resumes_on_one_process_at_the_same_global_batch(tmp_path, reference):
    """Elastic: the position is global (epoch, step of the global batch), so another world size continues it.
    The 2 workers are a TF_CONFIG cluster forked from the fork servers (tests/procs.py): what a launcher does when
    a task dies is the tests above (and tests/launch/test_launch.py's exit status 137); the 2 TensorFlow imports
    of a launch cost ~7 CPU-s quiet."""
    clean = {k: None for k in os.environ if k.startswith(("STRATKIT_", "SLURM_")) and k != "STRATKIT_TEST_IMPORT_LOG"}
    killed = run_cluster(SCRIPT, worker_tf_configs(free_ports(2)), timeout=600, grace_after_failure=10,
                         env={**clean, "OUT": str(tmp_path), "BACKUP_DIR": str(tmp_path / "backup"), "KILL_AT": "23",
                              "KILL_RANK": "1", "KILL_SIGNAL": "KILL"})
    assert killed[1].returncode == -signal.SIGKILL and not killed[1].killed, describe(killed)
    alone = _run(tmp_path, {}, attempt=1)  # the chief's backup in backup_dir, one process now
    assert alone.ok, describe([alone])
    assert "world size 2 -> 1" in alone.stderr and "the global batch is kept" in alone.stderr
    assert _retrained(tmp_path) == [21, 22]
    _assert_equals_reference(tmp_path, reference)
