"""Backups on object storage (issue 44): `backup_dir` on S3, GCS and Azure, killed and resumed as real processes.

`checkpoint_script.py` trains (160 rows, global batch 16: epochs of 10 steps, `backup_every=7`, EarlyStopping,
ReduceLROnPlateau, ModelCheckpoint, CSVLogger); the one uninterrupted process with a local `backup_dir` is the
reference every run here must equal (weights and history within 1e-5). Each worker stages its backups under
STRATKIT_BACKUP_STAGING with "{rank}" in it (a disk of its own per worker); the tests delete those disks
between attempts, so a resume can only come from the store. Kills are timed by events: the script stops before
step KILL_AT (`KILL_SIGNAL=EXTERNAL`: it writes ready-<rank>.json and waits), the test looks at the store (the
commit it waits for) and then sends SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import stores
from procs import REPO_ROOT, child_env, describe, run_process, start_process

from stratkit.training.checkpoint.layout import Position

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("checkpoint_script.py"))
TOLERANCE = 1e-5
AT_21 = Position(2, 1)      # the backup before step 23 (global steps 7, 14, 21, ...)
AT_14 = Position(1, 4)


def _unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{os.urandom(3).hex()}"


def _result(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"result-{rank}.json").read_text())


def _retrained(out: Path, rank: int = 0, first: int = 0) -> list[int]:
    """Steps attempt `first` trained that a later attempt trained again (from the run's own step log)."""
    lines = [tuple(map(int, line.split())) for line in (out / f"steps-{rank}.log").read_text().splitlines()]
    trained = {step for attempt, step in lines if attempt == first}
    return sorted(step for attempt, step in lines if attempt > first and step in trained)


def _equals_reference(out: Path, reference: Path, ranks=(0,)) -> None:
    want = _result(reference)
    for rank in ranks:
        got = _result(out, rank)
        for a, b in zip(got["weights"], want["weights"]):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=TOLERANCE, rtol=0)
        assert got["epochs"] == want["epochs"] and got["stopped_epoch"] == want["stopped_epoch"] > 0
        for key, values in want["history"].items():
            np.testing.assert_allclose(got["history"][key], values, atol=TOLERANCE, rtol=0, err_msg=key)
    for rank in ranks[1:]:  # workers bit-identical
        assert _result(out, rank)["weights"] == _result(out, ranks[0])["weights"]


def _committed(server: stores.StoreServer, url: str, fs=None) -> list[Position]:
    """The positions with a manifest in the store, newest first (this test's own client: no TensorFlow here)."""
    found = []
    for key in (fs or server.fs()).find(url.split("://", 1)[1]):
        parts = key.split("/")
        if parts[-1] == "manifest.json" and parts[-3] == "backups":
            stem = parts[-2].split("-", 1)[1]          # 00000001-epoch-00002-step-0000001
            epoch, _, step = stem[len("epoch-"):].partition("-step-")
            found.append(Position(int(epoch), int(step or 0)))
    return sorted(found, reverse=True)


def _wait_for(check, what: str, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.1)


class Running:
    """A training started in the background: a process (`script`) or `stratkit launch --workers N`; its output
    is read as it comes (`said` waits for a line)."""

    def __init__(self, out: Path, env: dict, workers: int = 0, extra: list[str] = ()) -> None:
        out.mkdir(parents=True, exist_ok=True)
        clean = {k: None for k in os.environ if k.startswith(("STRATKIT_", "SLURM_")) or k == "TF_CONFIG"}
        clean.pop("STRATKIT_TEST_IMPORT_LOG", None)   # a measuring run's (tests/cpu_times.py): forks as without it
        if workers:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stratkit.cli", "launch", "--workers", str(workers), "--max-restarts", "0",
                 "--no-private-network", *extra, "--", sys.executable, SCRIPT], env=child_env(None, {**clean, **env}),
                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            streams = (self.proc.stdout, self.proc.stderr)
        else:   # one process: forked from a fork server when its environment allows it (S3's does), as
            pipes = (os.pipe(), os.pipe())  # run_process forks (tests/procs.py): no TensorFlow import to pay
            with os.fdopen(pipes[0][1], "wb") as stdout, os.fdopen(pipes[1][1], "wb") as stderr:
                self.proc = start_process([sys.executable, SCRIPT], child_env(None, {**clean, **env}), stdout, stderr)
            streams = tuple(os.fdopen(read, "r") for read, _ in pipes)   # (its own copies of the write ends)
        self._lines: dict[str, list[str]] = {"out": [], "err": []}
        self._readers = [threading.Thread(target=self._read, args=(stream, self._lines[name]), daemon=True)
                         for name, stream in zip(("out", "err"), streams)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        lines.extend(stream)  # (a line at a time, as the process writes them)

    @property
    def out(self) -> str:
        return "".join(self._lines["out"])

    @property
    def err(self) -> str:
        return "".join(self._lines["err"])

    def said(self, text: str) -> bool:
        return text in self.err

    def finish(self, timeout: float = 600) -> int:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for reader in self._readers:
                reader.join(30)
        return self.proc.returncode


def _env(server: stores.StoreServer, url: str, out: Path, **extra: str) -> dict:
    return {**server.env, "OUT": str(out), "BACKUP_DIR": url, "STRATKIT_BACKUP_STAGING": str(out / "disk-{rank}"),
            **extra}


def _kill_after_commit(server, url, out: Path, first: Running, rank: int, position: Position = AT_21) -> None:
    """Before step 23, once the backup at `position` is committed: SIGKILL worker `rank` (a host gone)."""
    ready = out / f"ready-{rank}.json"
    _wait_for(ready.exists, f"worker {rank} to reach step 23")
    _wait_for(lambda: _committed(server, url)[:1] == [position], f"the commit of {position}")
    os.kill(json.loads(ready.read_text())["pid"], signal.SIGKILL)
    first.finish()
    for disk in out.glob("disk-*"):  # the host is gone with its disk: the resume reads the store alone
        shutil.rmtree(disk)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted process with a local backup_dir."""
    out = tmp_path_factory.mktemp("reference")
    result = run_process(SCRIPT, env={"OUT": str(out), "BACKUP_DIR": str(out / "backup")}, timeout=300)
    assert result.ok, describe([result])
    return out


@pytest.mark.multiworker
def test_s3_two_workers_without_a_shared_disk_killed_then_preempted_resume_from_the_store(tmp_path, reference,
                                                                                          store_server):
    """Worker 1's host SIGKILLed before step 23: the next attempt, on fresh disks, resumes from the store at 21.
    Then a notice on worker 1 at step 33: both stop at one step, their backup is committed before they exit 75
    (inside the 5 s grace), and the restart resumes from it: nothing trained twice."""
    server = store_server("s3")
    url = server.url(server.make_bucket(_unique("two")), "run1")
    env = _env(server, url, tmp_path, KILL_AT="23", KILL_RANK="1", KILL_SIGNAL="EXTERNAL")
    first = Running(tmp_path, env, workers=2)
    _kill_after_commit(server, url, tmp_path, first, rank=1)
    assert first.proc.returncode != 0 and "worker:1" in first.err and "killed by SIGKILL" in first.err, \
        first.err[-3000:]

    logs = tmp_path / "logs"
    env = {**env, "ATTEMPT": "1", "KILL_ATTEMPT": "1", "KILL_AT": "33", "KILL_SIGNAL": "TERM"}
    second = Running(tmp_path, env, workers=2, extra=["--log-dir", str(logs)])
    assert second.finish() == 0, second.err[-5000:]
    text = second.out + second.err
    assert f"resumed from {url}/backups/00000001-epoch-00002-step-0000001 at epoch 2 + 1 steps" in text
    for rank in (0, 1):
        assert _retrained(tmp_path, rank) == [21, 22]   # at most backup_every=7, from the store alone
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    preempted = [e for e in events if e["event"] in ("exit", "stopped") and e["attempt"] == 0]
    assert sorted(e["returncode"] for e in preempted) == [75, 75], preempted
    sent = json.loads((tmp_path / "signal-1.json").read_text())["time"]
    assert max(e["time"] for e in preempted) - sent < 5.0, (preempted, sent)   # inside the grace period
    assert "committed to the store in" in text and "this worker's part is in the store in" in text
    stopped = re.search(r"stopped at (epoch \d+ \+ \d+ steps)", text)
    assert stopped and f"resumed from {url}/backups/00000002-" in text and f"at {stopped[1]}\n" in text
    for rank in (0, 1):
        assert _retrained(tmp_path, rank, first=1) == []   # the notice: nothing trained twice
    _equals_reference(tmp_path, reference, ranks=(0, 1))
    assert _committed(server, url) == [] and server.fs().find(url.split("://")[1]) == []  # a finished run: removed


@pytest.mark.multiworker
@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_one_process_killed_then_two_workers_resume_from_the_store(tmp_path, reference, store_server, scheme):
    """GCS and Azure: one process killed mid-epoch, 2 workers on fresh disks resume (another world size)."""
    stores.gate(scheme)
    server = store_server(scheme)
    url = server.url(server.make_bucket(_unique("grow")), "run1")
    env = _env(server, url, tmp_path, KILL_AT="23", KILL_RANK="0", KILL_SIGNAL="EXTERNAL")
    first = Running(tmp_path, env)
    _kill_after_commit(server, url, tmp_path, first, rank=0)
    assert first.proc.returncode == -signal.SIGKILL
    second = Running(tmp_path, {**env, "ATTEMPT": "1"}, workers=2)
    assert second.finish() == 0, second.err[-5000:]
    assert "at epoch 2 + 1 steps" in second.out and "world size 1 -> 2" in second.err
    assert _retrained(tmp_path, 0) == [21, 22]
    _equals_reference(tmp_path, reference, ranks=(0, 1))


def test_sigkill_during_an_upload_resumes_from_the_previous_commit(tmp_path, reference, store_server):
    """Once step 14's backup is committed, the store stops answering uploads of weights (the next one hangs
    mid-request); SIGKILL then: the restart resumes from the commit before it (step 14)."""
    server = store_server("s3")
    url = server.url(server.make_bucket(_unique("midway")), "run1")
    # (unpaced: with a tiny model the next upload would otherwise wait ~2 s, past the end of this short run)
    env = _env(server, url, tmp_path, KILL_AT="16", KILL_RANK="0", KILL_SIGNAL="EXTERNAL",
               STRATKIT_BACKUP_UPLOAD_SHARE="1")
    first = Running(tmp_path, env)
    try:
        _wait_for((tmp_path / "ready-0.json").exists, "step 16")   # (the run waits there for `sent`)
        _wait_for(lambda: _committed(server, url)[:1] == [AT_14], "the commit of step 14")
        server.hold(b".weights.h5")
        (tmp_path / "sent").write_text("")
        _wait_for(lambda: b"-step-" in server.held, "the next backup's upload under way")
        assert b"epoch-00001-step-0000004" not in server.held    # (a later backup's: 21, or newer)
        os.kill(first.proc.pid, signal.SIGKILL)
        assert first.finish() == -signal.SIGKILL
    finally:
        server.up()
    second = Running(tmp_path, {**env, "ATTEMPT": "1"})
    assert second.finish() == 0, second.err[-5000:]
    assert f"resumed from {url}/backups/00000001-epoch-00001-step-0000004 at epoch 1 + 4 steps" in second.out
    retrained = _retrained(tmp_path)
    assert retrained[0] == 14 and retrained == list(range(14, retrained[-1] + 1)), retrained  # from the commit
    _equals_reference(tmp_path, reference)


def test_the_store_down_mid_run_training_goes_on_and_the_run_says_what_never_arrived(tmp_path, store_server):
    server = store_server("s3")
    url = server.url(server.make_bucket(_unique("outage")), "run1")
    # HOLD_AT: step 33 waits for the store to be back, so the backup of step 35 is made after it (under load the
    # run once trained to its end before the test saw the warning and brought the store up: nothing said "again")
    env = _env(server, url, tmp_path, KILL_AT="16", KILL_RANK="0", KILL_SIGNAL="EXTERNAL", STEP_SECONDS="0.1",
               EPOCHS="4", AWS_MAX_ATTEMPTS="2", HOLD_AT="33")   # (botocore's own retries hide a failure ~8 s)
    run = Running(tmp_path, env)
    steps = tmp_path / "steps-0.log"
    try:
        _wait_for((tmp_path / "ready-0.json").exists, "step 16")    # (the run waits there for `sent`)
        _wait_for(lambda: _committed(server, url)[:1] == [AT_14], "the commit of step 14")
        server.down()
        (tmp_path / "sent").write_text("")
        _wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 30, "step 30 (backups at 21 "
                  "and 28 written while the store is down)")
        _wait_for(lambda: run.said("uploads are failing"), "the warning that uploads fail")
        import s3fs

        direct = s3fs.S3FileSystem(key=server.key, secret=server.secret, skip_instance_cache=True,
                                   endpoint_url=f"http://127.0.0.1:{server.port}")   # past the proxy, which is down
        assert _committed(server, url, direct)[0] == AT_14   # still the resume point (the newest commit)
    finally:
        server.up()
    try:
        # The retries back off up to RETRY_MAX (30 s): after a long outage (a loaded machine: the test waits for step
        # 30 and the warning) the next try can come after the few steps left, and training's end drops it. The run
        # holds at step 33 until the store has answered again.
        _wait_for(lambda: run.said("the store answers again"), "an upload to land once the store is back", 100)
    finally:
        (tmp_path / "go").write_text("")
    assert run.finish() == 0, run.err[-5000:]
    assert run.err.count("uploads are failing") == 1, run.err[-5000:]   # one warning for the outage, not per retry
    assert "the newest committed backup is epoch 1 + 4 steps" in run.err
    assert "the store answers again" in run.err
    assert "never reached the store (epoch 2 + 1 steps" in run.err      # 21 first among them
    assert _committed(server, url) == []   # the run finished: its backups removed from the store
