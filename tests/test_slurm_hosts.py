"""stratkit under a real Slurm: slurmctld and two slurmd on test hosts h1 and h2 (tests/hosts.py,
tests/slurm_cluster.py), jobs started with srun and sbatch as a user would.

One cluster for the module (it starts in about a second), checked to answer from every host before each test
(tests/slurm_cluster.py: a daemon that does not is named, with why); each test submits its own job.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hosts
import slurm_cluster
from procs import REPO_ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.hosts]

PARITY = REPO_ROOT / "tests" / "strategy" / "parity_cases.py"
SRUN = ["srun", "-N2", "--ntasks-per-node=1"]
#: What a user's shell has: no quieting from the test suite, no hidden GPUs.
USER_ENV = {"TF_CPP_MIN_LOG_LEVEL": None, "CUDA_VISIBLE_DEVICES": None}
NOISE = ("All log messages before absl::InitializeLog", "cuInit")


@pytest.fixture(scope="module")
def slurm_up(tmp_path_factory):
    hosts.gate()
    hosts.gate(slurm_cluster.unavailable_reason())
    workdir = tmp_path_factory.mktemp("slurm")
    with hosts.make_hosts(2) as made, slurm_cluster.slurm_cluster(made, workdir) as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm_up):
    """The module's cluster (h1 head, h2), handed to a test only while every daemon answers from every host."""
    slurm_up.check()
    return slurm_up


def _env(**extra):
    env = child_env(env=USER_ENV)
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def _results(out: str) -> list[dict]:
    """The RESULT lines parity_cases.py prints, one per task."""
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT ")]


def test_srun_trains_like_one_process_and_quietly(slurm, one_process_uneven):
    step = slurm.run([*SRUN, sys.executable, str(PARITY), "mwms", "trainer_uneven"], timeout=180, env=_env())
    assert step.returncode == 0, step.stdout[-6000:] + slurm.logs()
    workers = _results(step.stdout)
    assert len(workers) == 2, step.stdout[-6000:]
    for worker in workers:
        got, want = worker["trainer_uneven"]["w"], one_process_uneven["w"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)
    # issue 24 item 4: a user's srun output at the default log level has no TensorFlow start-up noise
    noisy = [line for line in step.stdout.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, "\n".join(noisy)


FAILING = """
import os, sys
import stratkit
trainer = stratkit.Trainer()
import keras, numpy as np
if os.environ["SLURM_PROCID"] == "1":
    raise RuntimeError("task 1 failed on purpose")
model = trainer.build(lambda: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
model.compile(optimizer="sgd", loss="mse")
trainer.fit(model, (np.ones((64, 2)), np.ones((64, 1))), epochs=50, global_batch_size=8, verbose=0)
print("task 0 finished training alone", flush=True)
"""


@pytest.mark.parametrize("kill_on_bad_exit", [False, True], ids=["default", "kill-on-bad-exit"])
def test_a_failing_task_ends_the_step_with_its_error(slurm, tmp_path, kill_on_bad_exit):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    flags = ["--kill-on-bad-exit=1"] if kill_on_bad_exit else []
    start = time.monotonic()
    step = slurm.run([*SRUN, *flags, sys.executable, str(script)], timeout=150, env=_env())
    took = time.monotonic() - start
    assert step.returncode != 0, step.stdout[-6000:]
    assert "RuntimeError: task 1 failed on purpose" in step.stdout, step.stdout[-6000:]
    assert "task 0 finished training alone" not in step.stdout
    assert took < 120, f"the step took {took:.0f} s"


def test_example_sbatch_script_runs_on_two_nodes(slurm, tmp_path):
    example = REPO_ROOT / "examples" / "slurm_sbatch.sh"
    (tmp_path / "train.py").write_text(PARITY.read_text())
    (tmp_path / "input_cases.py").write_text(PARITY.with_name("input_cases.py").read_text())  # parity_cases imports it
    # the example as a user copies it, submitted from the directory of train.py, the venv's python first on PATH
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    job = slurm.run(["sbatch", "--wait", f"--output={tmp_path}/job-%j.out", str(example), "mwms", "trainer_uneven"],
                    timeout=180, env=_env(PATH=path), cwd=tmp_path)
    outputs = list(tmp_path.glob("job-*.out"))
    text = outputs[0].read_text(errors="replace") if outputs else ""
    assert job.returncode == 0, job.stdout + text[-6000:] + slurm.logs()
    workers = _results(text)
    assert len(workers) == 2, text[-6000:]
    assert workers[0]["trainer_uneven"]["w"] == workers[1]["trainer_uneven"]["w"]
    assert not re.search("|".join(map(re.escape, NOISE)), text), text[-6000:]


def test_a_dead_controller_is_named_and_teardown_leaves_no_daemons(tmp_path):
    hosts.gate()
    hosts.gate(slurm_cluster.unavailable_reason())
    with hosts.make_hosts(1) as made:
        with pytest.raises(RuntimeError, match="on purpose"):
            with slurm_cluster.slurm_cluster(made, tmp_path / "one") as cluster:
                pids = [d.pid for d in cluster.daemons]
                # a controller that dies after the start (as one did in issue 40: srun then says only
                # "Unable to contact slurm controller") is named by the check, with how it ended
                slurmctld = cluster.daemon("slurmctld").proc
                os.kill(slurmctld.pid, signal.SIGKILL)
                slurmctld.wait(timeout=30)
                with pytest.raises(slurm_cluster.SlurmNotReady) as lost:
                    cluster.check()
                assert "slurmctld on h1" in str(lost.value) and "killed by SIGKILL" in str(lost.value)
                assert "TCP port 6817 in h1's network namespace: nothing listening" in str(lost.value)
                raise RuntimeError("the test failed on purpose")
        assert not made[0].pids() or made[0].pids() == [made[0].holder.pid]
    assert all(not Path(f"/proc/{p}").exists() for p in pids)


SHOW_SHARE = """
import json, os, stratkit
from stratkit.strategy.factory import pin_gpus
pin_gpus(stratkit.detect())
print("SHARE", json.dumps([os.environ["SLURM_PROCID"], os.environ["SLURM_LOCALID"], os.environ["CUDA_VISIBLE_DEVICES"]]))
"""


def test_tasks_sharing_a_nodes_gpus_get_their_slurm_localid_share(slurm):
    # 2 tasks per node, no --gpus-per-task, on nodes that show 4 GPUs (the tests' stand-in inventory)
    step = slurm.run(["srun", "-N2", "--ntasks-per-node=2", "--overcommit", sys.executable, "-c", SHOW_SHARE],
                     timeout=120, env=_env(STRATKIT_FAKE_GPU_COUNT="4"))
    assert step.returncode == 0, step.stdout[-6000:] + slurm.logs()
    shares = sorted(tuple(json.loads(line.split(" ", 1)[1])) for line in step.stdout.splitlines()
                    if line.startswith("SHARE "))
    assert shares == [("0", "0", "0,1"), ("1", "1", "2,3"), ("2", "0", "0,1"), ("3", "1", "2,3")], step.stdout


CHECKPOINT_SCRIPT = REPO_ROOT / "tests" / "training" / "checkpoint_script.py"
#: The user's train.py for examples/slurm_requeue.sh: tests/training/checkpoint_script.py (Trainer.fit with
#: backup_every=7 and EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger; one "attempt step" line per
#: step trained in OUT/steps-<rank>.log), its attempt being Slurm's restart count of the job.
REQUEUE_TRAIN = f"""
import json, os, runpy, sys
os.environ["ATTEMPT"] = os.environ.get("SLURM_RESTART_COUNT", "0")
with open(os.path.join(os.environ["OUT"], "runs.log"), "a") as handle:
    handle.write(json.dumps({{k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID")}})
                 + "\\n")
sys.argv = [{str(CHECKPOINT_SCRIPT)!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
STOPPED = re.compile(r"preempted: preemption notice: SIGUSR1 at .*?; stopped at (epoch \d+(?: \+ \d+ steps)?) ")
RESUMED = re.compile(r"resumed from \S+ at (epoch \d+(?: \+ \d+ steps)?)$", re.MULTILINE)


def _steps(out: Path, rank: int) -> list[tuple[int, int]]:
    """(attempt, global step) of every step rank trained, in order (checkpoint_script.py's log)."""
    path = out / f"steps-{rank}.log"
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def _until(slurm, job: str, output: Path, ready, what: str, timeout: float = 150.0) -> float:
    """Wait until `ready()`; fail at once, with the job's output, if the job ends first. The time it came."""
    deadline = time.monotonic() + timeout
    while not ready():
        record = slurm.job(job)
        if time.monotonic() > deadline or (record or {}).get("JobState") in FINAL:
            text = output.read_text(errors="replace") if output.exists() else "(no output)"
            raise AssertionError(f"waiting for {what}: job {job} is {record}\n{text[-6000:]}\n{slurm.logs()}")
        time.sleep(0.05)
    return time.monotonic()


@pytest.mark.multiworker
def test_a_batch_job_stopped_by_usr1_is_requeued_and_resumes_at_that_step(slurm, tmp_path):
    """Issue 40: `sbatch --requeue --signal=B:USR1@N` (examples/slurm_requeue.sh as a user copies it), 2 tasks
    on 2 nodes. The first notice takes B:'s path (`scancel --batch` sends it as slurmctld does N s before the
    limit: to the batch shell only, which hands it to srun); the second the path of `--signal=USR1@N` without
    B: (every task gets it from its slurmstepd, the shell nothing). Each time every task stops at one step,
    backs up and exits 75, the script requeues the job, and the requeued job (same id, SLURM_RESTART_COUNT 1,
    then 2) resumes at that step: it ends equal to one uninterrupted process."""
    out, reference = tmp_path / "out", tmp_path / "reference"
    out.mkdir()
    reference.mkdir()
    # One uninterrupted process, trained meanwhile: much of the job's time is Slurm's wait before a requeued start
    with open(reference / "output.txt", "wb") as sink:
        uninterrupted = subprocess.Popen([sys.executable, str(CHECKPOINT_SCRIPT)], stdout=sink, stderr=sink,
                                         env=child_env(env={"OUT": str(reference), "STRATEGY": "one_device",
                                                            "BACKUP_DIR": str(reference / "backup")}))
    try:
        job, output, times = _requeued_twice(slurm, tmp_path, out)
        uninterrupted.wait(timeout=300)
    finally:
        uninterrupted.kill()
        uninterrupted.wait()
    assert uninterrupted.returncode == 0, (reference / "output.txt").read_text(errors="replace")[-6000:]
    print("seconds after each notice:", times)

    # One job, three runs: the same job id, Slurm's restart count 0 (unset), 1, 2 on both tasks
    runs = [json.loads(line) for line in (out / "runs.log").read_text().splitlines()]
    assert {r["SLURM_JOB_ID"] for r in runs} == {job}, runs
    assert sorted((r["SLURM_PROCID"], r["SLURM_RESTART_COUNT"] or "0") for r in runs) == [
        (rank, count) for rank in "01" for count in "012"], runs
    # the first notice reached the batch shell (B:), the second only the tasks; each stopped both tasks at one
    # step, and each requeued run resumed at it
    assert output.count("passed to the tasks") == 1, output[-6000:]
    assert output.count(f"requeueing job {job}") == 2, output[-6000:]
    stopped, resumed = STOPPED.findall(output), RESUMED.findall(output)
    assert len(stopped) == 4 and stopped[0] == stopped[1] and stopped[2] == stopped[3], output[-6000:]
    assert resumed == stopped, (resumed, stopped)
    # at most 1 step trained again at each requeue, by either task; every step trained
    for rank in (0, 1):
        steps = _steps(out, rank)
        again = [(a, s) for i, (a, s) in enumerate(steps) if any(b < a and s == t for b, t in steps[:i])]
        assert all(sum(a == n for a, _ in again) <= 1 for n in (1, 2)), again
        assert sorted({s for _, s in steps}) == list(range(max(s for _, s in steps) + 1))

    # equal to one uninterrupted process (weights and the whole history within 1e-5)
    want = json.loads((reference / "result-0.json").read_text())
    for rank in (0, 1):
        got = json.loads((out / f"result-{rank}.json").read_text())
        assert got["epochs"] == want["epochs"] and got["stopped_epoch"] == want["stopped_epoch"] > 0
        for a, b in zip(got["weights"], want["weights"], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=0)
        for key, values in want["history"].items():
            np.testing.assert_allclose(got["history"][key], values, atol=1e-5, rtol=0, err_msg=key)


def _requeued_twice(slurm, workdir: Path, out: Path) -> tuple[str, str, dict[str, float]]:
    """Submit examples/slurm_requeue.sh from `workdir`; USR1 by B:'s path after 8 steps, then by the tasks' path
    after 8 steps of the requeued run. The job id, its output and the seconds from each notice to its requeue and
    to the requeued run's first step."""
    (workdir / "train.py").write_text(REQUEUE_TRAIN)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = _env(PATH=path, OUT=str(out), BACKUP_DIR=str(out / "backup"), STEP_SECONDS="0.1")
    submit = slurm.run(["sbatch", "--parsable", str(REPO_ROOT / "examples" / "slurm_requeue.sh")], timeout=60,
                       env=env, cwd=workdir)
    assert submit.returncode == 0, submit.stdout
    job = submit.stdout.strip()
    output = workdir / f"stratkit-{job}.out"      # the example's --output, appended to by each run
    times = {}
    for attempt, path_flags in ((0, ["--batch"]), (1, [])):
        def trained(run: int, at_least: int) -> bool:
            return sum(a == run for a, _ in _steps(out, 0)) >= at_least

        _until(slurm, job, output, lambda: trained(attempt, 8), f"8 steps of run {attempt}")
        sent_at = time.monotonic()
        sent = slurm.run(["scancel", "--signal=USR1", *path_flags, job], timeout=30)
        assert sent.returncode == 0, sent.stdout
        requeued = _until(slurm, job, output, lambda: (slurm.job(job) or {}).get("Restarts") == str(attempt + 1),
                          f"requeue {attempt + 1}")
        first = _until(slurm, job, output, lambda: trained(attempt + 1, 1), f"the first step of run {attempt + 1}")
        times[f"requeued {attempt + 1}"], times[f"first step {attempt + 1}"] = (
            round(requeued - sent_at, 2), round(first - sent_at, 2))
        # one step, one backup write, srun's exit and the requeue: well inside Slurm's own grace (KillWait 30 s)
        assert requeued - sent_at < 30, times
    _until(slurm, job, output, lambda: all((out / f"result-{r}.json").exists() for r in (0, 1)), "the results")
    record = slurm.wait_job(job, FINAL, timeout=60)
    text = output.read_text(errors="replace")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "2", (record, text[-6000:])
    return job, text, times
