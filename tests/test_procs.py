"""tests/procs.py's fork servers: a child forked from one is the child a new interpreter would be, and a child
whose start-up matters is a new interpreter.

A forked child's parent is a fork server, a started one's this pytest process: that is how these tests tell
them apart. tests/launch/test_standby.py compares a forked and a started run of one probe in detail (argv,
`__main__`, environment, output, exit codes, atexit, threads, numpy's generator).
"""

from __future__ import annotations

import os
import time

import pytest

import procs
from procs import describe, run_cluster, run_process, worker_tf_configs

pytestmark = pytest.mark.slow

PROBE = """
import json, os, sys
import tensorflow as tf
print(json.dumps({"parent": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "hash": hash("stratkit"),
                  "task": json.loads(os.environ.get("TF_CONFIG", "{}")).get("task"), "x": os.environ.get("X"),
                  "devices": len(tf.config.list_logical_devices("CPU"))}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_clusters_children_are_forked_each_with_its_own_environment_arguments_and_hash_seed(tmp_path):
    configs = worker_tf_configs([1, 2])
    results = run_cluster(PROBE, configs, env={"X": "x"}, args=["3"], cwd=tmp_path)
    assert [r.returncode for r in results] == [3, 3], describe(results)
    seen = [r.last_json() for r in results]
    assert all(s["parent"] != os.getpid() for s in seen), seen          # forked, from the fork servers
    assert [s["task"] for s in seen] == [c["task"] for c in configs]    # TF_CONFIG is each child's own
    assert all(s["argv"] == ["3"] and s["cwd"] == str(tmp_path) and s["x"] == "x" for s in seen)
    assert all(r.stderr.endswith("to stderr\n") for r in results)
    assert seen[0]["hash"] != seen[1]["hash"]   # two servers: the workers hash strings as two interpreters do


def test_a_child_that_reads_something_different_at_import_or_says_fork_false_is_a_new_interpreter():
    forked = run_process(PROBE, args=["0"])
    level = run_process(PROBE, args=["0"], env={"TF_CPP_MIN_LOG_LEVEL": "1"})
    unforked = run_process(PROBE, args=["0"], fork=False)
    assert all(r.ok for r in (forked, level, unforked)), describe([forked, level, unforked])
    assert forked.last_json()["parent"] != os.getpid()
    assert level.last_json()["parent"] == os.getpid() == unforked.last_json()["parent"]
    assert procs.IMPORT_TIME.fullmatch("TF_CPP_MIN_LOG_LEVEL") and not procs.IMPORT_TIME.fullmatch("OUT")


def test_a_forked_child_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            f"open({str(tmp_path / 'pid')!r}, 'w').write(str(child.pid))\n"
            "print('up', flush=True)\ntime.sleep(300)\n")
    result = run_process(code, timeout=30)
    assert result.killed and result.returncode == -9 and result.stdout == "up\n", describe([result])
    pid, deadline = int((tmp_path / "pid").read_text()), time.monotonic() + 30
    while procs.alive(pid) and time.monotonic() < deadline:   # SIGKILLed with its group: gone within moments
        time.sleep(0.05)
    assert not procs.alive(pid)
