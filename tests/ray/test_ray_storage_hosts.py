"""RayRunner on a Ray cluster of test hosts that share no disk: a lost node's task resumes on a fresh node from S3.

Every host has a disk of its own (tests/hosts.py ``private_disks``: Ray's session files, the backups' staging and
the training's working directory are each host's), and the S3 server (moto, IAM on) runs on a host of its own
(tests/storage_hosts.py says what the runs share and how they are checked). The Ray head on h1 runs no tasks
(``--num-cpus=0``: the driver's node); h2 and h3 have one CPU each, so `RayRunner(num_workers=2)` places one
worker on each. h4 joins once they train, as an autoscaler's replacement would. Before step 23, once the backup of
step 21 is committed, the host of worker 1 dies (`Host.kill_all`); `min_workers=2` makes the runner wait for Ray's
verdict on the lost node, count the live ones (the survivor and h4) and run both workers again: the one on h4
reads its backup from the store. The store's credentials reach the tasks through
``ray.init(runtime_env={"env_vars": ...})``, as docs/storage.md says.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

import hosts
import stores
from ray_helpers import RAY, hosts_env, needs_ray
from storage_hosts import SCRIPT, OnHost, Reference, Run, measured, staged, staging_on, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.ray, pytest.mark.multiworker,
              pytest.mark.storage_hosts, needs_ray]

PORT = 6380
DRIVER = r'''
import json, os, sys

import ray

from stratkit.ray import RayRunner

ADDRESS, SCRIPT = sys.argv[1:3]
RUN, STORE_VARIABLES = json.loads(sys.argv[3]), json.loads(sys.argv[4])


def train(settings, script):
    """tests/training/checkpoint_script.py as this task's training; a retry is attempt 1 (the test wrote `sent`
    once it had taken the host away, before any retry can start)."""
    import os, runpy, socket, sys

    os.environ.update(settings)
    os.environ["ATTEMPT"] = "1" if os.path.exists(os.path.join(settings["OUT"], "sent")) else "0"
    print("RUNNING ON " + socket.gethostname(), flush=True)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    return socket.gethostname()


ray.init(address=ADDRESS, runtime_env={"env_vars": {name: os.environ[name] for name in STORE_VARIABLES}})
runner = RayRunner(num_workers=2, min_workers=2, max_retries=1, timeout=480)
try:
    out = {"result": runner.run(train, RUN, SCRIPT)}
except Exception as error:  # noqa: BLE001 - reported to the test
    out = {"error": type(error).__name__, "message": str(error)}
report = runner.last_run
out["report"] = {"attempts": report.attempts, "workers": report.workers, "nodes": report.nodes}
print("DRIVER " + json.dumps(out), flush=True)
'''


def test_ray_a_lost_nodes_task_resumes_on_a_fresh_node_from_the_store(tmp_path):
    hosts.gate()
    results = tmp_path / "results"
    results.mkdir()
    reference = Reference(tmp_path)
    try:
        with hosts.make_hosts(5, private_disks=True, shared=[results]) as made, \
                stores.S3Server(host=made[4]) as store:
            h1, h2, h3, h4, _ = made
            run = Run.new(store, reference, results, "ray")
            addresses = ",".join(h.address for h in made) + "," + ",".join(h.name for h in made)
            env = hosts_env({"NO_PROXY": f"127.0.0.1,localhost,{addresses}"})   # the store too: no proxy
            common = ["--disable-usage-stats", "--num-gpus=0"]
            head = h1.run([RAY, "start", "--head", f"--node-ip-address={h1.address}", f"--port={PORT}",
                           "--include-dashboard=false", "--num-cpus=0", *common], timeout=180, env=env)
            assert head.returncode == 0, head.stdout[-3000:]

            def node(host: hosts.Host) -> None:
                started = host.run([RAY, "start", f"--address={h1.address}:{PORT}", f"--node-ip-address={host.address}",
                                    "--num-cpus=1", *common], timeout=180, env=env)
                assert started.returncode == 0, started.stdout[-3000:]

            node(h2)
            node(h3)
            script = results / "driver.py"
            script.write_text(DRIVER)
            driver = OnHost(h1, [sys.executable, str(script), f"{h1.address}:{PORT}", str(SCRIPT),
                                 json.dumps(run.settings(KILL_AT="23", KILL_RANK="1", KILL_SIGNAL="EXTERNAL")),
                                 json.dumps(sorted(store.env))], {**env, **store.env})  # the user's credentials
            wait_until(lambda: run.out.joinpath("hosts.log").exists()
                       and len(run.out.joinpath("hosts.log").read_text().splitlines()) == 2,
                       "both workers placed", 300, [driver])
            node(h4)                                  # joins while they train
            wait_until((run.out / "ready-1.json").exists, "worker 1 at step 23", 300, [driver])
            wait_until(lambda: run.committed()[:1] == [(2, 1)], "the commit of step 21", 120, [driver])
            assert staged(h4) == []
            pid = json.loads((run.out / "ready-1.json").read_text())["pid"]
            lost = next(h for h in (h2, h3) if pid in h.pids())
            killed = time.time()
            lost.kill_all(rounds=20)                  # its raylet, the task's actor and training process
            (run.out / "sent").write_text("")         # (what tells the retry's processes they are attempt 1)
            staging_on(h4, [driver])
            code = driver.finish(480)
            out = driver.said("DRIVER ")
            assert code == 0 and "result" in out, driver.tail(6000)
            survivor = h3 if lost is h2 else h2
            hosts_of = run.ran_on()
            assert out["report"]["attempts"] == 2 and out["report"]["workers"] == [2, 2], (out, driver.tail())
            assert hosts_of[0][1] == lost.name and sorted(hosts_of[1].values()) == sorted([survivor.name, h4.name])
            fresh = next(rank for rank, name in hosts_of[1].items() if name == h4.name)
            assert f"[worker:{fresh}] [stratkit] resumed from {run.url}/backups/" in driver.out + driver.err, \
                driver.tail()
            for rank in (0, 1):
                assert run.retrained(rank) == [21, 22]
            worst = run.equals_reference()      # (the CSV log read from the store: before it goes)
        # (leaving the hosts killed every Ray process on them; never `ray stop`: it stops every Ray on the machine)
    finally:
        reference.stop()
    verdict = re.search(r"Ray's verdict after ([0-9.]+) s", driver.out + driver.err)
    measured("ray", retrained=2, max_weight_diff=worst, first_step_after_kill_s=round(run.first_step_after(killed), 1),
             ray_verdict_s=float(verdict[1]) if verdict else None)
