"""`RayRunner(num_workers=2, min_workers=1)` goes on after a real node loss on a two-node Ray cluster.

The cluster is tests/ray/test_ray_hosts.py's (a head on test host h1, a second node on h2, token
authentication), made for this test alone since it takes h2 away. The driver
(`ray_node_loss_driver.py`, on h1) runs a small `stratkit.Trainer` job with `backup_dir` on the file system
both hosts share, one worker per node (STRICT_SPREAD). Mid-epoch 2, h2 is lost the way a machine that loses
power is: its cable is pulled first (from then on nothing it sends arrives, and nothing answers for it: no
connection reset, no ICMP), then every process on it is killed. Nobody tells the survivors; they learn it
from timeouts, as Ray does from its health check.

The run must go on with the one worker left, from the last backup, to the end, and its weights must equal
one uninterrupted process's (the same global batch at either world size). The evidence is what the run
writes: every training process logs each step it trains (the optimizer's global step, its replicas, the
time), and the runner's report and log lines.

Step backups: the driver runs `Trainer.fit(backup_every=5)` (`ray_node_loss_driver.BACKUP_EVERY`), so the
assertions check that the retry resumed at the last step backup before the loss (step 15, 3 steps trained
again), not at the epoch's start.

Ray runs with its default health check: it judges the silent node dead about 5 x (10 s + 3 s) = 65 s after
the loss, well after the survivor has failed (TensorFlow's coordination heartbeat), so the runner's wait for
Ray's verdict before it counts the nodes is on the path.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import time

import pytest

from procs import REPO_ROOT
from ray_helpers import Lines, hosts_env, needs_ray, ray_on_hosts

import ray_node_loss_driver as job  # the job's constants: steps per epoch, per backup

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.ray, needs_ray]

DRIVER = REPO_ROOT / "tests" / "ray" / "ray_node_loss_driver.py"
#: The global step after which h2 is lost (the first attempt holds there until it is): mid-epoch 2, so the
#: retry trains again what came after the last backup.
LOSE_AT_STEP = job.STEPS_PER_EPOCH + job.STEPS_PER_EPOCH // 2


def read_steps(work) -> list[dict]:
    """Every step every training process logged, in time order."""
    steps = []
    for path in glob.glob(str(work / "steps" / "*.jsonl")):
        with open(path) as handle:
            steps += [json.loads(line) for line in handle if line.strip()]
    return sorted(steps, key=lambda s: s["t"])


def test_a_node_lost_mid_epoch_the_run_goes_on_with_one_worker_from_the_last_backup(two_hosts, tmp_path):
    h1, h2 = two_hosts
    env = hosts_env()
    work = tmp_path / "work"  # the test hosts share this machine's file system: both read and write it
    work.mkdir()
    started = time.monotonic()
    with ray_on_hosts(h1, h2, env) as address:
        driver = h1.popen([sys.executable, str(DRIVER), address, str(work), str(LOSE_AT_STEP)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                          start_new_session=True)
        lines = Lines(driver)
        deadline = time.monotonic() + 600
        lines.until(lambda line: line.startswith(f"[worker:0] STEP {LOSE_AT_STEP} "), deadline)
        h2.unplug()              # silent from now on ...
        h2.kill_all(rounds=20)   # ... and nothing is left running on it
        lost_at = time.time()
        with open(work / "lost", "w"):  # the survivor goes on to step LOSE_AT_STEP + 1 and finds its peer gone
            pass
        run = lines.until(lambda line: line.startswith(("RUN ", "FAILED ")), deadline)
        assert run.startswith("RUN "), lines.tail()
        run = json.loads(run[len("RUN "):])
        single = json.loads(lines.until(lambda line: line.startswith("SINGLE "), deadline)[len("SINGLE "):])
        assert driver.wait(timeout=60) == 0, lines.tail()
    took = time.monotonic() - started
    log = "\n".join(lines.seen)
    got, report = run["got"], run["report"]

    # The retry ran with the one worker the live node fits, on h1, and it is what run() returned.
    assert report["attempts"] == 2 and report["workers"] == [2, 1], (report, log[-6000:])
    assert report["tasks"] == ["worker:0"] and report["nodes"] == {"worker:0": "198.18.0.1"}, report
    assert got["replicas"] == 1 and got["host"] == "h1" and got["steps"] == job.EPOCHS * job.STEPS_PER_EPOCH
    assert "was lost with node 198.18.0.2" in log and "198.18.0.2 dead" in log, log[-6000:]
    assert "world size 2 -> 1" in log, log[-6000:]

    # What the training processes logged: attempt 1 trained on 2 replicas up to the loss, the retry on 1.
    steps = read_steps(work)
    before = [s for s in steps if s["replicas"] == 2]
    retry = [s for s in steps if s["replicas"] == 1]
    assert {s["host"] for s in before} == {"h1", "h2"} and {s["host"] for s in retry} == {"h1"}
    last_before = max(s["step"] for s in before)
    assert last_before == LOSE_AT_STEP and all(s["t"] > lost_at for s in retry), (last_before, lost_at)
    trained = [s["step"] for s in retry]
    resumed_at = trained[0] - 1  # global steps already done when the retry started: where it resumed
    assert trained == list(range(resumed_at + 1, job.EPOCHS * job.STEPS_PER_EPOCH + 1)), trained
    # It resumed at the last step backup written before the loss (every `STEPS_PER_BACKUP` = BACKUP_EVERY steps).
    assert resumed_at == LOSE_AT_STEP // job.STEPS_PER_BACKUP * job.STEPS_PER_BACKUP, (resumed_at, last_before)
    assert "resumed from" in log, log[-6000:]
    first_step_after = retry[0]["t"] - lost_at

    # The global batch stayed 8 at either world size, and the retry read the data from the backup's epoch on as
    # an uninterrupted run does: the weights equal one process that trained all the epochs without a stop.
    worst = max(abs(a - b) for a, b in zip(got["weights"], single["weights"]))
    assert len(got["weights"]) == len(single["weights"]) and worst <= 1e-5, worst

    # Seconds from the loss to what the driver printed (read by this test, so a little late) and to the step.
    after = {what: round(lines.when(text) - lost_at, 1) for what, text in [
        ("attempt_failed", "attempt 1 of 3 failed"), ("ray_verdict", "Ray's verdict after"),
        ("retry_placed", "attempt 2, 1 task(s)")]}
    print("NODE LOSS " + json.dumps({
        "lost_after_step": last_before, "resumed_at_step": resumed_at, "retrained_steps": last_before - resumed_at,
        "steps_per_backup": job.STEPS_PER_BACKUP, "seconds_after_loss": {**after, "retry_first_step":
                                                                           round(first_step_after, 1)},
        "max_weight_diff": worst, "test_s": round(took, 1),
        "runner": [line for line in lines.seen if line.startswith("[stratkit]") and "epoch" not in line],
        "unhandled": [line for line in lines.seen if "Unhandled" in line]}),
          flush=True)
    assert first_step_after < 300, f"the retry's first step came {first_step_after:.0f} s after the loss"
