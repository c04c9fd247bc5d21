"""stratkit on a real Spark standalone cluster across two test hosts (tests/hosts.py).

A master on h1, one worker per host (1 core each), and the driver on h1 too (the root namespace has no
route to the hosts): a small driver script runs ``SparkRunner(num_workers=2).run(train_fn)`` against
``spark://h1:7077``, as a user would. One cluster for the module; the test that kills h2 runs last.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hosts
from procs import child_env

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.spark]

PORT = 7077

#: The drivers' Spark session (this module's and tests/test_spark_elastic_hosts.py's), one text so both run the
#: same cluster set-up: the script defines MASTER, ADDRESS and APP; it waits for both executors to register.
SESSION = r'''
spark = (SparkSession.builder.master(MASTER).appName(APP)
         .config("spark.driver.host", ADDRESS).config("spark.driver.bindAddress", ADDRESS)
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.cores.max", "2")
         .config("spark.executor.memory", "512m")
         .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", ""))
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
deadline = time.monotonic() + 60
while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:   # the driver and two executors
    if time.monotonic() > deadline:
        raise SystemExit("the two executors did not register within 60 s")
    time.sleep(0.2)
print("EXECUTORS READY", flush=True)
'''

DRIVER = r'''
import json, os, socket, sys, time

from pyspark.sql import SparkSession

from stratkit.spark import SparkRunner, SparkTrainingError

MODE, MASTER, ADDRESS = sys.argv[1], sys.argv[2], sys.argv[3]
APP = "stratkit-hosts"


def uneven_training():
    """tests/spark/test_spark_runs.py's uneven_training (7 rows, global batch 4), saying where it runs."""
    import socket

    print("RUNNING ON " + socket.gethostname(), flush=True)
    import stratkit

    trainer = stratkit.Trainer()
    import keras
    import numpy as np

    def build():
        model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    model = trainer.build(build)
    history = trainer.fit(model, (np.eye(7, dtype="float32"), np.ones((7, 1), "float32")), epochs=2,
                          global_batch_size=4, shuffle=False, verbose=0)
    return {"replicas": trainer.num_replicas, "host": socket.gethostname(),
            "w": [float(v) for v in np.ravel(model.get_weights()[0])],
            "loss": [float(v) for v in history.history["loss"]]}


def sleeping():
    """Ready to train, then waits: the test takes h2 away meanwhile."""
    import socket
    import time

    import stratkit

    trainer = stratkit.Trainer()
    print("SLEEPING ON " + socket.gethostname(), flush=True)
    time.sleep(300)
    return trainer.num_replicas

''' + SESSION + r'''
runner = SparkRunner(num_workers=2, timeout=None if MODE == "parity" else 120)
try:
    result = runner.run(uneven_training if MODE == "parity" else sleeping)
    out = {"result": result}
except SparkTrainingError as error:
    out = {"error": type(error).__name__, "message": str(error)}
out["run_id"] = runner.last_run.run_id if runner.last_run else None
print("DRIVER " + json.dumps(out), flush=True)
spark.stop()
'''


class Cluster:
    def __init__(self, h1: hosts.Host, h2: hosts.Host, workdir: Path) -> None:
        self.h1, self.h2, self.workdir = h1, h2, workdir
        self.spark_home = Path(__import__("pyspark").__file__).parent
        self.daemons: list[tuple[str, subprocess.Popen, Path]] = []
        self.master = f"spark://h1:{PORT}"

    def env(self, host: hosts.Host) -> dict[str, str]:
        conf = self.workdir / "conf"
        conf.mkdir(exist_ok=True)
        return child_env(env={"SPARK_HOME": str(self.spark_home), "SPARK_CONF_DIR": str(conf),
                              "SPARK_LOCAL_IP": host.address, "PYSPARK_PYTHON": sys.executable,
                              "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"})

    def start(self, name: str, host: hosts.Host, argv: list[str], ready: str, timeout: float = 60) -> None:
        log = self.workdir / f"{name}.log"
        handle = open(log, "wb")
        proc = host.popen([str(self.spark_home / "bin" / "spark-class"), *argv], env=self.env(host),
                          stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          start_new_session=True, cwd=self.workdir)
        handle.close()
        self.daemons.append((name, proc, log))
        deadline = time.monotonic() + timeout
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Spark {name} did not start:\n{self.logs()}")
            time.sleep(0.2)

    def start_all(self) -> None:
        """The master on h1, then one 1-core worker per host, each once the one before says it is up (this
        module's fixture and tests/test_spark_elastic_hosts.py start the same cluster)."""
        self.start("master", self.h1, ["org.apache.spark.deploy.master.Master", "--host", "h1", "--port", str(PORT),
                                       "--webui-port", "0"], "I have been elected leader")
        for host in (self.h1, self.h2):
            self.start(f"worker-{host.name}", host,
                       ["org.apache.spark.deploy.worker.Worker", self.master, "--host", host.name,
                        "--cores", "1", "--memory", "1g", "--webui-port", "0",
                        "--work-dir", str(self.workdir / f"work-{host.name}")],
                       "Successfully registered with master")

    def logs(self, tail: int = 3000) -> str:
        return "".join(f"\n--- {name} ---\n{log.read_text(errors='replace')[-tail:]}" for name, _, log in self.daemons)

    def stop(self) -> None:
        for _, proc, _ in self.daemons:
            if proc.poll() is None:
                hosts._kill_group(proc.pid)
        for _, proc, _ in self.daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def driver(self, mode: str) -> Driver:
        script = self.workdir / "driver.py"
        script.write_text(DRIVER)
        env = self.env(self.h1)
        proc = self.h1.popen([sys.executable, str(script), mode, self.master, self.h1.address], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             text=True, start_new_session=True, cwd=self.workdir)
        return Driver(proc)


class Driver:
    """The driver process on h1, its output read line by line as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines, self.new = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.new.put(line)
        self.new.put(None)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:
                return False
            if text in line:
                return True
        return False

    def finish(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            hosts._kill_group(self.proc.pid)
            self.proc.wait()
            pytest.fail(f"the driver ran past {timeout} s:\n{self.output[-6000:]}")
        time.sleep(0.2)   # the reader's last lines
        found = [json.loads(line[7:]) for line in self.lines if line.startswith("DRIVER ")]
        assert found, f"driver exit {self.proc.returncode}:\n{self.output[-6000:]}"
        return found[-1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hosts.gate()
    workdir = tmp_path_factory.mktemp("spark-hosts")
    with hosts.make_hosts(2) as (h1, h2):
        made = Cluster(h1, h2, workdir)
        try:
            made.start_all()
            yield made
        finally:
            made.stop()


def _spark_leftovers(host: hosts.Host, keep: set[int]) -> list[str]:
    """Command lines of processes on `host` other than its name holder and the pids in `keep`."""
    out = []
    for pid in host.pids():
        if pid in keep or (host.holder is not None and pid == host.holder.pid):
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append(f"{pid}: {cmdline[:200]}")
    return out


def _daemon_pids(cluster: Cluster) -> set[int]:
    """The JVMs of the master and workers (spark-class execs java; nsenter execs spark-class)."""
    return {proc.pid for _, proc, _ in cluster.daemons}


def _nothing_left(cluster: Cluster, host: hosts.Host, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _spark_leftovers(host, _daemon_pids(cluster))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_two_hosts_train_an_uneven_batch_as_one_process_and_stream_their_logs(cluster, one_process_uneven):
    want = one_process_uneven
    driver = cluster.driver("parity")
    out = driver.finish(timeout=150)
    log = driver.output
    assert "result" in out, log[-6000:] + cluster.logs()
    got = out["result"]
    assert got["replicas"] == 2
    assert got["w"] == pytest.approx(want["w"], abs=1e-5)
    assert got["loss"] == pytest.approx(want["h"]["loss"], abs=1e-5)
    # the executors ran one on each host, and the line train_fn printed on h2 reached the driver on h1
    ran_on = {line.split("] ", 1)[0] + "]": line.rsplit(" ", 1)[1] for line in log.splitlines()
              if line.startswith("[worker:") and "RUNNING ON " in line}
    assert sorted(ran_on.values()) == ["h1", "h2"], log[-6000:]
    assert got["host"] == ran_on["[worker:0]"]
    assert driver.proc.returncode == 0, log[-6000:]
    assert _nothing_left(cluster, cluster.h1) == []
    assert _nothing_left(cluster, cluster.h2) == []


def test_losing_a_host_mid_run_fails_the_run_with_its_cause_and_leaves_nothing_running(cluster):
    driver = cluster.driver("lost")
    try:
        assert driver.wait_for("SLEEPING ON h2", timeout=90), driver.output[-6000:] + cluster.logs()
        assert driver.wait_for("SLEEPING ON h1", timeout=30) or "SLEEPING ON h1" in driver.output
        killed = time.monotonic()
        # h2 goes away: every process on it (worker, executor, Python workers, training process) killed at once,
        # again until none is left (one may fork meanwhile)
        cluster.h2.kill_all(rounds=20)
        out = driver.finish(timeout=100)
        took = time.monotonic() - killed
    finally:
        if driver.proc.poll() is None:
            hosts._kill_group(driver.proc.pid)
    log = driver.output
    print(f"h2 lost: the run failed {took:.1f} s later: {out.get('message', out)}")
    assert out.get("error") == "SparkTrainingError", log[-6000:]
    assert "timeout" not in out["message"].split("\n", 1)[0].lower(), out["message"]
    # The root cause is the task on h2, whose connection to the driver just ended, not the task on h1 that
    # Spark killed once the barrier stage had lost h2's executor.
    lost = next(line.split("]", 1)[0][1:] for line in log.splitlines() if line.endswith("SLEEPING ON h2"))
    assert "root cause" in out["message"], out["message"]
    assert out["message"].startswith(f"task {lost} "), out["message"]
    assert "without an exit code" in out["message"], out["message"]
    assert took < 60, f"the run took {took:.0f} s to fail after h2 was lost:\n{out['message']}"
    assert _nothing_left(cluster, cluster.h1) == [], log[-4000:]
