"""A search on a real Spark standalone cluster across two test hosts, one of which dies mid-trial.

tests/test_spark_hosts.py's cluster (a master and a 1-core worker on h1, a 1-core worker on h2, the driver on
h1) runs `SparkRunner(num_workers=2, tune=True)` over tests/engine_searches.py's seeded RandomSearch. Once the
tuner on h2 is in its trial's second epoch, h2 dies with everything on it (`Host.kill_all`): its executor is
lost with the tuner, whose lease expires, and its trial runs again on h1's tuner from its backup (the store is
a directory both hosts see). The search ends with one process's trials and scores; Spark runs the lost task
again once a slot frees, as a new tuner that finds the search ended.
"""

from __future__ import annotations

import subprocess
import sys

import engine_searches
import pytest

import hosts
from test_spark_hosts import SESSION, Cluster, Driver

pytestmark = [pytest.mark.slow, pytest.mark.tune_acceptance, pytest.mark.timeout(1800), pytest.mark.hosts, pytest.mark.spark]

DRIVER = r'''
import json, os, sys, time

from pyspark.sql import SparkSession

import engine_searches
from stratkit.spark import SparkRunner

MASTER, ADDRESS, STORE = sys.argv[1], sys.argv[2], sys.argv[3]
APP = "stratkit-tune-hosts"
''' + SESSION + r'''
runner = SparkRunner(num_workers=2, tune=True, timeout=1200)
result = runner.run(engine_searches.seeded_search, "random", STORE, slow=1.0)
print("DRIVER " + json.dumps({"result": result, "lost": runner.last_run.lost,
                              "exit_codes": runner.last_run.exit_codes}), flush=True)
spark.stop()
'''


@pytest.fixture
def cluster(tmp_path):
    hosts.gate()
    with hosts.make_hosts(2) as (h1, h2):
        made = Cluster(h1, h2, tmp_path)
        try:
            made.start_all()
            yield made
        finally:
            made.stop()


def test_a_host_lost_mid_trial_loses_its_tuners_lease_and_the_search_ends_as_one_process(cluster, tmp_path_factory,
                                                                                         tmp_path):
    reference = engine_searches.shared_reference(tmp_path_factory)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    store = tmp_path / "store"
    store.mkdir()
    proc = cluster.h1.popen([sys.executable, str(script), cluster.master, cluster.h1.address, str(store)],
                            env=cluster.env(cluster.h1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True, cwd=tmp_path)
    driver = Driver(proc)
    assert driver.wait_for("HOST h2", timeout=600), driver.output[-6000:] + cluster.logs()
    assert driver.wait_for(" EPOCH 1 TUNER", timeout=300), driver.output[-6000:]
    cluster.h2.kill_all()  # the executor, its Python worker and the tuner's process: the host is gone
    out = driver.finish(timeout=1200)
    assert "result" in out, driver.output[-8000:] + cluster.logs()
    assert out["lost"], out  # h2's tuner, lost after the search started
    assert engine_searches.compare(out["result"], reference["random"]) == [], driver.output[-6000:]
    reruns = [line for line in driver.output.splitlines() if " RUN 2 " in line]
    assert reruns and all("HOST h1" in line for line in reruns), driver.output[-6000:]

