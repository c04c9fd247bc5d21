"""RayRunner on a real two-node Ray cluster across two test hosts (tests/hosts.py), token authentication on.

`ray start --head` on h1 (198.18.0.1), `ray start --address=...` on h2 (198.18.0.2), no dashboard, no usage
reporting, Ray's files in the test's own directory; the driver (`ray_hosts_driver.py`) runs on h1. One
cluster: 2 workers, one per node, train exactly as one process (<= 1e-5), through RayRunner and inside
Ray Train (TensorflowTrainer + stratkit.Trainer); then h2 is killed in the middle of
a long run, and the run fails naming the task that ran there and node 198.18.0.2 within 60 s. Leaving the test, `ray stop`
runs on both hosts and the hosts' teardown kills whatever is left in their namespaces.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from procs import REPO_ROOT
from ray_helpers import RAY_ENV, TOKEN, needs_ray

pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.ray, needs_ray]

PORT = 6380
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
DRIVER = REPO_ROOT / "tests" / "ray" / "ray_hosts_driver.py"


def _env(tmp_path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({k: v for k, v in RAY_ENV.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"})
    env["RAY_AUTH_TOKEN"] = TOKEN
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(REPO_ROOT), str(REPO_ROOT / "tests")])
    env["PYTHONUNBUFFERED"] = "1"
    # `ray start --head` always starts Ray's dashboard process (minimal with --include-dashboard=false), and in
    # Ray 2.60 it probes cloud metadata (169.254.169.254, metadata.google.internal) and, with usage stats off,
    # still sends a "disabled" report to usage-stats.ray.io. Its HTTP goes through `requests`, which honours
    # these: a loopback port where nothing listens, so nothing leaves (the tests' network rule checks it).
    env["HTTP_PROXY"] = env["HTTPS_PROXY"] = "http://127.0.0.1:9"
    env["NO_PROXY"] = "127.0.0.1,localhost,198.18.0.1,198.18.0.2,h1,h2"
    return env


def test_two_ray_nodes_train_exactly_and_a_lost_node_is_named(two_hosts, tmp_path):
    h1, h2 = two_hosts
    env = _env(tmp_path)
    # Ray's Unix sockets live under its temp dir: a pytest tmp_path is too long for them (107 bytes).
    temp = tempfile.mkdtemp(prefix="skray-")
    common = ["--num-cpus=2", "--disable-usage-stats", "--num-gpus=0", f"--temp-dir={temp}"]
    try:
        head = h1.run([RAY, "start", "--head", "--node-ip-address=198.18.0.1", f"--port={PORT}", "--include-dashboard=false", *common],
                      timeout=180, env=env)
        assert head.returncode == 0, head.stdout[-3000:]
        node = h2.run([RAY, "start", f"--address=198.18.0.1:{PORT}", "--node-ip-address=198.18.0.2", *common],
                      timeout=180, env=env)
        assert node.returncode == 0, node.stdout[-3000:]

        out = tmp_path / "out"
        out.mkdir()
        driver = h1.popen([sys.executable, str(DRIVER), f"198.18.0.1:{PORT}", str(out)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump():
            for line in driver.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        seen: list[str] = []

        def next_line(deadline: float) -> str:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                raise AssertionError("the driver ended early:\n" + "\n".join(seen[-80:]))
            seen.append(line)
            return line

        deadline = time.monotonic() + 400
        result = single = ray_train = None
        while ray_train is None:
            line = next_line(deadline)
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
        while not next_line(deadline).startswith("[worker:1] EPOCH 1"):
            pass
        h2.kill_all(rounds=3)
        killed = time.monotonic()
        while True:
            line = next_line(killed + 90)
            if line.startswith("LOST "):
                lost = json.loads(line[len("LOST "):])
                break
        took = time.monotonic() - killed
        # The task on h2 is named, with its node (which of the two it is, Ray's placement decides).
        assert lost["task"] in ("worker:0", "worker:1") and lost["node"] == "198.18.0.2" and lost["lost"], lost
        assert f"task {lost['task']}" in lost["summary"] and "was lost with node 198.18.0.2" in lost["summary"]
        assert took < 60, f"the lost node was named after {took:.0f} s"
        assert driver.wait(timeout=60) == 0, "\n".join(seen[-40:])
    finally:
        for host in (h2, h1):
            host.run([RAY, "stop", "--force"], timeout=60, env=env)
        shutil.rmtree(temp, ignore_errors=True)
