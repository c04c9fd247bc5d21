"""Issue 44 on hosts that share no disk: `backup_dir` on an S3 server, a lost host replaced by a fresh one.

Every host here has a disk of its own (tests/hosts.py, ``private_disks``: /tmp, /var/tmp and the home are each
host's, and a training process stages its backups and starts there), and the S3 server (moto, IAM on) runs on a
host of its own, reached at its 198.18 address as a store is reached over the network: no training host holds it,
so a backup goes from one host to another only through the store. The one directory the hosts and the test share
is ``results``: what the training script writes as evidence (hosts.log, the steps each worker trained, its final
weights) and the engines' configuration (Slurm's conf, munge socket and spool; Spark's logs and driver script),
never a backup, never a staging directory.

The training and the checks are tests/storage_hosts.py's (tests/training/checkpoint_script.py, equal to one
uninterrupted process within 1e-5, the workers bit-identical, the CSV log in the store whole). Kills are timed by
events: the script holds before global step KILL_AT (``KILL_SIGNAL=EXTERNAL``: it writes ready-<rank>.json and
waits), the test waits there for the commit it needs in the store and then takes the host away (`Host.kill_all`:
every process on it SIGKILLed at once).

What each test shows (the numbers print as ``MEASURED {...}``, for docs/fault-tolerance.md):

* `stratkit launch --nnodes 2` on h1 and h2; h1 (the chief and the rendezvous) dies before step 23; the job
  restarts on h2 and a fresh h3, which serves the rendezvous and becomes the chief;
* ``--nnodes 1:2``: h4 trains alone, h5 arrives mid-epoch and its worker reads the chief's backup from the store;
* a Spark standalone cluster (master and driver on h6, workers on h7 and h8): the host of worker 1 dies, and
  `SparkRunner(max_retries=1)` runs the stage again on the surviving worker and h9's, which joined meanwhile;
* Slurm (h10 to h13): examples/slurm_requeue.sh on h10 and h11, the nodes drained and the job told to stop (USR1);
  it is requeued onto h12 and h13;
* the GCS emulator and Azurite start on the store host too and serve the other hosts (no training: the backup
  tests of tests/training/test_remote_backups.py run every store on loopback).

RayRunner on hosts without a shared disk is tests/ray/test_ray_storage_hosts.py (``make test-ray``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import hosts
import stores
from procs import REPO_ROOT, child_env
from storage_hosts import BACKUP_EVERY, SCRIPT, OnHost, Reference, Run, measured, staged, staging_on, wait_until
from stratkit.launch.rendezvous import TOKEN_VAR

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.multiworker, pytest.mark.storage_hosts]

TOKEN = "0123456789abcdef0123456789abcdef"
#: Hosts of the module (one network; each test takes its own, so every replacement is a host that saw nothing):
#: h1-h3 launch, h4-h5 elastic, h6-h9 Spark, h10-h13 Slurm, h14 the store.
LAUNCH, ELASTIC, SPARK, SLURM, STORE = slice(0, 3), slice(3, 5), slice(5, 9), slice(9, 13), 13


@dataclass
class Site:
    hosts: list[hosts.Host]
    store: stores.S3Server
    results: Path
    reference: Reference

    def run(self, name: str) -> Run:
        return Run.new(self.store, self.reference, self.results, name)


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


def launcher(host: hosts.Host, nnodes: str, serving: hosts.Host, env: dict[str, str], *extra: str) -> OnHost:
    """`stratkit launch --nnodes NNODES --rdzv-endpoint SERVING:29400 -- python checkpoint_script.py` on `host`."""
    argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", nnodes, "--rdzv-endpoint",
            f"{serving.address}:29400", "--rdzv-timeout", "120", *extra, "--", sys.executable, str(SCRIPT)]
    return OnHost(host, argv, {**env, TOKEN_VAR: TOKEN})


# -- the other stores ------------------------------------------------------------------------------------------------
WRITE = """
import sys
from stratkit import storage
storage.open_store(sys.argv[1]).write_bytes("probe.txt", ("from " + sys.argv[2]).encode())
"""


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_gcs_and_azure_on_the_store_host_serve_the_other_hosts(site, scheme):
    """The GCS emulator and Azurite start on a test host too: a process on h1 writes through stratkit.storage to the
    store host's address, and the test reads the object back through its proxy (the training runs above use S3)."""
    stores.gate(scheme)
    with stores.SERVERS[scheme](host=site.hosts[STORE]) as server:
        url = server.url(server.make_bucket(f"probe-{os.getpid()}-{os.urandom(3).hex()}"), "run1")
        h1 = site.hosts[0]
        wrote = h1.run([sys.executable, "-c", WRITE, url, h1.name], timeout=120,
                       env=server.client_env(child_env()))
        assert wrote.returncode == 0, wrote.stdout[-3000:]
        assert server.fs().cat(f"{url.split('://', 1)[1]}/probe.txt") == b"from h1"


# -- stratkit launch --nnodes ----------------------------------------------------------------------------------------
def test_launch_a_host_killed_mid_epoch_restarts_on_a_fresh_host_from_the_store(site):
    """h1 (node 0: the chief and the rendezvous) dies before step 23, once the backup of step 21 is committed;
    the job restarts on h2 and a fresh h3 (which serves and becomes the chief): steps 21 and 22 again, then the run
    ends as one process."""
    h1, h2, h3 = site.hosts[LAUNCH]
    run = site.run("launch")
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
    run = site.run("elastic")
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


# -- Spark standalone ------------------------------------------------------------------------------------------------
SPARK_DRIVER = r'''
import json, os, sys, time

from pyspark.sql import SparkSession

from stratkit.spark import SparkRunner, SparkTrainingError

MASTER, ADDRESS, SCRIPT = sys.argv[1:4]
RUN, STORE_VARIABLES = json.loads(sys.argv[4]), json.loads(sys.argv[5])


def train(settings, script):
    """tests/training/checkpoint_script.py as this task's training; its attempt is the runner's, from 0."""
    import os, runpy, socket, sys

    os.environ.update(settings)
    os.environ["ATTEMPT"] = str(int(os.environ["STRATKIT_SPARK_ATTEMPT"]) - 1)
    print("RUNNING ON " + socket.gethostname(), flush=True)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    return socket.gethostname()


builder = (SparkSession.builder.master(MASTER).appName("stratkit-storage-hosts")
           .config("spark.driver.host", ADDRESS).config("spark.driver.bindAddress", ADDRESS)
           .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
           .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.cores.max", "2")
           .config("spark.executor.memory", "512m")
           # the retried barrier stage waits for the slot of the executor that replaces the lost one
           .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
           .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "300")
           .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", "")))
for name in STORE_VARIABLES:   # the store's endpoint and credentials (docs/storage.md): the executors' environment
    builder = builder.config(f"spark.executorEnv.{name}", os.environ[name])
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
deadline = time.monotonic() + 120
while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:   # the driver and two executors
    if time.monotonic() > deadline:
        raise SystemExit("the two executors did not register within 120 s")
    time.sleep(0.2)
print("EXECUTORS READY", flush=True)
runner = SparkRunner(num_workers=2, max_retries=1, timeout=480)
try:
    out = {"result": runner.run(train, RUN, SCRIPT), "attempts": runner.last_run.attempts}
except SparkTrainingError as error:
    out = {"error": type(error).__name__, "message": str(error)}
print("DRIVER " + json.dumps(out), flush=True)
spark.stop()
'''


@pytest.mark.spark
def test_spark_a_lost_worker_host_the_stage_retried_on_a_fresh_one_resumes_from_the_store(site):
    """A master and the driver on h6, workers on h7 and h8 (1 core each, the app takes 2). Worker 1's host dies
    before step 23; h9's worker registered meanwhile (as an autoscaler's replacement), so the master gives the app
    an executor there, and `SparkRunner(max_retries=1)` runs the barrier stage again on the surviving host and h9."""
    from test_spark_hosts import PORT, Cluster

    head, *workers, spare = site.hosts[SPARK]
    run = site.run("spark")
    workdir = site.results / "spark-cluster"      # its logs, (empty) conf and driver script: never training files
    workdir.mkdir()
    cluster = Cluster(head, workers[0], workdir)
    cluster.master = f"spark://{head.name}:{PORT}"

    def worker(host: hosts.Host) -> None:        # its work directory (the executors' own) on the host's disk
        cluster.start(f"worker-{host.name}", host, ["org.apache.spark.deploy.worker.Worker", cluster.master,
                                                    "--host", host.name, "--cores", "1", "--memory", "1g",
                                                    "--webui-port", "0", "--work-dir", "/tmp/spark-work"],
                      "Successfully registered with master", timeout=120)

    began, phases = time.monotonic(), {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - began, 1)

    try:
        cluster.start("master", head, ["org.apache.spark.deploy.master.Master", "--host", head.name, "--port",
                                       str(PORT), "--webui-port", "0"], "I have been elected leader", timeout=120)
        script = workdir / "driver.py"
        script.write_text(SPARK_DRIVER)
        settings = run.settings(KILL_AT="23", KILL_RANK="1", KILL_SIGNAL="EXTERNAL")
        env = {**cluster.env(head), **site.store.env}
        # the workers' JVMs and the driver's start side by side (the driver waits for its two executors)
        failed: list[BaseException] = []

        def start(host: hosts.Host) -> None:
            try:
                worker(host)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
                failed.append(exc)

        starting = [threading.Thread(target=start, args=(host,)) for host in workers]
        for thread in starting:
            thread.start()
        driver = OnHost(head, [sys.executable, str(script), cluster.master, head.address, str(SCRIPT),
                               json.dumps(settings), json.dumps(sorted(site.store.env))], env)
        for thread in starting:
            thread.join()
        if failed:
            raise failed[0]
        phase("cluster up")
        wait_until(lambda: "EXECUTORS READY" in driver.out, "the app's two executors", 180, [driver])
        phase("executors")
        worker(spare)                             # it joins while the app trains: the app holds all its cores
        wait_until((run.out / "ready-1.json").exists, "worker 1 at step 23", 300, [driver])
        wait_until(lambda: run.committed()[:1] == [(2, 1)], "the commit of step 21", 120, [driver])
        phase("step 23")
        assert staged(spare) == [] and spare.name not in run.ran_on()[0].values()
        pid = json.loads((run.out / "ready-1.json").read_text())["pid"]
        lost = next(h for h in workers if pid in h.pids())
        killed = time.time()
        lost.kill_all(rounds=20)                  # the host is gone: its Spark worker, executor, training process
        staging_on(spare, [driver])
        phase("resumed on the fresh host")
        code = driver.finish(480)
        phase("done")
    finally:
        cluster.stop()
    out = driver.said("DRIVER ")
    assert code == 0 and "result" in out, driver.tail(6000) + cluster.logs()
    survivor = next(h for h in workers if h is not lost)
    hosts_of = run.ran_on()
    assert out["attempts"] == 2 and sorted(hosts_of[1].values()) == sorted([survivor.name, spare.name]), hosts_of
    assert hosts_of[0][1] == lost.name and out["result"] == hosts_of[1][0]
    fresh = next(rank for rank, name in hosts_of[1].items() if name == spare.name)
    assert f"[worker:{fresh}] [stratkit] resumed from {run.url}/backups/" in driver.out + driver.err, driver.tail()
    for rank in (0, 1):
        assert run.retrained(rank) == [21, 22]
    worst = run.equals_reference()
    measured("spark", retrained=2, max_weight_diff=worst,
             first_step_after_kill_s=round(run.first_step_after(killed), 1), seconds=phases)


# -- Slurm -----------------------------------------------------------------------------------------------------------
#: The user's train.py for examples/slurm_requeue.sh: checkpoint_script.py, its attempt Slurm's restart count.
REQUEUE_TRAIN = f"""
import os, runpy, sys
os.environ["ATTEMPT"] = os.environ.get("SLURM_RESTART_COUNT", "0")
sys.argv = [{str(SCRIPT)!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_slurm_a_job_requeued_onto_other_nodes_resumes_from_the_store(site):
    """examples/slurm_requeue.sh (2 nodes) runs on h10 and h11; the admin drains both and Slurm tells the job to
    stop (USR1, the example's notice): every task backs up at one step, the backup is committed to the store before
    they exit 75, the script requeues the job, and Slurm starts it on h12 and h13, whose disks never saw it."""
    import slurm_cluster

    hosts.gate(slurm_cluster.unavailable_reason())
    nodes = site.hosts[SLURM]
    run = site.run("slurm")
    (run.out / "train.py").write_text(REQUEUE_TRAIN)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # the shared directory is Slurm's configuration, state and spool, and the job's (submission) directory
    with slurm_cluster.slurm_cluster(nodes, site.results / "slurm-cluster") as cluster:
        submit = cluster.run(["sbatch", "--parsable", str(REPO_ROOT / "examples" / "slurm_requeue.sh")],
                             timeout=60, env=run.env(PATH=path, STEP_SECONDS="0.05"), cwd=run.out)
        assert submit.returncode == 0, submit.stdout
        job = submit.stdout.strip()
        output = run.out / f"stratkit-{job}.out"

        def trained(attempt: int, at_least: int) -> bool:
            return sum(a == attempt for a, _ in run.steps(0)) >= at_least

        wait_until(lambda: trained(0, 16) and run.committed(), "16 steps and a commit of the first run", 300)
        first = sorted(run.ran_on()[0].values())
        drained = cluster.run(["scontrol", "update", f"NodeName={','.join(first)}", "State=DRAIN",
                               "Reason=stratkit-test-hosts-going-away"], timeout=30)
        assert drained.returncode == 0, drained.stdout
        noticed = time.time()
        sent = cluster.run(["scancel", "--signal=USR1", "--batch", job], timeout=30)
        assert sent.returncode == 0, sent.stdout
        wait_until(lambda: all((run.out / f"result-{r}.json").exists() for r in (0, 1)), "the requeued job's end",
                   420)
        record = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"}, timeout=120)
        text = output.read_text(errors="replace")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, text[-6000:])
    hosts_of = run.ran_on()
    assert first == [nodes[0].name, nodes[1].name] and sorted(hosts_of[1].values()) == [nodes[2].name, nodes[3].name]
    assert f"requeueing job {job}" in text and f"resumed from {run.url}/backups/" in text, text[-6000:]
    again = [run.retrained(rank) for rank in (0, 1)]
    assert all(len(steps) <= 1 for steps in again), again   # a notice: at most the step it came in
    worst = run.equals_reference()
    measured("slurm", retrained=max(map(len, again)), max_weight_diff=worst,
             first_step_after_notice_s=round(run.first_step_after(noticed), 1))
