"""What the tests of backups on hosts without a shared disk share (tests/test_storage_hosts.py and
tests/ray/test_ray_storage_hosts.py): the reference run, one run's evidence and store, processes on test hosts.

The training is tests/training/checkpoint_script.py (`Trainer.fit`, 160 rows, global batch 16, epochs of 10
steps, ``backup_every=7``, EarlyStopping, ReduceLROnPlateau, and ModelCheckpoint and CSVLogger writing to the
store); one uninterrupted process with a local ``backup_dir`` (`Reference`) is what each run must equal: weights
and history within 1e-5, its workers bit-identical, the CSV log in the store holding every epoch. A run (`Run`)
writes its evidence into a directory every host shares (hosts.log: where each attempt's workers ran; the steps
each trained and when; the final weights) and its backups under its own bucket of the store.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import hosts
import stores
from procs import REPO_ROOT, child_env

SCRIPT = REPO_ROOT / "tests" / "training" / "checkpoint_script.py"
TOLERANCE = 1e-5
BACKUP_EVERY = 7
#: Where each host stages its backups (`remote.staging_root()`: the temporary directory, for root).
STAGING = "/tmp/stratkit-backups-0"


class Reference:
    """One uninterrupted process with a local backup_dir, started in the background (in this machine's namespace)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.log = open(out / "output.txt", "wb")  # noqa: SIM115 - closed in `result`/`stop`
        env = child_env(None, {"OUT": str(out), "BACKUP_DIR": str(out / "backup"), "STRATEGY": "one_device"})
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def result(self) -> dict:
        code = self.proc.wait(timeout=600)
        self.log.close()
        assert code == 0, (self.out / "output.txt").read_text(errors="replace")[-4000:]
        return json.loads((self.out / "result-0.json").read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@dataclass
class Run:
    """One training run: its evidence directory (shared by every host), its store URLs, its processes' environment."""

    store: stores.StoreServer
    reference: Reference
    out: Path
    url: str
    artifacts: str

    @classmethod
    def new(cls, store: stores.StoreServer, reference: Reference, results: Path, name: str) -> Run:
        out = results / name
        out.mkdir()
        bucket = store.make_bucket(f"{name}-{os.getpid()}-{os.urandom(3).hex()}")
        return cls(store, reference, out, store.url(bucket, "run1"), store.url(bucket, "artifacts"))

    def settings(self, **extra: str) -> dict[str, str]:
        """What the training script reads (no secret: the store's credentials come from `env` or the engine)."""
        return {"OUT": str(self.out), "BACKUP_DIR": self.url, "ARTIFACTS": self.artifacts, **extra}

    def env(self, **extra: str) -> dict[str, str]:
        """A process's whole environment: ours without stratkit's and Slurm's variables, the store's, `settings`."""
        clean = {k: None for k in os.environ if k.startswith(("STRATKIT_", "SLURM_")) or k == "TF_CONFIG"}
        return child_env(None, {**clean, **self.store.env, **self.settings(**extra)})

    def committed(self) -> list[tuple[int, int]]:
        """(epoch, step) of every backup with a manifest in the store, newest first (through the test's proxy)."""
        found = []
        for key in self.store.fs().find(self.url.split("://", 1)[1]):
            parts = key.split("/")
            if parts[-1] == "manifest.json" and parts[-3] == "backups":
                epoch, _, step = parts[-2].split("-", 1)[1][len("epoch-"):].partition("-step-")
                found.append((int(epoch), int(step or 0)))
        return sorted(found, reverse=True)

    def steps(self, rank: int) -> list[tuple[int, int]]:
        """(attempt, global step) of every step `rank` trained, in order."""
        path = self.out / f"steps-{rank}.log"
        return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []

    def retrained(self, rank: int) -> list[int]:
        """Global steps `rank` trained more than once (every step of the run trained at least once)."""
        steps = self.steps(rank)
        done = sorted({s for _, s in steps})
        assert done == list(range(done[-1] + 1)), steps
        seen: set[int] = set()
        again = []
        for _, step in steps:
            if step in seen:
                again.append(step)
            seen.add(step)
        return again

    def ran_on(self) -> dict[int, dict[int, str]]:
        """{attempt: {rank: hostname}} from hosts.log."""
        out: dict[int, dict[int, str]] = {}
        for line in (self.out / "hosts.log").read_text().splitlines():
            attempt, rank, host = line.split()
            out.setdefault(int(attempt), {})[int(rank)] = host
        return out

    def first_step_after(self, when: float, rank: int = 0) -> float:
        """Seconds from `when` (time.time()) to the end of the first step `rank` trained in a later attempt."""
        lines = [line.split() for line in (self.out / f"times-{rank}.log").read_text().splitlines()]
        return min(float(t) for attempt, _, t in lines if int(attempt) > 0 and float(t) > when) - when

    def equals_reference(self, ranks: Sequence[int] = (0, 1)) -> float:
        """Every rank's weights and history within 1e-5 of the reference, the ranks bit-identical, the CSV log in
        the store with the reference's epochs and losses, the best weights there: the largest weight difference."""
        want = self.reference.result()
        worst = 0.0
        for rank in ranks:
            got = json.loads((self.out / f"result-{rank}.json").read_text())
            for a, b in zip(got["weights"], want["weights"], strict=True):
                np.testing.assert_allclose(np.array(a), np.array(b), atol=TOLERANCE, rtol=0)
                worst = max(worst, float(np.max(np.abs(np.array(a) - np.array(b)))))
            assert got["epochs"] == want["epochs"] and got["stopped_epoch"] == want["stopped_epoch"] > 0
            for key, values in want["history"].items():
                np.testing.assert_allclose(got["history"][key], values, atol=TOLERANCE, rtol=0, err_msg=key)
        for rank in ranks[1:]:
            assert (json.loads((self.out / f"result-{rank}.json").read_text())["weights"]
                    == json.loads((self.out / f"result-{ranks[0]}.json").read_text())["weights"])
        fs, root = self.store.fs(), self.artifacts.split("://", 1)[1]
        logged = list(csv.DictReader(io.StringIO(fs.cat(f"{root}/log.csv").decode())))
        reference = list(csv.DictReader(io.StringIO((self.reference.out / "log.csv").read_text())))
        assert [row["epoch"] for row in logged] == [row["epoch"] for row in reference], logged
        np.testing.assert_allclose([float(r["loss"]) for r in logged], [float(r["loss"]) for r in reference],
                                   atol=TOLERANCE, rtol=0)
        assert fs.exists(f"{root}/best.weights.h5")
        return worst


class OnHost:
    """A process on a test host, its stdout and stderr read as they come."""

    def __init__(self, host: hosts.Host, argv: Sequence[str], env: dict[str, str]) -> None:
        self.host = host
        self.proc = host.popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self.lines: dict[str, list[str]] = {"out": [], "err": []}
        self.readers = [threading.Thread(target=self.lines[name].extend, args=(stream,), daemon=True)
                        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        for reader in self.readers:
            reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines["out"])

    @property
    def err(self) -> str:
        return "".join(self.lines["err"])

    def said(self, prefix: str) -> dict:
        """The JSON after `prefix` on its (last) stdout line that starts with it."""
        lines = [line for line in self.out.splitlines() if line.startswith(prefix)]
        assert lines, f"no {prefix!r} line\n{self.tail()}"
        return json.loads(lines[-1][len(prefix):])

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.host.name} stdout\n{self.out[-chars:]}\n--- {self.host.name} stderr\n{self.err[-chars:]}"

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            hosts._kill_group(self.proc.pid)
            self.proc.wait()
            raise AssertionError(f"still running after {timeout} s\n{self.tail()}") from None
        finally:
            for reader in self.readers:
                reader.join(30)
        return self.proc.returncode


def wait_until(check: Callable[[], object], what: str, timeout: float, running: Sequence[OnHost] = ()) -> float:
    """Poll `check` until true (a failure, with their output, if one of `running` ends first); the time it came."""
    deadline = time.monotonic() + timeout
    while not check():
        ended = [p for p in running if p.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            tails = "\n".join(p.tail() for p in running)
            raise AssertionError(f"waiting {timeout} s for {what}: "
                                 f"{'a process ended' if ended else 'it did not come'}\n{tails}")
        time.sleep(0.05)
    return time.time()


def staged(host: hosts.Host) -> list[str]:
    """The runs whose backups `host` stages on its own disk (a finished run removes its staging)."""
    found = host.run(["find", STAGING, "-mindepth", "1", "-maxdepth", "1", "-type", "d"], timeout=30)
    return sorted(Path(p).name for p in found.stdout.split()) if found.returncode == 0 else []


def staging_on(host: hosts.Host, running: Sequence[OnHost]) -> list[str]:
    """Wait until `host` stages a run's backups on its own disk (from the resume, before step 1, to the end of
    training); that run, which this machine's own disk does not have."""
    runs: list[str] = []
    wait_until(lambda: runs.extend(staged(host)) or runs, f"{host.name} to stage the run's backups", 300, running)
    assert not [run for run in runs if (Path(STAGING) / run).exists()], runs
    return runs


def measured(name: str, **numbers: object) -> None:
    """One line of numbers for the docs (pytest -s shows it), with the load average they were measured at."""
    print("MEASURED " + json.dumps({"test": name, "load": round(os.getloadavg()[0], 1), **numbers}), flush=True)
