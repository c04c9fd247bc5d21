"""Parameter-server "done" markers live in a private directory no other user can write to.

A ps/worker task exits when the chief writes its done marker. If the marker's
name is predictable in the shared temp directory, another user can end every
task (or, with a symlink, have the chief write over one of the user's files).
"""

from __future__ import annotations

import io
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from procs import child_env

from stratkit.cluster import ClusterSpec
from stratkit.strategy import server

NOBODY = 65534
RUN_DIR_VAR = "STRATKIT_RUN_DIR"  # the launcher and the Spark runner agree on the directory through it
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

_SERVE = textwrap.dedent("""
    import json, sys
    from stratkit.cluster import ClusterSpec
    from stratkit.strategy.server import serve
    cluster = json.loads(sys.argv[1])
    serve(ClusterSpec(strategy="parameter_server", task_type="ps", task_index=0, cluster=cluster, is_chief=False,
                      num_workers=1), poll_seconds=0.1)
""")


@pytest.fixture
def shared_tmp():
    """A world-writable sticky directory, like /tmp, used as this test's TMPDIR (every user can reach it)."""
    import shutil
    import tempfile

    shared = tempfile.mkdtemp(prefix="stratkit-test-shared-", dir="/tmp")
    os.chmod(shared, 0o1777)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture
def chief():
    """A listening socket standing in for the chief (the ps task watches that it is reachable)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _cluster(chief_address: str) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"chief": [chief_address], "worker": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{port}"]}


def _spec(cluster: dict) -> ClusterSpec:
    return ClusterSpec(strategy="parameter_server", task_type="ps", task_index=0, cluster=cluster, is_chief=False,
                       num_workers=1)


def _start_serving(cluster: dict, env: dict) -> subprocess.Popen:
    import json

    return subprocess.Popen([sys.executable, "-c", _SERVE, json.dumps(cluster)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(env=env), start_new_session=True)


def _env(shared_tmp) -> dict:
    return {"TMPDIR": str(shared_tmp), RUN_DIR_VAR: None, server.STARTUP_VAR: "4"}


@pytest.mark.slow
@needs_root
def test_another_user_cannot_end_a_serving_task_with_a_forged_marker(shared_tmp, chief, monkeypatch):
    cluster = _cluster(chief)
    monkeypatch.setenv("TMPDIR", str(shared_tmp))
    monkeypatch.delenv(RUN_DIR_VAR, raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    marker = server.done_marker(_spec(cluster), "ps", 0)
    proc = _start_serving(cluster, _env(shared_tmp))
    try:
        assert "serving at" in proc.stdout.readline()
        # The other user writes "done" where the chief would.
        forge = subprocess.run(["/bin/sh", "-c", 'echo done > "$0"', marker], user=NOBODY, group=NOBODY,
                               capture_output=True, text=True)
        assert forge.returncode != 0, "another user could write the marker"
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()  # still serving
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
@needs_root
def test_a_marker_directory_owned_by_another_user_is_refused(shared_tmp, monkeypatch):
    cluster = _cluster("127.0.0.1:1")  # no chief: without the check, the task would give up after 4 s
    monkeypatch.setenv("TMPDIR", str(shared_tmp))
    monkeypatch.delenv(RUN_DIR_VAR, raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    directory = os.path.dirname(server.done_marker(_spec(cluster), "ps", 0))
    os.makedirs(directory, exist_ok=True)
    os.chown(directory, NOBODY, NOBODY)  # pre-created by the other user
    proc = _start_serving(cluster, _env(shared_tmp))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "owned by" in err and directory in err and "Fix:" in err, err


def test_the_launcher_gives_every_task_a_private_directory_and_removes_it(tmp_path):
    from stratkit.launch import launch

    code = textwrap.dedent(f"""
        import os, stat
        path = os.environ.get({RUN_DIR_VAR!r})
        info = os.lstat(path)
        print("RUN_DIR", path, stat.S_ISDIR(info.st_mode), oct(stat.S_IMODE(info.st_mode)),
              info.st_uid == os.geteuid(), flush=True)
    """)
    out = io.StringIO()
    result = launch([sys.executable, "-c", code], workers=2, stdout=out, stderr=io.StringIO(),
                    env=child_env(env={RUN_DIR_VAR: None}), handle_signals=False)
    assert result.returncode == 0, out.getvalue()
    lines = [line.split("RUN_DIR ", 1)[1].split() for line in out.getvalue().splitlines() if "RUN_DIR " in line]
    assert len(lines) == 2 and lines[0] == lines[1], out.getvalue()  # one directory, agreed by both tasks
    path, is_dir, mode, mine = lines[0]
    assert (is_dir, mode, mine) == ("True", "0o700", "True")
    assert not os.path.exists(path)  # removed when the launch ended


def test_spark_tasks_of_one_attempt_agree_on_a_fresh_private_marker_directory():
    from stratkit.spark import layout
    from stratkit.spark.task import TaskPlan, _run_env

    roles = tuple(layout.plan_roles(2, num_ps=1))

    def plan(run_id: str, attempt: int) -> TaskPlan:
        return TaskPlan(run_id=run_id, attempt=attempt, roles=roles, payload=b"", log_host="127.0.0.1",
                        log_port=1, log_token="t", use_gpu=False, gpu_counts=(None,) * len(roles))

    first = plan("stratkit-0123456789ab", 0)
    dirs = {_run_env(first, role).get(RUN_DIR_VAR) for role in roles}
    assert len(dirs) == 1 and None not in dirs  # every task of the attempt: the same directory
    (path,) = dirs
    assert os.path.isabs(path) and not os.path.exists(path)  # each task's server creates it (0700) itself
    assert _run_env(plan("stratkit-0123456789ab", 1), roles[0])[RUN_DIR_VAR] != path
    assert _run_env(plan("stratkit-ba9876543210", 0), roles[0])[RUN_DIR_VAR] != path


def test_the_private_marker_directory_is_created_0700_and_checked(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(RUN_DIR_VAR, str(run_dir))
    marker = server.done_marker(_spec(_cluster("127.0.0.1:1")), "ps", 0)
    assert os.path.dirname(marker) == str(run_dir)
    assert server.prepare_marker_dir() == str(run_dir)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    os.chmod(run_dir, 0o755)
    from stratkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"STRATKIT_RUN_DIR=.*0755.*Fix: chmod 700"):
        server.prepare_marker_dir()
