"""KerasTuner searches on stratkit's search service, for real: N tuner processes equal one process, and the
failures KerasTuner's own distributed mode hangs on.

`search_script.py` (a seeded RandomSearch of 8 trials, then a Hyperband) runs once as one process
(`reference`, shared by the module) and then as 2 tuners under `stratkit launch --tune` and under
`LocalRunner(tune=True)`: the same trials (ids and hyperparameters), the same scores (within 1e-5), the
same best model, on every tuner. Then: a tuner SIGKILLed and another SIGSTOPped mid-trial (their trials
run again elsewhere, from their last epoch, and the search ends as it would have); the chief SIGKILLed
and its restart resuming the search from S3 (moto) without running a finished trial again; a build
function that fails on the first hyperparameters (a ConfigError on every tuner, no trial trained).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from procs import REPO_ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

SCRIPT = str(Path(__file__).with_name("search_script.py"))
TRIAL = re.compile(r"TRIAL (\S+) RUN (\d+) EPOCH (\d+) TUNER (\d+) PID (\d+)")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "STRATKIT_TUNE_LEASE_SECONDS": None}


class Run:
    """A process (the launcher, or a script) in the background, its output lines collected with their time."""

    def __init__(self, argv: list[str], cwd: Path, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(argv, cwd=cwd, env=child_env(None, {**QUIET, **(env or {})}),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = 300, start: int = 0) -> tuple[int, re.Match]:
        """The first line from `start` on matching `pattern`: (its index, the match)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, (_, line) in enumerate(list(self.lines)[start:], start):
                match = regex.search(line)
                if match:
                    return index, match
            assert self.proc.poll() is None, f"ended early (exit {self.proc.returncode}):\n{self.text[-8000:]}"
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text[-8000:]}")

    def finish(self, timeout: float = 600) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(10)
        return code

    def results(self) -> dict[int, dict]:
        """Each tuner's RESULT line, by tuner."""
        found = {}
        for _, line in self.lines:
            if "RESULT " in line:
                result = json.loads(line.split("RESULT ", 1)[1])
                found[result["tuner"]] = result
        return found


def _launch(cwd: Path, *args: str, workers: int = 2, script: list[str] = (), env: dict | None = None) -> Run:
    return Run([sys.executable, "-m", "stratkit.cli", "launch", "--tune", "--workers", str(workers), *args, "--",
                sys.executable, SCRIPT, *script], cwd, env)


def _same_search(result: dict, reference: dict, searches=("random", "hyperband")) -> None:
    """The same trials, hyperparameters and best model as one process; scores within 1e-5. A search of fewer
    trials (`--trials`) is compared with the reference's first ones: trial k is the same trial either way."""
    for name in searches:
        got, expected = result[name], reference[name]
        assert got["trials"].keys() <= expected["trials"].keys() and got["trials"], name
        for trial_id, (values, score, status) in got["trials"].items():
            assert expected["trials"][trial_id][0] == values and expected["trials"][trial_id][2] == status, \
                (name, trial_id)
            assert abs(expected["trials"][trial_id][1] - score) <= 1e-5, (name, trial_id, score,
                                                                          expected["trials"][trial_id])
        best = min(got["trials"], key=lambda t: expected["trials"][t][1])
        assert got["best"] == expected["trials"][best][0], name
        if got["trials"].keys() == expected["trials"].keys():
            assert abs(got["model_loss"] - expected["model_loss"]) <= 1e-5, name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The search in one process: `python search_script.py`."""
    run = Run([sys.executable, SCRIPT], tmp_path_factory.mktemp("one-process"))
    assert run.finish() == 0, run.text[-8000:]
    result = run.results()[0]
    assert len(result["random"]["trials"]) == 8 and len(result["hyperband"]["trials"]) == 6
    return result


def _pids_listening(pid: int) -> set[str]:
    """The local addresses of the LISTEN sockets process `pid` holds (its fds' socket inodes in /proc/net/tcp*)."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    address, port = fields[1].rsplit(":", 1)
                    raw = bytes.fromhex(address)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(f"{ipaddress.ip_address(raw)}:{int(port, 16)}")
    return found


def test_two_tuners_under_launch_search_as_one_process(reference, tmp_path):
    run = _launch(tmp_path)
    _, started = run.wait_for(r"worker:0 started: pid (\d+) at 127\.0\.0\.1:(\d+)")
    _, tuner1 = run.wait_for(r"worker:1 started: pid (\d+)")
    run.wait_for(TRIAL.pattern)
    # Nothing a tuner opened listens beyond loopback: the service (worker 0, on the port the launcher held), and
    # no TensorFlow server in a tune run.
    assert _pids_listening(int(started[1])) == {f"127.0.0.1:{started[2]}"}
    assert _pids_listening(int(tuner1[1])) == set()
    assert run.finish() == 0, run.text[-8000:]
    results = run.results()
    assert set(results) == {0, 1}
    for result in results.values():  # every tuner ends with the whole search, get_best_models() included
        _same_search(result, reference)
    tuners = {int(m[3]) for m in TRIAL.findall(run.text)}
    assert tuners == {0, 1}  # both tuners trained trials
    print("wall time: one process random %.1f s hyperband %.1f s; 2 tuners random %.1f s hyperband %.1f s" % (
        reference["random"]["seconds"], reference["hyperband"]["seconds"], results[0]["random"]["seconds"],
        results[0]["hyperband"]["seconds"]))


DRIVER = """
import json, sys
import stratkit

def search():
    import runpy
    sys.argv = ["search_script.py"]
    runpy.run_path({script!r}, run_name="__main__")
    return "done"

print("VALUE", stratkit.LocalRunner(num_workers=2, tune=True).run(search), flush=True)
"""


@pytest.mark.tune_acceptance
def test_two_tuners_under_local_runner_search_as_one_process(reference, tmp_path):
    """LocalRunner(tune=True): this process (the driver) runs the search service, the tasks are the tuners."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(script=SCRIPT))
    run = Run([sys.executable, str(driver)], tmp_path)
    assert run.finish() == 0, run.text[-8000:]
    results = run.results()
    assert set(results) == {0, 1} and "VALUE done" in run.text
    for result in results.values():
        _same_search(result, reference)


def test_a_killed_and_a_hung_tuner_lose_their_trials_and_the_search_ends_as_one_process(reference, tmp_path):
    """3 tuners; tuner 1 SIGKILLed and tuner 2 SIGSTOPped, each in its trial's second epoch: both trials run
    again on a tuner alive (from the epoch their backups hold, not from the start), within 30 s of the kill;
    every trial scores as in one process (the resumed ones too); the search ends, the launch succeeds."""
    # Each tuner signals itself on its line (`--signal-at`): the test's own kill, on a loaded machine, once landed
    # after the trial's training had ended (its backups removed, its end not yet reported), and the trial ran again
    # from its start.
    run = _launch(tmp_path, "--exit-grace", "3", "--stop-grace", "3", workers=3,
                  script=["--search", "random", "--trials", "4", "--slow", "0.5", "--signal-at", "1:KILL", "2:STOP"],
                  env={"STRATKIT_TUNE_LEASE_SECONDS": "6"})
    killed_at, killed = run.wait_for(r"TRIAL (\S+) RUN 1 EPOCH 1 TUNER 1 PID (\d+)")
    kill_time = run.lines[killed_at][0]
    _, hung = run.wait_for(r"TRIAL (\S+) RUN 1 EPOCH 1 TUNER 2 PID (\d+)")
    try:
        index, again = run.wait_for(rf"TRIAL {re.escape(killed[1])} RUN 2 EPOCH (\d+) TUNER [02]", timeout=120)
        assert run.lines[index][0] - kill_time < 30  # its trial runs again elsewhere within 30 s
        assert again[1] == "1"  # from its last epoch's backup: the second epoch, not the first
        _, lost = run.wait_for(r"tuner 2 lost trial (\S+) \(run 1", timeout=120)
        assert lost[1] == hung[1]                    # the trial it held when it hung
        _, resumed = run.wait_for(rf"TRIAL {re.escape(lost[1])} RUN 2 EPOCH (\d+) TUNER [01]", timeout=120)
        assert resumed[1] == "1"  # from its backup, as the killed one
        assert run.finish(timeout=600) == 0, run.text[-8000:]
    finally:
        try:
            os.kill(int(hung[2]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "worker:1 (a tuner) killed by SIGKILL" in run.text and "the search goes on without it" in run.text
    result = run.results()[0]
    _same_search(result, reference, searches=("random",))


@pytest.mark.tune_acceptance
def test_a_killed_chief_resumes_from_s3_and_runs_no_finished_trial_again(reference, tmp_path, store_server):
    """The store is S3 (moto); worker 0 (the chief: its service and a tuner) is SIGKILLed after some trials
    ended; --max-restarts restarts both tuners, the new chief resumes from search.json on S3, and no trial
    that had ended runs again."""
    s3 = store_server("s3")
    bucket = s3.make_bucket(f"tune-{os.getpid()}-{int(time.time())}")
    url = s3.url(bucket, "search")
    run = _launch(tmp_path, "--max-restarts", "1",
                  script=["--search", "random", "--trials", "6", "--store", url, "--slow", "0.3"],
                  env=s3.client_env({}))
    _, chief = run.wait_for(r"worker:0 started: pid (\d+)")
    fs = s3.fs()
    state_key = f"{bucket}/search/random/search.json"
    deadline = time.monotonic() + 300
    while True:
        try:
            ended = json.loads(fs.cat_file(state_key)).get("ended", {})
        except FileNotFoundError:
            ended = {}
        if len(ended) >= 3:
            break
        assert time.monotonic() < deadline and run.proc.poll() is None, run.text[-8000:]
        time.sleep(0.2)
    os.kill(int(chief[1]), signal.SIGKILL)
    restarted, _ = run.wait_for(r"attempt 2 of 2: worker:0 started", timeout=120)
    ended = json.loads(fs.cat_file(state_key))["ended"]  # the state the chief died with
    assert run.finish(timeout=600) == 0, run.text[-8000:]
    again = {m[0] for _, line in run.lines[restarted:] for m in TRIAL.findall(line)}
    assert again and not again & set(ended), (sorted(ended), sorted(again))
    assert "resumed the search from s3://" in run.text
    for result in run.results().values():
        _same_search(result, reference, searches=("random",))


def test_a_build_function_failing_on_the_first_hyperparameters_stops_every_tuner_before_any_trial(tmp_path,
                                                                                                  reference):
    units = reference["random"]["trials"]["0"][0]["units"]  # trial 0's (the default, 4, builds at construction)
    run = _launch(tmp_path, script=["--search", "random", "--trials", "2", "--build-fails-on", str(units)])
    assert run.finish() != 0
    message = f"the model-building function fails on the search's first hyperparameters"
    assert re.search(rf"\[worker:0\].*ConfigError: {message}", run.text), run.text[-8000:]
    assert re.search(rf"\[worker:1\].*ConfigError: {message}", run.text), run.text[-8000:]
    assert not TRIAL.search(run.text)  # no trial trained an epoch
