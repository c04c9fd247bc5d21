"""An elastic node's standby (`stratkit.launch.standby`): a task forked from it is the task `python` would start.

One real standby (it imports TensorFlow and Keras) forks each task; the same
probe script also runs as `python probe.py ...` with the same environment, and
the two must print the same: argv, `sys.path[0]`, `__name__`, `__file__`, the
environment, stdout and stderr apart, exit codes (an exception's traceback from
the script's frame on), atexit handlers and a non-daemon thread at exit,
numpy's global generator drawing afresh in each task, and `-m module`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from procs import child_env
from stratkit.launch.standby import ForkedTask, TaskStandby, python_run, wanted

pytestmark = pytest.mark.slow

PROBE = """
    import atexit, json, os, sys, threading, time
    import numpy as np
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
                      "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_") or k == "TF_CONFIG"},
                      "cwd": os.getcwd(), "draw": float(np.random.random()), "stdin": sys.stdin.read()}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread ran", flush=True))).start()
    how = sys.argv[1] if len(sys.argv) > 1 else ""
    if how == "raise":
        raise ValueError("boom from the script")
    if how == "exit3":
        sys.exit(3)
    if how == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.py").write_text(textwrap.dedent(PROBE))
    (folder / "probe_module.py").write_text("import runpy, os\nrunpy.run_path(os.path.join(os.path.dirname("
                                            "__file__), 'probe.py'), run_name='__main__')\n")
    return folder


@pytest.fixture(scope="module")
def standby(probe):
    env = child_env(None, {"PROBE_SHARED": "1"})
    made = TaskStandby.start([sys.executable, "probe.py"], env)
    assert made is not None
    try:
        assert made.wait_ready(240), made.error
        yield made
    finally:
        made.close()


def _task_env(**extra: str) -> dict[str, str]:
    return child_env({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}},
                     {"PROBE_SHARED": "1", **extra})


def _collect(task: ForkedTask) -> tuple[int, str, str]:
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, into=into: into.append(s.read().decode())) for s, into in
               ((task.stdout, out), (task.stderr, err))]
    for reader in readers:
        reader.start()
    code = task.wait(60)
    for reader in readers:
        reader.join(10)
    return code, "".join(out), "".join(err)


def _both(standby: TaskStandby, probe: Path, *args: str, module: bool = False, **env: str):
    """(forked, started): each (exit code, stdout, stderr) of the probe run both ways, in `probe`."""
    command = [sys.executable, "-m", "probe_module", *args] if module else [sys.executable, "probe.py", *args]
    previous = os.getcwd()
    os.chdir(probe)
    try:
        standby.run = python_run(command)[1]  # (a launch has one command; this test tries both kinds)
        task = standby.fork(_task_env(**env))
        assert task is not None, standby.error
        forked = _collect(task)
        done = subprocess.run(command, env=_task_env(**env), capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    finally:
        os.chdir(previous)
    return forked, (done.returncode, done.stdout, done.stderr)


def _facts(stdout: str) -> dict:
    facts = json.loads(stdout.splitlines()[0])
    facts.pop("draw")
    return facts


def test_which_commands_a_standby_runs_and_the_switch():
    assert python_run(["python", "train.py", "--lr", "1"]) == (["python"], ("path", "train.py", ["--lr", "1"]))
    assert python_run(["/venv/bin/python3.11", "-u", "-m", "pkg.train", "x"]) == (
        ["/venv/bin/python3.11", "-u"], ("module", "pkg.train", ["x"]))
    for other in (["bash", "run.sh"], ["python", "-c", "print(1)"], ["python", "-X", "importtime", "t.py"],
                  ["python"], ["python", "-m"], ["torchrun", "t.py"]):
        assert python_run(other) is None, other
    assert wanted({}) and wanted({"STRATKIT_STANDBY": "1"})
    assert not wanted({"STRATKIT_STANDBY": "0"}) and not wanted({"STRATKIT_STANDBY": "off"})
    assert TaskStandby.start(["python", "t.py"], {"STRATKIT_STANDBY": "0"}) is None


def test_a_forked_task_sees_what_a_started_one_sees(standby, probe):
    (code, out, err), (code2, out2, err2) = _both(standby, probe, "a", "b", PROBE_TASK="7")
    assert code == code2 == 0, (err, err2)
    assert _facts(out) == _facts(out2)
    facts = _facts(out)
    assert facts["argv"] == ["probe.py", "a", "b"] and facts["name"] == "__main__"
    assert facts["env"]["PROBE_TASK"] == "7" and "TF_CONFIG" in facts["env"]  # the task's env, not the standby's
    assert out.splitlines()[1:] == out2.splitlines()[1:] == ["thread ran", "atexit ran"]
    assert err == err2 == "to stderr\n"


def test_a_forked_task_exits_as_a_started_one(standby, probe):
    (code, _, err), (code2, _, err2) = _both(standby, probe, "exit3")
    assert code == code2 == 3
    (code, out, err), (code2, out2, err2) = _both(standby, probe, "raise")
    assert code == code2 == 1
    assert err == err2 and err.startswith("to stderr\nTraceback (most recent call last):\n  File \""), err
    assert err.rstrip().endswith("ValueError: boom from the script") and "standby" not in err
    assert out.splitlines()[1:] == ["thread ran", "atexit ran"]


def test_a_module_runs_as_with_python_m(standby, probe):
    (code, out, _), (code2, out2, _) = _both(standby, probe, "x", module=True)
    assert code == code2 == 0
    assert _facts(out) == _facts(out2)


def test_each_forked_task_draws_its_own_numpy_numbers_and_a_signal_ends_it(standby, probe):
    draws = []
    for _ in range(2):
        (_, out, _), _ = _both(standby, probe)
        draws.append(json.loads(out.splitlines()[0])["draw"])
    assert draws[0] != draws[1]
    previous = os.getcwd()
    os.chdir(probe)
    try:
        standby.run = python_run([sys.executable, "probe.py", "sleep"])[1]
        task = standby.fork(_task_env())
    finally:
        os.chdir(previous)
    assert task is not None, standby.error
    assert task.stdout.readline().startswith(b"{")
    assert task.stdout.readline() == b"sleeping\n"
    os.killpg(task.pid, signal.SIGTERM)  # its own process group, as a started task's
    assert task.wait(30) == -signal.SIGTERM


def test_a_fork_may_name_its_own_command_directory_and_output_files(standby, probe, tmp_path):
    """`fork(env, run=, cwd=, output=)`: one standby serves any script (the tests' fork server,
    tests/procs.py): the command, working directory and the files stdout and stderr go to are the fork's."""
    out, err = (open(tmp_path / name, "w+b") for name in ("out", "err"))
    with out, err:
        task = standby.fork(_task_env(PROBE_TASK="9"), run=("path", str(probe / "probe.py"), ["exit3"]),
                            cwd=str(tmp_path), output=(out.fileno(), err.fileno()))
        assert task is not None and task.stdout is None and task.stderr is None, standby.error
        assert task.wait(60) == 3
    facts = json.loads((tmp_path / "out").read_text().splitlines()[0])
    assert facts["argv"] == [str(probe / "probe.py"), "exit3"] and facts["cwd"] == str(tmp_path)
    assert facts["path0"] == str(probe) and facts["env"]["PROBE_TASK"] == "9"
    assert (tmp_path / "err").read_text() == "to stderr\n"
