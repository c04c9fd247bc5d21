"""`stratkit launch --nnodes N --rdzv-endpoint HOST:PORT`: one cluster across several launchers.

The fast tests check the flags and the rendezvous' authentication in-process.
The slow ones start two real launcher processes on loopback (`--no-private-network`:
the tasks must reach each other), the second a few seconds late, as two
machines would: the training equals one process, a failure on one node stops
both with its report, a node killed stops the other, and nothing is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procs import alive, child_env, free_ports, run_process
from stratkit.cli import main
from stratkit.errors import ConfigError
from stratkit.launch.nodelink import NodeLink
from stratkit.launch.rendezvous import TOKEN_VAR, RendezvousServer

TOKEN = "0123456789abcdef0123456789abcdef"
PARITY = Path(__file__).resolve().parents[1] / "strategy" / "parity_cases.py"


# -- flags ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "words"), [
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"], [TOKEN_VAR, "not set", "secrets.token_hex"]),
    (["--nnodes", "2"], ["--rdzv-endpoint", "HOST:PORT"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1"], ["--rdzv-endpoint", "'127.0.0.1'", "HOST:PORT"]),
    (["--nnodes", "0", "--rdzv-endpoint", "127.0.0.1:1"], ["--nnodes", "got 0"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--workers-per-node", "0"], ["--workers-per-node", "got 0"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--private-network"], ["--private-network", "reach"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--workers", "2"], ["--workers 2", "--workers-per-node"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--print-tf-config"], ["--print-tf-config", "--hosts"]),
    (["--rdzv-endpoint", "127.0.0.1:1"], ["--rdzv-endpoint", "--nnodes N"]),
])
def test_a_bad_multi_node_setting_is_refused_before_anything_starts_naming_the_flag(argv, words, refused_launch,
                                                                                 monkeypatch):
    if words[0] != TOKEN_VAR:
        monkeypatch.setenv(TOKEN_VAR, TOKEN)
    refused_launch(argv, words)


def test_a_short_token_is_refused_naming_the_variable(capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_VAR, "short")
    assert main(["launch", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--", "python", "x.py"]) == 2
    assert TOKEN_VAR in capsys.readouterr().err


# -- the rendezvous, in-process ----------------------------------------------------------------------
def test_a_wrong_token_is_refused_and_never_joins():
    port = free_ports(1)[0]
    server = RendezvousServer("127.0.0.1", port, TOKEN.encode(), nnodes=2, workers_per_node=1)
    try:
        stranger = NodeLink("127.0.0.1", port, b"f" * 32, serving=False, workers_per_node=1, join_timeout=5)
        with pytest.raises(ConfigError, match=TOKEN_VAR):
            stranger.connect(0)
        assert server.round(0).nodes == [] and not server.round(0).formed
        # a node with the token then joins (its ports: whatever it holds)
        good = NodeLink("127.0.0.1", port, TOKEN.encode(), serving=True, workers_per_node=1, join_timeout=5)
        assert good.connect(0) == "127.0.0.1"
        good.send("JOIN", {"serving": True, "host": "127.0.0.1", "ports": [1234]})
        deadline = time.monotonic() + 5
        while not server.round(0).nodes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server.round(0).nodes) == 1 and server.rejected >= 1
        good.close()
    finally:
        server.close()


def test_the_cluster_is_the_layouts_with_the_serving_node_first():
    port = free_ports(1)[0]
    server = RendezvousServer("127.0.0.1", port, TOKEN.encode(), nnodes=2, workers_per_node=2)
    links = []
    try:
        import threading
        for serving, ports in ((False, [7001, 7002]), (True, [7003, 7004])):  # the joining node first
            link = NodeLink("127.0.0.1", port, TOKEN.encode(), serving=serving, workers_per_node=2, join_timeout=10)
            link.connect(0)
            links.append(link)
            thread = threading.Thread(target=link.join, args=(ports,), daemon=True)
            thread.start()
            time.sleep(0.2)
        for link in links:
            deadline = time.monotonic() + 5
            while link.node < 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert [link.node for link in links] == [1, 0]
        assert links[0].cluster == {"worker": ["127.0.0.1:7003", "127.0.0.1:7004", "127.0.0.1:7001",
                                               "127.0.0.1:7002"]}
    finally:
        for link in links:
            link.close()
        server.close()


def test_parameter_server_placement_chief_on_node_0_ps_from_node_1_round_robin():
    from stratkit.cluster.layout import node_tasks

    def names(nodes):
        return [[t.name for t in tasks] for tasks in nodes]

    assert names(node_tasks(2, 1, chief=True, ps=1)) == [["chief:0", "worker:0"], ["worker:1", "ps:0"]]
    assert names(node_tasks(3, 2, chief=True, ps=2)) == [
        ["chief:0", "worker:0", "worker:1"], ["worker:2", "worker:3", "ps:0"], ["worker:4", "worker:5", "ps:1"]]
    assert names(node_tasks(2, 1, ps=3, chief=True)) == [["chief:0", "worker:0", "ps:1"], ["worker:1", "ps:0", "ps:2"]]
    assert names(node_tasks(1, 2, chief=True, ps=1)) == [["chief:0", "worker:0", "worker:1", "ps:0"]]
    assert names(node_tasks(2, 1)) == [["worker:0"], ["worker:1"]]


def _form(server_port: int, nodes: list[tuple[bool, list[int]]], **layout_flags) -> list[NodeLink]:
    import threading

    links = []
    for serving, ports in nodes:  # in join order
        link = NodeLink("127.0.0.1", server_port, TOKEN.encode(), serving=serving, join_timeout=10, **layout_flags)
        link.connect(0)
        links.append(link)
        threading.Thread(target=link.join, args=(ports,), daemon=True).start()
        time.sleep(0.2)
    for link in links:
        deadline = time.monotonic() + 5
        while link.node < 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    return links


def test_a_parameter_server_cluster_places_the_chief_and_ps_tasks_and_shares_one_marker_dir():
    port = free_ports(1)[0]
    server = RendezvousServer("127.0.0.1", port, TOKEN.encode(), nnodes=2, workers_per_node=1, chief=True, ps=1)
    links = []
    try:
        links = _form(port, [(False, [7001, 7002]), (True, [7003, 7004])], workers_per_node=1, chief=True, ps=1)
        joined, serving = links
        assert (serving.node, joined.node) == (0, 1)
        assert [t.name for t in serving.tasks] == ["chief:0", "worker:0"]
        assert [t.name for t in joined.tasks] == ["worker:1", "ps:0"]
        assert serving.cluster == joined.cluster == {
            "chief": ["127.0.0.1:7003"], "worker": ["127.0.0.1:7004", "127.0.0.1:7001"], "ps": ["127.0.0.1:7002"]}
        assert serving.run_dir == joined.run_dir and "stratkit-run-" in serving.run_dir
    finally:
        for link in links:
            link.close()
        server.close()


def test_a_node_with_other_layout_flags_is_refused_naming_them():
    port = free_ports(1)[0]
    server = RendezvousServer("127.0.0.1", port, TOKEN.encode(), nnodes=2, workers_per_node=1, chief=True, ps=1)
    link = NodeLink("127.0.0.1", port, TOKEN.encode(), serving=False, workers_per_node=1, join_timeout=5)
    try:
        link.connect(0)
        with pytest.raises(ConfigError, match=r"--workers-per-node 1 --chief --ps 1.*same --nnodes, --workers-per-node, --chief and --ps"):
            link.join([7001])
        assert server.round(0).nodes == []
    finally:
        link.close()
        server.close()


# -- two launchers on loopback (slow) ---------------------------------------------------------------
def _node(port: int, script: list[str], *extra: str, token: str = TOKEN) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--no-private-network", "--stop-grace", "3", *extra, "--", *script]
    return subprocess.Popen(argv, env=child_env(None, {TOKEN_VAR: token}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _two_nodes(script: list[str], *extra: str, late: float = 3.0,
               timeout: float = 240) -> list[tuple[int, str, str]]:
    port = free_ports(1)[0]
    first = _node(port, script, *extra)
    time.sleep(late)
    second = _node(port, script, *extra)
    out = []
    for proc in (first, second):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        out.append((proc.returncode, stdout, stderr))
    return out


def _pids(stderr: str) -> list[int]:
    return [int(p) for p in re.findall(r"started: pid (\d+)", stderr)]


def _assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running: {left}"


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_nodes_train_as_one_process(one_process_uneven):
    want = one_process_uneven
    nodes = _two_nodes([sys.executable, str(PARITY), "mwms", "trainer_uneven"])
    for code, stdout, stderr in nodes:
        assert code == 0, stderr[-4000:]
    (_, out0, err0), (_, out1, err1) = nodes
    assert "serving the rendezvous" in err0 and "node 0 of 2" in err0, err0[-2000:]
    assert "joining the rendezvous" in err1 and "node 1 of 2" in err1, err1[-2000:]
    assert "gRPC servers cannot be protected across hosts" in err0
    for prefix, stdout in (("[worker:0] RESULT ", out0), ("[worker:1] RESULT ", out1)):
        line = next(line for line in stdout.splitlines() if line.startswith(prefix))  # its own tasks' lines
        got = json.loads(line[len(prefix):])["trainer_uneven"]
        flat_want = want["w"] + [v for k in sorted(want["h"]) if k != "examples_per_sec" for v in want["h"][k]]
        flat_got = got["w"] + [v for k in sorted(got["h"]) if k != "examples_per_sec" for v in got["h"][k]]
        assert len(flat_want) == len(flat_got)
        for a, b in zip(flat_want, flat_got):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (want, got)
    assert "[worker:1]" not in out0 and "[worker:0]" not in out1


FAIL_ON_WORKER_1 = textwrap.dedent("""
    import json, os, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(f"task {index} up", flush=True)
    if index == 1:
        time.sleep(1)
        raise RuntimeError("node two broke on purpose")
    time.sleep(120)
""")


@pytest.mark.slow
def test_a_task_failing_on_node_two_stops_both_nodes_with_its_report():
    started = time.monotonic()
    nodes = _two_nodes([sys.executable, "-c", FAIL_ON_WORKER_1], late=2.0, timeout=90)
    assert time.monotonic() - started < 60
    (code0, _, err0), (code1, _, err1) = nodes
    assert code0 == code1 == 1, (err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert "root cause" in err and "worker:1 on node 1 (127.0.0.1)" in err, err[-3000:]
        assert "RuntimeError: node two broke on purpose" in err, err[-3000:]
    assert "worker:0 (pid" in err0 and "stopped by the launcher after worker:1 on node 1" in err0, err0[-3000:]
    _assert_gone(_pids(err0) + _pids(err1))


FAIL_ONCE_ON_WORKER_1 = textwrap.dedent("""
    import json, os, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = os.environ["STRATKIT_RESTART_COUNT"]
    print(f"task {index} attempt {attempt} at {json.loads(os.environ['TF_CONFIG'])['cluster']['worker'][index]}",
          flush=True)
    if attempt == "0":
        if index == 1:
            raise SystemExit(3)
        time.sleep(60)  # worker 0 still trains when worker 1 fails: a restart (not after it finished)
""")


@pytest.mark.slow
def test_max_restarts_restarts_every_node_on_new_ports():
    nodes = _two_nodes([sys.executable, "-c", FAIL_ONCE_ON_WORKER_1], "--max-restarts", "1", late=2.0, timeout=90)
    (code0, out0, err0), (code1, out1, err1) = nodes
    assert code0 == code1 == 0, (err0[-3000:], err1[-3000:])
    for err in (err0, err1):
        assert "attempt 1 of 2 failed: worker:1 on node 1 (127.0.0.1) exited with code 3" in err, err[-3000:]
        assert "restart 1 of 1" in err and "done: every task succeeded (attempt 2 of 2" in err, err[-3000:]
    first, second = (re.findall(r"task 0 attempt (\d) at (\S+)", out0))
    assert first[0] == "0" and second[0] == "1" and first[1] != second[1], out0  # new ports
    _assert_gone(_pids(err0) + _pids(err1))


@pytest.mark.slow
def test_other_nodes_get_the_exit_grace_after_worker_0_finished_then_stop_as_a_success():
    script = "import json, os, time; time.sleep(300 * json.loads(os.environ['TF_CONFIG'])['task']['index'])"
    started = time.monotonic()
    nodes = _two_nodes([sys.executable, "-c", script], "--exit-grace", "2", late=1.0, timeout=90)
    assert time.monotonic() - started < 40
    (code0, _, err0), (code1, _, err1) = nodes
    assert code0 == code1 == 0, (err0[-2000:], err1[-2000:])
    assert "worker:1 still running 2 s after worker:0 (on node 0) finished" in err1, err1[-2000:]
    _assert_gone(_pids(err0) + _pids(err1))


@pytest.mark.slow
def test_a_node_alone_gives_up_after_the_join_timeout_naming_the_flag():
    port = free_ports(1)[0]
    started = time.monotonic()
    alone = _node(port, [sys.executable, "-c", "print('never')"], "--rdzv-timeout", "3")
    out, err = alone.communicate(timeout=60)
    assert alone.returncode == 2 and "never" not in out, err
    assert "--rdzv-timeout 3" in err and "not all nodes joined" in err, err
    assert time.monotonic() - started < 30


SLEEP = "import time; print('up', flush=True); time.sleep(300)"


@pytest.mark.slow
def test_a_node_killed_stops_the_other_within_the_heartbeat_bound_and_leaves_nothing_running():
    port = free_ports(1)[0]
    # --max-restarts: a lost node is final (the others cannot form the cluster without it): no restart
    first = _node(port, [sys.executable, "-c", SLEEP], "--max-restarts", "1")
    time.sleep(2)
    second = _node(port, [sys.executable, "-c", SLEEP], "--max-restarts", "1")
    try:
        # wait until node 1's task runs (its "up" line)
        deadline = time.monotonic() + 60
        line = ""
        while "up" not in line and time.monotonic() < deadline:
            line = second.stdout.readline()
        assert "[worker:1] up" in line, line
        time.sleep(1)
        killed = time.monotonic()
        os.kill(second.pid, signal.SIGKILL)
        _, err0 = first.communicate(timeout=60)
        assert time.monotonic() - killed < 60
        assert first.returncode not in (0, None), err0[-2000:]
        assert "node 1 (127.0.0.1)" in err0 and "lost" in err0 and "restarting" not in err0, err0[-3000:]
        _, err1 = second.communicate(timeout=10)
        _assert_gone(_pids(err0) + _pids(err1))
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


@pytest.mark.slow
def test_a_launcher_with_a_wrong_token_is_refused_and_the_run_goes_on_without_it():
    port = free_ports(1)[0]
    first = _node(port, [sys.executable, "-c", "print('trained')"], "--rdzv-timeout", "60")
    try:
        time.sleep(2)
        intruder = _node(port, [sys.executable, "-c", "print('intruder ran')"], token="x" * 32)
        out, err = intruder.communicate(timeout=60)
        assert intruder.returncode == 2, err
        assert TOKEN_VAR in err and "refused" in err and "intruder ran" not in out
        second = _node(port, [sys.executable, "-c", "print('trained')"])
        out1, err1 = second.communicate(timeout=60)
        out0, err0 = first.communicate(timeout=60)
        assert first.returncode == second.returncode == 0, (err0[-2000:], err1[-2000:])
        assert "[worker:0] trained" in out0 and "[worker:1] trained" in out1
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()


# -- two test hosts (network namespaces h1, h2 at 198.18.0.1/.2; tests/hosts.py) ---------------------
def _start_on_two_hosts(h1, h2, argv: list[str], env: dict[str, str], late: float,
                        env2: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """`argv` on h1, then `late` s later on h2 (with `env2` if given), output piped: how two machines start."""
    procs = [h1.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    time.sleep(late)
    procs.append(h2.popen(argv, env=env if env2 is None else env2, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True))
    return procs


def _assert_all_ok(procs: list[subprocess.Popen[str]], outs: list[tuple[str, str]]) -> None:
    """Every launcher exited 0 (the first that did not: the end of its stderr)."""
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-4000:]


def _left(*test_hosts) -> list[list[int]]:
    return [[p for p in h.pids() if h.holder is None or p != h.holder.pid] for h in test_hosts]


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.multiworker
def test_two_hosts_train_as_one_cluster_with_the_second_starting_late(one_process_uneven):
    import hosts

    want = one_process_uneven
    script = [sys.executable, str(PARITY), "mwms", "trainer_uneven"]
    port = 29400
    with hosts.make_hosts(2) as (h1, h2):
        argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--rdzv-endpoint",
                f"{h1.address}:{port}", "--stop-grace", "3", "--rdzv-timeout", "120", "--", *script]
        env = child_env(None, {TOKEN_VAR: TOKEN})
        procs = _start_on_two_hosts(h1, h2, argv, env, late=8)
        outs = [p.communicate(timeout=240) for p in procs]
    _assert_all_ok(procs, outs)
    (out0, err0), (out1, err1) = outs
    assert f"node 0 of 2 ({h1.address})" in err0 and f"node 1 of 2 ({h2.address})" in err1, (err0[-2000:], err1)
    assert "started: pid" in err1 and f"at {h2.address}:" in err1, err1[-2000:]  # its own address, not h1's
    for prefix, stdout in (("[worker:0] RESULT ", out0), ("[worker:1] RESULT ", out1)):
        line = next(line for line in stdout.splitlines() if line.startswith(prefix))
        got = json.loads(line[len(prefix):])["trainer_uneven"]
        for a, b in zip(want["w"] + want["h"]["loss"], got["w"] + got["h"]["loss"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (want, got)


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.multiworker
def test_two_hosts_restart_after_a_failure_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    import hosts

    script = Path(__file__).with_name("resume_script.py")
    one = run_process(str(script), args=[str(tmp_path / "one")], timeout=240)
    assert one.ok, one.stderr[-3000:]
    want = json.loads(one.stdout.split("RESULT ", 1)[1].splitlines()[0])
    backup = tmp_path / "backup"  # every host sees it: the test hosts share the file system
    with hosts.make_hosts(2) as (h1, h2):
        argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--rdzv-endpoint",
                f"{h1.address}:29400", "--stop-grace", "3", "--rdzv-timeout", "120", "--max-restarts", "1", "--",
                sys.executable, str(script), str(backup)]
        env = child_env(None, {TOKEN_VAR: TOKEN, "DIE_AFTER_EPOCH": "2"})
        procs = _start_on_two_hosts(h1, h2, argv, env, late=3)
        outs = [p.communicate(timeout=300) for p in procs]
    _assert_all_ok(procs, outs)
    (out0, err0), (out1, err1) = outs
    assert "[worker:1] worker 1 dies after epoch 2" in out1, out1[-2000:]
    for err in (err0, err1):
        assert f"attempt 1 of 2 failed: worker:1 on node 1 ({h2.address}) exited with code 3" in err, err[-3000:]
        assert "restart 1 of 1" in err and "done: every task succeeded (attempt 2 of 2" in err, err[-3000:]
    resumed = [json.loads(line.split("RESULT ", 1)[1]) for out in (out0, out1)
               for line in out.splitlines() if "RESULT " in line]
    assert len(resumed) == 2 and len(resumed[0]["loss"]) == 2, resumed  # epochs 3 and 4 only: it resumed
    assert resumed[0]["w"] == resumed[1]["w"]  # the workers are identical
    for a, b in zip(want["w"], resumed[0]["w"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (want, resumed[0])
    for a, b in zip(want["loss"][2:], resumed[0]["loss"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (want["loss"], resumed[0]["loss"])


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.multiworker
def test_two_hosts_train_a_parameter_server_cluster_and_every_task_ends():
    import hosts

    digits = str(Path(__file__).resolve().parents[2] / "examples" / "digits.py")
    with hosts.make_hosts(2) as (h1, h2):
        argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--chief", "--ps", "1",
                "--rdzv-endpoint", f"{h1.address}:29400", "--stop-grace", "3", "--rdzv-timeout", "120", "--",
                sys.executable, digits, "--epochs", "2"]
        env = child_env(None, {TOKEN_VAR: TOKEN})
        procs = _start_on_two_hosts(h1, h2, argv, env, late=3)
        outs = [p.communicate(timeout=300) for p in procs]
        left = _left(h1, h2)
    _assert_all_ok(procs, outs)
    (out0, err0), (out1, err1) = outs
    assert f"node 0 of 2 ({h1.address}): chief:0, worker:0" in err0, err0[-2000:]
    assert f"node 1 of 2 ({h2.address}): worker:1, ps:0" in err1, err1[-2000:]
    assert "ps:0 started: pid" in err1 and f"at {h2.address}:" in err1
    result = json.loads(next(line for line in out0.splitlines() if line.startswith("[chief:0] {"))[len("[chief:0] "):])
    assert result["strategy"] == "parameter_server", result
    assert result["held_out_accuracy"] > 0.8, result
    # every ps/worker task ended when the chief finished (its done marker reached the other host): exit 0
    assert "done: every task succeeded" in err0 and "done: every task succeeded" in err1, (err0[-1500:], err1[-1500:])
    assert left == [[], []], left


def _host_nodes(h1, h2, script: list[str], *extra: str, token2: str = TOKEN, late: float = 2.0):
    argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--rdzv-endpoint", f"{h1.address}:29400",
            "--stop-grace", "3", "--rdzv-timeout", "60", *extra, "--", *script]
    return _start_on_two_hosts(h1, h2, argv, child_env(None, {TOKEN_VAR: TOKEN}), late,
                               env2=child_env(None, {TOKEN_VAR: token2}))


@pytest.mark.slow
@pytest.mark.hosts
def test_two_hosts_a_failure_on_host_two_stops_both_with_its_report():
    import hosts

    with hosts.make_hosts(2) as (h1, h2):
        started = time.monotonic()
        procs = _host_nodes(h1, h2, [sys.executable, "-c", FAIL_ON_WORKER_1])
        outs = [p.communicate(timeout=90) for p in procs]
        took = time.monotonic() - started
        left = _left(h1, h2)
    assert took < 60, took
    (_, err0), (_, err1) = outs
    assert procs[0].returncode == procs[1].returncode == 1, (err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert f"worker:1 on node 1 ({h2.address})" in err and "node two broke on purpose" in err, err[-3000:]
    assert left == [[], []], left


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.parametrize("how", ["killed", "unplugged"])  # unplugged: its link down first, so no FIN ever comes
def test_two_hosts_losing_host_two_ends_host_one_and_a_wrong_token_never_joins(how):
    import hosts

    with hosts.make_hosts(2) as (h1, h2):
        # a launcher with the wrong token is refused on host 2 and never joins
        intruder = _host_nodes(h1, h2, [sys.executable, "-c", SLEEP], token2="x" * 32)
        out, err = intruder[1].communicate(timeout=60)
        assert intruder[1].returncode == 2 and TOKEN_VAR in err and "refused" in err, err[-2000:]
        assert "[worker" not in out
        second = h2.popen([sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--rdzv-endpoint",
                           f"{h1.address}:29400", "--stop-grace", "3", "--", sys.executable, "-c", SLEEP],
                          env=child_env(None, {TOKEN_VAR: TOKEN}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
        line, deadline = "", time.monotonic() + 60
        while "up" not in line and time.monotonic() < deadline:
            line = second.stdout.readline()
        assert "[worker:1] up" in line, line
        killed = time.monotonic()
        if how == "unplugged":
            subprocess.run(["ip", "-n", h2.netns, "link", "set", "eth0", "down"], check=True)
        h2.kill_all()  # the host is gone: every process on it at once
        _, err0 = intruder[0].communicate(timeout=90)
        took = time.monotonic() - killed
        second.communicate(timeout=10)
        time.sleep(1)
        left = _left(h1, h2)
    assert took < (60 if how == "unplugged" else 10), took  # the heartbeat bound (10 s) | the closed connection
    assert intruder[0].returncode not in (0, None), err0[-2000:]
    assert f"node 1 ({h2.address})" in err0 and "lost" in err0, err0[-3000:]
    assert left == [[], []], left


@pytest.mark.slow
def test_with_log_dir_every_node_writes_its_tasks_logs_and_events(tmp_path):
    script = [sys.executable, "-c", "print('logged', flush=True)"]
    port = free_ports(1)[0]
    nodes = [_node(port, script, "--log-dir", str(tmp_path / "a"))]
    time.sleep(1)  # "a" serves the rendezvous: node 0, worker 0
    nodes.append(_node(port, script, "--log-dir", str(tmp_path / "b")))
    outs = [proc.communicate(timeout=60) for proc in nodes]
    assert [proc.returncode for proc in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    assert "logged" in (tmp_path / "a" / "worker-0.log").read_text()
    assert "logged" in (tmp_path / "b" / "worker-1.log").read_text()
    assert any('"event": "done"' in line for line in (tmp_path / "b" / "events.jsonl").read_text().splitlines())


# -- GPUs: every node reports its count; a cluster of different counts is refused on every node ----------------
@pytest.mark.parametrize("elastic", [False, True], ids=["nnodes-2", "nnodes-1:2"])
def test_nodes_with_different_gpu_counts_are_refused_on_every_node_naming_them(elastic):
    import threading

    from stratkit.launch.elastic import ElasticRendezvous

    port = free_ports(1)[0]
    server = (ElasticRendezvous("127.0.0.1", port, TOKEN.encode(), 1, 2, 1, last_call=5.0, gpus=4) if elastic
              else RendezvousServer("127.0.0.1", port, TOKEN.encode(), nnodes=2, workers_per_node=1, gpus=4))
    links = [NodeLink("127.0.0.1", port, TOKEN.encode(), serving=i == 0, workers_per_node=1, join_timeout=10,
                      gpus=gpus) for i, gpus in enumerate((4, 0))]
    errors: list[str] = []

    def join(link: NodeLink, port_: int) -> None:
        try:
            link.join([port_])
        except ConfigError as exc:
            errors.append(str(exc))

    try:
        for link in links:
            link.connect(0)
        threads = [threading.Thread(target=join, args=(link, 7001 + i)) for i, link in enumerate(links)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert len(errors) == 2, errors
        for message in errors:
            assert "node 0" in message and "4 GPU(s)" in message and "node 1" in message and "0 GPU(s)" in message
            assert "mixing GPU and CPU-only nodes" in message and "Fix:" in message
        assert all(link.cluster == {} for link in links)  # no cluster formed: no task starts
    finally:
        for link in links:
            link.close()
        server.close()


GPU_SHOW = [sys.executable, "-c", "import os; print('GPUS', os.environ['CUDA_VISIBLE_DEVICES'])"]


@pytest.mark.slow
@pytest.mark.hosts
def test_two_hosts_pin_their_own_gpus_and_different_gpu_counts_are_refused_on_both():
    import hosts

    with hosts.make_hosts(2) as (h1, h2):
        argv = [sys.executable, "-m", "stratkit.cli", "launch", "--nnodes", "2", "--rdzv-endpoint",
                f"{h1.address}:29400", "--stop-grace", "3", "--rdzv-timeout", "60", "--workers-per-node", "2", "--",
                *GPU_SHOW]
        env = child_env(None, {TOKEN_VAR: TOKEN, "CUDA_VISIBLE_DEVICES": None, "STRATKIT_FAKE_GPU_COUNT": "4"})
        procs = _start_on_two_hosts(h1, h2, argv, env, late=1)
        outs = [p.communicate(timeout=120) for p in procs]
        _assert_all_ok(procs, outs)
        # each node splits its own 4 GPUs between its own 2 workers
        assert sorted(re.findall(r"\[(worker:\d)\] GPUS (\S+)", outs[0][0] + outs[1][0])) == \
            [("worker:0", "0,1"), ("worker:1", "2,3"), ("worker:2", "0,1"), ("worker:3", "2,3")]
        assert re.search(r"worker:2 started: pid \d+ at [\d.:]+, GPUs 0,1", outs[1][1]), outs[1][1][-2000:]

        # one worker per GPU of each node: 4 on h1, 2 on h2 -- refused for the GPUs, on both, at once
        argv[argv.index("--workers-per-node") + 1] = "gpu"
        procs = _start_on_two_hosts(h1, h2, argv, env, late=1, env2={**env, "STRATKIT_FAKE_GPU_COUNT": "2"})
        outs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 2, err[-3000:]
        assert f"node 0 h1 ({h1.address}): 4 GPU(s)" in err and f"node 1 h2 ({h2.address}): 2 GPU(s)" in err, err
        assert "different GPU counts" in err and "Fix:" in err
        assert "started: pid" not in err and "GPUS" not in out  # refused before any task started


def test_an_elastic_node_arriving_with_another_gpu_count_is_refused_and_the_running_round_goes_on():
    from stratkit.launch.elastic import ElasticRendezvous

    port = free_ports(1)[0]
    server = ElasticRendezvous("127.0.0.1", port, TOKEN.encode(), 1, 2, 1, last_call=0.2)
    first = NodeLink("127.0.0.1", port, TOKEN.encode(), serving=True, workers_per_node=1, join_timeout=10, gpus=4)
    late = NodeLink("127.0.0.1", port, TOKEN.encode(), serving=False, workers_per_node=1, join_timeout=10, gpus=2)
    try:
        first.connect(0)
        first.join([7001])  # the round forms with node 0 alone after the last call
        assert first.cluster == {"worker": ["127.0.0.1:7001"]}
        late.connect(0)
        with pytest.raises(ConfigError, match=r"shows 2 GPU\(s\) but the running nodes show 4"):
            late.join([7002])
        assert first.decision is None and not first.resize  # the running round was not ended for it
    finally:
        late.close()
        first.close()
        server.close()
