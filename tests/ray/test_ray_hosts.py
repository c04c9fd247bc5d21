"""RayRunner on a real two-node Ray cluster across two test hosts (tests/hosts.py), token authentication on.

`ray start --head` on h1 (198.18.0.1), `ray start --address=...` on h2 (198.18.0.2), no dashboard, no usage
reporting, Ray's files in the test's own directory; the driver (`ray_hosts_driver.py`) runs on h1. One
cluster: 2 workers, one per node, train exactly as one process (<= 1e-5), through RayRunner and inside
Ray Train (TensorflowTrainer + stratkit.Trainer); then h2 is killed in the middle of
a long run, and the run fails naming the task that ran there and node 198.18.0.2 within 60 s. Leaving the test, every
process on both hosts is killed (`ray_helpers.ray_on_hosts`; never `ray stop`, which stops every Ray on the machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from procs import REPO_ROOT
from ray_helpers import Lines, hosts_env, needs_ray, ray_on_hosts

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.ray, needs_ray]

DRIVER = REPO_ROOT / "tests" / "ray" / "ray_hosts_driver.py"


def test_two_ray_nodes_train_exactly_and_a_lost_node_is_named(two_hosts, tmp_path):
    h1, h2 = two_hosts
    env = hosts_env()
    with ray_on_hosts(h1, h2, env) as address:
        out = tmp_path / "out"
        out.mkdir()
        driver = h1.popen([sys.executable, str(DRIVER), address, str(out)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines = Lines(driver)
        deadline = time.monotonic() + 400
        result = single = ray_train = None
        while ray_train is None:
            line = lines.next(deadline)
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            elif line.startswith("SINGLE "):
                single = json.loads(line[len("SINGLE "):])
            elif line.startswith("RAYTRAIN "):
                ray_train = json.loads(line[len("RAYTRAIN "):])
        got = result["got"]
        assert sorted(result["nodes"].values()) == ["198.18.0.1", "198.18.0.2"]  # one worker per node
        assert got["replicas"] == 2 and got["source"] == "ray"
        assert got["host"] == ("h1" if result["nodes"]["worker:0"] == "198.18.0.1" else "h2")
        worst = max(abs(a - b) for g, w in zip(got["weights"], single["weights"]) for a, b in zip(g, w))
        assert worst <= 1e-5, f"2 Ray nodes vs one process: max |diff| of weights {worst}"
        # The same job inside Ray Train across the two nodes: exact too, the workers identical.
        assert sorted(r["host"] for r in ray_train) == ["h1", "h2"]
        assert ray_train[0]["weights"] == ray_train[1]["weights"] and ray_train[0]["replicas"] == 2
        worst = max(abs(a - b) for g, w in zip(ray_train[0]["weights"], single["weights"]) for a, b in zip(g, w))
        assert worst <= 1e-5, f"Ray Train on 2 nodes vs one process: max |diff| of weights {worst}"

        # The long run: kill h2 (its raylet, its task's actor and training process) once both tasks train.
        lines.until(lambda line: line.startswith("[worker:1] EPOCH 1"), deadline)
        h2.kill_all(rounds=3)
        killed = time.monotonic()
        lost = json.loads(lines.until(lambda line: line.startswith("LOST "), killed + 90)[len("LOST "):])
        took = time.monotonic() - killed
        # The task on h2 is named, with its node (which of the two it is, Ray's placement decides).
        assert lost["task"] in ("worker:0", "worker:1") and lost["node"] == "198.18.0.2" and lost["lost"], lost
        assert f"task {lost['task']}" in lost["summary"] and "was lost with node 198.18.0.2" in lost["summary"]
        assert took < 60, f"the lost node was named after {took:.0f} s"
        assert driver.wait(timeout=60) == 0, lines.tail(40)
