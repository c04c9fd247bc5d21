"""Issue 44 on hosts that share no disk: `backup_dir` on an S3 server, a lost host replaced by a fresh one.

Every host here has a disk of its own (tests/hosts.py, ``private_disks``: /tmp, /var/tmp and the home are each
host's, and a training process stages its backups and starts there), and the S3 server (moto, IAM on) runs on a
host of its own, reached at its 198.18 address as a store is reached over the network: no training host holds it,
so a backup goes from one host to another only through the store. The one directory the hosts and the test share
is ``results``: what the training script writes as evidence (hosts.log, the steps each worker trained, its final
weights) and the engines' configuration (Slurm's conf, munge socket and spool; Spark's logs and driver script),
never a backup, never a staging directory.

The training is tests/training/checkpoint_script.py (`Trainer.fit`, 160 rows, global batch 16, epochs of 10 steps,
``backup_every=7``, EarlyStopping, ReduceLROnPlateau, and ModelCheckpoint and CSVLogger writing to the store); one
uninterrupted process with a local ``backup_dir`` is the reference each run must equal (weights and history within
1e-5, its workers bit-identical). Kills are timed by events: the script holds before global step KILL_AT
(``KILL_SIGNAL=EXTERNAL``: it writes ready-<rank>.json and waits), the test waits there for the commit it needs in
the store and then takes the host away (`Host.kill_all`: every process on it SIGKILLed at once).

What each test shows (the numbers print as ``MEASURED {...}``, for docs/fault-tolerance.md):

* `stratkit launch --nnodes 2` on h1 and h2; h1 (the chief and the rendezvous) dies before step 23; the job
  restarts on h2 and a fresh h3, which serves the rendezvous and becomes the chief;
* ``--nnodes 1:2``: h4 trains alone, h5 arrives mid-epoch and its worker reads the chief's backup from the store;
* a Spark standalone cluster (master and driver on h6, workers on h7 and h8): the host of worker 1 dies, and
  `SparkRunner(max_retries=1)` runs the stage again on the surviving worker and h9's, which joined meanwhile;
* Slurm (h10 to h13): examples/slurm_requeue.sh on h10 and h11, the nodes drained and the job told to stop (USR1);
  it is requeued onto h12 and h13.

RayRunner on hosts without a shared disk is tests/ray/test_ray_storage_hosts.py (``make test-ray``).
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
import pytest

import hosts
import stores
from procs import REPO_ROOT, child_env
from stratkit.launch.rendezvous import TOKEN_VAR

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.multiworker, pytest.mark.storage_hosts]

SCRIPT = REPO_ROOT / "tests" / "training" / "checkpoint_script.py"
TOKEN = "0123456789abcdef0123456789abcdef"
TOLERANCE = 1e-5
BACKUP_EVERY = 7
STEPS_PER_EPOCH = 10
#: Hosts of the module (one network; each test takes its own, so every replacement is a host that saw nothing):
#: h1-h3 launch, h4-h5 elastic, h6-h9 Spark, h10-h13 Slurm, h14 the store.
LAUNCH, ELASTIC, SPARK, SLURM, STORE = slice(0, 3), slice(3, 5), slice(5, 9), slice(9, 13), 13
#: The staging root of the backups on each host (remote.staging_root(): the temporary directory), for root.
STAGING = "/tmp/stratkit-backups-0"


# -- the module's hosts, store and reference -----------------------------------------------------------------------
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
class Site:
    hosts: list[hosts.Host]
    store: stores.S3Server
    results: Path
    reference: Reference


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    hosts.gate()
    results = tmp_path_factory.mktemp("results")
    reference = Reference(tmp_path_factory.mktemp("reference"))
    try:
        with hosts.make_hosts(14, private_disks=True, shared=[results]) as made, \
                stores.S3Server(host=made[STORE]) as store:
            yield Site(made, store, results, reference)
    finally:
        reference.stop()


@dataclass
class Run:
    """One training run: its evidence directory (shared), its store URL and the environment of its processes."""

    site: Site
    out: Path
    url: str
    artifacts: str

    def env(self, **extra: str) -> dict[str, str]:
        clean = {k: None for k in os.environ if k.startswith(("STRATKIT_", "SLURM_")) or k == "TF_CONFIG"}
        return child_env(None, {**clean, **self.site.store.env, TOKEN_VAR: TOKEN, "OUT": str(self.out),
                                "BACKUP_DIR": self.url, "ARTIFACTS": self.artifacts, **extra})

    def committed(self) -> list[tuple[int, int]]:
        """(epoch, step) of every backup with a manifest in the store, newest first (through the test's proxy)."""
        found = []
        for key in self.site.store.fs().find(self.url.split("://", 1)[1]):
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
        """Global steps a later attempt trained again (every step of the run trained at least once)."""
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
        """Seconds from `when` (time.time()) to the end of the first step `rank` trained after it."""
        times = [float(line.split()[2]) for line in (self.out / f"times-{rank}.log").read_text().splitlines()]
        return min(t for t in times if t > when) - when

    def equals_reference(self, ranks: Sequence[int] = (0, 1)) -> float:
        """Every rank's weights and history within 1e-5 of the reference, the ranks bit-identical; the largest
        weight difference. The CSV log in the store has the reference's epochs and losses."""
        want = self.site.reference.result()
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
        fs = self.site.store.fs()
        logged = list(csv.DictReader(io.StringIO(fs.cat(self.artifacts.split("://", 1)[1] + "/log.csv").decode())))
        reference = list(csv.DictReader(io.StringIO((self.site.reference.out / "log.csv").read_text())))
        assert [row["epoch"] for row in logged] == [row["epoch"] for row in reference], logged
        np.testing.assert_allclose([float(r["loss"]) for r in logged], [float(r["loss"]) for r in reference],
                                   atol=TOLERANCE, rtol=0)
        assert fs.exists(self.artifacts.split("://", 1)[1] + "/best.weights.h5")
        return worst


def new_run(site: Site, name: str) -> Run:
    out = site.results / name
    out.mkdir()
    bucket = site.store.make_bucket(f"{name}-{os.getpid()}-{os.urandom(3).hex()}")
    return Run(site, out, site.store.url(bucket, "run1"), site.store.url(bucket, "artifacts"))


# -- processes on hosts --------------------------------------------------------------------------------------------
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


def launcher(host: hosts.Host, nnodes: str, serving: hosts.Host, env: dict[str, str], *extra: str) -> OnHost:
    """`stratkit launch --nnodes NNODES --rdzv-endpoint SERVING:29400 ... -- python checkpoint_script.py` on `host`."""
    argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", nnodes, "--rdzv-endpoint",
            f"{serving.address}:29400", "--rdzv-timeout", "120", *extra, "--", sys.executable, str(SCRIPT)]
    return OnHost(host, argv, env)


def staged(host: hosts.Host) -> list[str]:
    """The runs whose backups were staged on `host`'s own disk (a finished run leaves its directory, emptied)."""
    found = host.run(["find", STAGING, "-mindepth", "1", "-maxdepth", "1", "-type", "d"], timeout=30)
    return sorted(Path(p).name for p in found.stdout.split()) if found.returncode == 0 else []


def staging_on(host: hosts.Host, running: Sequence[OnHost]) -> list[str]:
    """Wait until `host` stages a run's backups on its own disk (its staging lives from the resume, before step 1,
    to the end of training); that run, which this machine's own disk does not have."""
    runs: list[str] = []
    wait_until(lambda: runs.extend(staged(host)) or runs, f"{host.name} to stage the run's backups", 300, running)
    assert not [run for run in runs if (Path(STAGING) / run).exists()], runs
    return runs


def measured(name: str, **numbers: object) -> None:
    print("MEASURED " + json.dumps({"test": name, "load": os.getloadavg()[0], **numbers}), flush=True)


# -- stratkit launch --nnodes ----------------------------------------------------------------------------------------
def test_launch_a_host_killed_mid_epoch_restarts_on_a_fresh_host_from_the_store(site):
    """h1 (node 0: the chief and the rendezvous) dies before step 23, once the backup of step 21 is committed;
    the job restarts on h2 and a fresh h3 (which serves and becomes the chief): steps 21 and 22 again, then the run
    ends as one process."""
    h1, h2, h3 = site.hosts[LAUNCH]
    run = new_run(site, "launch")
    env = run.env(KILL_AT="23", KILL_RANK="0", KILL_SIGNAL="EXTERNAL")
    first = [launcher(h1, "2", h1, env), launcher(h2, "2", h1, env)]
    wait_until((run.out / "ready-0.json").exists, "worker 0 at step 23", 300, first)
    wait_until(lambda: run.committed()[:1] == [(2, 1)], "the commit of step 21", 120, first)
    killed = time.time()
    h1.kill_all(rounds=20)                        # the machine is gone, with its disk
    assert first[1].finish(120) != 0, first[1].tail()
    gave_up = time.time() - killed
    assert staged(h3) == []

    env = run.env(ATTEMPT="1")
    second = [launcher(h3, "2", h3, env), launcher(h2, "2", h3, env)]
    staging_on(h3, second)
    codes = [node.finish(300) for node in second]
    assert codes == [0, 0], "\n".join(node.tail() for node in second)
    assert run.ran_on() == {0: {0: "h1", 1: "h2"}, 1: {0: "h3", 1: "h2"}}
    assert (f"[worker:0] [stratkit] resumed from {run.url}/backups/00000001-epoch-00002-step-0000001 "
            "at epoch 2 + 1 steps") in second[0].out, second[0].tail()
    for rank in (0, 1):
        assert run.retrained(rank) == [21, 22]
    worst = run.equals_reference()
    measured("launch", retrained=len(run.retrained(0)), backup_every=BACKUP_EVERY, max_weight_diff=worst,
             other_node_gave_up_s=round(gave_up, 1), first_step_after_kill_s=round(run.first_step_after(killed), 1))


def test_launch_an_elastic_arrival_reads_the_chiefs_backup_from_the_store(site):
    """`--nnodes 1:2`: h4 trains alone; h5 arrives mid-epoch 2 (its disk has nothing of the run); the world grows
    to 2 at a step boundary, and h5's worker reads the chief's backup from the store."""
    h4, h5 = site.hosts[ELASTIC]
    run = new_run(site, "elastic")
    timeline = run.out / "timeline.jsonl"
    env = run.env(KILL_AT="17", KILL_RANK="0", KILL_SIGNAL="EXTERNAL", STEP_SECONDS="0.05")
    alone = launcher(h4, "1:2", h4, {**env, "STRATKIT_TIMELINE": str(timeline)})
    wait_until((run.out / "ready-0.json").exists, "h4's worker at step 17", 300, [alone])
    wait_until(lambda: run.committed()[:1] == [(1, 4)], "the commit of step 14", 120, [alone])
    arriving = launcher(h5, "1:2", h4, env)
    assert staged(h5) == []
    arrived = wait_until(lambda: timeline.exists() and "rdzv: node arrived" in timeline.read_text(),
                         "the rendezvous on h4 to admit h5", 300, [alone, arriving])
    (run.out / "sent").write_text("")           # h4's worker goes on: it stops at the next step boundary
    staging_on(h5, [alone, arriving])
    codes = [alone.finish(300), arriving.finish(120)]
    assert codes == [0, 0], alone.tail() + arriving.tail()
    hosts_of = run.ran_on()
    assert hosts_of[0] == {0: "h4"} and hosts_of[max(hosts_of)] == {0: "h4", 1: "h5"}, hosts_of
    assert "world size 1 -> 2: node h5" in alone.err, alone.tail()
    assert f"[worker:1] [stratkit] resumed from {run.url}/backups/" in arriving.out, arriving.tail()
    again = run.retrained(0)
    assert len(again) <= BACKUP_EVERY, again
    worst = run.equals_reference()
    measured("elastic", retrained=len(again), max_weight_diff=worst,
             first_step_of_two_after_arrival_s=round(run.first_step_after(arrived, rank=1), 1))
