"""`stratkit launch --nnodes` and preemption: a task's exit 75 restarts every node without counting, and a node
whose own launcher is preempted ends every node with 75 (elastic: it leaves, the others go on).

Two real launchers on loopback (`--no-private-network`), the second a moment late as a second machine would
start. The tasks are small Python scripts (no TensorFlow) that behave as a training process with a backup does:
on SIGTERM they exit 75 (`stratkit.status.EXIT_PREEMPTED`). The same with real training on test hosts:
tests/launch/test_elastic.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procs import child_env, free_ports
from stratkit.launch.rendezvous import TOKEN_VAR
from stratkit.launch.standby import STANDBY_VAR

TOKEN = "0123456789abcdef0123456789abcdef"

pytestmark = pytest.mark.slow

#: Round 0: worker 1 is preempted (exits 75 as a task does after its preemption backup); worker 0 trains on and
#: saves (75) when it is stopped. Round 1: both finish.
PREEMPTED_ONCE = """
    import json, os, signal, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = int(os.environ["STRATKIT_RESTART_COUNT"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    print(f"task {index} round {attempt}", flush=True)
    if attempt == 0 and index == 1:
        time.sleep(1)
        sys.exit(75)
    time.sleep(2 if attempt else 30)
"""

#: Saves (exits 75) on SIGTERM; in a later round finishes at once.
SAVES_ON_SIGTERM = """
    import json, os, signal, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = int(os.environ["STRATKIT_RESTART_COUNT"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    print(f"ready {index} round {attempt}", flush=True)
    time.sleep(1 if attempt else 60)
"""


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "task.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


class _Nodes:
    """Two launchers of one --nnodes run on loopback, their output read as it comes."""

    def __init__(self, nnodes: str, script: list[str], tmp_path: Path, *extra: str, standby: bool = True) -> None:
        port = free_ports(1)[0]
        self.logs = [tmp_path / "node0", tmp_path / "node1"]
        self.procs: list[subprocess.Popen[str]] = []
        for number, logs in enumerate(self.logs):
            argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", nnodes, "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--no-private-network", "--stop-grace", "5", "--rdzv-last-call", "5",
                    "--log-dir", str(logs), *extra, "--", *script]
            env = child_env(None, {TOKEN_VAR: TOKEN, STANDBY_VAR: None if standby else "0"})
            self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, start_new_session=True))
            if number == 0:
                time.sleep(1)

    def wait_until_running(self, timeout: float = 60) -> None:
        """Until both tasks printed "ready <index> round 0"."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            logs = "".join(p.read_text() for logs in self.logs if logs.exists() for p in logs.glob("*.log"))
            if "ready 0 round 0" in logs and "ready 1 round 0" in logs:
                return
            time.sleep(0.1)
        raise AssertionError(f"the tasks were not both ready within {timeout} s: {self.finish(1)}")

    def launcher_of(self, index: int) -> int:
        """Which launcher runs worker `index` (once running): a node's rank is its place in the rendezvous, and
        under load the launcher started second can join first."""
        found = [number for number, logs in enumerate(self.logs)
                 if f"ready {index} round 0" in "".join(p.read_text() for p in logs.glob("*.log"))]
        assert len(found) == 1, found
        return found[0]

    def finish(self, timeout: float = 120) -> list[tuple[int, str]]:
        out = []
        for proc in self.procs:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
            out.append((proc.returncode, err))
        return out

    def outcomes(self, number: int) -> list[str]:
        events = [json.loads(line) for line in (self.logs[number] / "events.jsonl").read_text().splitlines()]
        return [e["outcome"] for e in events if e["event"] == "attempt_end"]


@pytest.mark.parametrize("nnodes", ["2", "1:2"], ids=["nnodes-2", "nnodes-1:2"])
def test_a_task_preempted_on_one_node_restarts_every_node_without_counting_against_max_restarts(tmp_path, nnodes):
    nodes = _Nodes(nnodes, _script(tmp_path, PREEMPTED_ONCE), tmp_path, "--max-restarts", "0")
    (code0, err0), (code1, err1) = nodes.finish()
    assert [code0, code1] == [0, 0], (err0[-3000:], err1[-3000:])
    for err in (err0, err1):  # (under MIN:MAX the tasks are forked from each node's standby, both rounds)
        assert "attempt 1 was preempted: worker:1 on node 1 (127.0.0.1)" in err, err[-3000:]
        assert "a preemption is not counted against --max-restarts" in err, err[-3000:]
        assert "root cause" not in err
    assert nodes.outcomes(0)[-1] == nodes.outcomes(1)[-1] == "succeeded"


def test_a_node_whose_launcher_is_preempted_ends_every_node_with_75(tmp_path):
    nodes = _Nodes("2", _script(tmp_path, SAVES_ON_SIGTERM), tmp_path, "--max-restarts", "1")
    nodes.wait_until_running()
    os.kill(nodes.procs[1].pid, signal.SIGTERM)  # the platform takes node 1's machine: SIGTERM to its launcher
    (code0, err0), (code1, err1) = nodes.finish()
    assert [code0, code1] == [75, 75], (err0[-3000:], err1[-3000:])
    assert "its launcher was preempted by SIGTERM" in err0 and "exiting 75 (preempted)" in err0, err0[-3000:]
    assert "restarting" not in err0 + err1  # that node's machine is going away: the job's restart resumes


def test_under_min_max_a_node_whose_launcher_is_preempted_leaves_and_the_other_goes_on(tmp_path):
    # (without the standby: these tasks import no TensorFlow, and the decision is the rendezvous')
    nodes = _Nodes("1:2", _script(tmp_path, SAVES_ON_SIGTERM), tmp_path, standby=False)
    nodes.wait_until_running()
    second, first = nodes.launcher_of(1), nodes.launcher_of(0)   # node 1 leaves; node 0 holds the rendezvous
    os.kill(nodes.procs[second].pid, signal.SIGTERM)
    ended = nodes.finish()
    (code0, err0), (code1, err1) = ended[first], ended[second]
    assert code1 == 75, err1[-3000:]
    assert code0 == 0, err0[-3000:]
    assert "world size 2 -> 1: node 1 " in err0 and "lost (its launcher was preempted by SIGTERM" in err0, err0[-3000:]
    assert nodes.outcomes(first) == ["resized", "succeeded"], nodes.outcomes(first)
