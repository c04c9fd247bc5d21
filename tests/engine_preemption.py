"""What the engines' preemption tests share: tests/training/checkpoint_script.py as an engine's training
function, the signal sent from outside to one worker's training process, and the checks against one process.

The training is the step-backup acceptance run of tests/training/test_step_backups.py (160 rows, epochs of 10
steps, `backup_every=7`, EarlyStopping + ReduceLROnPlateau + ModelCheckpoint(best) + CSVLogger), run with
`runpy` inside each engine's training process (`train_script`, shipped by value). Worker `KILL_RANK` stops
before global step `KILL_AT` on its first attempt and waits; `Signaller` sends it the signal from the test
(SIGTERM: a preemption notice; SIGKILL: a crash), then lets it go on. The steps each attempt trained
(`steps-<rank>.log`) show where the retry resumed; the chief's result must equal one uninterrupted process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

SCRIPT = str(Path(__file__).resolve().parent / "training" / "checkpoint_script.py")
TOLERANCE = 1e-5
KILL_AT = 23        # mid-epoch 2; the last step backup before it is at step 21 (7 x 3)
BACKUP_EVERY = 7


def train_script(script: str, out: str, env: dict, extra_callbacks: list | None = None) -> dict:
    """An engine's train_fn: checkpoint_script.py in this training process; its attempt counted per rank."""
    import json
    import os
    import runpy
    import sys

    rank = max(json.loads(os.environ["TF_CONFIG"])["task"]["index"], 0)
    attempt = len([name for name in os.listdir(out) if name.startswith(f"start-{rank}-")])
    open(os.path.join(out, f"start-{rank}-{attempt}"), "w").close()
    os.environ.update(env)
    os.environ["ATTEMPT"] = str(attempt)
    sys.argv = [script]
    runpy.run_path(script, init_globals={"EXTRA_CALLBACKS": list(extra_callbacks or [])}, run_name="__main__")
    with open(os.path.join(out, f"result-{rank}.json")) as handle:
        return json.load(handle)


def script_env(out: Path, backup: Path | None = None, how: str = "EXTERNAL") -> dict:
    return {"OUT": str(out), "BACKUP_DIR": str(backup or out / "backup"), "BACKUP_EVERY": str(BACKUP_EVERY),
            "KILL_AT": str(KILL_AT), "KILL_RANK": "1", "KILL_SIGNAL": how, "STRATEGY": ""}


def reference(out: Path) -> Path:
    """One uninterrupted process (one device): what every engine's interrupted run must equal."""
    from procs import describe, run_process  # here: this module travels by value to the engines' processes

    out.mkdir(parents=True, exist_ok=True)
    result = run_process(SCRIPT, env={"OUT": str(out), "BACKUP_DIR": str(out / "backup"), "STRATEGY": "one_device",
                                      "BACKUP_EVERY": str(BACKUP_EVERY)}, timeout=300)
    assert result.ok, describe([result])
    return out


def first_ancestor(pid: int, name: str) -> int:
    """The nearest ancestor of `pid` whose /proc comm is `name` (e.g. the Spark executor's "java")."""
    while pid > 1:
        with open(f"/proc/{pid}/stat") as handle:
            pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/comm") as handle:
            if handle.read().strip() == name:
                return pid
    raise AssertionError(f"no ancestor named {name!r}")


class Signaller:
    """Waits for worker KILL_RANK to stop before step KILL_AT, sends it `sig`, then lets it go on (a thread).

    `ancestor`: send it to the training process's nearest ancestor of that name instead (the executor's JVM).
    """

    def __init__(self, out: Path, sig: int, timeout: float = 400.0, ancestor: str | None = None) -> None:
        self.out, self.sig, self.timeout, self.ancestor = out, sig, timeout, ancestor
        self.sent_at: float | None = None
        self.pid: int | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="signaller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ready = self.out / "ready-1.json"
        deadline = time.monotonic() + self.timeout
        while not ready.exists():
            if time.monotonic() > deadline:
                self.error = f"worker 1 never reached step {KILL_AT}"
                return
            time.sleep(0.02)
        time.sleep(0.1)  # the file is written whole before the process waits; read it once complete
        self.pid = json.loads(ready.read_text())["pid"]
        if self.ancestor is not None:
            self.pid = first_ancestor(self.pid, self.ancestor)
        self.sent_at = time.time()
        os.kill(self.pid, self.sig)
        (self.out / "sent").touch()

    def join(self) -> None:
        self._thread.join(timeout=5)
        assert self.error is None, self.error
        assert self.sent_at is not None, "no signal was sent"


def steps(out: Path, rank: int) -> list[tuple[int, int, float]]:
    """(attempt, global step, time it ended) for every step `rank` trained, in order."""
    rows = []
    for line in (out / f"times-{rank}.log").read_text().splitlines():
        attempt, step, when = line.split()
        rows.append((int(attempt), int(step), float(when)))
    return rows


def retrained(out: Path, rank: int) -> list[int]:
    """Steps a later attempt trained again."""
    rows = steps(out, rank)
    first = {step for attempt, step, _ in rows if attempt == 0}
    return sorted(step for attempt, step, _ in rows if attempt > 0 and step in first)


def resume_report(out: Path, sent_at: float) -> dict:
    """Where the retry resumed, how many steps it trained again, and seconds from the signal to its first step."""
    rows = steps(out, 1)
    last = max(step for attempt, step, _ in rows if attempt == 0)
    retry = [(step, when) for attempt, step, when in rows if attempt == 1]
    assert retry, f"no retry trained a step: worker 1 trained steps ..{last} in its first attempt and no other"
    return {"last_step_before": last, "resumed_at": retry[0][0], "retrained": retrained(out, 1),
            "signal_to_first_step_s": round(retry[0][1] - sent_at, 2)}


def assert_equals_reference(got: dict, out: Path, want_dir: Path) -> None:
    """The chief's result equals one uninterrupted process: weights, every epoch's history, the stopping epoch,
    the best file and the CSV log (tests/training/test_step_backups.py's acceptance)."""
    import h5py

    want = json.loads((want_dir / "result-0.json").read_text())
    for a, b in zip(got["weights"], want["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=TOLERANCE, rtol=0)
    assert got["epochs"] == want["epochs"], (got["epochs"], want["epochs"])
    assert got["stopped_epoch"] == want["stopped_epoch"] > 0
    for key, values in want["history"].items():
        np.testing.assert_allclose(got["history"][key], values, atol=TOLERANCE, rtol=0, err_msg=key)

    def best(path: Path) -> list:
        with h5py.File(path, "r") as handle:
            found: list = []
            handle.visititems(lambda name, obj: found.append((name, obj[()])) if isinstance(obj, h5py.Dataset)
                              else None)
        return [value for _, value in sorted(found, key=lambda item: item[0])]

    for a, b in zip(best(out / "best.weights.h5"), best(want_dir / "best.weights.h5")):
        np.testing.assert_allclose(a, b, atol=TOLERANCE, rtol=0)
    rows = (out / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(e) for e in want["epochs"]]


SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}
